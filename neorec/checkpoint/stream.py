"""model.pt, the trainer's model state: written through neorec.utils.files.write_atomic (temporary
name, fsync, rename) as a torch.save file whose zip entries all carry their CRC32, and read back by
`load_model_state` only after every entry checks against its CRC32 (torch.load does not check them),
so a truncated or damaged model.pt stops with an error naming it. A plain
`torch.load(path, weights_only=True)` reads it too.

Tables larger than memory: a cached table's state_dict entries are views of its file
(neorec/embedding/cache); torch.save would read them through the map, and every page read stays
resident until the save ends, so memory would grow by the table. Here those entries are replaced by
placeholders (allocated, never touched) and the file torch.save writes gets each placeholder's bytes
from its storage instead, read in windows of rows (`WINDOW_BYTES`): memory holds one window, never
the table. The result is an ordinary
torch.save file (torch.load, weights_only, mmap all work). torch's own CRC32s are turned off for this
save (`compute_crc32 = False`: they would read every placeholder); the writer computes each record's
CRC32 from the bytes it passes on instead, and `_fill_crcs` writes them into the archive's data
descriptors and central directory before the file is renamed into place.

How the bytes are swapped: torch.save writes each tensor's storage with one call of the file
object's write(), handing it the storage's memory; a placeholder's memory is recognised by its
address and size. A torch that wrote storages differently would leave a placeholder unseen: that
raises instead of writing a wrong file.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import nn

from neorec.embedding.fused.storage import RowStorage
from neorec.errors import NeorecError
from neorec.utils.files import check_zip, write_atomic

WINDOW_BYTES = 64 << 20
_STREAM_MIN_BYTES = 1 << 20  # smaller entries are copied as they are
_DAMAGED = "train the run again, or export it from one of its checkpoints (neorec export CHECKPOINT_DIR)"


class _NotStreamed(Exception):
    """torch.save wrote a placeholder in several pieces (see the module doc)."""


def save_model_state(state: dict, path: str | Path, model: nn.Module) -> None:
    """torch.save(state, path) atomically, streaming the entries of `model`'s cached tables from their
    storage. A failed write raises FileWriteError naming the file; an earlier file of that name stays."""
    sources: dict[str, tuple[RowStorage, int, int]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "range_sources"):
            sources.update(module.range_sources(f"{name}." if name else ""))
    sources = {k: v for k, v in sources.items() if k in state}
    if not sources:
        write_atomic(path, lambda f: torch.save(state, f), "model file")
        return
    # small entries are simply read (a copy of exactly the table's rows); large ones are streamed
    small = {k for k in sources if state[k].numel() * state[k].element_size() < _STREAM_MIN_BYTES}
    copies = {k: sources[k][0].read_range(sources[k][1], sources[k][2]) for k in small}
    placeholders = {k: torch.empty(state[k].shape, dtype=state[k].dtype) for k in sources if k not in small}
    by_address = {(p.data_ptr(), p.nbytes): k for k, p in placeholders.items()}

    def write(f: BinaryIO) -> None:
        from torch.utils.serialization import config

        writer = _SwappingWriter(f, by_address, {k: sources[k] for k in by_address.values()})
        compute_crc32 = config.save.compute_crc32
        config.save.compute_crc32 = False  # a CRC would read the placeholders (see the module doc)
        try:
            torch.save({k: placeholders.get(k, copies.get(k, v)) for k, v in state.items()}, writer)
        finally:
            config.save.compute_crc32 = compute_crc32
        unseen = sorted(set(by_address.values()) - writer.streamed)
        if unseen:
            raise _NotStreamed(unseen)
        f.flush()
        _fill_crcs(f, writer.crcs)

    try:
        write_atomic(path, write, "model file")
    except _NotStreamed as e:
        raise RuntimeError(
            f"saving {path}: torch.save did not write {e.args[0]} as one piece, so their rows could not be "
            f"streamed (torch {torch.__version__}); save the sharded checkpoint instead (neorec/checkpoint)"
        ) from None


def load_model_state(path: str | Path, error: type[Exception] = NeorecError) -> dict[str, torch.Tensor]:
    """model.pt's state dict (on the CPU, weights_only: no code runs) after every zip entry checked
    against its CRC32; a missing, truncated or damaged file raises `error` naming it."""
    path = Path(path)
    check_zip(path, "model file", _DAMAGED, error)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure inside torch becomes one clear message
        raise error(f"model file {path} cannot be loaded ({type(e).__name__}: {e}); {_DAMAGED}") from None
    if not isinstance(state, dict):
        raise error(f"model file {path} does not hold a state dict; {_DAMAGED}")
    return state


def _fill_crcs(f: BinaryIO, crcs: dict[tuple[int, int], int]) -> None:
    """Write the CRC32 of every entry of the zip archive in `f` (written with zeros in their place)
    into its data descriptor (or local header) and its central directory record. `crcs`: the CRC32 of
    the bytes of each write at (offset, size); an entry written otherwise is read back."""
    f.seek(0)
    archive = zipfile.ZipFile(f)  # reads the central directory; leaves `f` open
    central = archive.start_dir
    for info in archive.infolist():
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        start = info.header_offset + 30 + name_len + extra_len
        crc = crcs.get((start, info.compress_size))
        if crc is None:
            crc, left = 0, info.compress_size
            f.seek(start)
            while left > 0:
                chunk = f.read(min(left, WINDOW_BYTES))
                if not chunk:
                    raise OSError(f"{info.filename}: the archive ends inside it")
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
        packed = struct.pack("<I", crc)
        if info.flag_bits & 0x08:  # a data descriptor after the data: [signature] crc32, sizes
            f.seek(start + info.compress_size)
            at = start + info.compress_size + (4 if f.read(4) == b"PK\x07\x08" else 0)
        else:
            at = info.header_offset + 14
        f.seek(at)
        f.write(packed)
        f.seek(central)
        record = f.read(46)
        assert record[:4] == b"PK\x01\x02", "central directory record expected"
        f.seek(central + 16)
        f.write(packed)
        central += 46 + sum(struct.unpack("<HHH", record[28:34]))
    f.seek(0, io.SEEK_END)


class _SwappingWriter(io.RawIOBase):
    """A file for torch.save that writes a placeholder's rows from its storage, window by window."""

    def __init__(self, f, by_address: dict[tuple[int, int], str], sources: dict) -> None:
        super().__init__()
        self.f, self.by_address, self.sources = f, by_address, sources
        self.streamed: set[str] = set()
        self.offset = 0
        self.crcs: dict[tuple[int, int], int] = {}  # (offset, size) of each write -> CRC32 of its bytes

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        key = None
        if view.nbytes >= _STREAM_MIN_BYTES:
            key = self.by_address.get((np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes))
        if key is None:
            n = self.f.write(view)
            self.crcs[(self.offset, n)] = zlib.crc32(view[:n])
            self.offset += n
            return n
        storage, start, end = self.sources[key]
        row_bytes = view.nbytes // max(end - start, 1)
        step = max(1, WINDOW_BYTES // max(row_bytes, 1))
        crc = 0
        for a in range(start, end, step):
            rows = storage.read_range(a, min(a + step, end)).contiguous()
            data = rows.reshape(-1).view(torch.uint8).numpy()
            self.f.write(memoryview(data))
            crc = zlib.crc32(data, crc)
            del rows, data  # before the next window is read: one window in memory, not two
        self.crcs[(self.offset, view.nbytes)] = crc
        self.offset += view.nbytes
        self.streamed.add(key)
        return view.nbytes

    def flush(self) -> None:
        self.f.flush()
