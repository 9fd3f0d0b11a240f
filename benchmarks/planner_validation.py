"""Does the planner's cost model predict real runs? Predicted vs measured embedding time and memory.

For several plans of the Kaggle-like model on N processes (torchrun, gloo, this machine), each plan
is run for real and compared with neorec/planner's estimate:
- embedding time per step: measured = step time - the same step with the embedding collection
  replaced by a constant tensor (dense forward/backward, dense all-reduce and optimizer only), so it
  includes every stage of the embeddings and the waits one rank's extra work causes the others;
  predicted = PlanEstimate.step_time (slowest rank per synchronising phase);
- ranking: the plans ordered by predicted and by measured time;
- memory: per rank, the resident-memory growth from just before the model is built to the peak
  after training steps (VmHWM - VmRSS before), against the planner's estimate for that rank
  (weights + optimizer state + max(step buffers, initialisation window)).

    python benchmarks/planner_validation.py                 # calibrate if needed, 5 plans, record
    python benchmarks/planner_validation.py --plans planner,rw --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import append_results, markdown_table  # noqa: E402
from neorec.utils.host import MALLOC_ENV  # noqa: E402

PLANS = ("planner", "lpt_tw", "rw", "cw", "one_rank")
DESCRIPTIONS = {
    "planner": "the planner's plan (default of `neorec train --nproc N`)",
    "lpt_tw": "table-wise, LPT on ids x dim",
    "rw": "every table row-wise over all ranks",
    "cw": "every table column-wise over all ranks",
    "one_rank": "every table table-wise on rank 0",
}


def config(args):
    from neorec.config.load import load_config

    sets = [f"data.batch_size={args.batch_size}", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false"]  # fmt: skip
    if load_config(args.config, sets + (args.set or [])).data.source == "synthetic":  # samples for every step
        sets.append(f"data.synthetic.train_samples={args.batch_size * (args.steps + args.warmup)}")
    return load_config(args.config, sets + (args.set or []))


def workload_and_cluster(args):
    from neorec.planner import build_workload, measure_access, this_machine
    from neorec.train.build import build_source, build_tables

    cfg = config(args)
    source = build_source(cfg)
    tables = build_tables(cfg, source.info)
    batches = []
    for batch in source.train_batches(cfg.data.batch_size, 0):
        batches.append(batch)
        if len(batches) == 2:
            break
    ids, samples, weighted = measure_access(tables, batches)
    from neorec.train.build import run_wire_precisions

    forward, backward = run_wire_precisions(cfg, one_machine=True)
    workload = build_workload(tables, cfg.embedding.optimizer, cfg.data.batch_size, ids, samples,
                              forward, backward, weighted)  # fmt: skip
    return workload, this_machine(args.nproc)


def make_plan(name: str, workload, cluster):
    from neorec.distributed.plan import ShardingPlan, TablePlan, default_plan
    from neorec.planner import plan_sharding

    W = cluster.world_size
    tables = workload.table_configs
    if name == "planner":
        return plan_sharding(workload, cluster).plan
    if name == "lpt_tw":
        return default_plan(tables, cluster.topology())
    if name == "rw":
        return ShardingPlan(
            {t.name: TablePlan("rw", list(range(W))) if t.rows >= W else TablePlan("tw", [0]) for t in tables}
        )
    if name == "cw":
        return ShardingPlan({t.name: TablePlan("cw", list(range(W))) for t in tables})
    if name == "one_rank":
        return ShardingPlan({t.name: TablePlan("tw", [0]) for t in tables})
    raise SystemExit(f"unknown plan {name!r}; plans: {PLANS}")


# ---- the worker (one per rank, under torchrun) ---------------------------------------------------------
def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def worker(args) -> None:
    import torch.distributed as dist

    from neorec.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = config(args)
    from neorec.train.build import build_source

    source = build_source(cfg)
    batches = []
    for batch in source.train_batches(cfg.data.batch_size, 0):
        batches.append(batch)
        if len(batches) == args.steps + args.warmup:
            break
    del source
    rss_before = rss_mib("VmRSS")
    trainer = Trainer(cfg, Path(tempfile.gettempdir()) / "neorec-planner-validation")
    for batch in batches[: args.warmup]:
        trainer.train_step(batch)

    emb = trainer.embeddings
    b = cfg.data.batch_size // trainer.topo.world_size
    constant = torch.zeros(b, emb.output_dim, requires_grad=True)

    def timed(items, into: list[float]) -> None:
        dist.barrier()
        for batch in items:
            start = time.perf_counter()
            trainer.train_step(batch)
            into.append(time.perf_counter() - start)

    # full steps and steps without embedding work (a constant in place of the pooled embeddings),
    # in alternating blocks so that a neighbour's load on the machine hits both alike
    full, dense = [], []
    emb.timings.clear()
    for _ in range(args.rounds):
        timed(batches[args.warmup :], full)
        emb.forward = lambda sparse: constant  # type: ignore[method-assign]
        timed(batches[args.warmup :], dense)
        del emb.forward  # back to the class's forward
    stages = {k: v / len(full) for k, v in emb.timings.items()}
    peak = rss_mib("VmHWM")
    step, dense_step = float(np.median(full)), float(np.median(dense))
    out = {"rank": trainer.topo.rank, "step_s": step, "dense_s": dense_step, "stages_s": stages,
           "rss_before_mib": rss_before, "peak_mib": peak}  # fmt: skip
    Path(f"{args.result_file}.{trainer.topo.rank}").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_plan(args, plan_path: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", "--config", args.config, "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size), "--threads", str(args.threads), "--result-file", str(result),
               "--set", f"distributed.plan={plan_path}"]  # fmt: skip
        for s in args.set or []:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **MALLOC_ENV}
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        files = [Path(f"{result}.{r}") for r in range(args.nproc)]
        if out.returncode != 0 or not all(f.exists() for f in files):
            sys.exit(f"run of {plan_path} failed:\n{out.stderr[-4000:]}")
        return [json.loads(f.read_text()) for f in files]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, from {PLANS}")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument(
        "--steps", type=int, default=10, help="timed steps per round (each: full, then dense only)"
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="runs per plan, interleaved; median shown")
    p.add_argument("--calibrate", action="store_true", help="run `neorec plan --calibrate` first")
    p.add_argument("--set", action="append", help="config override for every run")
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.calibrate:
        from neorec.planner.calibrate import calibrate

        print("calibration:", calibrate(args.nproc, args.threads))
    from neorec.planner import estimate_plan

    workload, cluster = workload_and_cluster(args)
    names = args.plans.split(",")
    predicted, measured = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name in names:
            plan = make_plan(name, workload, cluster)
            paths[name] = Path(tmp) / f"{name}.json"
            plan.save(paths[name])
            predicted[name] = estimate_plan(plan, workload, cluster)
        runs: dict[str, list[list[dict]]] = {n: [] for n in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run_plan(args, paths[name]))
                r = runs[name][-1]
                print(
                    f"{name}: step {r[0]['step_s'] * 1e3:.1f} ms, dense {r[0]['dense_s'] * 1e3:.1f} ms",
                    flush=True,
                )
                for rank, x in enumerate(r):
                    est = predicted[name].ranks[rank].stages
                    print(
                        f"  rank {rank} stage ms measured / predicted: "
                        + ", ".join(
                            f"{k} {x['stages_s'].get(k, 0) * 1e3:.1f}/{est[k] * 1e3:.1f}" for k in est
                        ),
                        flush=True,
                    )
    for name in names:
        ordered = sorted(runs[name], key=lambda rs: rs[0]["step_s"] - rs[0]["dense_s"])
        measured[name] = ordered[len(ordered) // 2]
    rows = []
    pred_order = sorted(names, key=lambda n: predicted[n].step_time)
    meas_order = sorted(names, key=lambda n: measured[n][0]["step_s"] - measured[n][0]["dense_s"])
    for name in names:
        est, ranks = predicted[name], measured[name]
        emb_ms = (ranks[0]["step_s"] - ranks[0]["dense_s"]) * 1e3
        pred_ms = est.step_time * 1e3
        mem_pred = [r.memory["device"] / 2**20 for r in est.ranks]
        mem_meas = [x["peak_mib"] - x["rss_before_mib"] for x in ranks]
        mem_err = max(abs(p - m) / m for p, m in zip(mem_pred, mem_meas, strict=True))
        rows.append([name, round(pred_ms, 1), round(emb_ms, 1), f"{(pred_ms - emb_ms) / emb_ms:+.0%}",
                     pred_order.index(name) + 1, meas_order.index(name) + 1, round(ranks[0]["step_s"] * 1e3, 1),
                     round(ranks[0]["dense_s"] * 1e3, 1), " / ".join(f"{m:.0f}" for m in mem_pred),
                     " / ".join(f"{m:.0f}" for m in mem_meas), f"{mem_err:.0%}"])  # fmt: skip
    header = ["plan", "predicted emb ms/step", "measured emb ms/step", "error", "predicted rank", "measured rank",
              "step ms", "dense-only ms", "predicted MiB per rank", "measured MiB per rank", "worst mem error"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    same = pred_order == meas_order
    print(f"predicted order {pred_order}; measured order {meas_order}; same: {same}")
    if not args.no_record:
        notes = (f"config {args.config}, global batch {args.batch_size}, {args.nproc} processes x {args.threads} thread(s) "
                 f"(torchrun, gloo), {args.rounds} rounds of {args.steps} steps with and {args.steps} without embeddings "
                 f"after {args.warmup} warm-up (median step of each), median of {args.repeats} run(s) per plan. Plans: " + "; ".join(f"{n} = {DESCRIPTIONS[n]}" for n in names) + ". Measured "
                 "embedding time = step time - step time with the embeddings replaced by a constant (rank 0). "
                 "Measured memory = peak RSS - RSS before the model was built, per rank. Predicted order "
                 f"{pred_order}, measured order {meas_order} ({'same' if same else 'different'}). Calibration: "
                 f"{json.dumps({k: float(f'{v:.3g}') for k, v in _calibration().items()})}.")  # fmt: skip
        append_results("Planner validation: predicted vs measured", table, notes)


def _calibration() -> dict[str, float]:
    from neorec.planner.hardware import load_calibration

    return load_calibration()


if __name__ == "__main__":
    main()
