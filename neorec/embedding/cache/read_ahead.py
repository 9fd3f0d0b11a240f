"""Reading a coming batch's rows into the row cache ahead of its lookup, on the worker thread.

Prefetch of a coming batch (`prefetch(rows, ahead=True)`, which the training pipeline calls for
batch i+1 before batch i runs; with the worker thread only, `io_thread`, which file-backed tiers and
caches in device memory have: without it the rows come in at the lookup, build.py use_io_thread says
when) gives the rows the cache lacks their slots at
once, evicting others, and reads their records on a worker thread (background.py), so the disk works
while batch i computes. Until its lookup, such a batch is "in flight": its slots are pinned (no
eviction touches them, so no write-back can race the read of a row), and batch i's too, so a
prefetch never evicts rows a batch in flight needs. The worker places the records it read in their
slots; the batch's lookup waits for that if they are late, and so does any read of a slot whose
records are still on their way. A batch that does not fit beside the batches in flight is brought in at its
lookup instead.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from neorec.embedding.cache.device_io import StagedRead
from neorec.utils import index_ops

MAX_AHEAD = 4  # batches read ahead and not looked up yet, at most (the pipeline keeps 1 or 2)


@dataclass
class AheadBatch:
    """A batch whose rows were made resident ahead of its lookup: pinned until then."""

    rows: torch.Tensor  # its unique rows (the very tensor its lookup passes)
    slots: torch.Tensor  # the slots of its rows: pinned
    victims: torch.Tensor | None = None  # slots given to its missing rows, whose records are coming
    future: Future | StagedRead | None = None  # -> those records
    complete: bool = False  # every one of its rows has a slot (so its lookup has nothing to bring in)


class ReadAhead:
    """RowCache's reads ahead (a base class of RowCache, whose __init__ sets up the batches in
    flight, `_ahead`, and the slots whose records are on their way, `_loading`)."""

    def _classify_on_device(
        self, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(unique rows ascending, their slots, positions of the resident ones, of the missing ones,
        the number of slots pinned once they are: theirs and those of the batches in flight) of
        `rows`, with one read back to the host, of those counts (torch.unique, nonzero and counting
        the pinned slots for _make_room would each read one)."""
        n = rows.numel()
        ordered = torch.sort(rows).values
        _, place = index_ops.runs(ordered)
        # the unique rows first, then the sink row (never resident) in the places left over
        padded = torch.full((n,), self.num_rows, dtype=rows.dtype, device=rows.device).scatter_(
            0, place, ordered
        )
        slots = self.slot_index(padded)
        cached = slots >= 0
        pinned = torch.zeros(self.capacity + 1, dtype=torch.bool, device=rows.device)  # + a sink
        for e in self._ahead:
            pinned.index_fill_(0, e.slots, True)
        pinned.index_fill_(0, torch.where(cached, slots, self.capacity), True)
        pinned[self.capacity :].zero_()  # the sink (a kernel: setting an element copies from the host)
        num_unique = place[-1:] + 1 if n else place.new_zeros(1)
        counts = torch.cat([num_unique, cached.sum().view(1), pinned.sum().view(1)]).cpu()  # the one read
        num_unique, num_cached, num_pinned = counts.tolist()
        unique = padded[:num_unique]
        self._uniques.append((rows, unique))  # its lookup passes the same `rows`
        missing = ~cached
        missing[num_unique:] = False
        hit = index_ops.compact(cached, num_cached)
        miss = index_ops.compact(missing, num_unique - num_cached)
        return unique, slots[:num_unique], hit, miss, num_pinned

    def _load_ahead(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor | None = None,
        hit: torch.Tensor | None = None,
        miss: torch.Tensor | None = None,
        num_pinned: int | None = None,
    ) -> None:
        """A coming batch's unique `rows`: pin the resident ones, give the missing ones slots (evicting
        others, never a row of a batch in flight) and start reading their records. A batch that does
        not fit beside the batches in flight is left to its lookup. slots, hit, miss, num_pinned:
        as _classify_on_device gives them, when it has."""
        if slots is None or hit is None or miss is None:
            slots = self.slot_index(rows)
            hit, miss = index_ops.split(slots >= 0)
        resident = slots.index_select(0, hit)
        self._touch(resident, rows.numel())
        missing = rows.index_select(0, miss)
        if missing.numel():
            victims = self._make_room(missing.numel(), resident, num_pinned=num_pinned)
            if victims is None:  # no room now: it comes in at its lookup
                self._ahead.append(AheadBatch(rows, resident))
                return
            self._evict(victims)  # their write-backs are queued before the read below
            self._load(missing, victims)
            self._loading.index_fill_(0, victims, True)
            self._ahead.append(
                AheadBatch(
                    rows,
                    torch.cat([resident, victims]),
                    victims,
                    self.io.read_ahead(missing, self.records, victims),
                    complete=True,
                )
            )
        else:
            self._ahead.append(AheadBatch(rows, resident, complete=True))

    def _take_ahead(self, rows: torch.Tensor) -> AheadBatch | None:
        """The lookup of `rows`: if a prefetch read them ahead, finish that (and any older one), unpin
        them and return its entry."""
        for i, entry in enumerate(self._ahead):
            if entry.rows is rows:
                for _ in range(i + 1):
                    self._finish(self._ahead.popleft())
                return entry
        return None

    def _finish(self, entry: AheadBatch) -> None:
        """Wait for a read-ahead's records to be in their slots (the worker places them)."""
        if entry.future is not None:
            entry.future.result()
            self._loading.index_fill_(0, entry.victims, False)
            entry.future = None

    def _finish_all(self) -> None:
        for entry in self._ahead:
            self._finish(entry)
