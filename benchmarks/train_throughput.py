"""Training throughput and peak memory: neorec against a plain-PyTorch DLRM (facebookresearch/dlrm style).

Each (implementation, optimizer) pair runs in its own process so that peak RSS is its own. Batches
are generated before timing (data generation is not measured); the first `--warmup` steps are not
timed. Both sides train the same model shape on the same batches with the same optimizers.
Step times on this small VM vary by +-15% from one process to the next, so every pair runs
`--repeats` times, plain and neorec interleaved, and the table shows the median (and the range).

    python benchmarks/train_throughput.py                      # Kaggle-like config, SGD and AdaGrad
    python benchmarks/train_throughput.py --config mlperf_dcnv2 --optimizers adagrad
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import append_results, markdown_table, peak_rss_mib  # noqa: E402
from neorec.utils.host import MALLOC_ENV  # noqa: E402


def make_batches(cfg, n: int):
    from neorec.train.build import build_source

    source = build_source(cfg)
    out = []
    for batch in source.train_batches(cfg.data.batch_size, 0):
        out.append(batch)
        if len(out) == n:
            break
    return source, out


def config_for(args, optimizer: str):
    from neorec.config.load import load_config

    emb_opt = "{name: sgd, lr: 0.05}" if optimizer == "sgd" else "{name: adagrad, lr: 0.05}"
    dense_opt = "{name: sgd, lr: 0.01}" if optimizer == "sgd" else "{name: adagrad, lr: 0.01}"
    sets = [f"embedding.optimizer={emb_opt}", f"train.dense_optimizer={dense_opt}", "train.progress=false"]
    sets += [f"data.synthetic.train_samples={args.batch_size * (args.steps + args.warmup)}"]
    sets += [f"data.batch_size={args.batch_size}"] + (args.set or [])
    return load_config(args.config, sets)


def worker(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = config_for(args, args.optimizer)
    source, batches = make_batches(cfg, args.steps + args.warmup)
    rss_data = peak_rss_mib()
    if args.impl == "neorec":
        from neorec.train.trainer import Trainer

        trainer = Trainer(cfg, Path("/tmp/neorec-bench"))

        def step(batch):
            trainer.train_step(batch)

        prepared = batches
    else:
        from benchmarks.baselines.plain_dlrm import PlainDLRM, split_sparse

        torch.manual_seed(cfg.seed)
        info = source.info
        model = PlainDLRM(info.num_dense, [f.num_ids for f in info.features], cfg.embedding.dim,
                          cfg.model.bottom_mlp, cfg.model.top_mlp)  # fmt: skip
        emb_params = [p for bag in model.emb for p in bag.parameters()]
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        e, d = cfg.embedding.optimizer, cfg.train.dense_optimizer
        if args.optimizer == "sgd":
            opts = [torch.optim.SGD(emb_params, lr=e.lr), torch.optim.SGD(dense_params, lr=d.lr)]
        else:
            opts = [torch.optim.Adagrad(emb_params, lr=e.lr), torch.optim.Adagrad(dense_params, lr=d.lr)]
        loss_fn = torch.nn.BCEWithLogitsLoss()

        def step(item):
            dense, idx, off, labels = item
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss = loss_fn(model(dense, idx, off), labels)
            loss.backward()
            for o in opts:
                o.step()

        prepared = [(b.dense, *split_sparse(b.sparse), b.labels) for b in batches]
    for item in prepared[: args.warmup]:
        step(item)
    start = time.perf_counter()
    for item in prepared[args.warmup :]:
        step(item)
    seconds = time.perf_counter() - start
    samples = sum(len(b) for b in batches[args.warmup :])
    return {"samples_per_s": samples / seconds, "ms_per_step": 1000 * seconds / args.steps,
            "peak_rss_mib": peak_rss_mib(), "data_rss_mib": rss_data}  # fmt: skip


def run_worker(args, impl: str, opt: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, opt, "--config", args.config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]  # fmt: skip
    for s in args.set or []:
        cmd += ["--set", s]
    env = dict(os.environ)
    if args.malloc == "keep":
        env.update(MALLOC_ENV)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        sys.exit(f"{impl}/{opt} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--optimizers", default="sgd,adagrad", help="comma-separated: sgd, adagrad")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="processes per pair, interleaved; median shown")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--set", action="append", help="config override passed to both sides")
    p.add_argument("--malloc", choices=["keep", "system"], default="keep",
                   help="keep: both sides keep freed memory for reuse (neorec/utils/host.py); system: glibc default")  # fmt: skip
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.impl, args.optimizer = args.worker
        print(json.dumps(worker(args)))
        return
    rows = []
    for opt in args.optimizers.split(","):
        runs: dict[str, list[dict]] = {"plain": [], "neorec": []}
        for _ in range(args.repeats):
            for impl in ("plain", "neorec"):
                runs[impl].append(run_worker(args, impl, opt))
        res = {impl: median_run(r) for impl, r in runs.items()}
        for impl in ("plain", "neorec"):
            r = res[impl]
            speedup = r["samples_per_s"] / res["plain"]["samples_per_s"]
            label = "plain PyTorch DLRM (EmbeddingBag, sparse grads)" if impl == "plain" else "neorec (fused engine)"
            spread = [round(x["samples_per_s"]) for x in runs[impl]]
            rows.append([label, opt, round(r["samples_per_s"]), f"{min(spread)}-{max(spread)}",
                         round(r["ms_per_step"], 1), round(r["peak_rss_mib"]), f"{speedup:.2f}x"])  # fmt: skip
    header = ["implementation", "optimizer", "samples/s (median)", "range", "ms/step", "peak RSS MiB", "vs plain"]
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (f"config {args.config}, batch {args.batch_size}, {args.steps} timed steps after {args.warmup} warm-up, "
                 f"{args.threads} threads, allocator {args.malloc} on both sides; median of {args.repeats} interleaved processes per row "
                 f"(peak RSS includes the pre-generated batches).")  # fmt: skip
        append_results(f"Training throughput: {args.config}", table, notes)


if __name__ == "__main__":
    main()
