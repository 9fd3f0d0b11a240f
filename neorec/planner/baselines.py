"""Naive plans to hold the planner against, scored by the same cost model.

Both cut a table into the fewest row-wise shards that fit a rank (table-wise when it fits whole)
and put a table in device memory while the ranks it lands on have room, else in host memory, else
on SSD behind a row cache (the memory tiers in order; the cache's device memory is not counted here).
- round-robin: tables in model order, shards dealt to ranks in turn;
- size-greedy: largest tables first, each shard onto the rank with the most free memory
  (balances memory, not time).
They may run out of memory; `over_capacity` in the result says so rather than failing.
"""

from __future__ import annotations

import math
import time

import numpy as np

from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.planner.cost import estimate_plan
from neorec.planner.hardware import Cluster
from neorec.planner.planner import PlanResult, rank_capacity
from neorec.planner.workload import TableLoad, Workload


def _num_shards(load: TableLoad, room: float, world: int) -> int:
    size = load.table.rows * load.row_bytes()
    return int(min(world, load.table.rows, max(1, math.ceil(size / max(room * 0.9, 1.0)))))


def _tier_for(load: TableLoad, ranks: list[int], k: int, free: dict[str, np.ndarray]) -> str:
    per_shard = load.table.rows * load.row_bytes() / k
    for tier in free:  # fastest first
        if all(free[tier][r] >= per_shard for r in ranks):
            return tier
    return max(free, key=lambda t: min(free[t][r] for r in ranks))  # over capacity somewhere


def _build(workload: Workload, cluster: Cluster, name: str, order: list[TableLoad], pick) -> PlanResult:
    start = time.perf_counter()
    W = cluster.world_size
    free = {t: c.copy() for t, c in rank_capacity(cluster).items()}
    room = float(max(c[0] for c in free.values()))
    tables: dict[str, TablePlan] = {}
    for load in order:
        k = _num_shards(load, room, W)
        ranks = pick(k, free)
        tier = _tier_for(load, ranks, k, free)
        for r in ranks:
            free[tier][r] -= load.table.rows * load.row_bytes() / k
        kind = "tw" if k == 1 else "rw"
        tables[load.name] = TablePlan(kind, [int(r) for r in ranks], None, None if tier == "device" else tier)
    plan = ShardingPlan({t.name: tables[t.name] for t in workload.tables})
    estimate = estimate_plan(plan, workload, cluster)
    result = PlanResult(plan, estimate, None, name=name, seconds=time.perf_counter() - start)
    return result


def round_robin(workload: Workload, cluster: Cluster) -> PlanResult:
    W = cluster.world_size
    state = {"next": 0}

    def pick(k: int, free) -> list[int]:
        ranks = [(state["next"] + i) % W for i in range(k)]
        state["next"] = (state["next"] + k) % W
        return ranks

    return _build(workload, cluster, "round-robin", list(workload.tables), pick)


def size_greedy(workload: Workload, cluster: Cluster) -> PlanResult:
    def pick(k: int, free) -> list[int]:
        total = sum(free.values())
        return [int(r) for r in np.argsort(-total, kind="stable")[:k]]

    order = sorted(workload.tables, key=lambda t: -t.table.rows * t.row_bytes())
    return _build(workload, cluster, "size-greedy", order, pick)


def over_capacity(result: PlanResult, cluster: Cluster) -> list[str]:
    """'rank r: tier needs X bytes, has Y' for every rank and tier over its capacity."""
    out = []
    for r in result.estimate.ranks:
        for tier in cluster.tiers:
            used = r.memory.get(tier.name, 0)
            if used > tier.capacity:
                out.append(f"rank {r.rank}: {tier.name} needs {used:,.0f} bytes, has {tier.capacity:,.0f}")
    return out
