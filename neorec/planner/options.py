"""The ways one table can be sharded, each with what its pieces cost the ranks that hold them.

An `Option` is (kind, number of shards, plan tier: tiers.py). It splits into pieces that the partitioner
places: one rank each for tw / rw / cw, the L ranks of one node for twrw / twcw, every rank for dp.
Costs are additive, so a rank's load is the sum of its pieces plus `everyone` of every option
(what each rank pays for its own samples: sending ids, receiving pooled rows, sending gradients;
and for dp the whole table's work). The link part is exchanges.py's arithmetic rearranged so that
each byte is charged once to sender and once to receiver:

flat shard (tw, rw, cw), X = bytes it exchanges with one peer per step (its ids, pooled rows and
gradients for that peer's B samples; a sequence table's rows are one per id, not per bag): its rank moves (W - 1) X; every other rank moves X. So each
rank pays X in `everyone` and the piece adds (W - 2) X (split intra/inter by the node layout).

Compute and elementwise work come from cost.shard_work, the function the cost model uses. Every cost
is kept per phase (cost.PHASES: the ids' exchange; lookups and pooled rows; gradients and update),
each byte in the phase of the exchange that carries it, since a step waits for the slowest rank of
each phase (partition.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.distributed.plan import MANAGED_COLLISION_KINDS, even_splits
from neorec.planner.cost import (
    BYTES_PER_ID,
    PHASES,
    POOLED_COPIES,
    by_phase,
    counts_ahead,
    owner_work,
    shard_work,
    wire_element_bytes,
)
from neorec.planner.exchanges import replica_bytes_floor, replica_bytes_per_peer
from neorec.planner.hardware import Cluster
from neorec.planner.tiers import PLACEMENTS, placements
from neorec.planner.workload import TableLoad, Workload

ROW_KINDS = ("rw", "twrw")


@dataclass
class Option:
    table: str
    kind: str
    num_shards: int
    tier: str  # plan tier (tiers.py): device, host, cached or ssd
    piece_phases: list[tuple[float, ...]]  # seconds per step and phase on the rank holding each piece
    piece_memory: list[dict[str, float]]  # bytes per memory tier of each piece (weights, state, caches, buffers)
    everyone_phases: tuple[float, ...] = (0.0,) * len(PHASES)  # seconds per step and phase on every rank
    # the least of `everyone` one rank pays in the cost model (cost.estimate_plan) in any plan (bounds.py):
    # the link bytes `everyone` spreads over intra- and inter-node links by their share of the peers all
    # on the faster link; for dp the least its exchange adds to a group's (exchanges.replica_bytes_floor)
    everyone_low: float | None = None
    everyone_memory: dict[str, float] = field(default_factory=dict)  # bytes per memory tier on every rank (dp)
    init_bytes: int = 0  # initialisation window of the largest piece
    group_key: tuple = ()  # the fused engine groups tables by (dim, dtype, update rule)
    mean_row_split: bool = False  # a mean-pooled table split by rows: every id then carries a weight
    piece_costs: list[float] = field(init=False, default_factory=list)  # per piece, all phases
    everyone: float = field(init=False, default=0.0)  # all phases
    largest_phases: tuple[float, ...] = field(init=False, default=())  # per phase, the largest piece's

    def __post_init__(self) -> None:
        self.piece_costs = [sum(p) for p in self.piece_phases]
        self.everyone = sum(self.everyone_phases)
        if self.piece_phases:
            self.largest_phases = tuple(max(p[k] for p in self.piece_phases) for k in range(len(PHASES)))

    @property
    def placement(self) -> str:
        """ "rank": each piece on its own rank; "node": pieces on the L ranks of one node; "all"."""
        return {"twrw": "node", "twcw": "node", "dp": "all"}.get(self.kind, "rank")

    def total(self, world_size: int) -> float:
        return sum(self.piece_costs) + world_size * self.everyone

    @property
    def least_share(self) -> float:
        """`everyone_low`, or `everyone` when the option has none."""
        return self.everyone if self.everyone_low is None else self.everyone_low

    def total_low(self, world_size: int) -> float:
        """At most what the ranks together pay for this option in the cost model, in any plan: its
        link bytes add up to what `everyone` spreads, but a dp table may get its cheaper exchange."""
        saved = self.everyone - self.least_share if self.kind == "dp" else 0.0
        return self.total(world_size) - world_size * saved

    @property
    def max_piece(self) -> float:
        return max(self.piece_costs, default=0.0)

    def piece_size(self, allowance: tuple[float, ...]) -> float:
        """Its largest piece's cost in the phase where it is largest against `allowance` (per phase)."""
        if not self.largest_phases:  # dp: no pieces
            return 0.0
        return max(c / a for c, a in zip(self.largest_phases, allowance, strict=True))

    def max_piece_memory(self, tier: str) -> float:
        return max((m.get(tier, 0.0) for m in self.piece_memory), default=0.0) + self.everyone_memory.get(
            tier, 0.0
        )

    def memory_total(self, tier: str, world_size: int) -> float:
        return sum(m.get(tier, 0.0) for m in self.piece_memory) + world_size * self.everyone_memory.get(
            tier, 0.0
        )

    @property
    def memory_tiers(self) -> set[str]:
        """The memory tiers its pieces use."""
        return {t for m in [*self.piece_memory, self.everyone_memory] for t in m}

    @property
    def label(self) -> str:
        return self.kind if self.num_shards == 1 or self.kind in ("dp",) else f"{self.kind}x{self.num_shards}"


def phase_means(choice: dict[str, Option], world_size: int) -> tuple[float, ...]:
    """Seconds per phase a rank pays on average when every table takes its option in `choice`."""
    totals = _zero()
    for o in choice.values():
        for p in [*o.piece_phases, tuple(world_size * v for v in o.everyone_phases)]:
            totals = _add(totals, p)
    return tuple(v / world_size for v in totals)


def split_counts(load: TableLoad, cluster: Cluster) -> dict[str, list[int]]:
    """Numbers of shards worth trying per kind: powers of two (and W) up to W for row splits, divisors
    of the dim for column splits (slices of at least 4 columns)."""
    W, dim = cluster.world_size, load.table.dim
    ks = sorted({k for k in [2**i for i in range(1, 16)] + [W] if 2 <= k <= W})
    return {
        "rw": [k for k in ks if k <= load.table.rows],
        "cw": [k for k in ks if dim % k == 0 and dim // k >= 4],
    }


def table_options(
    load: TableLoad,
    workload: Workload,
    cluster: Cluster,
    kinds: tuple[str, ...],
    tiers: tuple[str, ...] | None = None,
    shards: int | None = None,
) -> list[Option]:
    """Every option of `kinds` for the table, in every plan tier the cluster offers (or `tiers`);
    with `shards` (a table pinned to that many ranks: constraints.py) only the tw, rw and cw options
    of that many pieces (tw: one), whatever the powers of two and the world size."""
    out = []
    L, W = cluster.ranks_per_node, cluster.world_size
    splits = split_counts(load, cluster)
    if shards is not None:
        kinds = tuple(k for k in kinds if k in ("tw", "rw", "cw") and (k != "tw" or shards == 1))
        splits = {
            "rw": [shards] if shards <= load.table.rows else [],
            "cw": [shards] if load.table.dim % shards == 0 else [],
        }
    tiers = tiers or placements(cluster)
    mc = load.table.managed_collision
    if mc is not None:  # its id map lives with its rows: tw, or rw over whole buckets, in plain memory
        kinds = tuple(k for k in kinds if k in MANAGED_COLLISION_KINDS)
        splits["rw"] = [k for k in splits["rw"] if mc.buckets % k == 0]
        tiers = tuple(t for t in tiers if PLACEMENTS[t].cache_in is None)
    if load.table.pooling == "none":  # rows per id have no two-hop exchange (plan.validate)
        kinds = tuple(k for k in kinds if k not in ("twrw", "twcw"))
    for tier in tiers:
        if "tw" in kinds:
            out.append(_flat(load, "tw", 1, tier, workload, cluster))
        for kind in ("rw", "cw"):
            if kind in kinds:
                out += [_flat(load, kind, k, tier, workload, cluster) for k in splits[kind]]
        if W > 1 and "twrw" in kinds and L > 1 and load.table.rows >= L:
            out.append(_node(load, "twrw", tier, workload, cluster))
        if W > 1 and "twcw" in kinds and L > 1 and load.table.dim % L == 0:
            out.append(_node(load, "twcw", tier, workload, cluster))
        if W > 1 and "dp" in kinds:
            out.append(_replicated(load, tier, workload, cluster))
    return out


# ---- per kind -------------------------------------------------------------------------------------
def _shards(load: TableLoad, kind: str, k: int) -> list[tuple[tuple[int, int], int]]:
    """(row range, width) of each shard."""
    t = load.table
    if kind in ROW_KINDS:
        bounds = even_splits(t.rows, k)
        return [((bounds[i], bounds[i + 1]), t.dim) for i in range(k)]
    return [((0, t.rows), t.dim // k)] * k


def _piece_works(load: TableLoad, kind: str, k: int, tier: str, workload: Workload, cluster: Cluster):
    """shard_work of each shard; shards of an even split without an id sample cost the same (up to a
    row), so one is computed and reused: the 12-trillion-parameter dry run has thousands of them."""
    shards = _shards(load, kind, k)
    if load.id_sample is None and len(shards) > 1:
        one = shard_work(load, shards[0][0], shards[0][1], kind, tier, workload, cluster)
        return shards, [one] * len(shards)
    return shards, [shard_work(load, rows, width, kind, tier, workload, cluster) for rows, width in shards]


def _buffers(work) -> float:
    return work.ids * BYTES_PER_ID + work.pooled_bytes * POOLED_COPIES


def _link_seconds(intra: float, inter: float, cluster: Cluster) -> float:
    return intra / cluster.intra_node_bandwidth + inter / cluster.inter_node_bandwidth


def _split_links(nbytes, intra_share: float, cluster: Cluster) -> tuple[float, ...]:
    """Seconds per phase of `nbytes` per phase, `intra_share` of them within the node."""
    return tuple(_link_seconds(v * intra_share, v * (1 - intra_share), cluster) for v in nbytes)


def _zero() -> tuple[float, ...]:
    return (0.0,) * len(PHASES)


def _add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _fastest_link_seconds(nbytes: float, cluster: Cluster) -> float:
    """`nbytes` over the faster link a rank has (one node: its intra-node link)."""
    fastest = cluster.intra_node_bandwidth
    if cluster.num_nodes > 1:
        fastest = max(fastest, cluster.inter_node_bandwidth)
    return nbytes / fastest


def _id_bytes(load: TableLoad, workload: Workload, kind: str) -> int:
    mean_split = kind in ROW_KINDS and load.table.pooling == "mean"
    return 8 + (4 if workload.weighted or mean_split else 0)


def _memory(work, tier: str) -> dict[str, float]:
    mem = {name: float(nbytes) for name, nbytes in work.memory.items()}
    mem["device"] = mem.get("device", 0.0) + _buffers(work)
    return mem


def _flat(load: TableLoad, kind: str, k: int, tier: str, workload: Workload, cluster: Cluster) -> Option:
    W, L = cluster.world_size, cluster.ranks_per_node
    b = workload.batch_size / W
    F, p = len(load.table.features), load.ids_per_sample
    fe, be = wire_element_bytes(workload.forward_precision), wire_element_bytes(workload.backward_precision)
    shards, works = _piece_works(load, kind, k, tier, workload, cluster)
    costs, everyone, low = [], _zero(), 0.0
    intra_share = (L - 1) / (W - 1) if W > 1 else 0.0
    if load.id_sample is None and k > 1:  # identical pieces (see _piece_works): cost one, count k
        shards, works = shards[:1], works[:1]
    for (rows, width), work in zip(shards, works, strict=True):
        share = load.share(*rows) if kind in ROW_KINDS else 1.0
        rows_out = b * p * share if load.table.pooling == "none" else b * F  # rows per id, or per bag
        ids = b * (F * 4 + p * share * _id_bytes(load, workload, kind))
        x = (ids, rows_out * width * fe, rows_out * width * be)  # bytes per phase
        piece_link = [(W - 2) * v if W > 1 else 0.0 for v in x]
        costs.append(_add(by_phase(work.stages), _split_links(piece_link, intra_share, cluster)))
        if W > 1:  # one process exchanges nothing
            everyone = _add(everyone, _split_links(x, intra_share, cluster))
            low += _fastest_link_seconds(sum(x), cluster)
    if len(costs) < k:
        costs, works, low = costs * k, works * k, low * k
        everyone = tuple(v * k for v in everyone)
    own = by_phase(owner_work(load, kind, k, workload, cluster))
    everyone_and_low = (_add(everyone, own), low + sum(own))
    return _sharded(load, kind, k, tier, costs, works, everyone_and_low, kind in ROW_KINDS)


def _sharded(load: TableLoad, kind: str, k: int, tier: str, costs: list[tuple[float, ...]], works: list,
             everyone: tuple[tuple[float, ...], float], row_split: bool) -> Option:  # fmt: skip
    """The option of a table cut into k pieces of `costs` per phase (`row_split`: pieces of its
    rows); `everyone`: its `everyone_phases` and `everyone_low`."""
    memory: dict[int, dict[str, float]] = {}
    for w in works:
        if id(w) not in memory:
            memory[id(w)] = _memory(w, tier)
    return Option(
        table=load.name,
        kind=kind,
        num_shards=k,
        tier=tier,
        piece_phases=costs,
        piece_memory=[memory[id(w)] for w in works],  # (read only: pieces of one work share a dict)
        everyone_phases=everyone[0],
        everyone_low=everyone[1],
        init_bytes=max(w.init_bytes for w in works),
        group_key=_group_key(load),
        mean_row_split=row_split and load.table.pooling == "mean",
    )


def _group_key(load: TableLoad) -> tuple:
    return (load.table.dim, load.table.dtype, load.optimizer)


def _node(load: TableLoad, kind: str, tier: str, workload: Workload, cluster: Cluster) -> Option:
    """twrw / twcw: L pieces for the L ranks of one node; pooled rows meet inside the node first."""
    W, L = cluster.world_size, cluster.ranks_per_node
    N = W // L
    b = workload.batch_size / W
    F, p, D = len(load.table.features), load.ids_per_sample, load.table.dim
    wires = (wire_element_bytes(workload.forward_precision), wire_element_bytes(workload.backward_precision))
    shards, works = _piece_works(load, kind, L, tier, workload, cluster)
    costs, everyone, low = [], _zero(), 0.0
    intra_share = (L - 1) / (W - 1)
    y = [0.0] + [b * F * D * w for w in wires]  # per phase: one rank's pooled rows (gradients) crossing nodes
    for (rows, width), work in zip(shards, works, strict=True):
        share = load.share(*rows) if kind == "twrw" else 1.0
        x = b * (F * 4 + p * share * _id_bytes(load, workload, kind))  # ids, as for a flat shard
        intra = [(W - 2) * x * intra_share] + [2 * (L - 1) * N * b * F * width * w for w in wires]
        inter = [(W - 2) * x * (1 - intra_share)] + [(N - 2) * v for v in y[1:]]
        links = tuple(_link_seconds(a, e, cluster) for a, e in zip(intra, inter, strict=True))
        costs.append(_add(by_phase(work.stages), links))
        everyone = _add(everyone, _split_links([x, 0.0, 0.0], intra_share, cluster))
        low += _fastest_link_seconds(x, cluster)
    own = by_phase(owner_work(load, kind, L, workload, cluster))
    # y: what a rank of another node pays; the node's own ranks pay (N - 1) y, nothing on one node
    across = tuple(_link_seconds(0.0, v, cluster) for v in y)
    everyone = _add(_add(everyone, across), own)
    low += (sum(across) if N > 1 else 0.0) + sum(own)
    return _sharded(load, kind, L, tier, costs, works, (everyone, low), kind == "twrw")


def _replicated(load: TableLoad, tier: str, workload: Workload, cluster: Cluster) -> Option:
    """dp: the whole table on every rank; each rank looks up its own samples, and the gradients are
    exchanged as exchanges.replica_bytes_per_peer says for a group of this one table (counted ahead
    where training counts a group in this tier ahead: cost.counts_ahead). Every rank sends those
    bytes to each of its W - 1 peers and receives as many from each."""
    W, L = cluster.world_size, cluster.ranks_per_node
    t = load.table
    work = shard_work(load, (0, t.rows), t.dim, "dp", tier, workload, cluster)
    b, bp = workload.batch_size / W, workload.backward_precision
    intra_share = (L - 1) / (W - 1)

    def exchange(per_peer: float) -> float:
        moved = 2 * (W - 1) * per_peer
        return _link_seconds(moved * intra_share, moved * (1 - intra_share), cluster)

    own = _add(by_phase(work.stages), by_phase(owner_work(load, "dp", W, workload, cluster)))
    per_peer = replica_bytes_per_peer([load], t.dim, load.optimizer, bp, b, W, counts_ahead(cluster, [tier]))
    return Option(
        table=load.name,
        kind="dp",
        num_shards=W,
        tier=tier,
        piece_phases=[],
        piece_memory=[],
        everyone_phases=_add(own, (0.0, 0.0, exchange(per_peer))),  # the gradient exchange: with the update
        # in a group with other replicated tables, or counted otherwise, it may add less (bounds.py)
        everyone_low=sum(own) + exchange(replica_bytes_floor(load, bp, b, W)),
        everyone_memory=_memory(work, tier),
        init_bytes=work.init_bytes,
        group_key=_group_key(load),
    )
