"""The sharding plan of a run from its config, and `neorec plan`.

A run's plan is its plan file (distributed.plan) or, by default, the planner's (neorec/planner) over the
run's own data (access measured on its first training batches), this machine and the exchange codecs
training uses, planned around the run's constraints (distributed.sharding and distributed.kinds, as
run_constraints.py reads them; over a plan file they are applied to it and checked). The planner knows
nothing of runs: this module builds what it needs from the config (neorec/train/build.py) and hands
it over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from neorec.config.schema import RunConfig
from neorec.data.source import DataSource
from neorec.distributed.plan import KINDS, ShardingPlan
from neorec.distributed.topology import Topology
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.planner.hardware import Cluster, preset
from neorec.planner.planner import PlanResult, plan_sharding
from neorec.planner.workload import Workload, build_workload, measure_access
from neorec.train.build import build_source, build_tables, run_wire_precisions
from neorec.train.run_constraints import apply_to_plan_file, cluster_for_run, run_constraints, run_kinds
from neorec.utils.files import write_text
from neorec.utils.json_values import strict_dumps
from neorec.utils.progress import phase

SAMPLE_BATCHES = 2  # training batches read to measure ids per sample and the id distribution
TRAIN_PLAN_SECONDS = 10.0  # the planner's time budget when `neorec train` plans

log = logging.getLogger(__name__)


def workload_for_run(
    cfg: RunConfig,
    tables: list[TableConfig],
    num_batches: int = SAMPLE_BATCHES,
    one_machine: bool = False,
    source: DataSource | None = None,
) -> Workload:
    """The config's tables with access statistics measured on its first training batches (of
    `source`, the config's whole data; built here when not given).
    one_machine: every rank on this machine, so "auto" wire precisions are those of shared memory."""
    batches = []
    if num_batches > 0:
        source = build_source(cfg) if source is None else source
        for batch in source.train_batches(cfg.data.batch_size, 0):
            batches.append(batch)
            if len(batches) == num_batches:
                break
    ids, samples, weighted = measure_access(tables, batches) if batches else ({}, {}, False)
    forward, backward = run_wire_precisions(cfg, one_machine)
    return build_workload(
        tables, cfg.embedding.optimizer, cfg.data.batch_size, ids, samples or None,
        forward, backward, weighted, cache_fraction(cfg), cfg.embedding.cache.ssd_log,
        cfg.embedding.cache.policy, cfg.embedding.cache.size_mib,
    )  # fmt: skip


def cache_fraction(cfg: RunConfig) -> float:
    """The share of rows the planner gives a cached table's cache: embedding.cache.fraction (default
    0.2). With embedding.cache.size_mib instead, the planner's first guess: the plans' caches are
    sized from size_mib as training sizes them (planner.plan_sharding)."""
    return cfg.embedding.cache.fraction or 0.2


def default_plan_for_run(cfg: RunConfig, tables: list[TableConfig], topo: Topology) -> ShardingPlan:
    """The default plan of a multi-process run: rank 0 plans for this machine (its calibration, an
    SSD tier under embedding.cache.directory when set, access measured on the first training
    batches) around the run's constraints (distributed.sharding, distributed.kinds), and every rank
    receives the same plan, so that machines with different calibrations cannot disagree. A planning
    error stops every rank."""
    import torch.distributed as dist

    message: dict = {}
    if topo.rank == 0:
        try:
            with phase("planning the sharding", cfg.train.progress, budget_seconds=TRAIN_PLAN_SECONDS):
                workload = workload_for_run(cfg, tables, one_machine=topo.num_nodes == 1)
                cluster = cluster_for_run(cfg, topo.world_size, topo.local_world_size)
                result = plan_sharding(
                    workload, cluster, run_kinds(cfg), TRAIN_PLAN_SECONDS, run_constraints(cfg)
                )
            device = [r.memory.get("device", 0) for r in result.estimate.ranks]
            message = {"plan": result.plan.to_dict(), "device_bytes": device}
            log.info(f"planned the sharding of {len(tables)} tables over {topo.world_size} processes in "
                     f"{result.seconds:.1f} s (`neorec plan` shows the plan)")  # fmt: skip
        except ConfigError as e:
            message = {"error": str(e)}
    if topo.world_size > 1 and dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if "error" in message:
        raise ConfigError(f"sharding planner: {message['error']}")
    plan = ShardingPlan.from_dict(message["plan"], "planner")
    plan.device_bytes = message["device_bytes"]
    return plan


def build_plan(cfg: RunConfig, tables: list[TableConfig], topo):
    """The sharding plan: the planner's (neorec/planner), planned around `distributed.sharding`, or
    the plan file under those constraints (run_constraints.py); validated against the tables and the
    topology (errors name the table)."""
    d = cfg.distributed
    names = {t.name for t in tables}
    unknown = sorted(set(d.sharding) - names)
    if unknown:
        raise ConfigError(f"distributed.sharding names {unknown}, which are not tables; tables: {sorted(names)}")
    if d.plan:
        plan = apply_to_plan_file(ShardingPlan.load(d.plan), cfg)
    else:
        plan = default_plan_for_run(cfg, tables, topo)
    plan.validate(tables, topo)
    return plan


@dataclass
class PlanOutputs:
    """What `neorec plan` produced: text to print, files written."""

    text: str
    files: list[Path] = field(default_factory=list)
    results: list[PlanResult] = field(default_factory=list)


def plan_command(
    cfg: RunConfig | None,
    cluster_name: str = "this",
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    model: str = "config",
    output_dir: str | Path | None = None,
    baselines: bool = False,
    batches: int = SAMPLE_BATCHES,
    kinds: tuple[str, ...] | None = None,
    time_budget: float = 25.0,
    cluster: Cluster | None = None,
) -> PlanOutputs:
    """Plan the tables of `cfg` (or the 12-trillion-parameter dry-run model) on a cluster preset,
    around the config's constraints (distributed.sharding); write plan.json, report.txt and plan.png
    to `output_dir`. `kinds`: the kinds a table without its own may take (default: the config's
    distributed.kinds; every kind for the dry run); none at all is an error."""
    from neorec.planner import report
    from neorec.planner.baselines import round_robin, size_greedy

    if kinds is not None and not kinds:
        raise ConfigError(
            f"neorec plan: no sharding kinds to plan with (--kinds, distributed.kinds); give one or more of "
            f"{','.join(KINDS)}"
        )
    if model == "12t":
        from neorec.planner.large_model import describe, twelve_trillion_workload

        workload = twelve_trillion_workload()
        constraints = {}
        about = f"model: 12-trillion-parameter dry run: {describe(workload)}"
        cluster = cluster or preset(
            cluster_name if cluster_name != "this" else "paper", world_size, ranks_per_node
        )
    elif model == "config":
        if cfg is None:
            raise ConfigError("neorec plan: a config is needed (--config) unless --model 12t")
        source = build_source(cfg, wait=False)
        tables = build_tables(cfg, source.info)
        cluster = cluster or preset(cluster_name, world_size, ranks_per_node, cfg.embedding.cache.directory)
        one_machine = cluster_name == "this" and cluster.num_nodes == 1
        workload = workload_for_run(cfg, tables, batches, one_machine=one_machine, source=source)
        constraints = run_constraints(cfg)
        kinds = run_kinds(cfg) if kinds is None else kinds
        about = (
            f"model: config {cfg.name!r}: {len(tables)} tables, "
            f"{sum(t.rows * t.dim for t in tables):,} parameters, global batch {cfg.data.batch_size:,}"
        )
    else:
        raise ConfigError(f"neorec plan: --model must be 'config' or '12t', got {model!r}")
    with phase("planning the sharding", budget_seconds=time_budget):
        result = plan_sharding(workload, cluster, KINDS if kinds is None else kinds, time_budget, constraints)
    results = [result]
    if baselines:
        results += [round_robin(workload, cluster), size_greedy(workload, cluster)]
    text = "\n\n".join(
        [
            about,
            report.summary(result, cluster),
            report.rank_table(result, cluster, workload.table_configs),
            report.comparison(results, cluster),
        ]
    )
    outputs = PlanOutputs(text, results=results)
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        result.plan.save(out / "plan.json")
        write_text(out / "report.txt", text + "\n", "plan report")
        summary = {
            r.name: {
                "slowest_rank_s": r.estimate.max_cost,
                "mean_s": r.estimate.mean_cost,
                "imbalance": r.estimate.imbalance,
                "step_s": r.estimate.step_time,
                "planning_s": r.seconds,
                "memory_per_rank": [x.memory for x in r.estimate.ranks],
            }
            for r in results
        }
        summary["lower_bound_s"] = result.bound.value if result.bound else None  # type: ignore[assignment]
        write_text(out / "summary.json", strict_dumps(summary, indent=1) + "\n", "plan summary")
        report.plot(results, cluster, out / "plan.png")
        outputs.files = [out / "plan.json", out / "report.txt", out / "summary.json", out / "plan.png"]
    return outputs
