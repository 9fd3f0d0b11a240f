"""A sort-per-batch id map: the rules of neorec/embedding/id_map.py written plainly (one full sort
of the map's rows for every batch that brings new ids). Tests compare the map with it step by step:
same rows, evictions, state and stats for the same stream."""

from __future__ import annotations

import torch

from neorec.embedding.id_map import FREE, IdMap, bucket_of


class ReferenceIdMap(IdMap):
    """The map of one table or shard, with a full sort of its rows per batch that brings new ids.
    Construction, state and the sorted index of held ids (find) are IdMap's; what a batch does
    (remap, and the choice of rows for new ids) is written plainly here."""

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
        counted = ("hits", "misses") if train else ("eval_hits", "eval_misses")
        self.stats[counted[0]] += hits
        self.stats[counted[1]] += ids.numel() - hits
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
