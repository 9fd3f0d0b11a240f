"""The row cache's slots: which row each one holds, and which ones the eviction policy gives up.

Bookkeeping is dense and vectorised: `slot_of[row]` (int32, -1 = not cached; 4 bytes per row of the
table, and under LFU one byte more, `history`: the per-row costs kept in RAM), and per slot its row,
a dirty bit, the tick of its last use
and (LFU) its use count. Victims are the slots with the smallest key among those the current call
does not need (one `topk` per call):
- lru: key = tick of the last lookup;
- lfu: key = (use count, then tick): the least used go first, oldest among equals. A row's count
  outlives its eviction (`history`, one byte a row, saturating at 255): a row that comes back
  resumes its count instead of entering as a newcomer with 1 (hit rate 0.709 -> 0.720 at 20% cached
  in benchmarks/cache.py). Counts decay: they are halved every time the cache has seen
  `lfu_decay_rows` looked-up rows (default: 64 times as many as it has slots), so a count is about
  the row's recent uses and rows that were hot long ago do not stay forever;
Free slots have the smallest key of all, so they fill first. Evicting an updated row writes its
record back to the backing store.
"""

from __future__ import annotations

import torch

from neorec.embedding.cache.records import as_words
from neorec.utils import index_ops

_PINNED = torch.iinfo(torch.int64).max
_SAMPLE = 4096  # keys sampled to choose victims (smallest)


class SlotBookkeeping:
    """RowCache's slot bookkeeping and eviction (a base class of RowCache, whose __init__ sets up the
    state these methods keep: slot_of, row_of, dirty, last_used, uses, history, tick)."""

    def _touch(self, resident: torch.Tensor, num_rows: int) -> None:
        """A new tick: `resident` slots were used now."""
        self.tick += 1
        self._decay(num_rows)
        self.last_used.index_fill_(0, resident, self.tick)
        if self.policy == "lfu":
            self.uses.index_add_(0, resident, torch.ones_like(resident))

    def _make_room(
        self, k: int, resident: torch.Tensor, fit: bool = True, num_pinned: int | None = None
    ) -> torch.Tensor | None:
        """Up to k slots to reuse, never one of `resident` or of a batch in flight (read ahead, not
        looked up yet). fit=True: all k or None; else as many as there are. num_pinned: the number
        of those slots, when the caller has counted them."""
        start = self._fresh
        if self.capacity - start >= k:  # never-used slots suffice (no victim to choose, none pinned)
            self._fresh += k
            return torch.arange(start, start + k, device=self.device)
        pinned = torch.cat([resident, *(e.slots for e in self._ahead)])
        if self.policy == "lru":
            key = self.last_used[:start].clone()
        else:  # one pass: (use count, then tick)
            key = torch.add(self.last_used[:start], self.uses[:start], alpha=1 << 32)
        key.index_fill_(0, pinned, _PINNED)
        # resident slots are distinct; with batches in flight they may repeat: count them in the keys,
        # unless even counting the repeats leaves room for k (no read back then)
        if num_pinned is None:
            num_pinned = pinned.numel()
            if self._ahead and self.capacity - num_pinned < k:
                num_pinned = int((key == _PINNED).sum())
        free = self.capacity - num_pinned  # never-used slots and unpinned ones
        if fit and free < k:
            return None
        k = min(k, free)
        fresh = torch.arange(start, min(start + k, self.capacity), device=self.device)
        self._fresh += fresh.numel()
        if fresh.numel() == k:
            return fresh
        return torch.cat([fresh, smallest(key, k - fresh.numel())])

    def _decay(self, num_rows: int) -> None:
        """LFU: halve every count once lfu_decay_rows rows have been looked up since the last time."""
        if self.policy != "lfu":
            return
        self._looked_up += num_rows
        if self._looked_up >= self.lfu_decay_rows:
            self.uses.bitwise_right_shift_(1)
            self.history.bitwise_right_shift_(1)
            self._looked_up = 0

    def _evict(self, slots: torch.Tensor) -> None:
        if self._on_device:
            self._evict_on_device(slots)
            return
        rows = self.row_of.index_select(0, slots)
        occupied = index_ops.where(rows >= 0)
        slots, rows = slots.index_select(0, occupied), rows.index_select(0, occupied)
        if rows.numel() == 0:
            return
        rows, order = index_ops.sort(rows)  # ascending: runs of neighbours go out together, cheap counting
        slots = slots.index_select(0, order)
        dirty = self.dirty.index_select(0, slots)
        if bool(dirty.all()):
            self._write_back(slots, rows)
        elif bool(dirty.any()):
            at = index_ops.where(dirty)
            self._write_back(slots.index_select(0, at), rows.index_select(0, at))
        if self.policy == "lfu":
            self.history.index_copy_(
                0, rows, self.uses.index_select(0, slots).clamp_(max=255).to(torch.uint8)
            )
        self.slot_of.index_fill_(0, rows, -1)
        self.row_of.index_fill_(0, slots, -1)
        self._moves += 1
        self.stats.add("evictions", rows, ascending=True)

    def _evict_on_device(self, slots: torch.Tensor) -> None:
        """_evict without reading anything back: which slots are occupied and which were updated stay
        on the device; DeviceIO copies the records out and its worker writes back the updated ones."""
        rows = self.row_of.index_select(0, slots)
        occupied = rows >= 0
        dirty = self.dirty.index_select(0, slots).logical_and_(occupied)
        self.io.write_back(rows, dirty, self.records, slots)
        target = torch.where(occupied, rows, self.num_rows)  # empty slots: the sink entry
        if self.policy == "lfu":
            self.history.index_copy_(
                0, target, self.uses.index_select(0, slots).clamp_(max=255).to(torch.uint8)
            )
        self.slot_of.index_fill_(0, target, -1)
        self.row_of.index_fill_(0, slots, -1)
        self.dirty.index_fill_(0, slots, False)
        self._moves += 1
        self.stats.add("evictions", rows, where=occupied)
        self.stats.add("writebacks", rows, where=dirty)

    def _write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the records in `slots` back as those of `rows` (ascending)."""
        self.io.write(rows, as_words(self.records).index_select(0, slots).view(torch.uint8))
        self.dirty.index_fill_(0, slots, False)
        self.stats.add("writebacks", rows, ascending=True)

    def _load(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Bookkeeping of `rows` (sorted), whose records are now in `slots`."""
        self._moves += 1
        self.slot_of.index_copy_(0, rows, slots.to(torch.int32))
        self.row_of.index_copy_(0, slots, rows)
        self.dirty.index_fill_(0, slots, False)
        self.last_used.index_fill_(0, slots, self.tick)
        if self.policy == "lfu":
            self.uses.index_copy_(0, slots, self.history.index_select(0, rows).long() + 1)
        else:
            self.uses.index_fill_(0, slots, 1)
        self.stats.add("misses", rows, ascending=True)

    def slot_index(self, rows: torch.Tensor) -> torch.Tensor:
        """slot_of[rows] as int64, unchecked: -1 for a row without a slot."""
        return self.slot_of.index_select(0, rows).long()

    def mark_updated(self, slots: torch.Tensor) -> None:
        """The records of `slots` were updated in place: write them back when they are evicted."""
        self.dirty.index_fill_(0, slots, True)


def smallest(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k smallest entries of `key` (ties in any order), as torch.topk(largest=False)
    gives them, but cheaper for k far below len(key): a threshold from a sample of the keys keeps
    only the candidates (some spare), and the topk runs over those."""
    n = key.numel()
    if k * 8 >= n or key.device.type != "cpu":  # on a device, topk reads nothing back; the sample's would
        return torch.topk(key, k, largest=False, sorted=False).indices
    # every so many slots (no random numbers: training's stay untouched); the k-th smallest key is
    # below the q-th smallest of the sample, near surely
    sample = key[:: max(1, n // _SAMPLE)]
    q = min(sample.numel(), int(sample.numel() * k / n * 1.5) + 16)
    threshold = torch.kthvalue(sample, q).values
    candidates = index_ops.where(key <= threshold)
    if candidates.numel() < k:  # the sample misled: the exact way
        return torch.topk(key, k, largest=False, sorted=False).indices
    chosen = torch.topk(key.index_select(0, candidates), k, largest=False, sorted=False).indices
    return candidates.index_select(0, chosen)
