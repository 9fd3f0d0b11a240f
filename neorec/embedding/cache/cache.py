"""A software-managed row cache in RAM over a slower backing tier (backing.py), for one group of tables.

One cache covers a row's weights AND its optimizer state: a row is one record (records.py) holding
all of them, resident with all of them or with none, so an update never reads weights from one tier
and state from another, and bringing a row in or writing it back moves one contiguous record. The
engine sees one `CachedStorage` per tensor (the RowStorage of neorec/embedding/fused/storage.py), all
sharing the group's `RowCache`.

Exact semantics: every row has one current value, in its cache slot or in the backing store (or in
a write-back on its way there, background.py); evicting an updated row writes its record back.
Reads therefore always return the last written values, so training through the cache is bitwise
training without it, whatever the policy, the cache size and the order of prefetches. A batch with
more unique rows than the cache still trains exactly: the rows that do not fit are read from and
written to the backing store directly (slowly).

The cache's jobs beyond this file's: slots.py keeps the slot bookkeeping and the eviction policy
(lru, lfu); read_ahead.py reads a coming batch's rows ahead of its lookup on a worker thread
(background.py); device_io.py moves records between a cache in device memory and its backing store
on the host; cached_storage.py gives the engine one storage per tensor over the group's cache. Here:
RowCache's state, bringing a batch's rows in at its lookup, reads and writes of one tensor, and
whole ranges (checkpoints).
"""

from __future__ import annotations

from collections import deque

import torch

from neorec.embedding.cache import device_io
from neorec.embedding.cache.background import BackgroundIO
from neorec.embedding.cache.read_ahead import MAX_AHEAD, AheadBatch, ReadAhead
from neorec.embedding.cache.slots import SlotBookkeeping
from neorec.embedding.cache.stats import CacheStats
from neorec.utils import index_ops

POLICIES = ("lru", "lfu")
_LFU_DECAY_TURNOVERS = 64  # LFU counts halve after this many times the slots in looked-up rows


class RowCache(ReadAhead, SlotBookkeeping):
    """`capacity` rows (records: weights and optimizer state) of a group in RAM, before `backing`."""

    def __init__(
        self,
        tables: list[tuple[str, int, int]],
        backing,
        capacity: int,
        policy: str = "lru",
        lfu_decay_rows: int | None = None,
        device: torch.device | str = "cpu",
        io_thread: bool | None = None,
    ) -> None:
        """device: where the cached records and the bookkeeping live (the backing store stays where
        it is: host memory or a file). io_thread: read ahead and write back on a worker thread
        (default: for file-backed tiers)."""
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}, got {policy!r}")
        self.num_rows = backing.num_rows
        if capacity < 1:
            raise ValueError(
                f"the cache of tables {[t[0] for t in tables]} needs at least one row, got {capacity}"
            )
        self.capacity = min(capacity, self.num_rows)
        self.policy = policy
        self.backing, self.layout = backing, backing.layout
        self.device = device = torch.device(device)
        if io_thread is None:
            io_thread = backing.tier != "dram"
        self.io = BackgroundIO(backing, background=io_thread)
        # the device path: records cross to and from the host in DeviceIO only, and the bookkeeping
        # avoids reading anything back except one count per read ahead (see _classify_on_device);
        # both names are looked up on device_io, where tests replace them to run this path on the CPU
        self._on_device = device_io.stages_through_host(device)
        if self._on_device:
            self.io = device_io.DeviceIO(self.io, device)
        self.records = self.layout.empty(self.capacity, device)
        # the device as its tensors name it ("cuda" given: cuda:N), so that it compares equal to a batch's
        self.device = device = self.records.device
        self.buffers = self.layout.views(self.records)  # per field: a strided view of the records
        # one entry more than rows: a sink that evictions of empty slots (row -1) write to
        self.slot_of = torch.full((self.num_rows + 1,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.last_used = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.uses = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        # LFU: a row's use count (saturating, decayed with the others) survives its eviction, so a
        # row that comes back resumes its count instead of starting at 1 as a newcomer would
        self.history = torch.zeros(
            self.num_rows + 1 if policy == "lfu" else 0, dtype=torch.uint8, device=device
        )
        self.tick = 0
        self._fresh = 0  # slots [_fresh, capacity) were never used
        self.lfu_decay_rows = lfu_decay_rows or _LFU_DECAY_TURNOVERS * self.capacity
        self._looked_up = 0  # rows looked up since the last halving of the LFU counts
        self._uniques: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=4)  # see _unique
        self._ahead: deque[AheadBatch] = deque()  # batches read ahead, not looked up yet (in flight)
        self._loading = torch.zeros(self.capacity, dtype=torch.bool, device=device)  # records on their way
        self._moves = 0  # changes of slot_of so far (see _slots)
        self._slot_memo: tuple[torch.Tensor, torch.Tensor, bool, int] | None = None
        # (unique rows of the last batch looked up, _moves then) when all of them had slots: reads
        # and writes of that batch's rows need no check until rows move
        self._resident: tuple[torch.Tensor, int] | None = None
        self._resident_parts: list[torch.Tensor] = []  # tensors of rows of that batch (rows_of)
        self.stats = CacheStats(
            [t[0] for t in tables], [t[1] for t in tables], self.layout.record_bytes, backing.tier, device
        )

    # ---- bringing rows in ------------------------------------------------------------------------
    def prefetch(self, rows: torch.Tensor, lookup: bool = False, ahead: bool = False) -> None:
        """Make `rows` (may repeat) resident, evicting others; lookup=True counts them as looked up.
        ahead=True: they are a coming batch's: give the missing ones slots now and read them on the
        worker thread (see read_ahead.py)."""
        split = None
        if ahead and self.io.background and len(self._ahead) == MAX_AHEAD:
            self._finish(self._ahead.popleft())  # its slots are not pinned any more
        if ahead and self.io.background and self._on_device:
            split = self._classify_on_device(rows)
            unique = split[0]
        else:
            unique = self._unique(rows)
        if lookup:
            self.stats.add("lookups", unique, ascending=True)
        if ahead:
            if self.io.background:
                self._load_ahead(*(split or (unique, None, None, None, None)))
            return
        self._ensure(unique, count_unfit=True)

    def _unique_known(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The unique rows of `rows` if _unique has them (or `rows` itself, when it is such a result)."""
        for seen, unique in self._uniques:
            if seen is rows or unique is rows:
                return unique
        return None

    def _unique(self, rows: torch.Tensor) -> torch.Tensor:
        """torch.unique(rows), once per tensor: a batch's prefetch and its lookup pass the same one."""
        known = self._unique_known(rows)
        if known is not None:
            return known
        unique = index_ops.sorted_unique(rows)
        self._uniques.append((rows, unique))
        return unique

    def _ensure(self, rows: torch.Tensor, count_unfit: bool = False) -> None:
        """Bring unique `rows` in (as many as fit next to those of them already resident); the rest
        will be read from the backing store directly, and count as misses when count_unfit."""
        ahead = self._take_ahead(rows)
        if ahead is not None and ahead.complete:  # its read ahead gave every row a slot
            self._set_resident(rows)
            return
        slots = self.slot_index(rows)
        hit, miss = index_ops.split(slots >= 0)
        resident = slots.index_select(0, hit)
        if ahead is None:  # a prefetched batch was touched then
            self._touch(resident, rows.numel())
        missing = rows.index_select(0, miss)
        if missing.numel() == 0:
            self._set_resident(rows, check_loading=True)
            return
        victims = self._make_room(missing.numel(), resident, fit=False)
        if count_unfit and victims.numel() < missing.numel():
            self.stats.add("misses", missing[victims.numel() :], ascending=True)
        missing = missing[: victims.numel()]  # beyond the cache: read/written in the backing store directly
        if missing.numel():
            self._evict(victims)  # updated victims' records are copied out before their slots are reused
            self.io.read_into(missing, self.records, victims)
            self._load(missing, victims)
        if victims.numel() == miss.numel():
            self._set_resident(rows, check_loading=True)

    def _set_resident(self, unique: torch.Tensor, check_loading: bool = False) -> None:
        """The batch of `unique` rows, just looked up, has all its rows in slots. check_loading: some
        of them may be rows a later batch's read ahead is bringing in (it was not read ahead itself,
        or not completely), so it counts only when no read ahead is on its way. A batch whose read
        ahead was complete has none: its rows were resident or its own since its prefetch."""
        if check_loading and any(e.future is not None for e in self._ahead):
            self._resident = None
            return
        self._resident, self._resident_parts = (unique, self._moves), []

    def _all_resident(self, rows: torch.Tensor) -> bool:
        """Whether `rows` are known to have slots without looking: rows of the batch looked up last
        (or a tensor of some of them, rows_of), which all had slots, and nothing has moved since."""
        resident = self._resident
        if resident is None or resident[1] != self._moves:
            return False
        return self._unique_known(rows) is resident[0] or any(p is rows for p in self._resident_parts)

    def unique_count(self, rows: torch.Tensor) -> int | None:
        """The number of unique rows in `rows` if the cache has counted them (a batch it prefetched)."""
        unique = self._unique_known(rows)
        return None if unique is None else unique.numel()

    def rows_of(self, batch_rows: torch.Tensor, rows: torch.Tensor) -> None:
        """`rows` are some of the rows of `batch_rows` (e.g. those an update of that batch touches): if
        that batch is the one just looked up with all its rows given slots, reads and writes of
        `rows` need no check either."""
        if self._all_resident(batch_rows):
            self._resident_parts = [*self._resident_parts[-3:], rows]

    # ---- reads and writes of one tensor ------------------------------------------------------------
    def _slots(self, rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(slot_of[rows], whether all are cached), remembered for the last `rows` tensor until rows
        move: an update reads and then writes the same rows for every tensor of the group."""
        memo = self._slot_memo
        if memo is not None and memo[0] is rows and memo[3] == self._moves:
            return memo[1], memo[2]
        slots = self.slot_index(rows)
        if self._all_resident(rows):
            # rows of the batch just looked up, all given slots, nothing moved since; its records
            # were placed when its lookup took it from the batches in flight
            self._slot_memo = (rows, slots, True, self._moves)
            return slots, True
        all_cached = bool((slots >= 0).all())
        if any(e.future is not None for e in self._ahead):  # records on their way to some slots
            cached = slots if all_cached else slots[slots >= 0]
            if bool(self._loading.index_select(0, cached).any()):
                self._finish_all()
        self._slot_memo = (rows, slots, all_cached, self._moves)
        return slots, all_cached

    def resident_slots(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The slots of `rows` when every one of them has a slot, its record in place in stream order
        (the kernels then read and update the records where they are), else None. No host read for
        the rows of the batch just looked up (see _slots)."""
        slots, all_cached = self._slots(rows)
        return slots if all_cached else None

    def read(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        slots, all_cached = self._slots(rows)
        if not all_cached:  # not prefetched: bring them in now, in one eviction round
            self._ensure(index_ops.sorted_unique(rows))
            slots, all_cached = self._slots(rows)
            if not all_cached:  # more unique rows than the cache holds
                return self._read_split(name, rows, slots, slots >= 0)
        return self.buffers[name].index_select(0, slots)

    def _read_split(
        self, name: str, rows: torch.Tensor, slots: torch.Tensor, cached: torch.Tensor
    ) -> torch.Tensor:
        buffer = self.buffers[name]
        out = buffer.new_empty((rows.numel(), *buffer.shape[1:]))
        out[cached] = buffer.index_select(0, slots[cached])
        direct, inverse = torch.unique(rows[~cached], return_inverse=True)
        out[~cached] = self.layout.view(self.io.read(direct), name).index_select(0, inverse)
        return out

    def write(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite unique `rows`; cached ones are marked dirty, the others go straight through."""
        slots, all_cached = self._slots(rows)
        if all_cached:
            self.buffers[name].index_copy_(0, slots, values)
            self.dirty.index_fill_(0, slots, True)
            return
        cached = slots >= 0
        self.buffers[name].index_copy_(0, slots[cached], values[cached])
        self.dirty.index_fill_(0, slots[cached], True)
        direct, order = torch.sort(rows[~cached])
        records = self.io.read(direct)  # the row's other fields are kept
        self.layout.view(records, name).copy_(values[~cached].index_select(0, order))
        self.io.write(direct, records)
        if name == next(iter(self.layout.fields)):
            self.stats.add("write_through", direct, ascending=True)

    # ---- whole ranges: checkpoints -----------------------------------------------------------------
    def flush(self) -> None:
        """Write every updated resident row back (they stay cached, now clean), and wait for it."""
        self._finish_all()
        slots = self.dirty.nonzero().flatten()
        if slots.numel():
            rows, order = torch.sort(self.row_of.index_select(0, slots))
            self._write_back(slots.index_select(0, order), rows)
        self.io.drain()
        if hasattr(self.backing, "release"):  # what the write-backs mapped: not needed any more
            self.backing.release()

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Field `name` of rows [start, end), a copy (checkpoints read in windows)."""
        self.flush()
        return self.backing.read_range(name, start, end)

    def view_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Field `name` of rows [start, end) without reading it where the tier allows (a view of the
        file; state_dict), else a copy."""
        self.flush()
        if hasattr(self.backing, "view_range"):
            return self.backing.view_range(name, start, end)
        return self.backing.read_range(name, start, end)

    def write_range(self, name: str, start: int, end: int, values: torch.Tensor) -> None:
        """Overwrite rows [start, end) in the backing store; cached copies of them are dropped
        (after a flush, so the other fields of those rows lose nothing)."""
        self.flush()
        for entry in self._ahead:  # batches read ahead: their rows may lose their slots here
            entry.complete = False
        rows = torch.arange(start, end, device=self.device)
        slots = self.slot_index(rows)
        resident = slots >= 0
        slots = slots[resident]
        self.slot_of.index_fill_(0, rows[resident], -1)
        self.row_of.index_fill_(0, slots, -1)
        self._moves += 1
        self.last_used.index_fill_(0, slots, -1)
        self.uses.index_fill_(0, slots, 0)
        self.backing.write_range(name, start, end, values)

    def resident_rows(self) -> int:
        return int((self.row_of >= 0).sum())

    def close(self) -> None:
        """Write everything back and stop the worker thread (the backing store stays usable)."""
        self.flush()
        self.io.close()
