"""Memory left behind by building a model: the heap and peak RSS after the trainer is constructed.

Training keeps freed memory in the heap for reuse (neorec/utils/host.py), so whatever the heap grows
to while tables are initialised stays resident for the whole run. Each run builds the trainer in a
fresh process, in the environment the other benchmarks time in (MALLOC_ENV), and reports glibc's
heap size (`mallinfo2().arena`), the part of it in use, and the process's peak RSS. Runs repeat
because the heap's size can depend on how freed holes happen to be reused.

    python benchmarks/init_memory.py                                  # criteo_kaggle, AdaGrad
    python benchmarks/init_memory.py --config mlperf_dcnv2 --optimizer sgd --repeats 2

Linux with glibc only (mallinfo2).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results, markdown_table, peak_rss_mib  # noqa: E402
from neorec.utils.host import MALLOC_ENV  # noqa: E402

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def heap_mib() -> tuple[float, float]:
    """(heap size, bytes in use) of glibc's main heap and arenas, in MiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.arena / 2**20, info.uordblks / 2**20


def worker(args) -> dict:
    import torch

    from neorec.config.load import load_config
    from neorec.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    opt = f"{{name: {args.optimizer}, lr: 0.05}}"
    sets = [f"embedding.optimizer={opt}", "train.progress=false", *(args.set or [])]
    cfg = load_config(args.config, sets)
    before = peak_rss_mib()
    trainer = Trainer(cfg, Path(args.out))
    heap, used = heap_mib()
    weights = sum(w.tensor.numel() * w.tensor.element_size() for w in getattr(trainer.embeddings, "weights", [])
                  if hasattr(w, "tensor"))  # fmt: skip
    return {"heap_mib": heap, "heap_in_use_mib": used, "peak_rss_mib": peak_rss_mib(), "rss_before_mib": before,
            "table_mib": weights / 2**20}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--optimizer", default="adagrad", help="the tables' optimizer (sgd, adagrad, rowwise_adagrad, adam)")
    p.add_argument("--set", action="append", help="config override")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/neorec-init-memory", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    cmd = [sys.executable, __file__, "--worker", "--config", args.config, "--optimizer", args.optimizer,
           "--threads", str(args.threads)]  # fmt: skip
    for s in args.set or []:
        cmd += ["--set", s]
    rows = []
    for i in range(args.repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **MALLOC_ENV})
        if out.returncode != 0:
            sys.exit(f"run {i + 1} failed:\n{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([i + 1, round(r["table_mib"]), round(r["heap_mib"]), round(r["heap_in_use_mib"]),
                     round(r["peak_rss_mib"])])  # fmt: skip
    header = ["run", "table weights MiB", "heap MiB", "heap in use MiB", "peak RSS MiB"]
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (f"config {args.config}, embedding optimizer {args.optimizer}, {args.threads} threads; each run "
                 "builds the trainer in a fresh process with freed memory kept (MALLOC_ENV). Heap: glibc "
                 "mallinfo2 after the trainer is built; the tables themselves live in memory maps outside it.")  # fmt: skip
        append_results(f"Memory after building the model: {args.config}", table, notes)


if __name__ == "__main__":
    main()
