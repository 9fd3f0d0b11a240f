"""Reduced-precision communication: bytes per step and held-out AUC for each codec setting.

Trains the default config (synthetic Criteo-like data) with `neorec train --nproc N` once per
setting, on the same data and for the same number of steps, with a plan that mixes table-wise,
row-wise, column-wise and data-parallel tables so every exchange is exercised, and reads rank 0's
bytes per step and the final AUC from summary.json.

    python benchmarks/comms_precision.py                 # 2 processes, the whole default run
    python benchmarks/comms_precision.py --steps 200 --no-record
    python benchmarks/comms_precision.py --codecs        # encode/decode time of each codec, one thread
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results, markdown_table  # noqa: E402

SETTINGS = [  # (forward, backward, dense)
    ("fp32", "fp32", "fp32"),
    ("fp16", "fp16", "fp16"),
    ("bf16", "bf16", "bf16"),
    ("fp16", "bf16", "fp32"),  # what `auto` gives where exchanges are not CPU tensors in shared memory
]
MIXED_PLAN = (
    "distributed.sharding={C3: {kind: rw, ranks: [0, 1]}, C4: {kind: rw, ranks: [1, 0]}, "
    "C7: {kind: cw, ranks: [0, 1]}, C10: {kind: cw, ranks: [1, 0]}, C9: {kind: dp}, C20: {kind: dp}}"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="default")
    p.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's whole run)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--codecs", action="store_true", help="time each codec's encode and decode alone")
    p.add_argument("--shape", type=int, nargs=2, default=[8192, 128], help="--codecs: a block's rows, width")
    p.add_argument("--note", default="", help="added to the record's notes")
    args = p.parse_args()
    if args.codecs:
        return codec_times(args)
    rows, aucs = [], {}
    for fwd, bwd, dense in SETTINGS:
        sets = [MIXED_PLAN, f"distributed.forward_precision={fwd}", f"distributed.backward_precision={bwd}",
                f"distributed.dense_precision={dense}", "train.progress=false", "logging.plot=false",
                "logging.tensorboard=false", *args.set]  # fmt: skip
        if args.steps:
            sets.append(f"train.max_steps={args.steps}")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "neorec", "train", "--nproc", str(args.nproc), "--config", args.config,
                   "--output-dir", tmp]  # fmt: skip
            for s in sets:
                cmd += ["--set", s]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{fwd}/{bwd}/{dense} failed:\n{out.stderr[-4000:]}")
            summary = json.loads((Path(tmp) / "summary.json").read_text())
        sent = summary["comm_bytes_per_step"]
        auc = summary["eval_auc"]
        aucs[(fwd, bwd, dense)] = auc
        rows.append([fwd, bwd, dense, summary["steps"], round(sent.get("input_dist", 0) / 1024, 1),
                     round(sent.get("fwd", 0) / 1024, 1), round(sent.get("bwd", 0) / 1024, 1),
                     round((sent.get("dense", 0) + sent.get("dp", 0)) / 1024, 1),
                     round(sum(sent.values()) / 1024, 1), f"{auc:.4f}",
                     f"{auc - aucs[SETTINGS[0]]:+.4f}", round(summary["samples_per_s"])])  # fmt: skip
        print(rows[-1], flush=True)
    header = ["forward", "backward", "dense", "steps", "ids KiB/step", "fwd KiB/step", "bwd KiB/step",
              "dense+dp KiB/step", "total KiB/step", "eval AUC", "AUC - fp32", "samples/s"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (f"{args.nproc} processes (torchrun, gloo), config {args.config}; bytes sent by rank 0 per step; "
                 f"plan: default table-wise plus {MIXED_PLAN.split('=', 1)[1]}. Same data and steps for each row.")  # fmt: skip
        append_results(f"Communication precision ({args.nproc} processes)", table, notes)


def codec_times(args) -> None:
    """Median of 5 rounds of 40 encodes (and decodes) of a [rows, width] fp32 block of N(0, 3) values,
    one thread, for each codec."""
    import time

    import torch

    from neorec.distributed.codecs import CODECS, Codec

    torch.set_num_threads(1)
    x = torch.randn(*args.shape, generator=torch.Generator().manual_seed(0)) * 3
    rows = []
    for name in CODECS:
        codec, times = Codec(name), {"encode": [], "decode": []}
        wire = codec.encode(x)
        for _ in range(5):
            calls = (("encode", lambda c=codec: c.encode(x)), ("decode", lambda c=codec, w=wire: c.decode(w)))
            for what, run in calls:
                start = time.perf_counter()
                for _ in range(40):
                    run()
                times[what].append((time.perf_counter() - start) / 40 * 1e3)
        rows.append([name, f"{sorted(times['encode'])[2]:.3f}", f"{sorted(times['decode'])[2]:.3f}",
                     wire.numel() * wire.element_size()])  # fmt: skip
    table = markdown_table(["codec", "encode ms", "decode ms", "wire bytes"], rows)
    print(table)
    if not args.no_record:
        rows_, width = args.shape
        notes = f"a [{rows_}, {width}] fp32 block, 1 thread, medians of 5 x 40 calls. {args.note}"
        append_results("Exchange codecs alone: encode and decode time", table, notes.strip())


if __name__ == "__main__":
    main()
