"""The sharding planner: choose every table's sharding and tier, then place its pieces.

Tiers (tiers.py): device memory, host memory, or a row cache in device memory over host memory
(cached) or over SSD files (ssd), whatever the cluster offers; a cached table costs its misses and
takes its cache in device memory and all its rows in the backing tier.

    options (options.py)   every (kind, number of shards, tier) of every table, with additive costs,
                           that keeps the table's constraint (constraints.py: allowed kinds, a pinned
                           kind, ranks or node, a tier, a cache size); a constraint that cannot hold
                           stops here, naming the table
    feasibility            a table none of whose options fits an empty rank stops here, named; so
                           does a rank that the pieces pinned to it overfill
    lower bound (bounds.py)
    choice                 per table, the cheapest option whose pieces are small enough to balance
                           ("grain": a fraction of the lower bound) and whose memory fits; device
                           memory goes to the tables that save the most seconds per byte
    placement (partition.py)  pinned pieces where they are pinned; then greedy, then moves and swaps
                           off the slowest ranks, for the other pieces
    refinement             for tables on the slowest ranks, other options are tried while the step
                           cost drops (within the time budget)
The step cost: the sum over the phases that end in an exchange (cost.PHASES) of the slowest rank
in each. Several grains are tried and the plan of the lowest step cost is kept. The result is a
ShardingPlan (the data a hand-written plan file holds) plus the cost model's estimate of it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from neorec.distributed.plan import KINDS, ShardingPlan, TablePlan
from neorec.distributed.replicas import updates_by_owner
from neorec.errors import ConfigError
from neorec.planner.bounds import LowerBound, lower_bound
from neorec.planner.choice import choose_options, total_size
from neorec.planner.constraints import (
    TableConstraint,
    check,
    check_pinned_memory,
    table_options_for,
    violations,
    with_cache_fractions,
)
from neorec.planner.cost import (
    PlanEstimate,
    estimate_plan,
    first_cache_shares,
    largest_cache_shares,
    latency_phases,
    latency_seconds,
    owner_buffer_bytes,
)
from neorec.planner.hardware import Cluster
from neorec.planner.options import Option, phase_means
from neorec.planner.partition import Assignment, NodePiece, Piece, PlacementError, partition
from neorec.planner.tiers import PLACEMENTS, placements
from neorec.planner.workload import Workload

GRAINS = (1.0, 0.5, 0.25)  # largest piece allowed, as a fraction of the lower bound
DEVICE_FILLS = (0.99, 0.97, 0.93)  # share of device memory the choice step may hand out, tried in turn
REPAIRS = 60  # pieces that fit nowhere: split their table finer (or move it to host) this often
CACHE_ROUNDS = 3  # plans made at most with caches sized in MiB (plan_sharding)


@dataclass
class PlanResult:
    plan: ShardingPlan
    estimate: PlanEstimate  # the cost model's view of the plan (exact exchange bytes)
    bound: LowerBound | None  # no plan of these options has a lower step cost (bounds.py)
    choices: dict[str, Option] = field(default_factory=dict)
    additive_step: float = 0.0  # the step cost (partition.py) in the additive model the partitioner balanced
    seconds: float = 0.0  # planning time
    name: str = "planner"


def rank_capacity(cluster: Cluster, init_allowance: float = 0.0) -> dict[str, np.ndarray]:
    """Bytes per rank and tier that shards may use: capacity less the reserve; on a CPU (one tier)
    also less the initialisation window, which comes on top of the weights while tables are built."""
    W = cluster.world_size
    out = {}
    for t in cluster.tiers:
        room = t.capacity - (cluster.reserved if t.name == "device" else 0)
        if t.name == "device" and not cluster.has_host_tier:
            room -= min(init_allowance, room / 2)
        out[t.name] = np.full(W, float(max(room, 0)))
    return out


def plan_sharding(
    workload: Workload,
    cluster: Cluster,
    kinds: tuple[str, ...] = KINDS,
    time_budget: float = 40.0,
    constraints: dict[str, TableConstraint] | None = None,
) -> PlanResult:
    """The planner's plan for `workload` on `cluster` (see the module docstring). `kinds`: the kinds
    a table without kinds or a kind of its own may take; `constraints`: per table (constraints.py),
    planned around: only options that satisfy them are weighed, and pinned pieces are placed first.
    With caches sized in MiB per rank (workload.cache_mib), which the options, one table at a time,
    cannot price, each option's cache holds the share of its table's rows that the previous plan gave
    the largest cache of that table (the first plan: cost.first_cache_shares); the estimates size the
    caches as training does. Planned up to CACHE_ROUNDS times, until a plan repeats; the fastest plan
    that fits is kept, without a lower bound where the cluster offers cached tiers."""
    start = time.perf_counter()
    constraints = constraints or {}
    if workload.cache_mib is None:
        result = _plan_once(workload, cluster, kinds, constraints, start, start + time_budget)
        check_capacity(result.estimate, cluster)
        return result
    results: list[PlanResult] = []  # (a constraint's cache_fraction with size_mib: refused by the config)
    shares = first = first_cache_shares(workload, cluster.world_size)
    while shares and len(results) < CACHE_ROUNDS:  # (no shares: nothing cached, the guess did not matter)
        guess = replace(workload, cache_fractions={**workload.cache_fractions, **first, **shares})
        try:
            result = _plan_once(guess, cluster, kinds, constraints, start, start + time_budget)
        except ConfigError:  # (PlacementError too)
            if not results:
                raise
            break  # a guess that fits nowhere: the plans so far stand
        if any(r.plan == result.plan for r in results):
            break
        results.append(result)
        shares = largest_cache_shares(result.plan, workload, cluster)
    fits = [r for r in results if capacity_error(r.estimate, cluster) is None]
    if not fits:
        raise PlacementError(
            f"{capacity_error(results[-1].estimate, cluster)}; every rank that holds a cached table gives "
            f"its row caches embedding.cache.size_mib ({workload.cache_mib:g} MiB): a smaller one takes less"
        )
    best = min(fits, key=lambda r: r.estimate.step_time)
    best.seconds = time.perf_counter() - start
    if any(PLACEMENTS[p].cache_in is not None for p in placements(cluster)):
        best.bound = None  # the options' caches were guesses: their bound bounds no plan of real caches
    return best


def _plan_once(
    workload: Workload, cluster: Cluster, kinds: tuple[str, ...], constraints: dict[str, TableConstraint],
    start: float, deadline: float,
) -> PlanResult:  # fmt: skip
    """One plan (plan_sharding), with its estimate, which may not fit the cluster's memory; refined
    until `deadline` (time.perf_counter) at most."""
    workload = with_cache_fractions(workload, constraints)
    feasible, capacity = feasible_options(workload, cluster, kinds, constraints)
    W = cluster.world_size
    owner_buffers = owner_buffer_bytes(workload, cluster)
    device_total = float(capacity["device"].sum()) - W * owner_buffers
    # every plan pays at least the latencies of the id, pooled-row and gradient exchanges
    bound = lower_bound(feasible, W, device_total, latency_seconds({"tw"}, 0, workload.weighted, cluster))

    def placer(choice: dict[str, Option], improve_seconds: float = 2.0) -> Assignment:
        improve_seconds = min(improve_seconds, max(0.25, deadline - time.perf_counter()))  # within the budget
        return place(choice, cluster, capacity, owner_buffers, improve_seconds, workload.weighted, constraints)

    # candidates: every kind, and without dp (its gradient exchange has a fixed cost per group that
    # the per-table choice does not see)
    without_dp = {n: [o for o in opts if o.kind != "dp"] for n, opts in feasible.items()}
    option_sets = [feasible] + ([without_dp] if all(without_dp.values()) and without_dp != feasible else [])
    best: tuple[float, dict[str, Option], Assignment] | None = None
    error: PlacementError | None = None
    tried: set[tuple[int, ...]] = set()  # choices placed already (the option sets often agree)
    for fill in DEVICE_FILLS:
        for options, size in _sizes(option_sets, bound.value, capacity, W, fill * device_total):
            if best is not None and time.perf_counter() >= deadline:
                break  # out of time: the plans so far stand
            choice = choose_options(options, size, capacity, W, fill * device_total)
            if (key := tuple(map(id, choice.values()))) in tried:
                continue
            tried.add(key)
            try:
                choice, assignment = place_with_repairs(choice, feasible, placer, W, size)
            except PlacementError as e:
                error = error or e
                continue
            if best is None or assignment.step_cost < best[0] - 1e-12:
                best = (assignment.step_cost, choice, assignment)
        if best is not None:
            break
    if best is None:
        assert error is not None
        raise error
    _, choice, assignment = best
    choice, assignment = refine(choice, assignment, feasible, cluster, placer, deadline)
    plan = to_plan(choice, assignment, cluster)
    broken = violations(plan, constraints, kinds)
    if broken:  # the options and the partitioner keep every constraint: this would be a planner bug
        raise AssertionError("the planner broke constraints: " + "; ".join(broken))
    estimate = estimate_plan(plan, workload, cluster)
    return PlanResult(plan, estimate, bound, choice, assignment.step_cost, time.perf_counter() - start)


def _sizes(option_sets, bound: float, capacity, W: int, device_room: float):
    """(options, size) to choose by, best first: for every set of options and grain, pieces against
    the mean load of each phase that the choice by their whole cost gives, then by their whole cost."""
    by_total = [(o, partial(total_size, most=g * bound)) for o, g in itertools.product(option_sets, GRAINS)]
    for (options, size), grain in zip(by_total, GRAINS * len(option_sets), strict=True):
        means = phase_means(choose_options(options, size, capacity, W, device_room), W)
        yield options, partial(Option.piece_size, allowance=tuple(grain * max(m, 0.1 * bound) for m in means))
    yield from by_total


def feasible_options(
    workload: Workload,
    cluster: Cluster,
    kinds: tuple[str, ...] = KINDS,
    constraints: dict[str, TableConstraint] | None = None,
) -> tuple[dict[str, list[Option]], dict[str, np.ndarray]]:
    """Every table's options that keep its constraint and fit an empty rank, and the bytes per rank
    and tier that shards may use. ConfigError naming the table when its constraint cannot hold or
    leaves it no option, when it fits nowhere, or when the pieces pinned to a rank overfill it; also
    when all ranks together are too small. (`neorec train` calls this before it starts processes.)"""
    constraints = constraints or {}
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise ConfigError(f"planner: unknown sharding kind(s) {bad}; kinds: {list(KINDS)}")
    W = cluster.world_size
    check(constraints, workload, kinds, W, cluster.num_nodes, cluster)
    all_options = {
        t.name: table_options_for(t, workload, cluster, kinds, constraints.get(t.name)) for t in workload.tables
    }
    init = max(
        (o.init_bytes for opts in all_options.values() for o in opts if o.kind in ("tw", "dp")), default=0
    )
    capacity = rank_capacity(cluster, init)
    feasible = {}
    for name, opts in all_options.items():
        feasible[name] = [o for o in opts if _fits_empty_rank(o, capacity)]
        if not feasible[name]:
            raise _fits_nowhere(workload, name, opts, capacity, constraints.get(name))
    _check_total_memory(feasible, capacity, W)
    check_pinned_memory(feasible, constraints, capacity, cluster, owner_buffer_bytes(workload, cluster))
    return feasible, capacity


def check_capacity(estimate: PlanEstimate, cluster: Cluster) -> None:
    """The cost model's memory of every rank and tier against the cluster's capacity."""
    error = capacity_error(estimate, cluster)
    if error is not None:
        raise error


def capacity_error(estimate: PlanEstimate, cluster: Cluster) -> PlacementError | None:
    """check_capacity's error, None when the plan fits."""
    for r in estimate.ranks:
        for tier in cluster.tiers:
            used = r.memory.get(tier.name, 0)
            if used > tier.capacity:
                return PlacementError(
                    f"infeasible: constraint '{tier.name} memory of rank {r.rank}' broke: the plan needs "
                    f"{used:,.0f} bytes, the rank has {tier.capacity:,.0f} (shortfall {used - tier.capacity:,.0f} bytes)"
                )
    return None


# ---- steps --------------------------------------------------------------------------------------------
def _fits_empty_rank(o: Option, capacity: dict[str, np.ndarray]) -> bool:
    return all(
        o.max_piece_memory(tier) <= capacity.get(tier, np.zeros(1))[0] for tier in o.memory_tiers | {"device"}
    )


def _fits_nowhere(
    workload: Workload, name: str, opts: list[Option], capacity, constraint: TableConstraint | None = None
) -> ConfigError:
    t = workload.by_name[name]
    lines, short_in = [], set()  # (plan tier, memory tier) where its smallest piece is short
    for tier in sorted({o.tier for o in opts}):

        def short(o: Option) -> float:  # the largest shortfall over the memory tiers it uses
            return max(o.max_piece_memory(m) - float(capacity.get(m, np.zeros(1))[0]) for m in o.memory_tiers)

        smallest = min((o for o in opts if o.tier == tier), key=short)
        m = max(smallest.memory_tiers, key=lambda m: smallest.max_piece_memory(m) - float(capacity[m][0]))
        need, room = smallest.max_piece_memory(m), float(capacity[m][0])
        where = tier if m == tier else f"{tier} ({m} memory)"
        short_in |= {(tier, x) for x in smallest.memory_tiers
                     if smallest.max_piece_memory(x) > capacity[x][0]}
        lines.append(
            f"  {where}: its smallest piece ({smallest.label}) needs {need:,.0f} bytes, a rank has {room:,.0f} "
            f"(shortfall {need - room:,.0f} bytes)"
        )
    size = t.table.rows * t.row_bytes()
    ways = (
        "1) more ranks or a cluster with more memory per rank; 2) fp16 weights (embedding.dtype); "
        "3) rowwise_adagrad or sgd instead of adagrad/adam; 4) fewer rows or a smaller dim for this table"
    )
    more = []
    if "ssd" not in {o.tier for o in opts}:
        more.append("an SSD tier for cached tables (embedding.cache.directory on this machine)")
    if {("cached", "device"), ("ssd", "device")} & short_in:  # the cache, in device memory
        if workload.cache_mib is not None:
            more.append(f"a smaller cache (embedding.cache.size_mib, now {workload.cache_mib:g})")
        else:
            more.append(f"a smaller cache (embedding.cache.fraction, now {workload.fraction(name):g})")
    if ("ssd", "ssd") in short_in:  # on disk: the table and its write log of ssd_log x its records
        more.append(f"a smaller write log (embedding.cache.ssd_log, now {workload.ssd_log:g}, that share "
                    "of the table's records on disk beside them; 0: none)")  # fmt: skip
    ways += "".join(f"; {i}) {way}" for i, way in enumerate(more, 5))
    under = f" under its constraints ({constraint.describe()})" if constraint is not None else ""
    if constraint is not None:
        ways += f"; {5 + len(more)}) looser constraints for it (distributed.sharding)"
    return PlacementError(
        f"table {name!r} ({t.table.rows:,} rows x {t.table.dim}, {size:,.0f} bytes with optimizer state) fits "
        f"nowhere{under}:\n" + "\n".join(lines) + "\nways out: " + ways
    )


def _check_total_memory(feasible: dict[str, list[Option]], capacity, W: int) -> None:
    """Even the most compact option of every table must fit in all ranks' memory together."""
    tiers = list(capacity)
    need = sum(min(sum(o.memory_total(t, W) for t in tiers) for o in opts) for opts in feasible.values())
    have = sum(float(c.sum()) for c in capacity.values())
    if need > have:
        raise PlacementError(
            f"infeasible: constraint 'memory of all ranks together' broke: the tables need {need:,.0f} bytes "
            f"(weights, optimizer state, buffers; every table in its most compact sharding) but the "
            f"{W} ranks have {have:,.0f} in tiers {tiers} (shortfall {need - have:,.0f} bytes)"
            + ("" if "ssd" in tiers else "; an SSD tier (embedding.cache.directory on this machine) would let "
               "tables live in files behind a row cache")
        )  # fmt: skip


def place(
    choice: dict[str, Option],
    cluster: Cluster,
    capacity: dict[str, np.ndarray],
    owner_buffers: float = 0.0,
    improve_seconds: float = 2.0,
    weighted: bool = False,
    constraints: dict[str, TableConstraint] | None = None,
) -> Assignment:
    """Partition the chosen options' pieces over the ranks; `owner_buffers`: device bytes every rank
    needs for its own samples' pooled rows; the pieces of tables pinned by `constraints` go where
    they are pinned."""
    W = cluster.world_size
    constraints = constraints or {}
    pieces, node_pieces = [], []
    base = np.tile(np.asarray(fixed_phases(choice, cluster, weighted)), (W, 1))  # [rank, phase]
    base_memory = {t: np.zeros(W) for t in capacity}
    base_memory["device"] += owner_buffers
    for name, o in choice.items():
        base += np.asarray(o.everyone_phases)
        for tier, nbytes in o.everyone_memory.items():
            base_memory[tier] += nbytes
        c = constraints.get(name)
        if o.placement == "rank":
            group = name if o.num_shards > 1 else None
            pins = list(c.ranks) if c is not None and c.ranks else [None] * o.num_shards
            for i, (cost, mem) in enumerate(zip(o.piece_costs, o.piece_memory, strict=True)):
                label = f"table {name!r} ({o.label}, {o.tier}) shard {i}"
                pieces.append(Piece(label, cost, mem, group, name, pins[i], o.piece_phases[i]))
        elif o.placement == "node":
            node = c.node if c is not None else None
            label = f"table {name!r} ({o.label}, {o.tier})"
            node_pieces.append(NodePiece(label, o.piece_costs, o.piece_memory, name, node, o.piece_phases))
    over = [t for t in capacity if (base_memory[t] > capacity[t]).any()]
    if over:
        raise PlacementError(f"replicated (dp) tables alone exceed the {over[0]} memory of a rank")
    return partition(
        pieces,
        W,
        capacity,
        base,
        base_memory,
        node_pieces,
        cluster.ranks_per_node,
        improve_seconds=improve_seconds,
    )


def place_with_repairs(
    choice: dict[str, Option], feasible: dict[str, list[Option]], placer, world_size: int,
    size: Callable[[Option], float],
) -> tuple[dict[str, Option], Assignment]:  # fmt: skip
    """place(), and when a table's piece fits on no rank, give that table its cheapest option (of
    `size` at most 1 if it has one) with pieces at most half as large in the same tier (failing that,
    one in a slower tier) and retry."""

    def piece_bytes(o: Option) -> float:
        return max(o.max_piece_memory(t) for t in o.memory_tiers | {"device"})

    choice = dict(choice)
    for _ in range(REPAIRS):
        try:
            return choice, placer(choice)
        except PlacementError as e:
            if e.table is None:
                raise
            current = choice[e.table]
            opts = feasible[e.table]
            smaller = [
                o for o in opts if o.tier == current.tier and piece_bytes(o) <= piece_bytes(current) / 2
            ]
            slower = [o for o in opts if o.tier not in (current.tier, "device")]
            if not (smaller or slower):
                raise
            others = smaller or slower
            small = [o for o in others if size(o) <= 1] or others
            choice[e.table] = min(small, key=lambda o: o.total(world_size))
    return choice, placer(choice)


def refine(
    choice: dict[str, Option],
    assignment: Assignment,
    feasible: dict[str, list[Option]],
    cluster: Cluster,
    placer,
    deadline: float,
) -> tuple[dict[str, Option], Assignment]:
    """Try other options for the tables on the slowest rank of each phase while that lowers the step
    cost."""
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        slowest = set(np.argmax(assignment.loads, axis=0).tolist())  # of each phase, most loaded first
        slowest = sorted(slowest, key=lambda r: -assignment.rank_loads[r])
        on_slowest = [n for r in slowest for n in _tables_on(r, choice, assignment, cluster)]
        replicated = [n for n, o in choice.items() if o.placement == "all"]  # they load every rank
        for name in dict.fromkeys(on_slowest + replicated):
            current = choice[name]
            for o in sorted(feasible[name], key=lambda o: o.total(cluster.world_size)):
                if o is current or (
                    o.max_piece >= current.max_piece and o.placement == current.placement == "rank"
                ):
                    continue
                if time.perf_counter() >= deadline:
                    return choice, assignment
                trial = dict(choice)
                trial[name] = o
                try:
                    a = placer(trial, improve_seconds=0.5)
                except PlacementError:
                    continue
                if a.step_cost < assignment.step_cost * (1 - 1e-9):
                    choice, assignment, improved = trial, a, True
                    break
            if improved:
                break
    return choice, assignment


def fixed_phases(choice: dict[str, Option], cluster: Cluster, weighted: bool) -> tuple[float, ...]:
    """Collective latencies every rank pays per phase, from the kinds in use (cost.collective_calls)."""
    dp_groups = {o.group_key for o in choice.values() if o.kind == "dp"}  # (dim, dtype, update rule)
    owner_groups = sum(updates_by_owner(key[2]) for key in dp_groups)
    weighted = weighted or any(o.mean_row_split for o in choice.values())
    return latency_phases({o.kind for o in choice.values()}, len(dp_groups), weighted, cluster, owner_groups)


def _tables_on(rank: int, choice: dict[str, Option], assignment: Assignment, cluster: Cluster) -> list[str]:
    """Tables with a piece on `rank`, most expensive piece first."""
    found: dict[str, float] = {}
    k, n = 0, 0
    L = cluster.ranks_per_node
    for name, o in choice.items():
        if o.placement == "rank":
            for cost in o.piece_costs:
                if assignment.ranks[k] == rank:
                    found[name] = max(found.get(name, 0.0), cost)
                k += 1
        elif o.placement == "node":
            if assignment.nodes[n] == rank // L:
                found[name] = o.piece_costs[rank % L]
            n += 1
    return sorted(found, key=lambda name: -found[name])


def to_plan(choice: dict[str, Option], assignment: Assignment, cluster: Cluster) -> ShardingPlan:
    tables: dict[str, TablePlan] = {}
    k, n = 0, 0
    for name, o in choice.items():
        tier = None if o.tier == "device" else o.tier
        if o.placement == "rank":
            ranks = assignment.ranks[k : k + o.num_shards]
            k += o.num_shards
            tables[name] = TablePlan(o.kind, [int(r) for r in ranks], None, tier)
        elif o.placement == "node":
            tables[name] = TablePlan(o.kind, [], int(assignment.nodes[n]), tier)
            n += 1
        else:
            tables[name] = TablePlan("dp", [], None, tier)
    return ShardingPlan(tables)
