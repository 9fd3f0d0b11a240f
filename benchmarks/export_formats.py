"""The two export formats side by side: .nrx (one neorec file) and pt2 (torch.export program +
safetensors weights), fp32 and int8 tables: export time, bytes on disk, load time in a fresh process,
and scoring throughput on the held-out set.

    python benchmarks/export_formats.py [--rows 100000] [--repeats 3]

Trains a short run of the default config with `--rows` rows per table (26 tables, dim 16) first.
Each load is timed in its own process after `import torch, neorec` (so the figures are the load
itself), and the best of `--repeats` is kept.
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

sys.path.insert(0, str(Path(__file__).parent))
from common import append_results, markdown_table  # noqa: E402

CHILD = """
import json, sys, time
import torch
from neorec.serving import load_export
from neorec.serving.predict import data_batches
start = time.perf_counter()
exported = load_export(sys.argv[1])
loaded = time.perf_counter() - start
batches = list(data_batches(exported, 2048))
start = time.perf_counter()
n = 0
with torch.no_grad():
    for b in batches:
        n += exported.probabilities(b).numel()
print(json.dumps({"load": loaded, "samples_per_s": n / (time.perf_counter() - start)}))
"""


def folder_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from neorec.config.load import load_config
    from neorec.serving import export_model
    from neorec.train.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="export_formats_"))
    sets = [f"data.synthetic.max_rows={args.rows}", "data.synthetic.train_samples=20480",
            "data.synthetic.eval_samples=20480", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false"]  # fmt: skip
    Trainer(load_config("default", sets), root / "run").fit()
    rows = []
    for fmt in ("nrx", "pt2"):
        for int8 in (False, True):
            out = root / (
                f"{'int8' if int8 else 'fp32'}.nrx" if fmt == "nrx" else f"{'int8' if int8 else 'fp32'}"
            )
            start = time.perf_counter()
            export_model(root / "run", out, int8=int8, measure=False, format=fmt)
            seconds = time.perf_counter() - start
            runs = []
            for _ in range(args.repeats):
                p = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(p.stderr[-3000:])
                runs.append(json.loads(p.stdout.splitlines()[-1]))
            rows.append([
                fmt, "int8" if int8 else "fp32", round(seconds, 2), f"{folder_bytes(out) / 2**20:.1f}",
                round(min(r["load"] for r in runs), 3),
                f"{statistics.median(r['samples_per_s'] for r in runs):,.0f}",
            ])  # fmt: skip
    header = ["format", "tables", "export s", "MiB on disk", "load s (best)", "score samples/s (median)"]
    table = markdown_table(header, rows)
    print(table)
    notes = (
        "Load: `load_export` in a fresh process after the imports (nrx: read, check, rebuild the model; "
        "pt2: `torch.export.load` and `.module()`). Scoring: `exported.probabilities` over the held-out "
        "set in batches of 2048."
    )
    append_results(
        f"Export formats: nrx vs pt2, default config with {args.rows} rows per table", table, notes
    )


if __name__ == "__main__":
    main()
