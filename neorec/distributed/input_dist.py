"""Input distribution: send every id to the ranks that hold its row (and columns).

Each rank has the ids of its own B samples for every feature. For each destination rank it builds
the jagged ids of the features that rank's shards look up, in that rank's local order: all ids of
the feature for whole-row shards (tw, cw, twcw), only the ids inside the shard's row range, rebased
to the shard, for row-split shards (rw, twrw). The receiver regroups what the W ranks sent into one
feature-major SparseBatch of W * B samples, samples of rank 0 first.

Sizes travel on the host, ahead of the ids. Every rank knows its own ids per feature on the host
(SparseBatch.length_per_key: the reader counted them before the batch went to the device); a
row-split feature's ids per shard are counted on the device and read back together, once per batch
for all such features (none without row-split shards). First one small all-to-all of these counts
over a host communicator (Comms.all_to_all_host), then the bag lengths, ids and weights, all three
started at once with sizes every rank already knows. The local batch carries its per-feature counts
too, so the lookup reads nothing back either. On a GPU the exchange thus never waits for the device
except for that one read of row-split counts.

Managed-collision tables (raw ids): a row-split table's ids go to the rank that holds their bucket
(id_map.bucket_of), unchanged; that rank's id map turns them into its rows in the lookup.

Mean pooling under a row split: each shard sees only part of a bag, so the bag's 1/length (of the
whole bag) becomes a per-id weight before the split and the shard pools by sum.
All ranks must agree on whether batches carry weights (they read the same kind of data).
"""

from __future__ import annotations

import torch

from neorec.distributed.comms import Comms, Pending
from neorec.distributed.layout import ROW_SPLIT, ShardLayout
from neorec.embedding.id_map import bucket_of
from neorec.errors import DataError
from neorec.sparse import SparseBatch
from neorec.utils import index_ops


class ExchangedBatch(SparseBatch):
    """A rank's local batch as the input distribution assembled it, with what it knows on the host
    of where the ids came from and went: ids_per_source[s][f], the ids rank s sent of local feature f;
    ids_per_shard[(table, feature)], the ids this rank sent to each row shard of a row-split table.
    The sequence exchange (sequence_dist.py) reads its row counts here."""

    __slots__ = ("ids_per_source", "ids_per_shard")

    def __init__(
        self,
        batch: SparseBatch,
        ids_per_source: list[list[int]],
        ids_per_shard: dict[tuple[str, str], list[int]],
    ) -> None:
        super().__init__(batch.keys, batch.values, batch.lengths, batch.weights, batch.length_per_key())
        self.ids_per_source, self.ids_per_shard = ids_per_source, ids_per_shard


class InputDist:
    def __init__(self, layout: ShardLayout, comms: Comms) -> None:
        self.layout, self.comms = layout, comms
        self.rank = comms.topo.rank
        self.features = [layout.send_features(r) for r in range(comms.topo.world_size)]
        self.local_keys = [f for u in layout.units[self.rank] for f in u.features]
        self.mean_row_split = any(
            u.kind in ROW_SPLIT and u.table.pooling == "mean" for units in layout.units for u in units
        )

    def __call__(self, sparse: SparseBatch) -> Pending:
        """Start the exchange; wait() gives the local SparseBatch of W * B samples."""
        b, world, device = sparse.batch_size, self.comms.topo.world_size, sparse.values.device
        with_weights = sparse.weights is not None or self.mean_row_split
        per_key = dict(zip(sparse.keys, sparse.length_per_key(), strict=True))
        parts = {k: sparse.feature(k) for k in {f for feats in self.features for _, f in feats}}
        splits = self._row_splits(sparse, parts, with_weights)
        lengths, values, weights, sizes = [], [], [], []  # sizes: ids per (destination, its feature)
        for dest in range(world):
            for unit, f in self.features[dest]:
                ids, lens, w = parts[f]
                if unit.kind in ROW_SPLIT:
                    owner, w, starts, shard_lengths, shard_counts = splits[(unit.table.name, f)]
                    n = shard_counts[unit.index]
                    sel = index_ops.compact(owner == unit.index, n)
                    ids = ids.index_select(0, sel) - starts[unit.index]
                    lens = shard_lengths[unit.index]
                    w = w.index_select(0, sel) if w is not None else None
                else:
                    n = per_key[f]
                    if with_weights and w is None:
                        w = torch.ones(n, dtype=torch.float32, device=device)
                lengths.append(lens.to(torch.int32))
                values.append(ids)
                if with_weights:
                    weights.append(w.to(torch.float32))
                sizes.append(n)
        n_local = len(self.local_keys)
        sent, start = [], 0  # to each destination: its features' sizes, then this rank's batch size
        for feats in self.features:
            sent += [*sizes[start : start + len(feats)], b]
            start += len(feats)
        got = self.comms.all_to_all_host(
            sent, [len(f) + 1 for f in self.features], [n_local + 1] * world, "input_dist"
        )
        rows = [got[s * (n_local + 1) : (s + 1) * (n_local + 1)] for s in range(world)]
        _check_batch_sizes(self.rank, b, [row[-1] for row in rows])
        got_sizes = [row[:-1] for row in rows]  # [source][local feature]
        send_counts, start = [], 0
        for feats in self.features:
            send_counts.append(sum(sizes[start : start + len(feats)]))
            start += len(feats)
        recv_counts = [sum(row) for row in got_sizes]
        send_len = torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int32, device=device)
        got_len = self.comms.all_to_all(
            send_len, [len(f) * b for f in self.features], [n_local * b] * world, "input_dist", self.comms.ids
        )
        send_val = torch.cat(values) if values else torch.empty(0, dtype=torch.int64, device=device)
        got_val = self.comms.all_to_all(send_val, send_counts, recv_counts, "input_dist", self.comms.ids)
        got_w = None
        if with_weights:
            send_w = torch.cat(weights) if weights else torch.empty(0, device=device)
            got_w = self.comms.all_to_all(send_w, send_counts, recv_counts, "input_dist", self.comms.ids)

        def finish() -> SparseBatch:
            recv_len = got_len.wait().view(world, n_local, b).to(torch.int64)
            local = regroup(self.local_keys, recv_len, got_val.wait(), got_w.wait() if got_w else None, got_sizes)
            return ExchangedBatch(local, got_sizes, {key: split[4] for key, split in splits.items()})

        return Pending([], finish)

    def _row_splits(
        self, sparse: SparseBatch, parts: dict, with_weights: bool
    ) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None, list[int], torch.Tensor, list[int]]]:
        """Per row-split (table, feature): (the shard of each id, the ids' weights (mean pooling
        folded in), each shard's first row, bag lengths per shard [S, B], ids per shard). The ids
        per shard of every such feature are read back to the host in one go."""
        b, device = sparse.batch_size, sparse.values.device
        per_key = dict(zip(sparse.keys, sparse.length_per_key(), strict=True))
        out: dict = {}
        counted = []
        for dest_features in self.features:
            for unit, f in dest_features:
                key = (unit.table.name, f)
                if unit.kind not in ROW_SPLIT or key in out:
                    continue
                ids, lens, w = parts[f]
                n = per_key[f]
                if with_weights and w is None:
                    w = torch.ones(n, dtype=torch.float32, device=device)
                bag_of_id = torch.arange(b, device=device).repeat_interleave(lens, output_size=n)
                if with_weights and unit.table.pooling == "mean":
                    w = w * lens.clamp(min=1).to(torch.float32).reciprocal().index_select(0, bag_of_id)
                starts = [s.rows[0] for s in self.layout.plan.shards(unit.table, self.comms.topo)]
                num_shards = len(starts)
                mc = unit.table.managed_collision
                if mc is not None:  # raw ids: the id's bucket decides, the owner's map gives the row
                    owner = bucket_of(ids, mc.buckets) // (mc.buckets // num_shards)
                    starts = [0] * num_shards
                else:
                    owner = self.layout.row_shard(unit.table, ids)
                ones = torch.ones(n, dtype=torch.int64, device=device)
                # one scatter per feature: each shard's ids per bag, and (summed) per shard
                shard_lengths = torch.zeros(num_shards * b, dtype=torch.int64, device=device)
                shard_lengths.index_add_(0, owner * b + bag_of_id, ones)
                shard_lengths = shard_lengths.view(num_shards, b)
                counted.append(shard_lengths.sum(dim=1))
                out[key] = [owner, w, starts, shard_lengths, None]
        if counted:
            per_shard = torch.cat(counted).tolist()  # the one read back of the batch
            start = 0
            for entry in out.values():
                k = entry[3].shape[0]
                entry[4] = per_shard[start : start + k]
                start += k
        return {key: tuple(entry) for key, entry in out.items()}


def regroup(
    keys: list[str],
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    sizes: list[list[int]],
) -> SparseBatch:
    """lengths [W, F, B] and values in (source, feature, sample) order -> a feature-major batch of
    W * B samples, (feature, source, sample) order. sizes[s][f]: the ids source s sent of feature f
    (on the host)."""
    world, nf, b = lengths.shape
    order = [s * nf + f for f in range(nf) for s in range(world)]
    flat = [n for row in sizes for n in row]
    if world > 1 and nf > 1:
        pieces = values.split(flat)
        values = torch.cat([pieces[k] for k in order]) if pieces else values
        if weights is not None:
            wp = weights.split(flat)
            weights = torch.cat([wp[k] for k in order]) if wp else weights
    per_key = [sum(sizes[s][f] for s in range(world)) for f in range(nf)]
    return SparseBatch(keys, values, lengths.permute(1, 0, 2).reshape(-1), weights, per_key)


def _check_batch_sizes(rank: int, b: int, sizes: list[int]) -> None:
    """Every rank passes as many samples a step (the lengths travel in blocks of that size): a
    DataError on every rank, naming the sizes, where one differs (the exchange would fail in torch, or
    cut another rank's bags)."""
    if any(n != b for n in sizes):
        raise DataError(
            f"rank {rank}: the ranks' batches have {sizes} samples (in rank order) this step; every rank "
            "passes the same number (the global batch divided by the world size)"
        )
