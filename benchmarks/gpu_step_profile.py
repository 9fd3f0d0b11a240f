"""Where a GPU training step goes: the data feed alone, the whole step, the host syncs, a profile.

Builds the trainer of a config on the GPU and runs its own loop (data feed, pipeline, train_step):

    python benchmarks/gpu_step_profile.py --config criteo_kaggle --set data.batch_size=16384

Prints, in order:
  1. the data feed alone (batches per second with no training), so that a slow feed shows apart;
  2. steady-state step time and samples/s over --steps steps (synchronised before and after), and
     the training thread's CPU time a step against it (the rest: waiting for the GIL, data or GPU);
  3. every place a step synchronises with the host (torch.cuda.set_sync_debug_mode("warn") over
     three steps), as neorec file:line with a count, the innermost neorec frame of each warning;
  4. a torch.profiler table of the top kernels by GPU time and of the top operators by CPU time,
     and the GPU's busy fraction (kernel time over wall time).
Needs a CUDA device (--device cpu runs the same loop on the CPU, without the sync check).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def batches_of(trainer):
    """The trainer's own path from data to device (Trainer.training_batches)."""
    return trainer.training_batches(0)[1]


def sync_sites(trainer, it, steps: int) -> Counter:
    """neorec file:line of each host synchronisation in `steps` steps."""
    sites: Counter = Counter()
    root = str(Path(__file__).resolve().parent.parent)

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(root) and "benchmarks" not in f.filename]
        where = f"{Path(frames[-1].filename).relative_to(root)}:{frames[-1].lineno} {frames[-1].name}" if frames else filename
        sites[where] += 1

    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer.train_step(next(it), is_local=True)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--set", action="append", default=[], help="config override, as for neorec train")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=22, help="rows of each profiler table")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu)")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    from neorec.config.load import load_config
    from neorec.train.trainer import Trainer

    need = args.warmup + args.steps + args.profile_steps + 3
    sets = [f"train.device={args.device}", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
            "train.eval_every=null", *args.set]  # fmt: skip
    cfg = load_config(args.config, sets)
    if cfg.data.source == "synthetic":  # enough samples for every step the profile takes
        samples = max(cfg.data.synthetic.train_samples, cfg.data.batch_size * need * 2)
        cfg = load_config(args.config, [*sets, f"data.synthetic.train_samples={samples}"])
    out = Path(tempfile.mkdtemp())
    trainer = Trainer(cfg, out)
    bs = cfg.data.batch_size
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"config {args.config} batch {bs} {name} torch {torch.__version__}", flush=True)

    # 1. the feed alone
    it = batches_of(trainer)
    for _ in range(3):
        next(it)
    sync()
    t0 = time.perf_counter()
    n = 0
    for _ in range(args.steps):
        next(it)
        n += 1
    sync()
    feed_s = (time.perf_counter() - t0) / n
    print(f"feed alone: {1000 * feed_s:.2f} ms/batch, {bs / feed_s:,.0f} samples/s", flush=True)

    # 2. whole steps
    it = batches_of(trainer)
    for _ in range(args.warmup):
        trainer.train_step(next(it), is_local=True)
    sync()
    t0, own0, all0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(args.steps):
        trainer.train_step(next(it), is_local=True)
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    own_s, all_s = (time.thread_time() - own0) / args.steps, (time.process_time() - all0) / args.steps
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB" if cuda else ""
    print(f"step: {1000 * step_s:.2f} ms, {bs / step_s:,.0f} samples/s{peak}", flush=True)
    # the training thread's CPU time against the step's: the rest it spent not running (waiting for
    # the GIL while the reader's threads held it, for a batch, or for the GPU)
    print(f"training thread: {1000 * own_s:.2f} ms of CPU a step, {1000 * (step_s - own_s):.2f} ms not "
          f"running; the process's other threads: {1000 * (all_s - own_s):.2f} ms of CPU a step")  # fmt: skip

    # 3. host syncs
    if cuda:
        sites = sync_sites(trainer, it, 3)
        print(f"host syncs in 3 steps: {sum(sites.values())}")
        for where, count in sites.most_common():
            print(f"  {count:4d}  {where}")

    # 4. profile
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            trainer.train_step(next(it), is_local=True)
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    busy_us = sum(getattr(e, dev_key) for e in events)
    print(f"profiled {args.profile_steps} steps: wall {1000 * wall / args.profile_steps:.2f} ms/step, "
          f"GPU busy {busy_us / 1e3 / args.profile_steps:.2f} ms/step ({busy_us / 1e6 / wall:.0%})")  # fmt: skip
    if cuda:
        print(events.table(sort_by=dev_key, row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
