"""The cost model: seconds per step and bytes of memory, per rank, for a plan on a cluster.

A rank's step has the stages the sharded collection times (sharded.py), in the same units:
- input_dist: routing its ids (elementwise work over every id it sends or receives) + the id
  all-to-alls (link bytes / link bandwidth + latency per call);
- lookup: for each shard it holds, ids x (per-id cost) + rows read / the tier's lookup bandwidth,
  plus the pooled output written;
- output_dist: encoding its pooled rows, the all-to-all(s), decoding and assembling its samples;
- output_dist_bwd: the same for the gradients;
- update: per id (sort, segment sums) + gradient rows read + touched rows and optimizer state read
  and written / the tier's update bandwidth; replicated tables add their gradient exchange.
A table behind a row cache (plan tier cached or ssd, tiers.py) is read and updated at the speeds of
the cache's tier, and its lookup adds the cache's misses: rows read from and written back to the
backing tier (the sharded collection times its cache prefetches as lookup, too).
Link bytes come from exchanges.py (the code's exact counts), split into intra- and inter-node.
The step time is the sum over the three phases that end in an exchange every rank waits for
(ids; lookup + pooled rows; gradients + update) of the slowest rank in that phase.

`shard_work` is the per-shard part shared with the partitioner (options.py), so that the costs the
planner balances are the costs it reports.

Memory per rank and tier: weights + optimizer state of its shards (cached shards: the cache and its
bookkeeping in device memory, every row in the backing tier; tiers.py; caches sized in MiB as training
sizes each rank's: cache_mib_fractions), plus the step's buffers (ids,
pooled rows and their gradients, wire copies, the backward's sort, the shared-memory transport's
pages: transport_bytes) and, while the model is built,
one initialisation window: storage.py fills each buffer of the fused engine (the shards of one dim,
dtype and optimizer, stacked) about 32 MiB of fp32 rows at a time (storage.init_window_rows), from
fp32 rows made per table (init.py, plus its 65536-row chunk) and, where a window spans tables,
concatenated: two fp32 windows at most are alive at once. Buffers and that
window are never alive together, so the peak counts the larger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.distributed.layout import ROW_SPLIT, ShardLayout
from neorec.distributed.plan import STORAGE_TIERS, ShardingPlan
from neorec.distributed.replicas import updates_by_owner
from neorec.embedding.cache.records import rows_in_mib
from neorec.embedding.fused.storage import INIT_CHUNK_ROWS, init_window_rows
from neorec.planner.exchanges import Traffic, plan_traffic
from neorec.planner.hardware import Cluster
from neorec.planner.tiers import PLACEMENTS, cache_traffic, record_bytes
from neorec.planner.tiers import memory as tier_memory
from neorec.planner.workload import TableLoad, Workload, state_bytes_per_row

STAGES = ("input_dist", "lookup", "output_dist", "output_dist_bwd", "update")
PHASES = (("input_dist",), ("lookup", "output_dist"), ("output_dist_bwd", "update"))
SSD_INIT_WINDOW_BYTES = 64 << 20  # embedding/cache/backing.py _WINDOW_BYTES
BYTES_PER_ID = 64  # step buffers per id looked up: received, regrouped, bag/row indices, the sort
POOLED_COPIES = 4  # the pooled output, its wire copy, its gradient, the decoded gradient
SHM_CAPACITY = 16 << 20  # distributed/shm.py: bytes of one rank's region of one parity


def wire_element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass
class ShardWork:
    """What one shard costs the rank that holds it, per step (seconds) and in memory (bytes)."""

    stages: dict[str, float]  # seconds per stage (STAGES) of its compute and elementwise work
    ids: float  # ids it looks up per step
    pooled_bytes: float  # fp32 bytes of its pooled output for the batch it serves
    memory: dict[str, int]  # bytes per memory tier: weights + optimizer state (+ a cache: tiers.py)
    init_bytes: int  # the fp32 window its initialisation allocates
    tier_bytes: float = 0.0  # bytes a cache moves per step from and to its backing tier
    hit_rate: float | None = None  # the cache's estimated hit rate (None: no cache)


def shard_work(
    load: TableLoad,
    rows: tuple[int, int],
    width: int,
    kind: str,
    tier: str,
    workload: Workload,
    cluster: Cluster,
    fraction: float | None = None,
) -> ShardWork:
    """Cost of a shard (rows x columns of `load`'s table) on the rank that holds it, without link
    transfers (those depend on the whole plan: exchanges.py); `fraction`: the share of its rows its
    cache holds, when it has one (None: the workload's for the table)."""
    t, W = load.table, cluster.world_size
    fraction = workload.fraction(load.name) if fraction is None else fraction
    batch = workload.batch_size / W if kind == "dp" else workload.batch_size  # samples it looks up
    share = load.share(*rows) if kind in ROW_SPLIT else 1.0
    ids = batch * load.ids_per_sample * share
    num_rows = rows[1] - rows[0]
    where = PLACEMENTS[tier]
    mem = cluster.tier(where.cache_in or where.rows_in)  # where rows are read and updated
    wb = load.weight_bytes
    # the output it serves: a pooled row per bag, or one row per id for a sequence table (pooling none)
    pooled = (ids if t.pooling == "none" else batch * len(t.features)) * width * 4
    stages = dict.fromkeys(STAGES, 0.0)
    stages["lookup"] = ids * cluster.lookup_per_id + (ids * width * wb + pooled) / mem.lookup_bandwidth
    # rows touched anywhere in the global batch (dp: each replica's share of them, see below)
    touched = load.unique(rows[0], rows[1], workload.batch_size * load.ids_per_sample * share)
    cache = cache_traffic(load, tier, rows, width, touched, fraction, cluster, workload.ssd_log)
    if cache is not None:
        stages["lookup"] += cache.seconds
    updated, received = touched, 0.0
    if kind == "dp" and W > 1 and updates_by_owner(load.optimizer):
        # replicas.py: each rank updates the rows it owns (1/W) and writes the others' new rows
        updated, received = touched / W, touched * (W - 1) / W
    moved = ids * width * 4 + updated * (
        2 * width * wb + 2 * state_bytes_per_row(load.optimizer, width) + 8 * width
    ) + received * width * wb
    stages["update"] = ids * cluster.update_per_id + moved / mem.update_bandwidth
    if kind == "dp" and W > 1:
        # replicas.py start_gradients: the ranks' unique rows and their gradients gathered (by owner:
        # each rank gets the rows it owns), sorted again and summed (decode + embedding_bag)
        gathered = load.unique(rows[0], rows[1], ids) * (1 if updates_by_owner(load.optimizer) else W)
        stages["update"] += gathered * cluster.update_per_id + gathered * width * 12 / cluster.stream_bandwidth
    if (
        kind != "dp"
    ):  # the shard's side of the exchanges: ids regrouped, pooled rows encoded, gradients decoded
        fe, be = (
            wire_element_bytes(workload.forward_precision),
            wire_element_bytes(workload.backward_precision),
        )
        elements = pooled / 4
        stages["input_dist"] = ids * 8 * 2 / cluster.stream_bandwidth
        stages["output_dist"] = elements * (4 + fe) / cluster.stream_bandwidth
        stages["output_dist_bwd"] = elements * (be + 4 + 8) / cluster.stream_bandwidth  # decode, concatenate
    return ShardWork(
        stages=stages,
        ids=ids,
        pooled_bytes=pooled,
        memory=tier_memory(
            load, tier, num_rows, width, fraction, workload.ssd_log, workload.cache_policy
        ),
        init_bytes=init_window_bytes(num_rows, t.dim, width, record_bytes(load, width) if tier == "ssd" else 0),
        tier_bytes=cache.tier_bytes if cache is not None else 0.0,
        hit_rate=cache.hit_rate if cache is not None else None,
    )


def init_window_bytes(rows: int, dim: int, width: int, record: int = 0) -> int:
    """fp32 bytes alive while `rows` rows (of a table of `dim` columns; `width` of them kept) are
    initialised: the rows made per table, their concatenation, one chunk of init.py. A table on SSD
    (`record`: bytes of its rows' records) is written to its file in windows of 64 MiB of records,
    each packed from the fp32 rows (embedding/cache/backing.py)."""
    window = min(rows, max(1, SSD_INIT_WINDOW_BYTES // record) if record else init_window_rows(width))
    return window * ((dim + width) * 4 + record) + min(rows, INIT_CHUNK_ROWS) * dim * 4


def owner_work(
    load: TableLoad, kind: str, num_shards: int, workload: Workload, cluster: Cluster
) -> dict[str, float]:
    """Elementwise work a table costs every rank for its own B samples, per stage: routing the ids
    (each row shard masks all the table's ids), decoding and assembling the pooled rows, scaling
    and encoding their gradients. A replicated table is only assembled and scaled."""
    b = workload.batch_size / cluster.world_size
    ids = b * load.ids_per_sample
    sequence = load.table.pooling == "none"  # one row per id instead of a pooled row per bag
    elements = (ids if sequence else b * len(load.table.features)) * load.table.dim
    fe, be = wire_element_bytes(workload.forward_precision), wire_element_bytes(workload.backward_precision)
    speed = cluster.stream_bandwidth
    out = dict.fromkeys(STAGES, 0.0)
    if kind == "dp":
        out["output_dist"] = elements * 8 / speed  # assemble (gather read + write)
        out["output_dist_bwd"] = elements * 8 / speed  # scale by 1/W
        return out
    masks = num_shards if kind in ROW_SPLIT else 0
    out["input_dist"] = (ids * 8 * 3 + masks * ids * 8 * 2) / speed
    # input_dist.py, per feature: the lengths cast for every destination, and on arrival a split
    # and a copy per piece; row splits also make the bag index, bucketize and count the ids per
    # shard and bag once (about 6 small ops) and, per shard, mask, compact, select and rebase the
    # ids (about 8)
    features = len(load.table.features)
    pieces = num_shards if kind in ("cw", "twcw", *ROW_SPLIT) else 1
    ops = features * pieces * 3
    if kind in ROW_SPLIT:
        ops += features * (6 + 8 * num_shards)
    out["input_dist"] += ops * cluster.op_overhead
    # every row shard sends a partial sum: decoded and added (forward), gathered and encoded (backward)
    # (a sequence table's id rows come from one row shard each)
    received = elements * (num_shards if kind in ROW_SPLIT and not sequence else 1)
    out["output_dist"] = received * ((fe + 4) + 8) / speed  # decode, then assemble
    out["output_dist_bwd"] = elements * 8 / speed + received * (8 + 4 + be) / speed  # scale by 1/W, gather, encode
    return out


def collective_calls(kinds: set[str], dp_groups: int, weighted: bool, owner_groups: int = 0) -> dict[str, int]:
    """Collective calls per stage and step (each costs the cluster's latency): the id exchange
    (its sizes on the host, lengths, ids, weights), the pooled exchange and its gradient (flat, plus two hops per
    hierarchical kind present), and per group of replicated tables one all-gather of its rows and
    gradients (replicas.py; a group small enough for a dense all-reduce also sends its counts),
    and for the `owner_groups` among them (rules with state) the counts and the updated rows."""
    two_hop = 2 * (("twrw" in kinds) + ("twcw" in kinds))
    return {
        "input_dist": 3 + int(weighted),
        "output_dist": 1 + two_hop,
        "output_dist_bwd": 1 + two_hop,
        "update": dp_groups + 2 * owner_groups,
    }


def latency_seconds(
    kinds: set[str], dp_groups: int, weighted: bool, cluster: Cluster, owner_groups: int = 0
) -> float:
    return sum(latency_phases(kinds, dp_groups, weighted, cluster, owner_groups))


def latency_phases(
    kinds: set[str], dp_groups: int, weighted: bool, cluster: Cluster, owner_groups: int = 0
) -> tuple[float, ...]:
    """latency_seconds per phase (PHASES)."""
    if cluster.world_size == 1:
        return (0.0,) * len(PHASES)
    calls = collective_calls(kinds, dp_groups, weighted, owner_groups)
    return by_phase({stage: cluster.latency * n for stage, n in calls.items()})


def by_phase(stages: dict[str, float]) -> tuple[float, ...]:
    """Seconds per synchronising phase (PHASES) of seconds per stage."""
    return tuple(sum(stages.get(s, 0.0) for s in phase) for phase in PHASES)


@dataclass
class RankEstimate:
    rank: int
    stages: dict[str, float]  # seconds per step
    memory: dict[str, int]  # bytes at peak, per tier
    weights: dict[str, int]  # weights + optimizer state, per tier (+ row caches in device memory)
    buffers: int  # step buffers (device tier)
    init: int  # initialisation window
    link_bytes: dict[str, float] = field(default_factory=dict)  # "intra" / "inter": sent + received
    tier_bytes: dict[str, float] = field(default_factory=dict)  # per backing tier: bytes row caches move

    @property
    def total(self) -> float:
        return sum(self.stages.values())


@dataclass
class PlanEstimate:
    ranks: list[RankEstimate]
    traffic: Traffic
    hit_rates: dict[str, float] = field(default_factory=dict)  # cached tables: estimated hit rate (shard mean)

    @property
    def max_cost(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def mean_cost(self) -> float:
        return sum(r.total for r in self.ranks) / len(self.ranks)

    @property
    def imbalance(self) -> float:
        return self.max_cost / self.mean_cost if self.mean_cost else 1.0

    @property
    def step_time(self) -> float:
        """Sum over the synchronising phases of the slowest rank in each."""
        return sum(max(by_phase(r.stages)[k] for r in self.ranks) for k in range(len(PHASES)))

    def stage_max(self) -> dict[str, float]:
        return {s: max(r.stages[s] for r in self.ranks) for s in STAGES}


def counts_replicas_ahead(plan: ShardingPlan, cluster: Cluster) -> bool:
    """Whether training counts the replicated tables' rows one batch ahead (replicas.py): on GPUs of
    the ranks' own (NCCL), with every replicated table's rows in a plain tensor (no row cache)."""
    return counts_ahead(cluster, [p.tier or "device" for p in plan.tables.values() if p.kind == "dp"])


def counts_ahead(cluster: Cluster, dp_tiers: list[str]) -> bool:
    """counts_replicas_ahead for replicated tables in plan tiers `dp_tiers`."""
    plain = all(STORAGE_TIERS[t] == "memory" for t in dp_tiers)
    return cluster.has_host_tier and not cluster.staged and plain


def estimate_plan(plan: ShardingPlan, workload: Workload, cluster: Cluster) -> PlanEstimate:
    """Seconds per stage and memory per tier of every rank under `plan`."""
    topo = cluster.topology()
    layout = ShardLayout(workload.table_configs, plan, topo)
    traffic = plan_traffic(plan, workload, topo, counted_ahead=counts_replicas_ahead(plan, cluster))
    W = cluster.world_size
    owner = dict.fromkeys(STAGES, 0.0)
    for load in workload.tables:
        p = plan.tables[load.name]
        for stage, seconds in owner_work(
            load, p.kind, len(plan.shards(load.table, topo)), workload, cluster
        ).items():
            owner[stage] += seconds
    links = {d: traffic.link_bytes(d) for d in traffic.matrices}
    dp_keys = {(t.dim, t.dtype, workload.by_name[t.name].optimizer) for t in layout.dp_tables}
    owner_groups = sum(updates_by_owner(optimizer) for _, _, optimizer in dp_keys)
    mean_row_split = any(u.kind in ROW_SPLIT and u.table.pooling == "mean" for us in layout.units for u in us)
    kinds = {p.kind for p in plan.tables.values()}
    calls = collective_calls(kinds, len(dp_keys), workload.weighted or mean_row_split, owner_groups)
    latency = cluster.latency if W > 1 else 0.0
    ranks = []
    hits: dict[str, list[float]] = {}
    for r in range(W):
        stages = dict.fromkeys(STAGES, 0.0)
        weights: dict[str, int] = {}
        tier_bytes: dict[str, float] = {}
        ids, pooled = 0.0, 0.0
        works = [(u.table, u.shard.rows, u.width, u.kind) for u in layout.units[r]]
        works += [(t, (0, t.rows), t.dim, "dp") for t in layout.dp_tables]
        # the fused engine's buffers: rows stacked per (width, dtype, rule, tier); [rows, dim, record]
        groups: dict[tuple, list[int]] = {}
        for table, rows, width, kind in works:
            load, tier = workload.by_name[table.name], plan.tables[table.name].tier or "device"
            key = (kind == "dp", width, table.dtype, load.optimizer, tier)
            groups.setdefault(key, [0, 0, record_bytes(load, width) if tier == "ssd" else 0])
            groups[key][0] += rows[1] - rows[0]
            groups[key][1] = max(groups[key][1], table.dim)
        init = max((init_window_bytes(n, dim, key[1], rec) for key, (n, dim, rec) in groups.items()), default=0)
        fractions = cache_mib_fractions(works, plan, workload)
        for table, rows, width, kind in works:
            tier = plan.tables[table.name].tier or "device"
            load = workload.by_name[table.name]
            w = shard_work(load, rows, width, kind, tier, workload, cluster, fractions.get(table.name))
            if w.hit_rate is not None:
                hits.setdefault(table.name, []).append(w.hit_rate)
            for stage, seconds in w.stages.items():
                stages[stage] += seconds
            ids += w.ids
            pooled += w.pooled_bytes
            for name, nbytes in w.memory.items():
                weights[name] = weights.get(name, 0) + nbytes
            if w.tier_bytes:
                backing = PLACEMENTS[tier].rows_in
                tier_bytes[backing] = tier_bytes.get(backing, 0.0) + w.tier_bytes

        def link(direction: str, r: int = r) -> float:
            intra, inter = links[direction][0][r], links[direction][1][r]
            return intra / cluster.intra_node_bandwidth + inter / cluster.inter_node_bandwidth

        for stage, seconds in owner.items():
            stages[stage] += seconds
        stages["input_dist"] += link("input_dist") + latency * calls["input_dist"]
        stages["output_dist"] += link("fwd") + latency * calls["output_dist"]
        stages["output_dist_bwd"] += link("bwd") + latency * calls["output_dist_bwd"]
        stages["update"] += link("dp") + latency * calls["update"]
        buffers = int(ids * BYTES_PER_ID + pooled * POOLED_COPIES + owner_buffer_bytes(workload, cluster))
        buffers += transport_bytes(traffic, r, cluster)
        memory = dict(weights)
        memory["device"] = memory.get("device", 0) + cluster.reserved
        if not cluster.has_host_tier:  # a CPU: the initialisation window is in the same memory
            memory["device"] += max(buffers, init)
        else:
            memory["device"] += buffers
        ranks.append(
            RankEstimate(
                rank=r,
                stages=stages,
                memory=memory,
                weights=weights,
                buffers=buffers,
                init=init,
                link_bytes={
                    "intra": float(sum(links[d][0][r] for d in links)),
                    "inter": float(sum(links[d][1][r] for d in links)),
                },
                tier_bytes=tier_bytes,
            )
        )
    return PlanEstimate(ranks, traffic, {name: sum(h) / len(h) for name, h in hits.items()})


def cache_mib_fractions(works: list[tuple], plan: ShardingPlan, workload: Workload) -> dict[str, float]:
    """With caches sized in MiB (workload.cache_mib), the share of its rows the cache of each cached
    shard of one rank holds (`works`: its shards as (table, rows, width, kind)), by table name, as
    training sizes them (embedding/cache/build.py _capacity): the rank's cached shards share
    cache_mib in proportion to their rows, each at most all its rows; {} without cache_mib."""
    if workload.cache_mib is None:
        return {}
    cached = [
        (table, rows[1] - rows[0], width)
        for table, rows, width, _ in works
        if PLACEMENTS[plan.tables[table.name].tier or "device"].cache_in is not None
    ]
    total = sum(n for _, n, _ in cached)
    out = {}
    for table, n, width in cached:
        record = record_bytes(workload.by_name[table.name], width)
        slots = rows_in_mib(workload.cache_mib, n / total, record)
        out[table.name] = min(1.0, max(1, slots) / n)
    return out


def largest_cache_shares(plan: ShardingPlan, workload: Workload, cluster: Cluster) -> dict[str, float]:
    """Per table with a cache under `plan`, the largest share of its shard's rows that a cache of it
    holds on any rank (cache_mib_fractions)."""
    layout = ShardLayout(workload.table_configs, plan, cluster.topology())
    out: dict[str, float] = {}
    for r in range(cluster.world_size):
        works = [(u.table, u.shard.rows, u.width, u.kind) for u in layout.units[r]]
        works += [(t, (0, t.rows), t.dim, "dp") for t in layout.dp_tables]
        for name, share in cache_mib_fractions(works, plan, workload).items():
            out[name] = max(out.get(name, 0.0), share)
    return out


def first_cache_shares(workload: Workload, world_size: int) -> dict[str, float]:
    """With caches sized in MiB, per table the share of its rows its caches hold when it is split
    evenly over `world_size` ranks and is the only table cached on them (cache_mib_fractions)."""
    assert workload.cache_mib is not None
    out = {}
    for load in workload.tables:
        rows = max(1, load.table.rows // world_size)
        slots = rows_in_mib(workload.cache_mib, 1.0, record_bytes(load, load.table.dim))
        out[load.name] = min(1.0, max(1, slots) / rows)
    return out


def transport_bytes(traffic: Traffic, rank: int, cluster: Cluster) -> int:
    """Pages of the shared-memory transport (distributed/shm.py) resident in `rank`: on a CPU machine
    with several ranks, each all-to-all writes the rank's sends into its own region and reads its part
    of every peer's region; regions alternate between two parities, and a page once touched stays
    resident. So twice the largest send plus twice the largest receive of one exchange, each within
    the regions' capacity. (GPU clusters exchange through the process group: nothing here.)"""
    if cluster.world_size == 1 or cluster.has_host_tier:
        return 0
    peers = cluster.world_size - 1
    send = max(traffic.sent(rank, d) for d in traffic.matrices)
    recv = max(traffic.received(rank, d) for d in traffic.matrices)
    return int(2 * min(send, SHM_CAPACITY) + 2 * min(recv, peers * SHM_CAPACITY))


def owner_buffer_bytes(workload: Workload, cluster: Cluster) -> float:
    """Buffers for the rank's own B samples: received pooled rows (wire and fp32), the assembled
    output, its gradient, the encoded gradient."""
    b = workload.batch_size / cluster.world_size
    width = sum(len(t.table.features) * t.table.dim for t in workload.tables)
    fe, be = wire_element_bytes(workload.forward_precision), wire_element_bytes(workload.backward_precision)
    return b * width * (fe + 4 + 4 + 4 + be)
