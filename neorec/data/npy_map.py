"""Memory-map a .npy file as a plain read-only numpy array: the sharded reader's columns.

`np.load(path, mmap_mode="r")` parses each file's header with Python (`ast.literal_eval`) and returns
an `np.memmap`, whose Python hooks run on every slice taken of it. A shard part has a file per column
(28 for Criteo), opened as the reader reaches it: about 6 ms of Python a part here, during which the
reader's thread holds the GIL a training thread bound by host work is waiting for. The columns of a
data set share a handful of headers (ids of one length, the dense matrix, the labels), so each
distinct header is parsed once, by numpy's own parser, and remembered by its bytes; the data is
mapped with `mmap` and viewed with `np.frombuffer` (about a quarter of the time, and slices of a
plain array cost no Python).
"""

from __future__ import annotations

import io
import mmap
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

_MAGIC = b"\x93NUMPY"
# header bytes -> shape, fortran order, dtype (dict operations are atomic: two threads that meet a new
# header at once parse it twice, no worse)
_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}


def map_npy(path: str | Path) -> np.ndarray:
    """The array of the .npy file `path`, memory-mapped read-only (as np.load(path, mmap_mode="r") but
    a plain ndarray). ValueError for a file that is not a .npy of a fixed-size dtype; OSError when it
    cannot be read."""
    with open(path, "rb") as f:
        start = f.read(12)
        if len(start) < 10 or not start.startswith(_MAGIC):
            raise ValueError("not a .npy file (no NUMPY magic string)")
        major = start[6]
        if major == 1:
            header_end = 10 + int.from_bytes(start[8:10], "little")
        elif major == 2 and len(start) == 12:
            header_end = 12 + int.from_bytes(start[8:12], "little")
        else:  # version 3 (utf-8 field names) and later: numpy's own reader
            return np.load(path, mmap_mode="r")
        f.seek(0)
        header = f.read(header_end)
        shape, fortran, dtype = _parsed(header, major)
        count = int(np.prod(shape, dtype=np.int64))
        if dtype.hasobject:
            raise ValueError("holds Python objects, which cannot be memory-mapped")
        size = f.seek(0, io.SEEK_END)
        need = header_end + count * dtype.itemsize
        if size < need:
            raise ValueError(f"truncated: {size} bytes, its header says {need}")
        if count == 0:  # nothing to map
            empty = np.empty(shape, dtype)
            empty.flags.writeable = False
            return empty
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays open while an array views it
    array = np.frombuffer(data, dtype, count=count, offset=header_end)
    return array.reshape(shape, order="F" if fortran else "C")


def _parsed(header: bytes, major: int) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of a .npy header, parsed by numpy once per distinct header."""
    known = _HEADERS.get(header)
    if known is not None:
        return known
    stream = io.BytesIO(header)
    stream.seek(8)
    read = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
    parsed = read(stream)
    if len(_HEADERS) < 4096:  # a data set has a few; a bound in case of many odd files
        _HEADERS[header] = parsed
    return parsed
