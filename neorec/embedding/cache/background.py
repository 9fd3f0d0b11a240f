"""Moving records between a cache and its backing store while training goes on.

One worker thread per cache runs, first in first out, two kinds of job:
- reads ahead: the rows a coming batch will need and does not have (its prefetch), placed straight
  into the slots the cache has given them (read_ahead.py; a cache in device memory gets them in a
  host buffer instead, which DeviceIO copies into the slots), so the disk works while the current
  batch computes; the cache touches those slots only once the job is done;
- write-backs of evicted rows, so the step does not wait for them (a cache in device memory hands
  over records still on their way to host memory: the job waits for them, write_when);
- any other job that must see every write submitted before it (submit).

Every row has one current value, and these rules keep what the cache gets equal to it:
- a job sees every write submitted before it (one worker, in order): a row evicted and then read
  ahead again is read after its write-back;
- a read on the caller's thread takes rows whose write-back is still pending from that write's
  records, the newest copy, and the others from the backing store, which no pending write touches
  (a write whose rows are not known yet, write_when, is waited for first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

_MAX_WRITES = 4  # write-backs in flight at most, before a new one waits for the oldest


@dataclass
class _Write:
    rows: torch.Tensor | None  # sorted, unique (None: known only when the job runs, write_when)
    records: torch.Tensor | None
    done: Future


class BackgroundIO:
    """Reads ahead and writes behind for one backing store (DramBacking or SsdBacking)."""

    def __init__(self, backing, background: bool = True) -> None:
        """background=False runs every job on the caller's thread (a host-memory backing, where a
        thread would only add a hand-over)."""
        self.backing, self.layout, self.background = backing, backing.layout, background
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="neorec-cache") if background else None
        self._writes: deque[_Write] = deque()
        self._reads: deque[Future] = deque()

    # ---- jobs ------------------------------------------------------------------------------------
    def read_ahead(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor | None) -> Future:
        """Start reading the records of `rows` (sorted, unique) into buffer[slots] (buffer in order if
        slots is None), after every write submitted so far. Nothing else may touch those slots until
        the future is done."""
        return self.submit(self.backing.read_into, rows, buffer, slots)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on the worker, after every write submitted so far; drain() waits for it too."""
        future = self._submit(fn, *args)
        self._reads.append(future)
        while self._reads and self._reads[0].done():
            self._reads.popleft()
        return future

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write `records` of `rows` (sorted, unique) back; `records` must not change afterwards."""
        self._add_write(_Write(rows, records, self._submit(self.backing.write, rows, records)))

    def write_when(self, ready: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A write whose rows and records ready() gives on the worker (it may wait for them, e.g. for
        a copy from a device to finish); in order with the other jobs."""

        def write() -> None:
            rows, records = ready()
            if rows.numel():
                self.backing.write(rows, records)

        self._add_write(_Write(None, None, self._submit(write)))

    def _add_write(self, w: _Write) -> None:
        self._writes.append(w)
        self._trim()
        while len(self._writes) > _MAX_WRITES:
            self._writes[0].done.result()
            self._trim()

    # ---- reads on the caller's thread ------------------------------------------------------------
    def read_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """Records of `rows` (sorted, unique) into buffer[slots] now, as read() gives them."""
        if any(not w.done.done() for w in self._writes):
            _words(buffer).index_copy_(0, slots, _words(self.read(rows)))
        else:  # finished writes are in the backing store: straight from it into the slots
            self.backing.read_into(rows, buffer, slots)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records of `rows` (sorted, unique) now: pending write-backs first (newest wins), then the
        backing store for the rest."""
        for w in self._writes:
            if w.rows is None:  # its rows are known once it has run: wait for it (and those before)
                w.done.result()
        pending = [w for w in self._writes if not w.done.done()] if self._writes else []
        if not pending:  # finished writes are in the backing store
            return self.backing.read(rows)
        out = self.layout.empty(rows.numel())
        todo = torch.ones(rows.numel(), dtype=torch.bool)
        for w in reversed(pending):
            pos, found = find_sorted(w.rows, rows)
            found &= todo
            at = found.nonzero().flatten()
            if at.numel():
                _words(out).index_copy_(0, at, _words(w.records).index_select(0, pos.index_select(0, at)))
                todo &= ~found
        rest = todo.nonzero().flatten()
        if rest.numel():
            _words(out).index_copy_(0, rest, _words(self.backing.read(rows.index_select(0, rest))))
        return out

    # ---- housekeeping ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every job (checkpoints read and write the backing store directly after this)."""
        for w in self._writes:
            w.done.result()
        for r in self._reads:
            r.result()
        self._reads.clear()
        self._trim()

    def close(self) -> None:
        self.drain()
        if self._worker is not None:
            self._worker.shutdown()

    def _submit(self, fn, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def _trim(self) -> None:
        """Forget finished writes."""
        while self._writes and self._writes[0].done.done():
            self._writes.popleft().done.result()  # raises here if the write failed


def find_sorted(sorted_rows: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position in sorted_rows, found) of each of `rows`."""
    if sorted_rows.numel() == 0:
        return torch.zeros_like(rows), torch.zeros(rows.numel(), dtype=torch.bool)
    pos = torch.searchsorted(sorted_rows, rows).clamp_(max=sorted_rows.numel() - 1)
    return pos, sorted_rows.index_select(0, pos) == rows


def _words(records: torch.Tensor) -> torch.Tensor:
    """Records as int64 words: torch copies whole rows of those several times faster than bytes."""
    return records.view(torch.int64)
