"""Where the rows of sequence features (tables with pooling none) go, and how they come back.

A sequence shard looks up one row per id it received; each row goes back to the rank that owns
the id's sample, in the same all-to-all as the pooled blocks (output_dist.py). The owner of a
batch's samples rebuilds each feature's rows in the order of its ids:
- tw: the one owner's rows are the feature's rows;
- cw: the column shards' rows, side by side in shard order;
- rw: each id went to the shard that holds its row (input_dist.py), so the shards' rows, one after
  the other, are the ids grouped by shard; one gather puts them back in id order.
Row counts cross no process boundary: the samples' owner knows how many ids it sent where, and a
shard knows how many it got from each rank (the lengths of its local batch). Both are on the host
already when the input distribution made the local batch (input_dist.ExchangedBatch); otherwise
they are counted here, with a read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.distributed.input_dist import ExchangedBatch
from neorec.distributed.layout import ShardLayout
from neorec.sparse import JaggedRows, SparseBatch


@dataclass
class SequenceRoutes:
    """One batch's row counts of every sequence shard, seen from this rank."""

    # recv[j][k]: rows of this rank's ids that rank j sends back for its k-th sequence (unit, feature)
    recv: list[list[int]]
    # send[s][k]: rows of rank s's ids that this rank's k-th sequence (unit, feature) sends to s
    send: list[list[int]]
    # rw features: the gather that puts the shards' rows (concatenated in shard order) in id order
    restore: dict[str, torch.Tensor]


def build_routes(layout: ShardLayout, sparse: SparseBatch, local: SparseBatch) -> SequenceRoutes:
    """Routes of one batch: `sparse` holds this rank's samples, `local` the ids its shards received."""
    me, world = layout.topo.rank, layout.topo.world_size
    exchanged = isinstance(local, ExchangedBatch)
    per_key = dict(zip(sparse.keys, sparse.length_per_key(), strict=True))
    shard_counts: dict[tuple[str, str], list[int]] = {}
    restore: dict[str, torch.Tensor] = {}
    for t in layout.tables:
        if t.pooling != "none" or layout.plan.tables[t.name].kind != "rw":
            continue
        num_shards = len(layout.plan.shards(t, layout.topo))
        for f in t.features:
            owner = layout.row_shard(t, sparse.feature(f)[0])
            if exchanged:
                shard_counts[(t.name, f)] = local.ids_per_shard[(t.name, f)]
            else:
                shard_counts[(t.name, f)] = torch.bincount(owner, minlength=num_shards).tolist()
            # a stable sort by shard lists the ids as the shards' rows arrive; its inverse restores them
            order = torch.sort(owner, stable=True)[1]
            restore[f] = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    recv = []
    for j in range(world):
        counts = []
        for u, f in layout.sequences[j]:
            counts.append(shard_counts[(u.table.name, f)][u.index] if u.kind == "rw" else per_key[f])
        recv.append(counts)
    mine = layout.sequences[me]
    send: list[list[int]] = [[] for _ in range(world)]
    if mine:
        position = {k: i for i, k in enumerate(local.keys)}
        columns = [position[f"{f}#{u.index}"] for u, f in mine]
        if exchanged:
            send = [[row[c] for c in columns] for row in local.ids_per_source]
        else:
            b = local.batch_size // world
            lengths = local.lengths.view(len(local.keys), world, b)
            index = torch.tensor(columns, device=lengths.device)
            per_source = lengths.index_select(0, index).sum(dim=2).t().tolist()  # [W][K], one host read
            send = [list(row) for row in per_source]
    return SequenceRoutes(recv, send, restore)


def local_sequence_rows(layout: ShardLayout, rows: dict[str, JaggedRows]) -> list[torch.Tensor]:
    """This rank's looked-up rows of its sequence shards, in layout.sequences order."""
    return [rows[f"{f}#{u.index}"].values for u, f in layout.sequences[layout.topo.rank]]


def assemble_sequences(
    layout: ShardLayout, routes: SequenceRoutes, received: list[torch.Tensor], sparse: SparseBatch
) -> dict[str, JaggedRows]:
    """Every exchanged sequence feature's rows, in the order of its ids in `sparse`, from what the
    shards sent (received: by rank, then in each rank's layout.sequences order)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    k = 0
    for j in range(layout.topo.world_size):
        for u, f in layout.sequences[j]:
            pieces.setdefault(f, []).append((u.index, received[k]))
            k += 1
    out = {}
    for f in layout.sequence_features():
        parts = [rows for _, rows in sorted(pieces[f], key=lambda p: p[0])]
        kind = next(layout.plan.tables[t.name].kind for t in layout.tables if f in t.features)
        if kind == "cw":
            values = torch.cat(parts, dim=1)
        elif kind == "rw":
            values = torch.cat(parts).index_select(0, routes.restore[f])
        else:
            values = parts[0]
        out[f] = JaggedRows(values, sparse.feature(f)[1])
    return out


class ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale` (a replicated table's rows:
    1/W, as output_dist does for exchanged outputs, since each rank's loss is a mean over its own
    samples)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None
