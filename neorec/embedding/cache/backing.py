"""Backing stores: where every row of a cached table lives, behind the RAM cache (cache.py).

Two tiers, one interface (`read`, `write`, `read_range`, `write_range`, `release`):
- `DramBacking`: a plain tensor in host memory (on a GPU machine, the tier behind device memory);
- `SsdBacking`: a file on disk, memory-mapped (numpy.memmap) and seen as a torch tensor.

Why a memory-mapped file rather than an embedded key-value store (RocksDB and the like): rows are
fixed-size and addressed by a dense index, so row r is simply at byte r * row_bytes; a map turns a
batch's misses into one vectorised `index_select` / `index_copy_` with no serialisation, no
per-row calls from Python and no extra dependency, and the kernel's page cache does read-ahead and
write-back. What a key-value store would add (compaction, sparse keys) the tables do not need.

Mapped pages count in the process's resident memory once touched, although they are the kernel's
clean (or written-back) page cache. So that resident memory stays within a budget, the store drops
its mapping's resident pages (madvise MADV_DONTNEED; dirty pages go to the page cache first, nothing
is lost) after every `release_bytes` of rows moved.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

from neorec.embedding.fused.storage import RowInit

# numpy has no bfloat16: such files are read as int16 and viewed as bfloat16 (same bytes).
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
_INIT_WINDOW_ROWS = 1 << 18


class DramBacking:
    """All rows in one host-memory tensor."""

    tier = "dram"

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.num_rows = tensor.shape[0]
        self.width = tensor.shape[1] if tensor.dim() == 2 else 0
        self.dtype = tensor.dtype

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(0, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.tensor.index_copy_(0, rows, values)

    def read_range(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as a copy (a view of a slice would make torch.save write the whole buffer)."""
        part = self.tensor[start:end]
        return part if end - start == self.num_rows else part.clone()

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        self.tensor[start:end].copy_(values)

    def release(self) -> None:
        """Nothing to give back: the rows are the memory."""


class SsdBacking:
    """All rows in a memory-mapped file: row r at byte r * row_bytes."""

    tier = "ssd"

    def __init__(
        self, path: str | Path, num_rows: int, width: int, dtype: torch.dtype, release_bytes: int = 256 << 20
    ) -> None:
        self.path = Path(path)
        self.num_rows, self.width, self.dtype = num_rows, width, dtype
        self.shape = (num_rows, width) if width else (num_rows,)
        self.row_bytes = max(width, 1) * torch.empty((), dtype=dtype).element_size()
        expected = num_rows * self.row_bytes
        if not self.path.exists() or self.path.stat().st_size != expected:
            raise FileNotFoundError(f"{self.path}: expected a table file of {expected} bytes")
        self.array = np.memmap(self.path, dtype=_NUMPY[dtype], mode="r+", shape=self.shape)
        self.tensor = _as_torch(self.array, dtype)
        self.release_bytes = release_bytes
        self._moved = 0  # bytes read or written through the mapping since the last release

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.tensor.index_select(0, rows)
        self._count(rows.numel())
        return out

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.tensor.index_copy_(0, rows, values)
        self._count(rows.numel())

    def read_range(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as a tensor over its own mapping of that part of the file: nothing is
        read into memory until someone reads it, and torch.save writes only this range. Mapped
        copy-on-write: changing the tensor does not change the table."""
        shape = (end - start, self.width) if self.width else (end - start,)
        part = np.memmap(
            self.path, dtype=_NUMPY[self.dtype], mode="c", offset=start * self.row_bytes, shape=shape
        )
        return _as_torch(part, self.dtype)

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        for a in range(start, end, _INIT_WINDOW_ROWS):
            b = min(a + _INIT_WINDOW_ROWS, end)
            self.tensor[a:b].copy_(values[a - start : b - start])
            self._count(b - a)

    def release(self) -> None:
        """Drop the mapping's resident pages (written-back first by the kernel; nothing is lost)."""
        self.array._mmap.madvise(mmap.MADV_DONTNEED)
        self._moved = 0

    def flush(self) -> None:
        """Push dirty pages to the file (checkpoints, the end of a run)."""
        self.array.flush()

    def _count(self, num_rows: int) -> None:
        self._moved += num_rows * self.row_bytes
        if self._moved >= self.release_bytes:
            self.release()


def create_ssd_file(path: str | Path, num_rows: int, width: int, dtype: torch.dtype, init: RowInit) -> None:
    """Write a table file in windows of rows with plain writes: the table is never whole in memory,
    and nothing is mapped while it is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for start in range(0, num_rows, _INIT_WINDOW_ROWS):
            end = min(start + _INIT_WINDOW_ROWS, num_rows)
            rows = init(start, end).to(dtype).contiguous()
            rows = rows.view(torch.int16) if dtype == torch.bfloat16 else rows
            f.write(memoryview(rows.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _as_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(array)  # shares the mapping; keeps `array` alive
    return t.view(dtype) if dtype == torch.bfloat16 else t
