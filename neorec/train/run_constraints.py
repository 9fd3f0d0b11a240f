"""A run's constraints on its sharding (`distributed.sharding`, `distributed.kinds`) as the planner
takes them (neorec/planner/constraints.py), the cluster a run plans for, and the checks that
`neorec train` makes of both before it starts any process.

Without a plan file the planner plans around the constraints. With one (distributed.plan) an
entry that pins a whole placement (a kind with its ranks or node, or dp) replaces the file's entry
for that table, a tier replaces its tier, and the file must keep every other constraint.
"""

from __future__ import annotations

from dataclasses import replace

from neorec.config.schema import RunConfig
from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.planner.constraints import TableConstraint, check, violations
from neorec.planner.hardware import Cluster, this_machine


def run_constraints(cfg: RunConfig) -> dict[str, TableConstraint]:
    """distributed.sharding, table by table, each named by its config key in errors."""
    return {
        name: TableConstraint(
            kinds=tuple(e.kinds) if e.kinds is not None else None,
            kind=e.kind,
            ranks=tuple(e.ranks),
            node=e.node,
            tier=e.tier,
            cache_fraction=e.cache_fraction,
            source=f"distributed.sharding.{name} (table {name!r})",
        )
        for name, e in cfg.distributed.sharding.items()
    }


def run_kinds(cfg: RunConfig) -> tuple[str, ...]:
    """The kinds the planner may give a table without kinds of its own (distributed.kinds)."""
    return tuple(cfg.distributed.kinds)


def cache_fractions(cfg: RunConfig) -> dict[str, float]:
    """Tables whose row cache holds a share of their rows of their own (distributed.sharding)."""
    return {n: e.cache_fraction for n, e in cfg.distributed.sharding.items() if e.cache_fraction is not None}


def cluster_for_run(cfg: RunConfig, world_size: int, ranks_per_node: int | None = None) -> Cluster:
    """This machine for `world_size` processes. On CUDA (train.device) its GPUs: each rank's share of
    the free GPU memory and of the host memory. On the CPU its RAM, with an SSD tier when the config
    names a folder for cached tables' files (embedding.cache.directory), whose filesystem gives its
    capacity."""
    if cfg.train.device == "cuda":
        from neorec.planner.hardware import this_gpu_machine

        return this_gpu_machine(world_size, ranks_per_node)
    return this_machine(world_size, ranks_per_node, ssd_directory=cfg.embedding.cache.directory)


def whole_pin(entry: TableConstraint) -> TablePlan | None:
    """The plan entry a constraint pins completely (kind and ranks or node, or dp), else None."""
    k = entry.kind
    if (k in ("tw", "rw", "cw") and entry.ranks) or (k in ("twrw", "twcw") and entry.node is not None):
        return TablePlan(k, list(entry.ranks), entry.node, entry.tier)
    if k == "dp":
        return TablePlan("dp", [], None, entry.tier)
    return None


def apply_to_plan_file(plan: ShardingPlan, cfg: RunConfig) -> ShardingPlan:
    """A plan file under the run's constraints (see the module docstring); ConfigError naming the
    table where the file breaks one."""
    constraints = run_constraints(cfg)
    for name, c in constraints.items():
        pinned = whole_pin(c)
        if pinned is not None:
            old = plan.tables.get(name)
            pinned.tier = c.tier or (old.tier if old is not None else None)
            plan.tables[name] = pinned
        elif c.tier is not None and name in plan.tables:
            plan.tables[name].tier = c.tier
    broken = violations(plan, constraints)
    if broken:
        raise ConfigError(f"the sharding plan {cfg.distributed.plan} breaks a constraint: {broken[0]}")
    return plan


def check_before_launch(cfg: RunConfig, tables: list[TableConfig], num_processes: int, precisions) -> None:
    """What the run's sharding would stop on, checked before its processes start: a plan file and
    the constraints on it against the tables and the ranks (plan.validate); without one, every
    constraint the planner would refuse, and on a CPU whether the pieces pinned to a rank fit its
    memory (on a GPU, rank 0 checks that when it plans: the launcher does not touch the GPUs).
    `precisions`: the run's (forward, backward) exchange codecs."""
    from neorec.distributed.topology import Topology

    topo = Topology(num_processes, 0, num_processes)
    if cfg.distributed.plan:
        plan = apply_to_plan_file(ShardingPlan.load(cfg.distributed.plan), cfg)
        plan.validate(tables, topo)
        return
    from neorec.planner.planner import feasible_options
    from neorec.planner.workload import build_workload

    workload = build_workload(
        tables, cfg.embedding.optimizer, cfg.data.batch_size, forward_precision=precisions[0],
        backward_precision=precisions[1], cache_fraction=cfg.embedding.cache.fraction or 0.2,
        ssd_log=cfg.embedding.cache.ssd_log, cache_policy=cfg.embedding.cache.policy,
        cache_mib=cfg.embedding.cache.size_mib,
    )  # fmt: skip
    if workload.cache_mib is not None:  # the caches the planner's first plan gives the tables
        from neorec.planner.cost import first_cache_shares

        workload = replace(workload, cache_fractions=first_cache_shares(workload, num_processes))
    constraints = run_constraints(cfg)
    if cfg.train.device == "cuda":
        check(constraints, workload, run_kinds(cfg), num_processes, 1)
        return
    from neorec.planner.constraints import with_cache_fractions

    cluster = cluster_for_run(cfg, num_processes)
    feasible_options(with_cache_fractions(workload, constraints), cluster, run_kinds(cfg), constraints)
