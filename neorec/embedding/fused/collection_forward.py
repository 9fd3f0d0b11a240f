"""The forward pass of FusedEmbeddingCollection: a batch's ids, checked and mapped to rows, prepared
per group (bags.py) and looked up in one FusedLookup call, whose backward trains the rows; and
`prefetch`, which brings a coming batch's rows into cached storages before its step and keeps the
batch prepared for its forward.

It is a base class of FusedEmbeddingCollection (collection.py) and works on the groups, storages
and settings that the collection's __init__ sets up.
"""

from __future__ import annotations

import torch

from neorec.embedding.fused.bags import GroupBatch, prepare_group, prepare_sequence_group
from neorec.embedding.fused.lookup import FusedLookup
from neorec.embedding.remap import remap_batch
from neorec.errors import DataError
from neorec.sparse import JaggedRows, SparseBatch
from neorec.utils.stages import stage, staged


class CollectionForward:
    """The collection's forward pass and prefetch."""

    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        """[B, output_dim] fp32 pooled vectors in feature_names order; trains the rows on backward."""
        return self.embed(sparse)[0]

    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """The pooled vectors and, per sequence feature, its fp32 rows (times the ids' weights) from
        one fused lookup; backward trains the rows of both."""
        if not self.layout.groups or sparse.batch_size == 0:  # e.g. a rank that holds no shard
            return self._empty(sparse)
        batches = None
        for i, (ahead, stamp, checked, prepared) in enumerate(self._prefetched):
            if ahead is sparse:  # its prefetch checked and prepared it, and counted its rows for the hit rate
                sparse.check_unchanged_since(stamp, "prefetch(batch)")
                sparse, batches = checked, prepared
                del self._prefetched[i]
                break
        else:
            with stage("check_ids"):
                sparse = self.bounds.check(sparse)
        if self.mapped:  # raw ids -> rows; a training batch's step is the update it will make
            sparse = remap_batch(sparse, self.mapped, self.num_updates + 1, self.training)
            if batches is not None:  # prepared by its prefetch from raw ids: the uncached groups again
                # (a managed-collision table's group is never cached; a cached one keeps what it read ahead)
                cached = self._cached_groups
                fresh = self._prepare(sparse, [not c for c in cached])
                batches = [old if c else new for c, old, new in zip(cached, batches, fresh, strict=True)]
        if self._cached:  # bring the whole batch in at once (one eviction round), then read it
            counted = batches is not None
            batches = batches or self._prepare(sparse)
            for storage, gb in zip(self.weights, batches, strict=True):
                if hasattr(storage, "prefetch"):
                    storage.prefetch(gb.rows, lookup=not counted)
        else:
            batches = self._prepare(sparse)
        anchor = torch.empty(0, device=sparse.values.device, requires_grad=True)
        with stage("lookup"):
            pooled, *rows = FusedLookup.apply(anchor, self, batches, sparse.batch_size)
        if not self.sequence_names:
            return pooled, {}
        return pooled, self._sequences(sparse, batches, rows)

    def _sequences(
        self, sparse: SparseBatch, batches: list[GroupBatch], rows: list[torch.Tensor]
    ) -> dict[str, JaggedRows]:
        """Each sequence feature's rows (views of its group's output) with its lengths."""
        b = sparse.batch_size
        out = {}
        groups = [(g, gb) for g, gb in zip(self.layout.groups, batches, strict=True) if g.sequence]
        for (g, gb), group_rows in zip(groups, rows, strict=True):
            assert gb.sequence_counts is not None
            for f, values in zip(g.features, group_rows.split(gb.sequence_counts), strict=True):
                i = sparse.keys.index(f)
                out[f] = JaggedRows(values, sparse.lengths[i * b : (i + 1) * b])
        return {f: out[f] for f in self.sequence_names}

    def _empty(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """Outputs of a batch without samples, or of an engine without tables."""
        device, b = sparse.values.device, sparse.batch_size
        sequences = {}
        for f, d in zip(self.sequence_names, self.sequence_dims, strict=True):
            lengths = sparse.feature(f)[1] if f in sparse.keys else sparse.lengths.new_zeros(b)
            sequences[f] = JaggedRows(torch.zeros(0, d, device=device), lengths)
        return torch.zeros(b, self.output_dim, device=device), sequences

    def prefetch(self, sparse: SparseBatch) -> None:
        """Bring the rows a coming batch will look up into the cached storages, before its step
        (the training pipeline calls this for batch i+1 before batch i runs). No-op without caches."""
        if sparse.batch_size == 0 or not self._cached:
            return
        checked = self.bounds.check(sparse)
        batches = self._prepare(checked)
        self._prefetched.append((sparse, sparse.stamp(), checked, batches))
        for storage, gb in zip(self.weights, batches, strict=True):
            if hasattr(storage, "prefetch"):  # ahead: a cache may only start reading them now
                storage.prefetch(gb.rows, lookup=True, ahead=True)

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """Per cached table: hit rate, rows and bytes moved from/to its backing tier, evictions."""
        out: dict[str, dict[str, float]] = {}
        for storage in self.weights:
            if hasattr(storage, "stats_by_table"):
                out.update(storage.stats_by_table())
        return out

    def prepare(self, sparse: SparseBatch) -> list[GroupBatch]:
        """Each group's ids of `sparse`, as its lookup takes them (ids of managed-collision tables
        not yet mapped to rows)."""
        return self._prepare(sparse)

    @staged("prepare_bags")
    def _prepare(self, sparse: SparseBatch, only: list[bool] | None = None) -> list[GroupBatch]:
        """Each group's GroupBatch; with `only`, of the groups it marks (None for the others)."""
        out: list = []
        groups = zip(self.layout.groups, self._constants, self._group_features(sparse), strict=True)
        for gi, (g, c, (features, indices)) in enumerate(groups):
            if only is not None and not only[gi]:
                out.append(None)
                continue
            if g.sequence:
                out.append(prepare_sequence_group(sparse, indices, g.feature_row_offsets))
                continue
            if len(indices) == sparse.num_features:  # the group has every feature of the batch
                num_ids = sparse.values.numel()
            else:  # one host sync per batch (cached on the batch), only with several groups
                per_key = sparse.length_per_key()
                num_ids = sum(per_key[i] for i in indices)
            out.append(prepare_group(sparse, features, c.row_offsets, c.mean, num_ids))
        return out

    def _group_features(self, sparse: SparseBatch) -> list[tuple[torch.Tensor, list[int]]]:
        """Per group, the positions of its features in the batch's keys (cached per key order)."""
        key = (tuple(sparse.keys), sparse.values.device)
        cached = self._feature_cache.get(key)
        if cached is None:
            position = {k: i for i, k in enumerate(sparse.keys)}
            looked_up = self.feature_names + self.sequence_names
            missing = [f for f in looked_up if f not in position]
            if missing:
                raise DataError(
                    f"the batch has no feature(s) {missing}; it has {sparse.keys} and the embedding tables "
                    f"look up {looked_up}"
                )
            cached = []
            for g in self.layout.groups:
                indices = [position[f] for f in g.features]
                cached.append(
                    (torch.tensor(indices, dtype=torch.int64, device=sparse.values.device), indices)
                )
            self._feature_cache[key] = cached
        return cached
