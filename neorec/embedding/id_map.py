"""The id map of a managed-collision table: raw 63-bit ids -> rows, no two ids on one row.

A table with `managed_collision` takes raw ids (any value in [0, 2^63)) instead of ids reduced
modulo its size. Its `rows` are the map's capacity. The map is cut into `buckets` equal parts:
bucket b holds rows [b * R/B, (b + 1) * R/B), and an id belongs to bucket `mix64(id) % B`. Row-wise
sharding gives every rank whole buckets, so a rank owns the ids of its buckets and evicts among
them exactly as one process holding the whole map would (sharded training equals single-process
training).

One training batch (`remap` with train=True), all in vectorised torch ops:
1. the batch's distinct ids are looked up in the sorted keys (searchsorted): hits keep their row;
2. every id of the batch is stamped with the current step (`last_seen`) and its count in the batch
   is added to `counts`;
3. new ids take rows of their bucket: free rows first (lowest row first), then the rows of the
   bucket's other ids in eviction order, lru: (last_seen, id) ascending, lfu: (counts, last_seen,
   id) ascending. Rows of ids the batch uses are never taken. New ids are served in the order
   (count in the batch descending, id ascending). Ties are broken by id, so the result is a pure
   function of the stream: the same stream gives the same map, on any machine or world size;
4. when a bucket gets more new ids than it has rows the batch does not use, the ids at the end of
   that order get no row for this batch: they are left out of their bags (counted as `dropped`)
   and come back as new ids next time. Evaluation (train=False) never changes the map: unknown ids
   are left out the same way (counted as misses).
The caller re-initialises evicted rows and their optimizer state (the engine that owns the rows).

State per row (saved in checkpoints with the table's rows, so it reshards with them):
`mc_keys` (the id on the row, -1 when free), `mc_last_seen` (step of its last batch), `mc_counts`
(how often it was looked up since it got the row). The sorted index is rebuilt from `mc_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.embedding.tables import ManagedCollisionConfig, TableConfig

FREE = -1
STATE = ("mc_keys", "mc_last_seen", "mc_counts")
# bytes per row: the three state tensors plus the sorted index (key and row)
BYTES_PER_ROW = 8 * (len(STATE) + 2)
STAT_FIELDS = ("hits", "misses", "inserts", "evictions", "dropped")

_MASK63 = (1 << 63) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 with wrapping arithmetic, top bit cleared: [0, 2^63)."""
    z = x.to(torch.int64) + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _M1
    z = (z ^ _shift_right(z, 27)) * _M2
    return (z ^ _shift_right(z, 31)) & _MASK63


def bucket_of(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The bucket of each raw id: a mixing hash modulo the bucket count (sequential ids spread)."""
    if num_buckets == 1:
        return torch.zeros_like(ids)
    return mix64(ids) % num_buckets


@dataclass(frozen=True)
class MapShard:
    """Which part of a table's map one engine holds: buckets [first, first + count) of `total`, which
    are the rows from `row_offset` on of `table` (the whole table; its initialiser re-initialises rows)."""

    first: int
    count: int
    total: int
    table: TableConfig
    row_offset: int
    eviction: str = "lru"

    def config(self) -> ManagedCollisionConfig:
        """The setting of the shard as a table of its own: its buckets, the table's eviction."""
        return ManagedCollisionConfig(eviction=self.eviction, buckets=self.count)


class IdMap:
    """The map of one table (or of one row-wise shard of it: its whole buckets)."""

    def __init__(
        self, capacity: int, eviction: str, shard: MapShard, device: torch.device | str | None = None
    ) -> None:
        if capacity % shard.count:
            raise ValueError(f"{shard.count} buckets do not divide {capacity} rows")
        self.capacity, self.eviction, self.shard = capacity, eviction, shard
        self.bucket_rows = capacity // shard.count
        from neorec.embedding.fused.storage import TensorStorage  # not at the top: fused imports this module

        device = torch.device(device) if device is not None else torch.device("cpu")
        self.keys = TensorStorage(torch.full((capacity,), FREE, dtype=torch.int64, device=device))
        self.last_seen = TensorStorage(torch.zeros(capacity, dtype=torch.int64, device=device))
        self.counts = TensorStorage(torch.zeros(capacity, dtype=torch.int64, device=device))
        self.stats = dict.fromkeys(STAT_FIELDS, 0)
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # sorted keys, their rows
        self._index_version = -1

    def storages(self) -> dict:
        """{state name: TensorStorage}: the per-row state, as the checkpoint code reads and writes it."""
        return dict(zip(STATE, (self.keys, self.last_seen, self.counts), strict=True))

    def to(self, device: torch.device) -> None:
        for s in self.storages().values():
            s.tensor = s.tensor.to(device)
        self._index = None

    @property
    def occupied(self) -> int:
        return int((self.keys.tensor != FREE).sum())

    # ---- the sorted index ------------------------------------------------------------------------
    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted keys, their rows), rebuilt when mc_keys changed other than through remap (a load)."""
        keys = self.keys.tensor
        if self._index is None or keys._version != self._index_version:
            rows = torch.nonzero(keys != FREE).view(-1)
            sorted_keys, order = torch.sort(keys.index_select(0, rows))
            self._index = (sorted_keys, rows.index_select(0, order))
            self._index_version = keys._version
        return self._index

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each id, or -1 where the map does not hold it."""
        sorted_keys, sorted_rows = self._sorted()
        if sorted_keys.numel() == 0:
            return torch.full_like(ids, FREE)
        pos = torch.searchsorted(sorted_keys, ids).clamp_(max=sorted_keys.numel() - 1)
        found = sorted_keys.index_select(0, pos) == ids
        return torch.where(found, sorted_rows.index_select(0, pos), FREE)

    # ---- one batch -----------------------------------------------------------------------------------
    def remap(self, ids: torch.Tensor, step: int, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each id, -1 for ids left out; rows whose id was evicted, to re-initialise)."""
        no_rows = ids.new_empty(0)
        if ids.numel() == 0:
            return ids.clone(), no_rows
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        rows = self.find(unique)
        found = rows != FREE
        hits = int(counts[found].sum())
        self.stats["hits"] += hits
        self.stats["misses"] += ids.numel() - hits
        if not train:
            return rows.index_select(0, inverse), no_rows
        seen = rows[found]
        self.last_seen.tensor.index_fill_(0, seen, step)
        self.counts.tensor.index_add_(0, seen, counts[found])
        evicted = no_rows
        if not bool(found.all()):
            new = ~found
            got, evicted = self._insert(unique[new], counts[new], seen, step)
            rows[new] = got
        return rows.index_select(0, inverse), evicted

    def _insert(
        self, new: torch.Tensor, counts: torch.Tensor, used: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for new ids (ascending), -1 for those left out; and the rows whose id was evicted."""
        device = new.device
        num_buckets = self.shard.count
        bucket = bucket_of(new, self.shard.total) - self.shard.first
        if bool(((bucket < 0) | (bucket >= num_buckets)).any()):
            raise RuntimeError("an id reached a map shard that does not hold its bucket")
        # new ids in serving order: bucket, then count in the batch descending, then id ascending
        # (new ids come sorted by id: their position breaks ties; one sort of packed keys)
        n = new.numel()
        most = int(counts.max())
        position = torch.arange(n, device=device)
        order = _lexsort([position, most - counts, bucket], [n, most + 1, num_buckets])
        sorted_bucket = bucket.index_select(0, order)
        first_of_bucket = torch.searchsorted(sorted_bucket, torch.arange(num_buckets, device=device))
        rank = torch.arange(new.numel(), device=device) - first_of_bucket.index_select(0, sorted_bucket)

        candidates, available = self._candidates(used)  # [B, per] rows in the order they are taken
        fits = rank < available.index_select(0, sorted_bucket)
        rows_sorted = torch.full_like(sorted_bucket, FREE)
        take = candidates[sorted_bucket[fits], rank[fits]]
        rows_sorted[fits] = take
        rows = torch.empty_like(rows_sorted)
        rows[order] = rows_sorted

        keys = self.keys.tensor
        old = keys.index_select(0, take)
        evicted = take[old != FREE]
        self.stats["inserts"] += take.numel()
        self.stats["evictions"] += evicted.numel()
        self.stats["dropped"] += int((~fits).sum())
        placed = rows != FREE
        new_rows, new_keys = rows[placed], new[placed]
        keys.index_copy_(0, new_rows, new_keys)
        self.last_seen.tensor.index_fill_(0, new_rows, step)
        self.counts.tensor.index_copy_(0, new_rows, counts[placed])
        self._merge_index(evicted, new_keys, new_rows)
        return rows, evicted

    def _candidates(self, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per bucket, its rows in the order new ids take them ([B, per]: free rows by row, then the
        other ids' rows in eviction order, then rows the batch uses), and how many may be taken."""
        b, per = self.shard.count, self.bucket_rows
        keys = self.keys.tensor
        device = keys.device
        in_use = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        in_use[used] = True
        occupied = keys != FREE
        # ties go by id: a row's place in the sorted index (free rows: their row, and they tie on nothing)
        _, sorted_rows = self._index if self._index is not None else self._sorted()
        by_id = torch.arange(self.capacity, device=device)
        by_id[sorted_rows] = torch.arange(sorted_rows.numel(), device=device)
        cls = occupied.to(torch.int64) + in_use.to(torch.int64)  # 0 free, 1 evictable, 2 used by the batch
        last_seen = self.last_seen.tensor
        steps = int(last_seen.max()) + 1 if self.capacity else 1
        # least significant first: id, (lfu) last use, then lru: last use, lfu: count; then the class
        sort_keys = [by_id, last_seen] if self.eviction == "lru" else [by_id, last_seen, self.counts.tensor]
        sizes = [self.capacity, steps] if self.eviction == "lru" else [self.capacity, steps, int(self.counts.tensor.max()) + 1]
        sort_keys.append(cls)
        sizes.append(3)
        view = [k.view(b, per) for k in sort_keys]
        order = _lexsort(view, sizes)
        rows = order + torch.arange(b, device=device).view(b, 1) * per
        return rows, per - in_use.view(b, per).sum(dim=1)

    def _merge_index(self, evicted: torch.Tensor, new_keys: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Drop the evicted ids from the sorted index and merge the new ones in (linear, no re-sort)."""
        assert self._index is not None  # built by find() before mc_keys changed
        sorted_keys, sorted_rows = self._index
        if evicted.numel():
            gone = torch.zeros(self.capacity, dtype=torch.bool, device=evicted.device)
            gone[evicted] = True
            keep = ~gone.index_select(0, sorted_rows)
            sorted_keys, sorted_rows = sorted_keys[keep], sorted_rows[keep]
        order = torch.argsort(new_keys)
        new_keys, new_rows = new_keys.index_select(0, order), new_rows.index_select(0, order)
        n_old, n_new = sorted_keys.numel(), new_keys.numel()
        out_keys = sorted_keys.new_empty(n_old + n_new)
        out_rows = sorted_rows.new_empty(n_old + n_new)
        at_new = torch.searchsorted(sorted_keys, new_keys) + torch.arange(n_new, device=new_keys.device)
        at_old = torch.searchsorted(new_keys, sorted_keys) + torch.arange(n_old, device=new_keys.device)
        out_keys[at_new], out_rows[at_new] = new_keys, new_rows
        out_keys[at_old], out_rows[at_old] = sorted_keys, sorted_rows
        self._index = (out_keys, out_rows)
        self._index_version = self.keys.tensor._version


def _lexsort(keys: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Indices that sort along the last dim by keys[-1], then keys[-2], ... (each in [0, size)); the
    first key is unique per row, so the order is total. One sort of packed int64 keys where they fit
    in 63 bits, else one stable sort per key."""
    bits = [max(1, (size - 1).bit_length()) for size in sizes]
    if sum(bits) <= 63:
        packed = torch.zeros_like(keys[0])
        shift = 0
        for k, nbits in zip(keys, bits, strict=True):
            packed |= k << shift
            shift += nbits
        return torch.sort(packed, dim=-1).indices
    order = torch.arange(keys[0].shape[-1], device=keys[0].device).expand_as(keys[0])
    for k in keys:
        k = torch.gather(k, -1, order)
        order = torch.gather(order, -1, torch.sort(k, dim=-1, stable=True).indices)
    return order
