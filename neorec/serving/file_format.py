"""The export file: one file, a JSON header and raw tensor bytes. Nothing is pickled.

    bytes 0..13     b"neorec-export\\n"                   (magic)
    bytes 14..25    header length (uint64 LE), crc32 of the header (uint32 LE)
    header          UTF-8 JSON: format, version, what the model is, and for every tensor its
                    dtype, shape and byte offset in the data; the data's length and crc32
    zero padding    to a multiple of 64 bytes
    data            every tensor's bytes, each starting at a multiple of 64 bytes

Reading checks the magic, the header's crc32, the zero padding, the file's size and the data's crc32
before building any tensor, so every byte of the file is checked and a truncated, corrupted or
foreign file stops with an ExportError naming the file. Tensors come back as views of one buffer read
in a single call. Writing goes through neorec.utils.files.write_atomic (temporary name, fsync, rename).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from neorec.errors import NeorecError
from neorec.utils.files import write_atomic

MAGIC = b"neorec-export\n"
FORMAT, VERSION = "neorec-export", 1
_PREFIX = struct.Struct("<QI")  # header length, header crc32
ALIGN = 64
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


class ExportError(NeorecError):
    """An export file is missing, truncated, corrupted, not an export, or does not fit. Names the file."""


def _pad(n: int) -> int:
    return -n % ALIGN


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (on the CPU)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _data_start(header_bytes: int) -> int:
    n = len(MAGIC) + _PREFIX.size + header_bytes
    return n + _pad(n)


def _encode(header: dict, tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """(the header bytes, with every tensor's entry and the data's length and crc32; every tensor's
    raw bytes in order)."""
    entries, raws, offset, crc = {}, [], 0, 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ExportError(f"tensor {name!r}: dtype {dtype} cannot be exported")
        raw = _raw(t)
        entries[name] = {"dtype": dtype, "shape": list(t.shape), "offset": offset, "bytes": raw.numel()}
        crc = zlib.crc32(bytes(_pad(raw.numel())), zlib.crc32(raw.numpy(), crc))
        offset += raw.numel() + _pad(raw.numel())
        raws.append(raw)
    full = {**header, "format": FORMAT, "version": VERSION, "tensors": entries}
    full.update(data_bytes=offset, data_crc32=crc)
    return json.dumps(full, indent=1).encode(), raws


def export_size(header: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the file of `header` and `tensors` takes, without writing it."""
    text, raws = _encode(header, tensors)
    return _data_start(len(text)) + sum(r.numel() + _pad(r.numel()) for r in raws)


def check_output_file(
    path: str | Path, flag: str, replaces: Callable[[Path], bool] | None = None, kind: str = ""
) -> None:
    """An output file's path does not name a folder, nor (with `replaces`, which tells whether an
    existing file is an earlier output of this `kind`) a file of anything else: a run's model.pt, a
    config or data given by mistake are never written over. Checked before any work."""
    if Path(path).is_dir():
        raise ExportError(f"{flag} {path}: is a folder; give the path of the file to write")
    if replaces is not None and Path(path).is_file() and not replaces(Path(path)):
        raise ExportError(
            f"{flag} {path}: is a file that is not {kind}; only an earlier output of its kind is replaced, "
            "never a run's model.pt, a config or data: give a new path"
        )


def is_export_file(path: str | Path) -> bool:
    """A file that starts as an export file does (its magic line); the rest is not read."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def write_export(path: str | Path, header: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write the file atomically (temporary name, fsync, rename); returns its size in bytes."""
    path = Path(path)
    text, raws = _encode(header, tensors)

    def write(f: BinaryIO) -> None:
        f.write(MAGIC + _PREFIX.pack(len(text), zlib.crc32(text)) + text)
        f.write(bytes(_data_start(len(text)) - len(MAGIC) - _PREFIX.size - len(text)))
        for r in raws:
            f.write(memoryview(r.numpy()))
            f.write(bytes(_pad(r.numel())))

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, write, "export file", "an earlier export of that name, if any, is intact")
    return path.stat().st_size


def read_header(path: str | Path) -> dict:
    """The checked JSON header alone (cheap: the tensors are not read)."""
    path = Path(path)
    with _open(path) as f:
        header, _ = _read_header(f, path)
    return header


def read_export(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, {name: tensor}) after every check; tensors are views of one CPU buffer."""
    path = Path(path)
    with _open(path) as f:
        header, start = _read_header(f, path)
        size = path.stat().st_size
        expected = start + int(header["data_bytes"])
        if size != expected:
            raise ExportError(
                f"export file {path} has {size} bytes but its header records {expected}: the file is "
                f"{'truncated' if size < expected else 'longer than written'}; export the model again"
            )
        data = torch.empty(int(header["data_bytes"]), dtype=torch.uint8)
        f.seek(start)
        if data.numel() and f.readinto(memoryview(data.numpy())) != data.numel():
            raise ExportError(
                f"export file {path} ended early: the file is truncated; export the model again"
            )
    if zlib.crc32(data.numpy()) != header["data_crc32"]:
        raise ExportError(
            f"export file {path}: checksum mismatch in the tensor data: the file is corrupted; export the model again"
        )
    tensors = {}
    for name, e in header["tensors"].items():
        try:
            dtype = DTYPES[e["dtype"]]
            chunk = data[e["offset"] : e["offset"] + e["bytes"]]
            tensors[name] = chunk.view(dtype).view(e["shape"])
        except (KeyError, TypeError, RuntimeError) as err:
            raise ExportError(
                f"export file {path}: tensor {name!r} is malformed in the header ({err})"
            ) from None
    return header, tensors


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as e:
        raise ExportError(f"export file {path} cannot be opened: {e.strerror or e}") from None


def _read_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """(header, where the data starts)."""
    prefix = f.read(len(MAGIC) + _PREFIX.size)
    if not prefix.startswith(MAGIC):
        hint = " (model.pt of a run? pass the run folder to `neorec export`)" if prefix[:2] == b"PK" else ""
        raise ExportError(
            f"{path} is not a neorec export file{hint}; write one with `neorec export RUN_DIR --out FILE`"
        )
    if len(prefix) < len(MAGIC) + _PREFIX.size:
        raise ExportError(
            f"export file {path} is truncated (it ends inside its header); export the model again"
        )
    length, crc = _PREFIX.unpack(prefix[len(MAGIC) :])
    text = f.read(length) if length < 1 << 30 else b""  # a header is small: a huge length is damage
    if len(text) != length:
        raise ExportError(
            f"export file {path} is truncated or corrupted (its header is cut); export the model again"
        )
    if any(f.read(_data_start(length) - len(MAGIC) - _PREFIX.size - length)):
        raise ExportError(
            f"export file {path}: the padding after its header is not zero: the file is corrupted; export it again"
        )
    if zlib.crc32(text) != crc:
        raise ExportError(
            f"export file {path}: checksum mismatch in the header: the file is corrupted; export it again"
        )
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"export file {path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ExportError(f"{path} is not a neorec export file (its header is not a neorec export header)")
    if header.get("version") != VERSION:
        raise ExportError(
            f"export file {path}: format version {header.get('version')}, this neorec reads {VERSION}"
        )
    for key in ("tensors", "data_bytes", "data_crc32"):
        if key not in header:
            raise ExportError(f"export file {path}: the header has no {key!r}")
    return header, _data_start(length)
