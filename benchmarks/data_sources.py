"""Training from files against training on drawn data: criteo_kaggle from preprocessed .npy shards (with
the reader's default gathering threads, and with one) and from their Parquet copy, against the same
config with its synthetic samples (on a GPU: drawn and kept in GPU memory, so the data costs the step
nothing).

    python benchmarks/data_sources.py --device cuda --batch-size 16384 --steps 240 --workers 8
    python benchmarks/data_sources.py --samples 200000 --batch-size 2048 --steps 60   # small, CPU

The data is written once, by `neorec data preprocess --synthetic --config criteo_kaggle
--parquet-output` (the config's own samples: the same tables and id distributions), into --dir and
kept there for later runs. Each source then trains `--steps` steps with `neorec train`, `--repeats`
rounds with the sources in turn. The table gives, per source, the median over rounds of the whole
run's samples/s (the trainer's summary: its first steps, when kernels compile and the reader starts,
included) and of the steady rate (the median of the logged windows after the first), the steady
rate against the drawn data's, and the data wait per step (time the training loop waited for a batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results, markdown_table  # noqa: E402

# the .npy reader twice: data.preprocessed.threads auto (one gathering thread per 4 cores, up to 4) and 1
SOURCES = ("synthetic (drawn)", "preprocessed .npy", "preprocessed .npy, 1 thread", "parquet")


def prepare(args) -> float:
    """Preprocess the config's synthetic samples into `--dir`, with a Parquet copy; seconds taken (0
    when the folder holds them already)."""
    data = args.dir / "data"
    if (data / "manifest.json").exists():
        return 0.0
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "neorec", "data", "preprocess", "--synthetic", "--config", args.config,
           "--out", str(data), "--workers", str(args.workers), "--parquet-output", "--no-progress",
           "--set", f"data.synthetic.train_samples={args.samples}",
           "--set", f"data.synthetic.eval_samples={max(args.samples // 20, 1)}"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def parquet_config(args) -> Path:
    """A config over the Parquet copy: the preprocessed ids read as rows (hashing none), each table
    as many rows as the manifest gives its feature."""
    import yaml

    from neorec.data.manifest import load_manifest
    from neorec.utils.files import write_text

    data = args.dir / "data"
    manifest = load_manifest(data)  # checked, as the reader checks it
    section = {
        "paths": [str(data / "parquet" / "train")],
        "eval_paths": [str(data / "parquet" / "eval")],
        "label": "label",
        "dense": [f"d{i}" for i in range(manifest["num_dense"])],
        "hashing": "none",
        "features": [{"name": f["name"], "rows": f["num_ids"]} for f in manifest["features"]],
    }
    path = args.dir / "parquet.yaml"
    write_text(path, yaml.safe_dump({"base": args.config, "data": {"source": "parquet", "parquet": section}}), "config")
    return path


def train(args, source: str, run: Path) -> dict[str, float]:
    """Train `--steps` steps from `source`; the run's figures."""
    config = str(parquet_config(args)) if source == "parquet" else args.config
    sets = [f"train.device={args.device}", f"data.batch_size={args.batch_size}", f"train.max_steps={args.steps}",
            f"train.log_every={args.log_every}", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false", "train.eval_every=null", *(args.set or [])]  # fmt: skip
    if source.startswith("preprocessed .npy"):
        sets += ["data.source=preprocessed", f"data.preprocessed.path={args.dir / 'data'}"]
        sets += ["data.preprocessed.threads=1"] if source.endswith("1 thread") else []
    elif source.startswith("synthetic"):
        sets += [f"data.synthetic.train_samples={args.samples}"]
    cmd = [sys.executable, "-m", "neorec", "train", "--config", config, "--output-dir", str(run)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{source}: neorec train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [x for x in lines if x.get("split") == "train"][1:]  # the first holds the start-up
    if not windows:
        raise SystemExit(f"{run}: fewer than two logged windows; give more --steps or a smaller --log-every")
    return {
        "whole": summary["samples_per_s"],
        "steady": statistics.median(x["samples_per_s"] for x in windows),
        "wait": statistics.median(x["data_wait_ms"] for x in windows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--steps", type=int, default=240, help="training steps per run")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--samples", type=int, default=4_000_000, help="training samples written")
    p.add_argument("--workers", type=int, default=4, help="preprocessing processes")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the sources, in turn")
    p.add_argument("--dir", type=Path, default=Path("/tmp/neorec-sources"))
    p.add_argument("--set", action="append", help="config override for every run (key=value)")
    p.add_argument("--results", type=Path, help="records file to append to (default: benchmarks/records/)")
    p.add_argument("--no-append", action="store_true", help="print only")
    args = p.parse_args()
    if args.steps * args.batch_size > args.samples:
        p.error(f"--steps {args.steps} of --batch-size {args.batch_size} need more than --samples {args.samples}")
    prepared = prepare(args)
    print(f"data in {args.dir / 'data'}" + (f" (preprocessed in {prepared:.1f} s)" if prepared else ""), flush=True)
    got: dict[str, list[dict[str, float]]] = {s: [] for s in SOURCES}
    for r in range(args.repeats):
        for source in SOURCES:
            got[source].append(train(args, source, args.dir / "runs" / f"{SOURCES.index(source)}-{r}"))
            print(source, got[source][-1], flush=True)
    base = statistics.median(x["steady"] for x in got[SOURCES[0]])
    rows = []
    for source, runs in got.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("whole", "steady", "wait")}
        rows.append([source, f"{med['whole']:,.0f}", f"{med['steady']:,.0f}", f"{med['steady'] / base:.2f}",
                     f"{med['wait']:.2f}", f"{min(x['steady'] for x in runs):,.0f}-{max(x['steady'] for x in runs):,.0f}"])  # fmt: skip
    header = ["source", "samples/s, whole run", "samples/s, steady", "x drawn (steady)", "data wait ms/step (steady)",
              "steady, range over rounds"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    if not args.no_append:
        notes = (f"{args.config}, batch {args.batch_size}, {args.steps} steps per run, {args.repeats} rounds with the "
                 f"sources in turn, {args.device}; {args.samples:,} training samples written by `neorec data preprocess "
                 f"--synthetic --parquet-output --workers {args.workers}`" + (f" in {prepared:.1f} s" if prepared else "")
                 + ". Steady: median of the logged windows of "
                 f"{args.log_every} steps after the first.")  # fmt: skip
        append_results("Training from files against drawn data", table, notes, path=args.results)


if __name__ == "__main__":
    main()
