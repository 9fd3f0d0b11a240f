"""The sharding planner: a cost model of every sharding kind, a partitioner, and the CLI's reports.

    from neorec.planner import plan_sharding, build_workload, this_machine
    result = plan_sharding(build_workload(tables, "rowwise_adagrad", batch_size=2048), this_machine(2))
    result.plan.save("plan.json")       # what `neorec train` reads as distributed.plan

Files, in the order a plan is made: hardware.py (the cluster), workload.py (tables and access
statistics), exchanges.py (bytes of every exchange), cost.py (seconds and memory per rank),
options.py (ways to shard one table), bounds.py (a lower bound), partition.py (placing pieces),
planner.py (all of it), baselines.py, report.py (table and chart), calibrate.py, large_model.py
(the 12-trillion-parameter dry run). The planner knows nothing of runs: the default plan of
`neorec train` and `neorec plan`, built from a run's config, are neorec/train/run_plan.py's.
"""

from neorec.planner.cost import PlanEstimate, estimate_plan
from neorec.planner.hardware import Cluster, MemoryTier, gpu_node, paper_cluster, preset, this_machine
from neorec.planner.planner import PlanResult, plan_sharding
from neorec.planner.workload import TableLoad, Workload, build_workload, measure_access

__all__ = [
    "Cluster",
    "MemoryTier",
    "PlanEstimate",
    "PlanResult",
    "TableLoad",
    "Workload",
    "build_workload",
    "estimate_plan",
    "gpu_node",
    "measure_access",
    "paper_cluster",
    "plan_sharding",
    "preset",
    "this_machine",
]
