"""The planner's plan and step estimate for ranks sharing one GPU, against a measured step time.

Ranks that share a GPU exchange through pinned host memory and gloo between processes. This prints
the planner's plan and per-stage estimate for such a run, costing that exchange at the PCIe rate and
at this machine's gloo link (hardware.gpu_machine; the figures of `neorec plan --calibrate`, else
CALIBRATED_CPU's), next to a step time measured on the GPU (`--measured-ms`, from a run's
samples/s), and appends the table to RESULTS.md. Runs on any machine: the GPU is described, not used.

    python benchmarks/planner_shared_gpu.py --config criteo_kaggle --batch 16384 --ranks 2 --measured-ms 29.6
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from neorec.config.load import load_config  # noqa: E402
from neorec.planner import hardware  # noqa: E402
from neorec.planner.planner import plan_sharding  # noqa: E402
from neorec.train.build import build_source, build_tables  # noqa: E402
from neorec.train.run_plan import workload_for_run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--batch", type=int, default=16384, help="global batch size")
    p.add_argument("--ranks", type=int, default=2, help="ranks sharing the GPU")
    p.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="the GPU's name, as torch reports it")
    p.add_argument("--gpu-free-gib", type=float, default=78.0, help="its free memory")
    p.add_argument("--host-gib", type=float, default=128.0, help="the machine's RAM")
    p.add_argument("--measured-ms", type=float, help="the step time measured with these ranks on the GPU")
    p.add_argument("--seconds", type=float, default=20.0, help="the planner's time budget")
    p.add_argument("--no-append", action="store_true", help="print only")
    args = p.parse_args()

    cfg = load_config(
        args.config, ["train.device=cuda", f"data.batch_size={args.batch}", "train.progress=false"]
    )
    tables = build_tables(cfg, build_source(cfg).info)
    workload = workload_for_run(cfg, tables, one_machine=True)
    gib = 2**30
    gloo = hardware.gpu_machine(
        args.ranks, args.ranks, args.gpu, int(args.gpu_free_gib * gib), 1, int(args.host_gib * gib)
    )
    pcie = replace(
        gloo,
        intra_node_bandwidth=hardware._GPUS[hardware.gpu_kind(args.gpu)]["pcie"]
        * hardware.GPU_EFFICIENCY["pcie"],
        latency=30e-6,
    )
    rows = []
    for name, cluster in (("PCIe rate (before)", pcie), ("gloo link (hardware.gpu_machine)", gloo)):
        result = plan_sharding(workload, cluster, time_budget=args.seconds)
        kinds = Counter(t.kind for t in result.plan.tables.values())
        stages = result.estimate.stage_max()
        step_ms = 1e3 * result.estimate.step_time
        rows.append([
            name, f"{cluster.intra_node_bandwidth / 1e9:.1f}", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
            *(f"{1e3 * stages[s]:.2f}" for s in ("input_dist", "output_dist", "output_dist_bwd", "update")),
            f"{step_ms:.2f}", f"{step_ms / args.measured_ms:.2f}" if args.measured_ms else "-",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    header = ["exchange costed at", "GB/s", "plan", "input dist ms", "output dist ms", "its backward ms",
              "update ms", "estimated step ms", "estimate / measured"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"{args.config}, global batch {args.batch:,}, {args.ranks} ranks sharing one {args.gpu} "
        f"({args.gpu_free_gib:g} GiB free), planner budget {args.seconds:g} s. "
        + (f"Measured step: {args.measured_ms} ms." if args.measured_ms else "")
    )
    if not args.no_append:
        append_results("Planner estimate for ranks sharing one GPU", table, notes)


if __name__ == "__main__":
    main()
