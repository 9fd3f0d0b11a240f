"""Bytes every exchange of a step sends, rank to rank, for a plan: the code's arithmetic, restated.

For each direction that CommStats counts ("input_dist", "fwd", "bwd", "dp"), a [W, W] matrix of
bytes per step from rank i (row) to rank j (column); the diagonal (what a rank keeps) is zero.
Rank 0's row sum is what a run's summary.json reports as `comm_bytes_per_step` for that direction
(tests/test_planner.py checks this on real gloo processes). Where the data decides the count (ids
per bag, ids falling into a row shard, distinct rows of a replicated table), the workload's access
statistics give the expected value.

Mirrors, line by line:
- input_dist.py: per destination, the local batch size and, per (unit, feature) it looks up, its id
  count (int64s, on the host communicator), int32 lengths of the B local bags, int64 ids (only the
  shard's rows for row splits), fp32 weights when the batches carry weights or any row-split table is
  mean-pooled;
- output_dist.py: one flat all-to-all of [B, flat width of the sender] rows (backward: of the
  receiver), then comms.two_hop for twrw / twcw (hop 1 to node peers: [N * B, d]; hop 2 across nodes:
  [B, d] for sums, [B, L * d] for joined column slices) when any node has such tables; sequence
  shards (pooling none) add one row of their width per id they looked up for the receiver's samples;
- codecs.py: fp32 4 bytes, bf16 2, fp16 2 with one extra column per block;
- replicas.py `ReplicaSync`: per group of replicated tables, a count, then either the touched rows
  (int64) and their gradients (codec) to every rank, or a dense all-reduce of [rows, dim + 1]; for
  update rules with state, W counts, each touched row to its owner only, then each owner's updated
  rows (int64 + the storage dtype) to every rank. With the counts read one batch ahead (on a GPU,
  the replicated rows in plain tensors: `counted_ahead`), the counts go ahead over the host
  communicator, no size travels with a part, and each owner sends the rows it received, padded,
  instead of their union.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neorec.distributed.layout import ROW_SPLIT, ShardLayout
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.replicas import DENSE_BYTES, updates_by_owner
from neorec.distributed.topology import Topology
from neorec.planner.workload import TableLoad, Workload

DIRECTIONS = ("input_dist", "fwd", "bwd", "dp")


def wire_bytes(precision: str, rows: float, width: int) -> float:
    """Bytes of `rows` rows of `width` columns in a codec's wire format (codecs.py)."""
    if precision == "fp16":
        return rows * (width + 1) * 2
    return rows * width * (2 if precision == "bf16" else 4)


@dataclass
class Traffic:
    """Bytes per step, per direction, from rank i (row) to rank j (column)."""

    matrices: dict[str, np.ndarray]
    topo: Topology

    def sent(self, rank: int, direction: str | None = None) -> float:
        names = [direction] if direction else list(self.matrices)
        return float(sum(self.matrices[d][rank].sum() for d in names))

    def received(self, rank: int, direction: str | None = None) -> float:
        names = [direction] if direction else list(self.matrices)
        return float(sum(self.matrices[d][:, rank].sum() for d in names))

    def link_bytes(self, direction: str) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, bytes sent plus received inside its node and across nodes."""
        m = self.matrices[direction]
        nodes = np.arange(self.topo.world_size) // self.topo.local_world_size
        same = nodes[:, None] == nodes[None, :]
        both = m + m.T
        return (both * same).sum(axis=1), (both * ~same).sum(axis=1)


def plan_traffic(plan: ShardingPlan, workload: Workload, topo: Topology, counted_ahead: bool = False) -> Traffic:
    """counted_ahead: the replicated tables' rows are counted one batch ahead (a GPU run:
    ReplicaSync.count_ahead), which changes what their exchanges send."""
    layout = ShardLayout(workload.table_configs, plan, topo)
    W, L, N = topo.world_size, topo.local_world_size, topo.num_nodes
    b = workload.batch_size / W
    mats = {d: np.zeros((W, W)) for d in DIRECTIONS}
    nodes = np.arange(W) // L
    peers = nodes[:, None] == nodes[None, :]  # same node
    cross = (np.arange(W) % L)[:, None] == (np.arange(W) % L)[None, :]  # same local index

    # ---- ids --------------------------------------------------------------------------------------
    mean_row_split = any(u.kind in ROW_SPLIT and u.table.pooling == "mean" for us in layout.units for u in us)
    id_bytes = 8 + (4 if workload.weighted or mean_row_split else 0)
    for dst in range(W):
        total = 8.0  # the sender's batch size, beside the id counts on the host communicator
        for unit, f in layout.send_features(dst):
            load = workload.by_name[unit.table.name]
            share = load.share(*unit.shard.rows) if unit.kind in ROW_SPLIT else 1.0
            total += 8 + b * 4 + b * load.ids_per_feature[f] * share * id_bytes
        mats["input_dist"][:, dst] += total

    # ---- pooled rows and their gradients -------------------------------------------------------------
    fp, bp = workload.forward_precision, workload.backward_precision
    flat = np.array(layout.flat_width)
    mats["fwd"] += np.array([wire_bytes(fp, b, w) for w in flat])[:, None]
    mats["bwd"] += np.array([wire_bytes(bp, b, w) for w in flat])[None, :]
    for src in range(W):  # sequence shards: one row per id of each rank's samples, in the same exchange
        for unit, f in layout.sequences[src]:
            load = workload.by_name[unit.table.name]
            share = load.share(*unit.shard.rows) if unit.kind in ROW_SPLIT else 1.0
            rows = b * load.ids_per_feature[f] * share
            mats["fwd"][src, :] += wire_bytes(fp, rows, unit.width)
            mats["bwd"][:, src] += wire_bytes(bp, rows, unit.width)
    for combine, has, node_widths in (
        ("sum", layout.has_twrw, layout.twrw_width),
        ("cat", layout.has_twcw, layout.twcw_width),
    ):
        if not has:
            continue
        for src in range(W):
            mine = node_widths[nodes[src]]
            d = mine if combine == "sum" else mine // L  # this rank's columns in the two-hop exchange
            for direction, precision in (("fwd", fp), ("bwd", bp)):
                hop1 = wire_bytes(precision, N * b, d)
                mats[direction][src, peers[src]] += hop1
                for dst in np.nonzero(cross[src] & ~peers[src])[0]:
                    if direction == "fwd":  # the block combined on this rank, for rank dst
                        mats[direction][src, dst] += wire_bytes(precision, b, mine if combine == "cat" else d)
                    else:  # the gradient of the block node(dst) sent us
                        mats[direction][src, dst] += wire_bytes(precision, b, node_widths[nodes[dst]])

    # ---- replicated tables ------------------------------------------------------------------------
    if W > 1:
        groups: dict[tuple, list] = {}
        for t in layout.dp_tables:
            load = workload.by_name[t.name]
            groups.setdefault((t.dim, t.dtype, load.optimizer), []).append(load)
        for (dim, _, optimizer), loads in groups.items():
            mats["dp"] += replica_bytes_per_peer(loads, dim, optimizer, bp, b, W, counted_ahead)
    for m in mats.values():
        np.fill_diagonal(m, 0.0)
    return Traffic(mats, topo)


def replica_bytes_per_peer(
    loads: list[TableLoad], dim: int, optimizer: str, precision: str, b: float, W: int,
    counted_ahead: bool = False,
) -> float:  # fmt: skip
    """Bytes each rank sends each peer per step for one group of replicated tables (one dim, dtype and
    update rule: replicas.py), gradients in `precision`, `b` samples per rank. plan_traffic sends this
    per group; the planner prices a dp option (options.py) as the group of its one table."""
    rows = sum(x.table.rows for x in loads)
    touched = sum(x.unique(0, x.table.rows, b * x.ids_per_sample, 1 / W) for x in loads)
    by_owner = updates_by_owner(optimizer)
    choose = 2 * rows * (dim + 1) * 4 <= DENSE_BYTES  # small enough for a dense all-reduce
    if counted_ahead:
        return _counted_ahead_bytes(rows, dim, touched, by_owner, choose, loads, precision, W)
    # when choosing, the counts go first: one per rank (by owner: one per owner and rank)
    per_peer = (8.0 * W if by_owner else 8.0) if choose else 0.0
    if not choose or W * touched * (wire_bytes(precision, 1, dim) + 8) <= 2 * rows * (dim + 1) * 4:
        sent = touched / W if by_owner else touched  # to the rows' owners, or to everyone
        per_peer += sent * 8 + wire_bytes(precision, sent, dim)
        per_peer += 8.0 if by_owner or not choose else 0.0  # the part's size, in a header
    else:
        per_peer += dense_all_reduce_bytes(precision, rows * (dim + 1), W) / (W - 1)
    if by_owner:  # the owner's updated rows, to every rank (and their size)
        per_peer += 8 + _union(loads, b, W) / W * (8 + dim * loads[0].weight_bytes)
    return per_peer


def _union(loads: list[TableLoad], b: float, W: int) -> float:
    """Distinct rows of the tables among the ids of a global batch (W ranks of b samples)."""
    return sum(x.unique(0, x.table.rows, W * b * x.ids_per_sample) for x in loads)


def replica_bytes_floor(load: TableLoad, precision: str, b: float, W: int) -> float:
    """The least bytes per peer that `load`'s table adds to replica_bytes_per_peer of any group it is
    in, counted ahead or not (the planner's lower bound: bounds.py): the lesser of its rows and
    gradients (sparse) and its part of a dense all-reduce, not rounded up, and for rules with state
    its part of the owners' updated rows, which a group sends no fewer of (counted ahead: touched, or
    at most rows / W of them); not the group's counts and sizes, sent once whatever its tables."""
    t, by_owner = load.table, updates_by_owner(load.optimizer)
    touched = load.unique(0, t.rows, b * load.ids_per_sample, 1 / W)
    sent = touched / W if by_owner else touched
    numel = t.rows * (t.dim + 1)
    if precision == "fp32":  # whole bytes rounded down: a group's sum rounds down no more
        dense = dense_all_reduce_bytes(precision, numel, W)
    else:  # a group's rows are rounded up to whole 256-element blocks per rank
        dense = 2 * (W - 1) * wire_bytes(precision, numel / (W * 256), 256)
    per_peer = min(sent * 8 + wire_bytes(precision, sent, t.dim), dense / (W - 1))
    if by_owner:
        per_peer += _union([load], b, W) / W * (8 + t.dim * load.weight_bytes)
    return per_peer


def _counted_ahead_bytes(rows, dim, touched, by_owner: bool, choose: bool, loads, bp: str, W: int) -> float:
    """Bytes to each peer of one replicated group whose rows were counted ahead (ReplicaSync's
    _start_counted): its counts in the batch's host exchange, the same choice of path, parts without
    their sizes, and each owner's received rows (the padded bound of its updated rows)."""
    per_peer = 8.0 * (W if by_owner else 1)
    dense = choose and W * touched * (wire_bytes(bp, 1, dim) + 8) > 2 * rows * (dim + 1) * 4
    if dense:
        per_peer += dense_all_reduce_bytes(bp, rows * (dim + 1), W) / (W - 1)
    else:
        sent = touched / W if by_owner else touched
        per_peer += sent * 8 + wire_bytes(bp, sent, dim)
    if by_owner:  # the owner's rows, padded to what it received: touched / W from each of W ranks
        bound = min(touched, rows / W) if dense else touched  # (dense: at most the rows it owns)
        per_peer += bound * (8 + dim * loads[0].weight_bytes)
    return per_peer


def dense_all_reduce_bytes(precision: str, numel: int, world: int) -> float:
    """Bytes one rank sends in Comms.all_reduce_sum of `numel` fp32 values."""
    if precision == "fp32":
        return float(2 * (world - 1) * numel * 4 // world)
    per_rank = -(-numel // (world * 256)) * 256
    return 2 * (world - 1) * wire_bytes(precision, per_rank // 256, 256)
