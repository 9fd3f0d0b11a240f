"""The id map of a managed-collision table: raw 63-bit ids -> rows, no two ids on one row.

A table with `managed_collision` takes raw ids (any value in [0, 2^63)) instead of ids reduced
modulo its size. Its `rows` are the map's capacity. The map is cut into `buckets` equal parts:
bucket b holds rows [b * R/B, (b + 1) * R/B), and an id belongs to bucket `mix64(id) % B`. Row-wise
sharding gives every rank whole buckets, so a rank owns the ids of its buckets and evicts among
them exactly as one process holding the whole map would (sharded training equals single-process
training).

One training batch (`remap` with train=True), all in vectorised torch ops, with no full sort of the
map's rows (per batch: a sort of the batch's ids and a few passes over the rows):
1. the batch's distinct ids are looked up in the sorted keys (searchsorted): hits keep their row;
2. every id of the batch is stamped with the current step (`last_seen`) and its count in the batch
   is added to `counts`;
3. new ids take rows of their bucket: free rows first (lowest row first), then the rows of the
   bucket's other ids in eviction order, lru: (last_seen, id) ascending, lfu: (counts, last_seen,
   id) ascending. That order is one packed int64 per row (class, lru: last use / lfu: count and last
   use, the id's place in the sorted index), and only the rows a bucket's new ids need are selected
   from it (topk), in exactly the order a full sort would give. Rows of ids the batch uses are never
   taken. New ids are served in the order (count in the batch descending, id ascending). Ties are
   broken by id, so the result is a pure function of the stream: the same stream gives the same
   map, on any machine or world size;
4. when a bucket gets more new ids than it has rows the batch does not use, the ids at the end of
   that order get no row for this batch: they are left out of their bags (counted as `dropped`)
   and come back as new ids next time. Evaluation (train=False) never changes the map: unknown ids
   are left out the same way (counted as misses).
The caller re-initialises evicted rows and their optimizer state (the engine that owns the rows).

State per row (saved in checkpoints with the table's rows, so it reshards with them):
`mc_keys` (the id on the row, -1 when free), `mc_last_seen` (step of its last batch), `mc_counts`
(how often it was looked up since it got the row). The sorted index (keys ascending, their rows) is
rebuilt from `mc_keys` after a load and otherwise kept up to date by a linear merge per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.embedding.tables import ManagedCollisionConfig, TableConfig
from neorec.utils.hashing import mix64

FREE = -1
STATE = ("mc_keys", "mc_last_seen", "mc_counts")
# bytes per row: the three state tensors plus the sorted index (key and row)
BYTES_PER_ROW = 8 * (len(STATE) + 2)
# training's lookups, then the held-out evaluations' (which change nothing: their counts apart, so
# that training's hit rate does not depend on how often a run evaluates)
STAT_FIELDS = ("hits", "misses", "inserts", "evictions", "dropped", "eval_hits", "eval_misses")

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

    def expire(self, before: int) -> torch.Tensor:
        """Free the rows of ids last seen before step `before` (the map's clock); returns those rows,
        for the caller to re-initialise. The sorted index is rebuilt on the next lookup."""
        keys = self.keys.tensor
        rows = torch.nonzero((keys != FREE) & (self.last_seen.tensor < before)).view(-1)
        if rows.numel():
            keys.index_fill_(0, rows, FREE)
            self.last_seen.tensor.index_fill_(0, rows, 0)
            self.counts.tensor.index_fill_(0, rows, 0)
        return rows

    # ---- one batch -----------------------------------------------------------------------------------
    def remap(self, ids: torch.Tensor, step: int, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each id, -1 for ids left out; rows whose id was evicted, to re-initialise)."""
        no_rows = ids.new_empty(0)
        if ids.numel() == 0:
            return ids.clone(), no_rows
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        rows = self.find(unique)
        is_new = rows == FREE
        new_at = torch.nonzero(is_new).view(-1)
        new_counts = counts.index_select(0, new_at)
        misses = int(new_counts.sum()) if new_at.numel() else 0
        hits, missed = ("hits", "misses") if train else ("eval_hits", "eval_misses")
        self.stats[hits] += ids.numel() - misses
        self.stats[missed] += misses
        if not train:
            return rows.index_select(0, inverse), no_rows
        if new_at.numel() == 0:
            self.last_seen.tensor.index_fill_(0, rows, step)
            self.counts.tensor.index_add_(0, rows, counts)
            return rows.index_select(0, inverse), no_rows
        found = ~is_new
        seen = rows.masked_select(found)
        self.last_seen.tensor.index_fill_(0, seen, step)
        self.counts.tensor.index_add_(0, seen, counts.masked_select(found))
        got, evicted = self._insert(unique.index_select(0, new_at), new_counts, seen, step)
        rows.index_copy_(0, new_at, got)
        return rows.index_select(0, inverse), evicted

    def _insert(
        self, new: torch.Tensor, counts: torch.Tensor, used: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for new ids (ascending), -1 for those left out; and the rows whose id was evicted."""
        device = new.device
        num_buckets, per = self.shard.count, self.bucket_rows
        n = new.numel()
        if self.shard.total > 1:
            bucket = bucket_of(new, self.shard.total) - self.shard.first
            if bool(((bucket < 0) | (bucket >= num_buckets)).any()):
                raise RuntimeError("an id reached a map shard that does not hold its bucket")
        # new ids in serving order: bucket, then count in the batch descending, then id ascending
        # (new ids come sorted by id, and a stable sort keeps that order among equal keys)
        if num_buckets == 1:
            order = torch.sort(-counts, stable=True).indices
            # one bucket: the first new ids in that order take its first rows, as many as it has
            num_fit = min(n, per - used.numel())  # rows of the batch's ids (distinct) are not taken
            take = self._candidates(used, num_fit).view(-1) if num_fit else used.new_empty(0)
            by_order = take if num_fit == n else torch.cat([take, take.new_full((n - num_fit,), FREE)])
        else:
            most = int(counts.max())
            order = _lexsort([torch.arange(n, device=device), most - counts, bucket], [n, most + 1, num_buckets])
            sorted_bucket = bucket.index_select(0, order)
            first_of_bucket = torch.searchsorted(sorted_bucket, torch.arange(num_buckets, device=device))
            rank = torch.arange(n, device=device) - first_of_bucket.index_select(0, sorted_bucket)
            width = min(n, per)
            candidates = self._candidates(used, width)  # [B, width] rows in the order they are taken
            available = per - torch.bincount(torch.div(used, per, rounding_mode="floor"), minlength=num_buckets)
            fits = rank < available.index_select(0, sorted_bucket)
            by_order = candidates.view(-1).index_select(0, sorted_bucket * width + rank.clamp(max=width - 1))
            num_fit = int(fits.sum())
            if num_fit < n:
                by_order = torch.where(fits, by_order, FREE)
            take = by_order if num_fit == n else by_order.masked_select(fits)
        rows = torch.empty_like(by_order).index_copy_(0, order, by_order)  # back to id order
        self.stats["inserts"] += num_fit
        self.stats["dropped"] += n - num_fit
        if num_fit == 0:
            return rows, used.new_empty(0)
        if num_fit < n:
            placed = rows != FREE
            new_rows, new_keys, new_counts = rows.masked_select(placed), new.masked_select(placed), counts.masked_select(placed)
        else:
            new_rows, new_keys, new_counts = rows, new, counts

        keys = self.keys.tensor
        old = keys.index_select(0, take)  # in serving order: the evicted rows come out in that order
        held = old != FREE
        num_evicted = int(held.sum())
        evicted = take if num_evicted == num_fit else take.masked_select(held)
        gone = old if num_evicted == num_fit else old.masked_select(held)
        self.stats["evictions"] += num_evicted
        keys.index_copy_(0, new_rows, new_keys)
        self.last_seen.tensor.index_fill_(0, new_rows, step)
        self.counts.tensor.index_copy_(0, new_rows, new_counts)
        self._merge_index(gone, new_keys, new_rows)
        return rows, evicted

    def _candidates(self, used: torch.Tensor, width: int) -> torch.Tensor:
        """Per bucket, the first `width` of its rows in the order new ids take them ([B, width]: free
        rows by row, then the other ids' rows in eviction order, then rows the batch uses). One packed
        key per row and a partial selection (topk): the keys of the rows that can be taken are distinct,
        so they come out exactly as a full sort orders them."""
        b, per = self.shard.count, self.bucket_rows
        keys, last_seen, counts = self.keys.tensor, self.last_seen.tensor, self.counts.tensor
        device = keys.device
        # ties go by id: a row's place in the sorted index (free rows: their row, and they tie on nothing)
        _, sorted_rows = self._sorted()
        numbers = torch.arange(self.capacity, device=device)
        by_id = numbers.clone().index_copy_(0, sorted_rows, numbers[: sorted_rows.numel()])
        occupied = (keys != FREE).to(torch.int64)
        # least significant first: id, (lfu) last use, then lru: last use, lfu: count; then the class
        # (0 free, 1 evictable, 2 used by the batch)
        steps = int(last_seen.max()) + 1
        sort_keys = [by_id, last_seen] if self.eviction == "lru" else [by_id, last_seen, counts]
        sizes = [self.capacity, steps] if self.eviction == "lru" else [self.capacity, steps, int(counts.max()) + 1]
        packed = _pack([*sort_keys, occupied], [*sizes, 3])
        if packed is not None:
            # rows of the batch are never taken: one value after every other row's is all they need
            packed.index_fill_(0, used, 2 << sum(max(1, (s - 1).bit_length()) for s in sizes))
            order = torch.topk(packed.view(b, per), width, dim=1, largest=False, sorted=True).indices
        else:
            cls = occupied.index_fill_(0, used, 2)
            order = _lexsort([k.view(b, per) for k in [*sort_keys, cls]], [*sizes, 3])[:, :width]
        return order if b == 1 else order + torch.arange(b, device=device).view(b, 1) * per

    def _merge_index(self, gone: torch.Tensor, new_keys: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Drop the evicted ids from the sorted index and merge the new ones (sorted by id) in: linear
        in the index, no re-sort."""
        assert self._index is not None  # built by find() before mc_keys changed
        sorted_keys, sorted_rows = self._index
        device = sorted_keys.device
        if gone.numel():
            keep = torch.ones(sorted_keys.numel(), dtype=torch.bool, device=device)
            keep.index_fill_(0, torch.searchsorted(sorted_keys, gone), False)
            sorted_keys, sorted_rows = sorted_keys.masked_select(keep), sorted_rows.masked_select(keep)
        n_old, n_new = sorted_keys.numel(), new_keys.numel()
        at_new = torch.searchsorted(sorted_keys, new_keys) + torch.arange(n_new, device=device)
        is_old = torch.ones(n_old + n_new, dtype=torch.bool, device=device).index_fill_(0, at_new, False)
        out_keys = sorted_keys.new_empty(n_old + n_new).index_copy_(0, at_new, new_keys)
        out_rows = sorted_rows.new_empty(n_old + n_new).index_copy_(0, at_new, new_rows)
        self._index = (out_keys.masked_scatter_(is_old, sorted_keys), out_rows.masked_scatter_(is_old, sorted_rows))
        self._index_version = self.keys.tensor._version


def _pack(keys: list[torch.Tensor], sizes: list[int]) -> torch.Tensor | None:
    """keys[-1], keys[-2], ... (each in [0, size)) packed into one int64 that compares the same way
    (most significant last), or None where they need more than 63 bits."""
    bits = [max(1, (size - 1).bit_length()) for size in sizes]
    if sum(bits) > 63:
        return None
    packed = keys[0].clone()
    shift = bits[0]
    for k, nbits in zip(keys[1:], bits[1:], strict=True):
        packed |= k << shift
        shift += nbits
    return packed


def _lexsort(keys: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Indices that sort along the last dim by keys[-1], then keys[-2], ... (each in [0, size)); the
    first key is unique per row, so the order is total. One sort of packed int64 keys where they fit
    in 63 bits, else one stable sort per key."""
    packed = _pack(keys, sizes)
    if packed is not None:
        return torch.sort(packed, dim=-1).indices
    order = torch.arange(keys[0].shape[-1], device=keys[0].device).expand_as(keys[0])
    for k in keys:
        k = torch.gather(k, -1, order)
        order = torch.gather(order, -1, torch.sort(k, dim=-1, stable=True).indices)
    return order
