"""Moving records between a cache and its backing store while training goes on.

One worker thread per cache runs, first in first out, two kinds of job:
- stages: reading the rows a coming batch will need and does not have (its prefetch), so the disk
  works while the current batch computes; the rows come into the cache only when their batch is
  looked up (`fetch`), so a prefetch never evicts rows the current batch still needs;
- write-backs of evicted rows, so the step does not wait for them.

Every row has one current value, and these rules keep what the cache gets equal to it:
- a job sees every write submitted before it (one worker, in order);
- a write submitted after a stage (a row of the current batch evicted, or written through, while the
  next batch's rows were being read) may have changed rows the stage read: writes are logged, and a
  staged record is used only if its row was not written since the stage was submitted;
- a read on the caller's thread (rows no stage holds) takes rows whose write-back is still pending
  from that write's records, the newest copy, and the others from the backing store, which no
  pending write touches.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

_MAX_STAGES = 4  # coming batches read ahead at most (the pipeline keeps 1)
_MAX_WRITES = 4  # write-backs in flight at most, before a new one waits for the oldest


@dataclass
class _Stage:
    rows: torch.Tensor  # sorted, unique
    records: Future  # -> [len(rows), record_bytes]
    mark: int  # writes logged before this stage was submitted
    batch: object = None  # the coming batch's unique rows (the very tensor its lookup will pass)


@dataclass
class _Write:
    rows: torch.Tensor  # sorted, unique
    records: torch.Tensor
    done: Future


class BackgroundIO:
    """Reads ahead and writes behind for one backing store (DramBacking or SsdBacking)."""

    def __init__(self, backing, background: bool = True) -> None:
        """background=False runs every job on the caller's thread (a host-memory backing, where a
        thread would only add a hand-over)."""
        self.backing, self.layout, self.background = backing, backing.layout, background
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="neorec-cache") if background else None
        self._stages: deque[_Stage] = deque()
        self._writes: deque[_Write] = deque()
        self._log: list[torch.Tensor] = []  # rows of each write, from write number _log_base on
        self._log_base = 0

    # ---- jobs ------------------------------------------------------------------------------------
    def stage(self, rows: torch.Tensor, batch: object = None) -> None:
        """Start reading `rows` (sorted, unique) for a coming batch; `batch`: that batch's unique rows,
        the tensor its lookup will pass to `consumed` (so the stage is dropped then without a search)."""
        if len(self._stages) == _MAX_STAGES:
            self._stages.popleft()
        mark = self._log_base + len(self._log)
        self._stages.append(_Stage(rows, self._submit(self.backing.read, rows), mark, batch))

    def staged(self) -> list[torch.Tensor]:
        """Rows of the stages not consumed yet (they are on their way)."""
        return [s.rows for s in self._stages]

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write `records` of `rows` (sorted, unique) back; `records` must not change afterwards."""
        self._log.append(rows)
        self._writes.append(_Write(rows, records, self._submit(self.backing.write, rows, records)))
        self._trim()
        while len(self._writes) > _MAX_WRITES:
            self._writes[0].done.result()
            self._trim()

    # ---- reads ----------------------------------------------------------------------------------
    def fetch_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """Records of `rows` (sorted, unique, not in the cache) into `buffer[slots]`: from the stages
        where they are valid, waiting for the oldest stage (the batch being looked up) but not for
        later ones; the rest read now."""
        todo = torch.ones(rows.numel(), dtype=torch.bool)
        words = _words(buffer)
        for i, stage in enumerate(self._stages):
            if i > 0 and not stage.records.done():
                continue
            pos, found = find_sorted(stage.rows, rows)
            found &= todo
            if not bool(found.any()):
                continue
            records = stage.records.result()
            found &= self._unwritten(stage).index_select(0, pos)
            at = found.nonzero().flatten()
            words.index_copy_(
                0, slots.index_select(0, at), _words(records).index_select(0, pos.index_select(0, at))
            )
            todo &= ~found
        rest = todo.nonzero().flatten()
        if rest.numel():
            words.index_copy_(0, slots.index_select(0, rest), _words(self.read(rows.index_select(0, rest))))

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Records of `rows` (sorted, unique) now: pending write-backs first (newest wins), then the
        backing store for the rest."""
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

    def _unwritten(self, stage: _Stage) -> torch.Tensor:
        """Per row of the stage: True if no write since the stage was submitted touched it."""
        ok = torch.ones(stage.rows.numel(), dtype=torch.bool)
        for rows in self._log[stage.mark - self._log_base :]:
            pos, found = find_sorted(stage.rows, rows)
            ok[pos[found]] = False
        return ok

    # ---- housekeeping ---------------------------------------------------------------------------
    def consumed(self, rows: torch.Tensor, batch: object = None) -> None:
        """`rows` (sorted, unique) were looked up: drop the stages read ahead for this very batch
        (`batch`, default `rows`: the same tensor object its prefetch passed), and the stages of no
        known batch that only held rows of them (a search). A stage of another batch waits for that
        batch's lookup (or for newer stages to push it out)."""
        batch = rows if batch is None else batch
        keep = deque(
            s
            for s in self._stages
            if s.batch is not batch and (s.batch is not None or not bool(find_sorted(rows, s.rows)[1].all()))
        )
        if len(keep) != len(self._stages):
            self._stages = keep
            self._trim()

    def drain(self, drop_stages: bool = False) -> None:
        """Wait for every job (checkpoints read and write the backing store directly after this)."""
        for w in self._writes:
            w.done.result()
        for s in self._stages:
            s.records.result()
        if drop_stages:
            self._stages.clear()
        self._trim()

    def close(self) -> None:
        self.drain(drop_stages=True)
        if self._worker is not None:
            self._worker.shutdown()

    def _submit(self, fn, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def _trim(self) -> None:
        """Forget finished writes, and the log that no stage needs any more."""
        while self._writes and self._writes[0].done.done():
            self._writes.popleft().done.result()  # raises here if the write failed
        oldest = min((s.mark for s in self._stages), default=self._log_base + len(self._log))
        drop = oldest - self._log_base
        if drop > 0:
            del self._log[:drop]
            self._log_base = oldest


def find_sorted(sorted_rows: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position in sorted_rows, found) of each of `rows`."""
    if sorted_rows.numel() == 0:
        return torch.zeros_like(rows), torch.zeros(rows.numel(), dtype=torch.bool)
    pos = torch.searchsorted(sorted_rows, rows).clamp_(max=sorted_rows.numel() - 1)
    return pos, sorted_rows.index_select(0, pos) == rows


def _words(records: torch.Tensor) -> torch.Tensor:
    """Records as int64 words: torch copies whole rows of those several times faster than bytes."""
    return records.view(torch.int64)
