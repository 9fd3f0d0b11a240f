"""The write log of an SSD table: evicted rows appended to a second file instead of written in place.

Writing a few thousand scattered rows into a file costs a page fault (through a map) or a system
call (pwrite) per row, 3-9 us each here (benchmarks/RESULTS.md, "SSD backing"); an
append of the same rows is one sequential write. So the table file (`<table>.rows.bin`, row r at
record r) is only read and rewritten in whole windows, and the rows a cache writes back go to the end
of this log (`<table>.rows.log`). `where[row]` (int32, 4 bytes a row in RAM) says where each row's
current record is: -1 in the table file, else its position in the log.

The log has two halves, used in turn. Appends fill the active half. When it is full, the rows still in
the other half are folded into the table file (compaction must have finished there already, see
below) and the halves swap. A full half is compacted bit by bit, a window of the table (16 MiB of
records) at a time, during the appends to the other half, so that it is done by the time that half
fills: the half's rows in the window are read from the log in ascending order and stored into the
table file's shared map (SsdBacking passes it; the window's pages are usually mapped already, since
misses are read through the same map), then their `where` is reset. Without a map, each window is read,
the half's rows in it overlaid, and written back in one sequential write. Windows that hold none of its
rows are skipped. Through the map, folding a half costs a store per record appended plus the page
cache's writeback of the window's dirty pages (sequential on disk, by the kernel); without it, it
rewrites about the whole file, about 2 / fraction records of sequential read and as many of write per
record appended. The disk holds the table plus the log (`fraction` of the table's rows, default 1.0:
twice the table on disk), allocated when the log is created.

Threads: the cache's worker thread appends and compacts; the training thread may read at the same
time (rows read on its own thread). A read takes `lock` while it looks rows up and gathers them, and so does an
append, the only thing that overwrites log records (a half is reused only after compaction); a
compaction writes a window of the table before it resets `where`, so a reader finds every row's
current record in one file or the other at any moment.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from neorec.embedding.cache.file_io import allocate, transfer
from neorec.utils import index_ops

_WINDOW_BYTES = 16 << 20  # records of the table file compacted at a time


def log_records(num_rows: int, fraction: float) -> int:
    """Records the write log of a table of `num_rows` holds: two halves of `fraction` of the rows
    over two, at least one each and at most 2^30 (their positions are int32)."""
    return 2 * max(1, min(int(fraction * num_rows) // 2, 2**30))


class WriteLog:
    """Append-only records of the rows written back to one table file, and where each row now lives."""

    def __init__(
        self,
        path: str | Path,
        table_path: str | Path,
        record_bytes: int,
        num_rows: int,
        fraction: float = 1.0,
        table_words: torch.Tensor | None = None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        make_room: Callable[[int], None] | None = None,
    ):
        """table_words: the table file's records through a shared map (int64 words): folding then
        stores the logged records into it instead of rewriting whole windows with pread/pwrite. The
        owner's gather(places) (ascending places, their records from `records`) and
        make_room(nbytes) (called before storing into nbytes of the map) keep the maps' resident
        pages within the owner's bound."""
        if not 0 < fraction <= 1:
            raise ValueError(f"the write log's fraction of the table must be in (0, 1], got {fraction}")
        self.path, self.table_path = Path(path), Path(table_path)
        self.record_bytes, self.num_rows = record_bytes, num_rows
        self.half = log_records(num_rows, fraction) // 2
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self.table_fd = os.open(self.table_path, os.O_RDWR)
        self._close = weakref.finalize(self, _close_all, self.fd, self.table_fd)  # also if never closed
        what = "the write log (embedding.cache.ssd_log sets its share of the table)"
        allocate(self.fd, 2 * self.half * record_bytes, self.path, what)
        words = record_bytes // 8
        self._map = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(2 * self.half, words))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map._mmap.madvise(mmap.MADV_HUGEPAGE)
        # the log's records as int64 words (only read: appends go through pwrite)
        self.records = torch.from_numpy(self._map)
        self.table_words, self._gather, self._make_room = table_words, gather, make_room
        self.where = torch.full((num_rows,), -1, dtype=torch.int32)
        self.lock = threading.Lock()
        self.active, self.tail = 0, 0  # the half being appended to, and its records so far
        self._compacting: int | None = None  # the full half being folded into the table
        self._window_rows = max(1, _WINDOW_BYTES // record_bytes)
        self._next_window, self._credit = 0, 0.0
        self.appended = self.compacted_windows = 0  # records appended, windows rewritten (stats)

    # ---- writes ----------------------------------------------------------------------------------
    def append(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Append `records` (int64 words, one per row) of unique `rows`; they become the rows' current values."""
        done, n = 0, rows.numel()
        while done < n:
            if self.tail == self.half:
                self._swap()
            take = min(self.half - self.tail, n - done)
            start = self.active * self.half + self.tail
            chunk = records[done : done + take].contiguous()
            with self.lock:
                transfer(self.fd, chunk, start * self.record_bytes, True, self.path)
                self.where.index_copy_(
                    0, rows[done : done + take], torch.arange(start, start + take, dtype=torch.int32)
                )
            self.tail += take
            done += take
            self._compact_share(take)
        self.appended += n

    def _swap(self) -> None:
        """The active half is full: finish folding the other one in, then append to it."""
        if self._compacting is not None:
            self._compact_rest()
        self._compacting, self._next_window, self._credit = self.active, 0, 0.0
        self.active, self.tail = 1 - self.active, 0

    def _compact_share(self, appended: int) -> None:
        """Compact the windows owed for `appended` records, so the full half is done before the active one fills."""
        if self._compacting is None:
            return
        windows = -(-self.num_rows // self._window_rows)
        self._credit += appended * windows / self.half
        while self._credit >= 1 and self._compacting is not None:
            self._compact_next()
            self._credit -= 1

    def _compact_rest(self) -> None:
        while self._compacting is not None:
            self._compact_next()

    def _compact_next(self) -> None:
        half, start = self._compacting, self._next_window * self._window_rows
        end = min(start + self._window_rows, self.num_rows)
        self.fold(start, end, half)
        self._next_window += 1
        if end == self.num_rows:
            self._compacting = None

    def fold(self, start: int, end: int, half: int | None = None) -> None:
        """Write the rows of table rows [start, end) that live in the log (in `half`, or either) into
        the table file: stored through the table's map (only their records are written; 3-4 ms of
        CPU a 16 MiB window half logged, against 9-16 ms to read and rewrite the window with
        pread/pwrite, benchmarks/history/design_choices.md), or without one in one read and one write of
        the window. They then live there again."""
        at, places = self._logged(start, end, half)
        if at.numel() == 0:
            return
        if self.table_words is not None:
            places, order = index_ops.sort(places)  # the log read in ascending order
            records = self._gather(places) if self._gather else self.records.index_select(0, places)
            if self._make_room is not None:
                self._make_room((end - start) * self.record_bytes)
            self.table_words[start:end].index_copy_(0, at.index_select(0, order), records)
        else:
            window = self.read_window(start, end)
            window.index_copy_(0, at, self.records.index_select(0, places))
            transfer(self.table_fd, window, start * self.record_bytes, True, self.table_path)
        self.where.index_fill_(0, at + start, -1)  # after the table holds them: readers see one or the other
        self.compacted_windows += 1

    def fold_range(self, start: int, end: int) -> None:
        """Every logged row of table rows [start, end) into the table file, window by window (a map of
        those rows is then current); all of them: the log starts empty again."""
        for a in range(start, end, self._window_rows):
            self.fold(a, min(a + self._window_rows, end))
        if start == 0 and end == self.num_rows:
            self.active, self.tail, self._compacting = 0, 0, None

    # ---- reads -----------------------------------------------------------------------------------
    def read_window(self, start: int, end: int) -> torch.Tensor:
        """Records of table rows [start, end) as they are in the table file (int64 words)."""
        out = torch.empty((end - start, self.record_bytes // 8), dtype=torch.int64)
        transfer(self.table_fd, out, start * self.record_bytes, False, self.table_path)
        return out

    def overlay(self, start: int, records: torch.Tensor) -> None:
        """Replace, in `records` (table rows start.., int64 words), the rows whose current value is in the log."""
        at, places = self._logged(start, start + records.shape[0])
        if at.numel():
            records.index_copy_(0, at, self.records.index_select(0, places))

    def _logged(self, start: int, end: int, half: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Of table rows [start, end), those whose record is in the log (in `half`, or either), as
        offsets from `start`, and their places in the log."""
        where = self.where[start:end]
        if half is None:
            logged = where >= 0
        else:
            logged = (where >= half * self.half) & (where < (half + 1) * self.half)
        at = index_ops.where(logged)
        return at, where.index_select(0, at).long()

    def release(self) -> None:
        """Drop the log map's resident pages (reads mapped them)."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)

    def flush(self) -> None:
        os.fsync(self.fd)
        os.fsync(self.table_fd)

    def close(self) -> None:
        self._close()
        self.fd = self.table_fd = -1


def _close_all(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
