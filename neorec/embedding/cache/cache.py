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
Free slots have the smallest key of all, so they fill first.

On a GPU (`device="cuda"`: the paper's cache of hot rows in device memory over host DRAM, or over
the SSD tier's files) the records and all the bookkeeping live in device memory and the backing
store in host memory or a file; rows and records cross between the two only in `DeviceIO` (misses
in, write-backs out), so the cache's logic, and its exactness, are the same code on both. The worker
thread reads and writes host memory only: a read ahead lands in a pinned host buffer, whose copy to
the device the worker starts on a stream of its own, and the batch's lookup places the records in
their slots after that copy; a write-back's records are copied to pinned host memory on another
stream, in the step's order, and the worker writes them once they are there. The training thread
reads one thing back from the device per read ahead (the counts of its rows, _classify_on_device)
and nothing in the lookup or the update of a batch read ahead completely.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from neorec.embedding.cache.background import BackgroundIO
from neorec.embedding.cache.stats import CacheStats
from neorec.utils import index_ops, streams

POLICIES = ("lru", "lfu")
_PINNED = torch.iinfo(torch.int64).max
_SAMPLE = 4096  # keys sampled to choose victims (smallest)
_LFU_DECAY_TURNOVERS = 64  # LFU counts halve after this many times the slots in looked-up rows
_MAX_AHEAD = 4  # batches read ahead and not looked up yet, at most (the pipeline keeps 1 or 2)


@dataclass
class _Ahead:
    """A batch whose rows were made resident ahead of its lookup: pinned until then."""

    rows: torch.Tensor  # its unique rows (the very tensor its lookup passes)
    slots: torch.Tensor  # the slots of its rows: pinned
    victims: torch.Tensor | None = None  # slots given to its missing rows, whose records are coming
    future: Future | StagedRead | None = None  # -> those records
    complete: bool = False  # every one of its rows has a slot (so its lookup has nothing to bring in)


class RowCache:
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
        # avoids reading anything back except one count per read ahead (see _classify_on_device)
        self._on_device = stages_through_host(device)
        if self._on_device:
            self.io = DeviceIO(self.io, device)
        self.records = self.layout.empty(self.capacity, device)
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
        self._ahead: deque[_Ahead] = deque()  # batches read ahead, not looked up yet (in flight)
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
        worker thread (see the module doc)."""
        split = None
        if ahead and self.io.background and len(self._ahead) == _MAX_AHEAD:
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
                self._ahead.append(_Ahead(rows, resident))
                return
            self._evict(victims)  # their write-backs are queued before the read below
            self._load(missing, victims)
            self._loading.index_fill_(0, victims, True)
            self._ahead.append(
                _Ahead(
                    rows,
                    torch.cat([resident, victims]),
                    victims,
                    self.io.read_ahead(missing, self.records, victims),
                    complete=True,
                )
            )
        else:
            self._ahead.append(_Ahead(rows, resident, complete=True))

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

    def _touch(self, resident: torch.Tensor, num_rows: int) -> None:
        """A new tick: `resident` slots were used now."""
        self.tick += 1
        self._decay(num_rows)
        self.last_used.index_fill_(0, resident, self.tick)
        if self.policy == "lfu":
            self.uses.index_add_(0, resident, torch.ones_like(resident))

    def _take_ahead(self, rows: torch.Tensor) -> _Ahead | None:
        """The lookup of `rows`: if a prefetch read them ahead, finish that (and any older one), unpin
        them and return its entry."""
        for i, entry in enumerate(self._ahead):
            if entry.rows is rows:
                for _ in range(i + 1):
                    self._finish(self._ahead.popleft())
                return entry
        return None

    def _finish(self, entry: _Ahead) -> None:
        """Wait for a read-ahead's records to be in their slots (the worker places them)."""
        if entry.future is not None:
            entry.future.result()
            self._loading.index_fill_(0, entry.victims, False)
            entry.future = None

    def _finish_all(self) -> None:
        for entry in self._ahead:
            self._finish(entry)

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
        self.io.write(rows, _words(self.records).index_select(0, slots).view(torch.uint8))
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

    def slot_index(self, rows: torch.Tensor) -> torch.Tensor:
        """slot_of[rows] as int64, unchecked: -1 for a row without a slot."""
        return self.slot_of.index_select(0, rows).long()

    def mark_updated(self, slots: torch.Tensor) -> None:
        """The records of `slots` were updated in place: write them back when they are evicted."""
        self.dirty.index_fill_(0, slots, True)

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


def _words(records: torch.Tensor) -> torch.Tensor:
    """Records as int64 words: torch copies whole rows of those several times faster than bytes."""
    return records.view(torch.int64)


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


def stages_through_host(device: torch.device) -> bool:
    """Whether the cache's records on `device` reach the host-side backing store through DeviceIO:
    on every device but the CPU (tests force it on the CPU to run that path without a GPU)."""
    return device.type != "cpu"


class DeviceIO:
    """BackgroundIO for a cache in device memory over a host-side backing store (host memory or a
    file): the one place where rows and records cross between the device and the host (misses in,
    write-backs out). Whatever the worker thread reads or writes is host memory.

    On a GPU, nothing here makes the training thread wait for the device: what goes to the host
    (the missing rows of a read ahead; an eviction's rows, updated flags and records) is copied into
    pinned buffers on a stream of its own, after the work queued so far, and the worker waits for
    that copy before it uses them; records read ahead go up on a second stream as soon as the worker
    has them, and the batch's lookup only orders its stream after that copy (StagedRead)."""

    def __init__(self, io: BackgroundIO, device: torch.device) -> None:
        self.io, self.device, self.background = io, device, io.background
        self.layout = io.layout
        # pinned host buffers make the copies to and from the device asynchronous (torch keeps a
        # pinned block until the copies that use it are done); only a CUDA device has them
        self._pin = device.type == "cuda"
        self._down = torch.cuda.Stream(device) if self._pin else None  # device -> host
        self._up = torch.cuda.Stream(device) if self._pin else None  # host -> device

    def read_ahead(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> StagedRead:
        """Start reading the records of `rows` (sorted, unique) on the worker thread (after every
        write submitted so far) into host memory, and copying them to the device; result() places
        them in buffer[slots]."""
        (host_rows,), copied = self._to_host([rows])
        host = self.layout.empty(rows.numel(), pin=self._pin)

        def read() -> tuple[torch.Tensor, object]:
            if copied is not None:
                copied.synchronize()
            self.io.backing.read_into(host_rows, host, None)
            return streams.run_on(self._up, None, lambda: host.to(self.device, non_blocking=True))

        return StagedRead(self.io.submit(read), host, buffer, slots)

    def write_back(
        self, rows: torch.Tensor, dirty: torch.Tensor, records: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write back the records in `slots` of those `rows` that are `dirty` (rows of empty slots are
        -1 and never dirty), without waiting: the records are gathered now, in the current stream's
        order, and the worker picks the updated ones once the copy to host memory is done."""
        (rows, dirty, words), copied = self._to_host([rows, dirty, _words(records).index_select(0, slots)])

        def ready() -> tuple[torch.Tensor, torch.Tensor]:
            if copied is not None:
                copied.synchronize()
            keep = index_ops.where(dirty)
            kept, order = index_ops.sort(rows.index_select(0, keep))
            return kept, words.index_select(0, keep.index_select(0, order)).view(torch.uint8)

        self.io.write_when(ready)

    def _to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Host copies of `tensors`, made on the down stream after the work the current stream has
        queued: (the copies, an event at their end). On the CPU (tests standing in for a device) the
        tensors themselves, which nothing changes afterwards, and no event."""
        if self._down is None:
            return [t.to("cpu") for t in tensors], None
        after = streams.mark(self.device)

        def copy() -> list[torch.Tensor]:
            out = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._down)  # the allocator keeps t until the copy has read it
                out.append(host)
            return out

        return streams.run_on(self._down, after, copy)  # type: ignore[return-value]

    def read_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        _words(buffer).index_copy_(0, slots, _words(self.read(rows)))

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """The records are copied to host memory here, on the caller's thread (a synchronous copy
        that waits for the kernels that wrote them); the worker writes that copy."""
        self.io.write(rows.cpu(), records.cpu())

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.io.read(rows.cpu()).to(self.device)

    def drain(self) -> None:
        self.io.drain()

    def close(self) -> None:
        self.io.close()


class StagedRead:
    """A read ahead of DeviceIO: records read into a host buffer on the worker thread and copied to
    the device there (on the up stream), placed in their slots by result() on the caller's thread (the
    cache calls it at the batch's lookup, or before anything touches those slots)."""

    def __init__(self, read: Future, host: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """read: the worker's job, which gives (the records on the device, an event at the end of
        their copy); host: the host buffer it reads them into (the job keeps it as long as needed)."""
        self._read: Future | None = read
        self._buffer, self._slots = buffer, slots

    def done(self) -> bool:
        """Whether the records are in their device slots."""
        return self._read is None

    def result(self) -> None:
        """Wait for the worker's read, order this stream after its copy up, then put the records in
        their slots (once)."""
        if self._read is None:
            return
        staged, arrived = self._read.result()
        streams.hand_over(arrived, [staged])
        _words(self._buffer).index_copy_(0, self._slots, _words(staged))
        self._read = None
        del self._buffer, self._slots  # the buffers go with the last reference


class CachedStorage:
    """One tensor (the weights, or one optimizer state) of a group, read and written through its cache."""

    def __init__(self, cache: RowCache, name: str) -> None:
        self.cache, self.name = cache, name
        field = cache.layout.fields[name]
        self.num_rows, self.width, self.dtype = cache.num_rows, field.width, field.dtype

    @property
    def view(self) -> torch.Tensor:
        """The field in the cache's records: [slots, width] (or [slots]), a strided view."""
        return self.cache.buffers[self.name]

    def resident_slots(self, rows: torch.Tensor) -> torch.Tensor | None:
        return self.cache.resident_slots(rows)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.cache.read(self.name, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.cache.write(self.name, rows, values)

    def prefetch(self, rows: torch.Tensor, lookup: bool = False, ahead: bool = False) -> None:
        self.cache.prefetch(rows, lookup, ahead)

    def unique_count(self, rows: torch.Tensor) -> int | None:
        return self.cache.unique_count(rows)

    def rows_of(self, batch_rows: torch.Tensor, rows: torch.Tensor) -> None:
        self.cache.rows_of(batch_rows, rows)

    def read_range(self, start: int, end: int) -> torch.Tensor:
        return self.cache.read_range(self.name, start, end)

    def view_range(self, start: int, end: int) -> torch.Tensor:
        return self.cache.view_range(self.name, start, end)

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        self.cache.write_range(self.name, start, end, values)

    def stats_by_table(self) -> dict[str, dict[str, float]]:
        return self.cache.stats.by_table()
