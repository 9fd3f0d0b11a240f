"""Input distribution: send every id to the ranks that hold its row (and columns).

Each rank has the ids of its own B samples for every feature. For each destination rank it builds
the jagged ids of the features that rank's shards look up, in that rank's local order: all ids of
the feature for whole-row shards (tw, cw, twcw), only the ids inside the shard's row range, rebased
to the shard, for row-split shards (rw, twrw). Then two all-to-alls: lengths first (their sizes are
known from the layout), then ids and weights (sizes from the lengths). The receiver regroups what
the W ranks sent into one feature-major SparseBatch of W * B samples, samples of rank 0 first.

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
from neorec.sparse import SparseBatch
from neorec.utils import index_ops


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
        b, world = sparse.batch_size, self.comms.topo.world_size
        with_weights = sparse.weights is not None or self.mean_row_split
        parts = {k: sparse.feature(k) for k in {f for feats in self.features for _, f in feats}}
        bag_of_id: dict[str, torch.Tensor] = {}
        split_cache: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        lengths, values, weights, counts = [], [], [], []
        for dest in range(world):
            n = 0
            for unit, f in self.features[dest]:
                ids, lens, w = parts[f]
                if with_weights and w is None:
                    w = torch.ones(ids.numel(), dtype=torch.float32, device=ids.device)
                if unit.kind in ROW_SPLIT:
                    key = (unit.table.name, f)
                    if key not in split_cache:
                        if f not in bag_of_id:
                            bag_of_id[f] = torch.arange(b, device=ids.device).repeat_interleave(lens)
                        if with_weights and unit.table.pooling == "mean":
                            w = w * lens.clamp(min=1).to(torch.float32).reciprocal().index_select(0, bag_of_id[f])
                        starts = [s.rows[0] for s in self.layout.plan.shards(unit.table, self.comms.topo)]
                        mc = unit.table.managed_collision
                        if mc is not None:  # raw ids: the id's bucket decides, the owner's map gives the row
                            owner = bucket_of(ids, mc.buckets) // (mc.buckets // len(starts))
                            starts = [0] * len(starts)
                        else:
                            inner = torch.tensor(starts[1:], dtype=ids.dtype, device=ids.device)
                            owner = torch.bucketize(ids, inner, right=True)
                        split_cache[key] = (owner, w, torch.tensor(starts, device=ids.device))
                    owner, w, starts = split_cache[key]
                    mine = owner == unit.index
                    sel = index_ops.where(mine)
                    ids = ids.index_select(0, sel) - starts[unit.index]
                    lens = torch.bincount(bag_of_id[f].index_select(0, sel), minlength=b)
                    w = w.index_select(0, sel) if w is not None else None
                lengths.append(lens.to(torch.int32))
                values.append(ids)
                if with_weights:
                    weights.append(w.to(torch.float32))
                n += ids.numel()
            counts.append(n)
        device = sparse.values.device
        send_len = torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int32, device=device)
        n_local = len(self.local_keys)
        got_len = self.comms.all_to_all(
            send_len, [len(f) * b for f in self.features], [n_local * b] * world, "input_dist", self.comms.ids
        )
        send_val = torch.cat(values) if values else torch.empty(0, dtype=torch.int64, device=device)
        send_w = torch.cat(weights) if with_weights and weights else None

        def finish() -> SparseBatch:
            recv_len = got_len.wait().view(world, n_local, b).to(torch.int64)
            per_source = recv_len.sum(dim=(1, 2)).tolist()
            got_val = self.comms.all_to_all(send_val, counts, per_source, "input_dist", self.comms.ids)
            got_w = None
            if with_weights:
                w = send_w if send_w is not None else torch.empty(0, device=device)
                got_w = self.comms.all_to_all(w, counts, per_source, "input_dist", self.comms.ids)
            return regroup(self.local_keys, recv_len, got_val.wait(), got_w.wait() if got_w else None)

        return Pending([got_len], finish)


def regroup(
    keys: list[str], lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None
) -> SparseBatch:
    """lengths [W, F, B] and values in (source, feature, sample) order -> a feature-major batch of
    W * B samples, (feature, source, sample) order."""
    world, nf, b = lengths.shape
    segment = lengths.sum(dim=2)  # [W, F]
    order = [s * nf + f for f in range(nf) for s in range(world)]
    if world > 1 and nf > 1:
        pieces = values.split(segment.reshape(-1).tolist())
        values = torch.cat([pieces[k] for k in order]) if pieces else values
        if weights is not None:
            wp = weights.split(segment.reshape(-1).tolist())
            weights = torch.cat([wp[k] for k in order]) if wp else weights
    return SparseBatch(keys, values, lengths.permute(1, 0, 2).reshape(-1), weights)
