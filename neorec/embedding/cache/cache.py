"""A software-managed row cache in RAM over a slower backing tier (backing.py), for one group of tables.

One cache covers a row's weights AND its optimizer state: a row is resident with all of them or with
none, so an update never reads weights from one tier and state from another. The engine sees one
`CachedStorage` per tensor (the RowStorage of neorec/embedding/fused/storage.py), all sharing the
group's `RowCache`.

Exact semantics: every row lives in exactly one place at a time (its cache slot, or the backing
store); evicting an updated row writes its weights and state back first. Reads therefore always
return the last written values, so training through the cache is bitwise training without it,
whatever the policy, the cache size and the order of prefetches. A batch with more unique rows than
the cache still trains exactly: the rows that do not fit are read from and written to the backing
store directly (slowly).

Bookkeeping is dense and vectorised: `slot_of[row]` (int32, -1 = not cached; 4 bytes per row of the
table, the one per-row cost kept in RAM), and per slot its row, a dirty bit, the tick of its last use
and (LFU) its use count. Victims are the slots with the smallest key among those the current call
does not need (one `topk` per call):
- lru: key = tick of the last lookup or prefetch;
- lfu: key = (uses since the row came in, then tick): the least used go first, oldest among equals.
Free slots have the smallest key of all, so they fill first.
"""

from __future__ import annotations

import torch

from neorec.embedding.cache.stats import CacheStats

POLICIES = ("lru", "lfu")
_PINNED = torch.iinfo(torch.int64).max


class RowCache:
    """`capacity` rows of a group (all its tensors) in RAM, in front of `backings` (one per tensor)."""

    def __init__(
        self, tables: list[tuple[str, int, int]], backings: dict, capacity: int, policy: str = "lru"
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {policy!r}")
        first = next(iter(backings.values()))
        self.num_rows = first.num_rows
        if capacity < 1:
            raise ValueError(
                f"the cache of tables {[t[0] for t in tables]} needs at least one row, got {capacity}"
            )
        self.capacity = min(capacity, self.num_rows)
        self.policy = policy
        self.backings = backings
        self.buffers = {
            name: torch.empty((self.capacity, b.width) if b.width else (self.capacity,), dtype=b.dtype)
            for name, b in backings.items()
        }
        self.slot_of = torch.full((self.num_rows,), -1, dtype=torch.int32)
        self.row_of = torch.full((self.capacity,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool)
        self.last_used = torch.full((self.capacity,), -1, dtype=torch.int64)
        self.uses = torch.zeros(self.capacity, dtype=torch.int64)
        self.tick = 0
        row_bytes = sum(max(b.width, 1) * b.tensor.element_size() for b in backings.values())
        self.stats = CacheStats([t[0] for t in tables], [t[1] for t in tables], row_bytes, first.tier)

    # ---- bringing rows in ------------------------------------------------------------------------
    def prefetch(self, rows: torch.Tensor, lookup: bool = False) -> None:
        """Make `rows` (may repeat) resident, evicting others; lookup=True counts them as looked up."""
        unique = torch.unique(rows)
        if lookup:
            self.stats.add("lookups", unique)
        self._ensure(unique, count_unfit=lookup)

    def _ensure(self, rows: torch.Tensor, count_unfit: bool = False) -> None:
        """Bring unique `rows` in (as many as fit next to those of them already resident); the rest
        will be read from the backing store directly, and count as misses when count_unfit."""
        slots = self.slot_of.index_select(0, rows).long()
        hit = slots >= 0
        resident = slots[hit]
        self.tick += 1
        self.last_used.index_fill_(0, resident, self.tick)
        self.uses.index_add_(0, resident, torch.ones_like(resident))
        missing = rows[~hit]
        room = self.capacity - resident.numel()
        if count_unfit and missing.numel() > room:
            self.stats.add("misses", missing[room:])
        missing = missing[:room]  # beyond the cache: read/written in the backing store directly
        if missing.numel():
            victims = self._victims(missing.numel(), resident)
            self._evict(victims)
            self._load(missing, victims)

    def _victims(self, k: int, pinned: torch.Tensor) -> torch.Tensor:
        """k slots to reuse: free ones first, then by policy; never a slot in `pinned`."""
        if self.policy == "lru":
            key = self.last_used  # pinned slots were just given the newest tick
        else:
            key = self.uses * (1 << 32) + self.last_used
            key.index_fill_(0, pinned, _PINNED)
        return torch.topk(key, k, largest=False, sorted=False).indices

    def _evict(self, slots: torch.Tensor) -> None:
        rows = self.row_of.index_select(0, slots)
        occupied = rows >= 0
        slots, rows = slots[occupied], rows[occupied]
        if rows.numel() == 0:
            return
        dirty = self.dirty.index_select(0, slots)
        if bool(dirty.any()):
            self._write_back(slots[dirty], rows[dirty])
        self.slot_of.index_fill_(0, rows, -1)
        self.row_of.index_fill_(0, slots, -1)
        self.stats.add("evictions", rows)

    def _write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        order = torch.argsort(rows)  # ascending rows: the backing store sees near-sequential writes
        slots, rows = slots[order], rows[order]
        for name, backing in self.backings.items():
            backing.write(rows, self.buffers[name].index_select(0, slots))
        self.dirty.index_fill_(0, slots, False)
        self.stats.add("writebacks", rows)

    def _load(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        for name, backing in self.backings.items():
            self.buffers[name].index_copy_(0, slots, backing.read(rows))
        self.slot_of.index_copy_(0, rows, slots.to(torch.int32))
        self.row_of.index_copy_(0, slots, rows)
        self.dirty.index_fill_(0, slots, False)
        self.last_used.index_fill_(0, slots, self.tick)
        self.uses.index_fill_(0, slots, 1)
        self.stats.add("misses", rows)

    # ---- reads and writes of one tensor ------------------------------------------------------------
    def read(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        slots = self.slot_of.index_select(0, rows)
        if bool((slots < 0).any()):  # not prefetched: bring them in now, in one eviction round
            self._ensure(torch.unique(rows))
            slots = self.slot_of.index_select(0, rows)
            cached = slots >= 0
            if not bool(cached.all()):  # more unique rows than the cache holds
                return self._read_split(name, rows, slots.long(), cached)
        return self.buffers[name].index_select(0, slots)

    def _read_split(
        self, name: str, rows: torch.Tensor, slots: torch.Tensor, cached: torch.Tensor
    ) -> torch.Tensor:
        buffer = self.buffers[name]
        out = buffer.new_empty((rows.numel(), *buffer.shape[1:]))
        out[cached] = buffer.index_select(0, slots[cached])
        direct = rows[~cached]
        out[~cached] = self.backings[name].read(direct)
        return out

    def write(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite unique `rows`; cached ones are marked dirty, the others go straight through."""
        slots = self.slot_of.index_select(0, rows).long()
        cached = slots >= 0
        if bool(cached.all()):
            self.buffers[name].index_copy_(0, slots, values)
            self.dirty.index_fill_(0, slots, True)
            return
        self.buffers[name].index_copy_(0, slots[cached], values[cached])
        self.dirty.index_fill_(0, slots[cached], True)
        self.backings[name].write(rows[~cached], values[~cached])
        if name == next(iter(self.backings)):
            self.stats.add("write_through", rows[~cached])

    # ---- whole ranges: checkpoints -----------------------------------------------------------------
    def flush(self) -> None:
        """Write every updated resident row back (they stay cached, now clean)."""
        slots = self.dirty.nonzero().flatten()
        if slots.numel():
            self._write_back(slots, self.row_of.index_select(0, slots))

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        self.flush()
        return self.backings[name].read_range(start, end)

    def write_range(self, name: str, start: int, end: int, values: torch.Tensor) -> None:
        """Overwrite rows [start, end) in the backing store; cached copies of them are dropped
        (after a flush, so the other tensors of those rows lose nothing)."""
        self.flush()
        rows = torch.arange(start, end)
        slots = self.slot_of.index_select(0, rows).long()
        resident = slots >= 0
        slots = slots[resident]
        self.slot_of.index_fill_(0, rows[resident], -1)
        self.row_of.index_fill_(0, slots, -1)
        self.last_used.index_fill_(0, slots, -1)
        self.uses.index_fill_(0, slots, 0)
        self.backings[name].write_range(start, end, values)

    def resident_rows(self) -> int:
        return int((self.row_of >= 0).sum())


class CachedStorage:
    """One tensor (the weights, or one optimizer state) of a group, read and written through its cache."""

    def __init__(self, cache: RowCache, name: str) -> None:
        self.cache, self.name = cache, name
        backing = cache.backings[name]
        self.num_rows, self.width, self.dtype = backing.num_rows, backing.width, backing.dtype

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.cache.read(self.name, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.cache.write(self.name, rows, values)

    def prefetch(self, rows: torch.Tensor, lookup: bool = False) -> None:
        self.cache.prefetch(rows, lookup)

    def read_range(self, start: int, end: int) -> torch.Tensor:
        return self.cache.read_range(self.name, start, end)

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        self.cache.write_range(self.name, start, end, values)

    def stats_by_table(self) -> dict[str, dict[str, float]]:
        return self.cache.stats.by_table()
