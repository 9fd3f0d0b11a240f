"""Bytes on disk: atomic writes, raw tensor files with checksums, and reading them back safely.

A shard file is raw tensor bytes one after another (no pickle, no header): the manifest says where
each piece starts, its dtype and shape, so a reader can fetch just the rows it needs with one seek.
Every file is written by neorec.utils.files.write_atomic (temporary name, fsync, rename), so a reader
sees either nothing or the whole file; its size and crc32 go into the manifest and are checked before use.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from neorec.errors import NeorecError
from neorec.utils import files

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


class CheckpointError(NeorecError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model. Names the file/table."""


class CheckpointWriteError(CheckpointError, files.FileWriteError):
    """A checkpoint file could not be written (disk full, a file-size limit, an I/O error). Names the
    file; the checkpoints saved before are untouched."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """A checkpoint file through neorec.utils.files.write_atomic: a failed write removes the partial
    file and raises CheckpointWriteError naming the file."""
    files.write_atomic(
        path, write, "checkpoint file", "the checkpoints saved before it are intact", CheckpointWriteError
    )


class RawWriter:
    """Appends tensors' bytes to an open file and keeps the running crc32 and size."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.offset, self.crc = f, 0, 0

    def append(self, tensor: torch.Tensor) -> int:
        """Write `tensor` (its rows, in order); returns the offset it starts at."""
        start = self.offset
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            data = t.reshape(-1).view(torch.uint8).numpy()
            self.f.write(memoryview(data))
            self.crc = zlib.crc32(data, self.crc)
            self.offset += data.nbytes
        return start


def check_file(path: Path, size: int, crc32: int | None) -> None:
    """The file exists, has the size the manifest recorded and (crc32 given) the same checksum."""
    files.check_recorded(
        path, [size, crc32], "its manifest.json", "use an earlier checkpoint", CheckpointError, what="checkpoint file "
    )


def read_rows(
    f: BinaryIO, path: Path, offset: int, shape: list[int], dtype: torch.dtype, rows: tuple[int, int]
) -> torch.Tensor:
    """Rows [a, b) of the piece at `offset` with `shape` ([rows] or [rows, width]) and `dtype`."""
    a, b = rows
    width = shape[1] if len(shape) == 2 else 1
    row_bytes = width * torch.empty(0, dtype=dtype).element_size()
    out = torch.empty((b - a) * row_bytes, dtype=torch.uint8)
    if out.numel():
        f.seek(offset + a * row_bytes)
        got = f.readinto(memoryview(out.numpy()))
        if got != out.numel():
            raise CheckpointError(f"checkpoint file {path}: ended after {got} of {out.numel()} bytes at offset "
                                  f"{offset + a * row_bytes}: the file is truncated")  # fmt: skip
    values = out.view(dtype)
    return values.view(b - a, width) if len(shape) == 2 else values


def load_tensors(path: Path) -> dict:
    """A small torch.save file (the dense state) with weights_only loading: no code is executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure inside torch becomes one clear message
        raise CheckpointError(f"checkpoint file {path} cannot be loaded ({type(e).__name__}: {e})") from None
