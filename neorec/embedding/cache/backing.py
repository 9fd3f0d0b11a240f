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
clean (or written-back) page cache, and a fault maps more than the row: its 4 KiB page, neighbours
already cached (fault-around, 64 KiB) and, for a file just written, whole large folios (MBs). So that
resident memory stays within a budget: the file's pages are dropped from the page cache once it is
written, the mapping is marked random-access (no read-ahead, so later faults bring single pages),
rows move in pieces, and the mapping's resident pages are dropped (madvise MADV_DONTNEED; dirty pages
go to the page cache first, nothing is lost) whenever the pieces may have mapped `release_bytes`,
counting 64 KiB per row.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from neorec.embedding.fused.storage import RowInit

# numpy has no bfloat16: such files are read as int16 and viewed as bfloat16 (same bytes).
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
_INIT_WINDOW_ROWS = 1 << 18
_FAULT_BYTES = 64 << 10  # at most mapped per row touched (fault-around), once the file is not cached


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
        self.array._mmap.madvise(mmap.MADV_RANDOM)
        self.tensor = _as_torch(self.array, dtype)
        self.release_bytes = release_bytes
        self.piece_rows = max(1, release_bytes // _FAULT_BYTES)
        self._mapped = 0  # bytes the mapping may hold resident since the last release, at most

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.tensor.new_empty((rows.numel(), *self.tensor.shape[1:]))
        self._in_pieces(rows, lambda lo, hi: torch.index_select(self.tensor, 0, rows[lo:hi], out=out[lo:hi]))
        return out

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self._in_pieces(rows, lambda lo, hi: self.tensor.index_copy_(0, rows[lo:hi], values[lo:hi]))

    def _in_pieces(self, rows: torch.Tensor, work) -> None:
        """work(lo, hi) over rows in rounds of piece_rows, each round split over I/O threads: a page
        fault that reads the disk blocks its thread, so several in flight keep the disk busy."""
        n = rows.numel()
        for start in range(0, n, self.piece_rows):
            end = min(start + self.piece_rows, n)
            step = max(64, -(-(end - start) // _IO_THREADS))
            bounds = [(a, min(a + step, end)) for a in range(start, end, step)]
            if len(bounds) == 1:
                work(*bounds[0])
            else:
                list(_io_pool().map(lambda b: work(*b), bounds))
            self._count(end - start)

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
        self._mapped = 0

    def flush(self) -> None:
        """Push dirty pages to the file (checkpoints, the end of a run)."""
        self.array.flush()

    def _count(self, num_rows: int) -> None:
        self._mapped += num_rows * _FAULT_BYTES
        if self._mapped >= self.release_bytes:
            self.release()


def create_ssd_file(path: str | Path, num_rows: int, width: int, dtype: torch.dtype, init: RowInit) -> None:
    """Write a table file in windows of rows with plain writes: the table is never whole in memory,
    and nothing is mapped while it is written. Its pages then leave the page cache (see above)."""
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
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


_IO_THREADS = 16
_POOL: ThreadPoolExecutor | None = None


def _io_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="neorec-ssd")
    return _POOL


def _as_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(array)  # shares the mapping; keeps `array` alive
    return t.view(dtype) if dtype == torch.bfloat16 else t
