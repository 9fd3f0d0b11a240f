"""The export formats side by side: .nrx (one neorec file), pt2 (torch.export program + safetensors
weights) and aoti (that program compiled by AOTInductor, one package), fp32 and row-wise int8, int4
and int2 tables: export time, bytes on disk, load time in a fresh process, scoring throughput on the
held-out set and the latency of one sample, and how far each format's scores lie from the .nrx
export's with the same tables. With `--auc`, instead: the
bytes per table row and the held-out AUC change against fp32 of every quantization, as `neorec
export` reports them, on fully trained runs of the shipped `default` and `movielens` configs.

    python benchmarks/export_formats.py [--rows 100000] [--repeats 3]
    python benchmarks/export_formats.py --auc [--configs default movielens]

Formats: trains a short run of the default config with `--rows` rows per table (26 tables, dim 16)
first. Each load is timed in its own process after `import torch, neorec` (so the figures are the
load itself), and the best of `--repeats` is kept; throughput and latency are the median of the
processes. `--formats` picks formats (default all three).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import append_results, markdown_table  # noqa: E402

CHILD = """
import itertools, json, statistics, sys, time
import torch
from neorec.serving import load_export
from neorec.serving.predict import data_batches
start = time.perf_counter()
exported = load_export(sys.argv[1])
loaded = time.perf_counter() - start
batches = list(data_batches(exported, 2048))
singles = list(itertools.islice(data_batches(exported, 1), 220))
probs = []
with torch.no_grad():
    start = time.perf_counter()
    for b in batches:
        probs.append(exported.probabilities(b))
    seconds = time.perf_counter() - start
    latency = []
    for b in singles:
        t = time.perf_counter()
        exported.probabilities(b)
        latency.append(time.perf_counter() - t)
n = sum(p.numel() for p in probs)
if len(sys.argv) > 2:
    torch.save(torch.cat(probs), sys.argv[2])
out = {"load": loaded, "samples_per_s": n / seconds, "latency_ms": [1000 * t for t in latency[20:]]}
print(json.dumps(out))
"""


def folder_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())


QUIET = ["train.progress=false", "logging.plot=false", "logging.tensorboard=false"]
KINDS = ("fp32", "int8", "int4", "int2")
FORMATS = ("nrx", "pt2", "aoti")


def export_path(root: Path, fmt: str, kind: str) -> Path:
    """nrx: a file; pt2: a folder; aoti: a .pt2 package."""
    return root / {"nrx": f"{kind}.nrx", "pt2": kind, "aoti": f"{kind}-aoti.pt2"}[fmt]


def formats(args: argparse.Namespace) -> None:
    from neorec.config.load import load_config
    from neorec.serving import export_model
    from neorec.train.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="export_formats_"))
    sets = [f"data.synthetic.max_rows={args.rows}", "data.synthetic.train_samples=20480",
            "data.synthetic.eval_samples=20480", *QUIET]  # fmt: skip
    Trainer(load_config("default", sets), root / "run").fit()
    rows = []
    for fmt in args.formats:
        for kind in KINDS:
            out = export_path(root, fmt, kind)
            quantize = None if kind == "fp32" else kind
            start = time.perf_counter()
            export_model(root / "run", out, quantize=quantize, measure=False, format=fmt)
            seconds = time.perf_counter() - start
            runs = []
            scores = root / f"{fmt}-{kind}.scores.pt"
            for i in range(args.repeats):
                cmd = [sys.executable, "-c", CHILD, str(out), *([str(scores)] if i == 0 else [])]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(p.stderr[-3000:])
                runs.append(json.loads(p.stdout.splitlines()[-1]))
            reference = root / f"nrx-{kind}.scores.pt"
            diff = "-"
            if fmt != "nrx" and reference.exists():  # the .nrx export with the same tables
                got, want = torch.load(scores), torch.load(reference)
                diff = f"{(got.double() - want.double()).abs().max().item():.1e}"
            rows.append([
                fmt, kind, round(seconds, 1), f"{folder_bytes(out) / 2**20:.1f}",
                round(min(r["load"] for r in runs), 2),
                f"{statistics.median(r['samples_per_s'] for r in runs):,.0f}",
                f"{min(min(r['latency_ms']) for r in runs):.2f} / "
                f"{statistics.median(statistics.median(r['latency_ms']) for r in runs):.2f}", diff,
            ])  # fmt: skip
    header = ["format", "tables", "export s", "MiB on disk", "load s (best)", "score samples/s (median)",
              "ms per 1-sample batch (min / median)", "max abs diff vs nrx"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    notes = (
        "Load: `load_export` in a fresh process after the imports (nrx: read, check, rebuild the model; "
        "pt2: `torch.export.load` and `.module()`; aoti: check the archive, `aoti_load_package`). Scoring: "
        "`exported.probabilities` over the held-out set (20,480 samples) in batches of 2048; latency: "
        "200 one-sample batches after 20 more, the fastest of all processes and the median process's median. Max abs diff: largest difference of a "
        "held-out probability from the .nrx export's with the same tables. Export s includes tracing "
        "(pt2, aoti) and the AOTInductor compile (aoti). Quantized tables: row-wise, fp32 scale and bias."
    )
    append_results(
        f"Export formats: {', '.join(args.formats)}, default config with {args.rows} rows per table",
        table,
        notes,
    )


def quantized_auc(args: argparse.Namespace) -> None:
    """Train each config, export it in fp32 and in every quantization with fp32 and fp16 scale and
    bias, and tabulate what `neorec export` reports: table bytes per row and held-out AUC."""
    from neorec.config.load import load_config
    from neorec.serving import export_model
    from neorec.train.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="export_auc_"))
    rows, runs = [], []
    for config in args.configs:
        run = root / config
        start = time.perf_counter()
        result = Trainer(load_config(config, QUIET), run).fit()
        fp32 = export_model(run, root / f"{config}.fp32.nrx")
        auc = fp32.eval["fp32"]["auc"]
        runs.append(
            f"{config}: {result.steps} steps in {time.perf_counter() - start:.0f} s, "
            f"{fp32.eval['fp32']['num_samples']:,} held-out samples"
        )
        rows.append([config, "fp32", f"{fp32.row_bytes['fp32']:.1f}", f"{auc:.6f}", "-", "-", "-", "-"])
        for kind in KINDS[1:]:
            row = [config, kind]
            for scale_dtype in ("fp32", "fp16"):
                r = export_model(
                    run, root / f"{config}.{kind}.{scale_dtype}.nrx", quantize=kind, scale_dtype=scale_dtype
                )
                assert r.eval["fp32"]["auc"] == auc and r.auc_change is not None
                row += [f"{r.row_bytes[kind]:.1f}", f"{r.eval[kind]['auc']:.6f}", f"{r.auc_change:+.1e}"]
            rows.append(row)
    header = ["config", "tables", "bytes per row", "held-out AUC", "change vs fp32",
              "bytes per row (fp16 s/b)", "held-out AUC (fp16 s/b)", "change vs fp32 (fp16 s/b)"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"Runs: {'; '.join(runs)}; `neorec train --config CONFIG` as shipped, then one export per table kind "
        "and scale dtype (`export_model`, as `neorec export RUN --quantize KIND --scale-dtype S`), whose "
        "held-out AUC of the fp32 and the quantized model give the AUC columns. The first three columns: "
        "fp32 scale and bias; the last three: fp16 (s/b). Bytes per row: all tables' bytes (codes, scale, "
        "bias) over their rows; a row of dim d takes 4d B in fp32 and d, d/2 or d/4 B of codes in int8, int4 "
        "or int2, plus 8 B of scale and bias (4 B in fp16)."
    )
    append_results(f"Quantized tables: bytes per row and held-out AUC change, {' and '.join(args.configs)}",
                   table, notes)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument(
        "--auc", action="store_true", help="bytes per row and AUC change of every quantization"
    )
    parser.add_argument(
        "--configs", nargs="+", default=["default", "movielens"], help="--auc: shipped configs"
    )
    args = parser.parse_args()
    if args.auc:
        quantized_auc(args)
    else:
        formats(args)


if __name__ == "__main__":
    main()
