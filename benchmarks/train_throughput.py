"""Training throughput and peak memory: neorec against a plain-PyTorch DLRM (facebookresearch/dlrm style).

Each (implementation, optimizer) pair runs in its own process so that peak RSS is its own. Batches
are generated before timing (data generation is not measured); the first `--warmup` steps are not
timed. Both sides train the same model shape on the same batches with the same optimizers.
Step times on this small VM vary by +-15% from one process to the next, so every pair runs
`--repeats` times, plain and neorec interleaved, and the table shows the median (and the range).

    python benchmarks/train_throughput.py                      # Kaggle-like config, SGD and AdaGrad
    python benchmarks/train_throughput.py --config mlperf_dcnv2 --optimizers adagrad
    python benchmarks/train_throughput.py --nproc 2     # neorec: 1 process x 2 threads vs 2 x 1, per stage
    python benchmarks/train_throughput.py --nproc 2 --pipeline-compare   # 2 processes, pipeline on/off

With --nproc N the comparison is neorec against itself: one process with all threads against N
processes (torchrun, gloo, sharded embeddings, default plan and comms precisions) with threads/N
each, on the same global batches, with the time of each stage per step (rank 0's view); 5 runs of
100 steps each by default, since a multi-process step runs at the pace of the slowest core.
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
    sets += [f"data.batch_size={args.batch_size}"]
    if load_config(args.config, sets + (args.set or [])).data.source == "synthetic":  # the batches made
        sets += [f"data.synthetic.train_samples={args.batch_size * (args.steps + args.warmup)}"]
    return load_config(args.config, sets + (args.set or []))


def worker(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = config_for(args, args.optimizer)
    source, batches = make_batches(cfg, args.steps + args.warmup)
    rss_data = peak_rss_mib()
    trainer = None
    if args.impl == "neorec":
        from neorec.train.trainer import Trainer

        trainer = Trainer(cfg, Path("/tmp/neorec-bench"))
        emb = trainer.embeddings
        if not hasattr(emb, "comms"):  # one process: the fused engine's own lookup/update timers
            emb.timings = trainer.timings

        def step(batch):
            trainer.train_step(batch)

        prepared = batches
    else:
        from benchmarks.baselines.plain_dlrm import PlainDCNv2, PlainDLRM, split_sparse

        torch.manual_seed(cfg.seed)
        info = source.info
        shape = (info.num_dense, [f.num_ids for f in info.features], cfg.embedding.dim, cfg.model.bottom_mlp,
                 cfg.model.top_mlp)  # fmt: skip
        if cfg.model.arch == "dcnv2":
            model = PlainDCNv2(*shape, cfg.model.cross_layers, cfg.model.low_rank)
        else:
            model = PlainDLRM(*shape)
        emb_params = [p for bag in model.emb for p in bag.parameters()]
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        e, d = cfg.embedding.optimizer, cfg.train.dense_optimizer
        if args.optimizer == "sgd":
            opts = [torch.optim.SGD(emb_params, lr=e.lr), torch.optim.SGD(dense_params, lr=d.lr)]
        else:
            opts = [torch.optim.Adagrad(emb_params, lr=e.lr), torch.optim.Adagrad(dense_params, lr=d.lr)]
        loss_fn = torch.nn.BCEWithLogitsLoss()

        bf16 = args.plain_precision == "bf16"

        def step(item):
            dense, idx, off, labels = item
            for o in opts:
                o.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(dense, idx, off)
            loss = loss_fn(logits.float(), labels)
            loss.backward()
            for o in opts:
                o.step()

        prepared = [(b.dense, *split_sparse(b.sparse), b.labels) for b in batches]
    for item in prepared[: args.warmup]:
        step(item)
    stages = {}
    if trainer is not None:
        stages = getattr(trainer.embeddings, "timings", None) or trainer.timings
        stages.clear()
        trainer.timings.clear()
        if trainer.comms is not None:
            import torch.distributed as dist

            dist.barrier()
            trainer.comms.stats.take()
    start = time.perf_counter()
    timed = prepared[args.warmup :]
    if trainer is not None and trainer.comms is not None and cfg.train.pipeline:
        # as Trainer.fit: the next batch's id exchange starts before this batch's step
        from neorec.train.pipeline import pipelined

        for _, local in pipelined(timed, trainer.local_batch, trainer.embeddings, 1):
            trainer.train_step(local, is_local=True)
    else:
        for item in timed:
            step(item)
    seconds = time.perf_counter() - start
    samples = sum(len(b) for b in batches[args.warmup :])
    out = {"samples_per_s": samples / seconds, "ms_per_step": 1000 * seconds / args.steps,
           "peak_rss_mib": peak_rss_mib(), "data_rss_mib": rss_data}  # fmt: skip
    if trainer is not None:
        merged = {**stages, **trainer.timings}
        out["stages_ms"] = {k: 1000 * v / args.steps for k, v in merged.items()}
        if trainer.comms is not None:
            out["bytes_per_step"] = {k: v / args.steps for k, v in trainer.comms.stats.take().items()}
    return out


def run_worker(args, impl: str, opt: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, opt, "--config", args.config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
           "--plain-precision", args.plain_precision]  # fmt: skip
    for s in args.set or []:
        cmd += ["--set", s]
    env = dict(os.environ)
    if args.malloc == "keep":
        env.update(MALLOC_ENV)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        sys.exit(f"{impl}/{opt} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


STAGES = ["input_dist", "lookup", "output_dist", "output_dist_bwd", "update", "allreduce"]


def run_neorec_procs(args, opt: str, nproc: int, threads: int) -> dict:
    """neorec on `nproc` processes (torchrun) with `threads` each; rank 0's result."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += [__file__, "--worker", "neorec", opt, "--config", args.config, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--threads", str(threads),
                "--result-file", str(result)]  # fmt: skip
        for s in args.set or []:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if args.malloc == "keep":
            env.update(MALLOC_ENV)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if out.returncode != 0 or not result.exists():
            sys.exit(f"neorec x{nproc} failed:\n{out.stderr[-4000:]}")
        return json.loads(result.read_text())


def scaling(args) -> None:
    """1 process x T threads against N processes x T/N threads, with the time per stage."""
    rows = []
    for opt in args.optimizers.split(","):
        runs: dict[int, list[dict]] = {1: [], args.nproc: []}
        for _ in range(args.repeats):
            runs[1].append(run_neorec_procs(args, opt, 1, args.threads))
            runs[args.nproc].append(run_neorec_procs(args, opt, args.nproc, max(1, args.threads // args.nproc)))
        base = median_run(runs[1])["samples_per_s"]
        for n, label in [(1, f"1 process x {args.threads} threads"),
                         (args.nproc, f"{args.nproc} processes x {max(1, args.threads // args.nproc)} threads")]:  # fmt: skip
            r = median_run(runs[n])
            st = r.get("stages_ms", {})
            dense = r["ms_per_step"] - sum(st.get(k, 0.0) for k in STAGES)
            sent = r.get("bytes_per_step", {})
            rows.append([label, opt, round(r["samples_per_s"]), f"{r['samples_per_s'] / base:.2f}x",
                         round(r["ms_per_step"], 1), *[round(st.get(k, 0.0), 1) for k in STAGES], round(dense, 1),
                         round(sum(sent.values()) / 2**20, 2), round(r["peak_rss_mib"])])  # fmt: skip
    header = ["setup", "optimizer", "samples/s (median)", "vs 1 process", "ms/step", "input dist", "lookup",
              "output dist", "output dist bwd", "fused update", "dense all-reduce", "dense fwd/bwd + rest",
              "MiB sent/step (rank 0)", "peak RSS MiB (rank 0)"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (f"config {args.config}, global batch {args.batch_size}, {args.steps} timed steps after {args.warmup} "
                 f"warm-up, median of {args.repeats} runs; stage columns are ms per step on rank 0 (input dist = "
                 "building and waiting for the id exchange; output dist = pooled exchange + assembly; dense "
                 "fwd/bwd + rest = step time minus the stages). Multi-process runs use torchrun + gloo, the "
                 "default transport (shared memory), pipeline, plan and comms precisions (auto: fp32 in "
                 "shared memory; fp32 dense).")  # fmt: skip
        append_results(f"Scaling: 1 vs {args.nproc} processes, {args.config}", table, notes)


def pipeline_compare(args) -> None:
    """N processes with and without the pipeline (train.pipeline), interleaved runs."""
    rows = []
    threads = max(1, args.threads // args.nproc)
    base_set = list(args.set or [])
    for opt in args.optimizers.split(","):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for on in (False, True):
                args.set = [*base_set, f"train.pipeline={str(on).lower()}"]
                runs[on].append(run_neorec_procs(args, opt, args.nproc, threads))
        args.set = base_set
        base = median_run(runs[False])["samples_per_s"]
        for on in (False, True):
            r = median_run(runs[on])
            st = r.get("stages_ms", {})
            rows.append([f"{args.nproc} processes x {threads} threads, " + ("pipelined" if on else "not pipelined"),
                         opt, round(r["samples_per_s"]), f"{r['samples_per_s'] / base:.2f}x", round(r["ms_per_step"], 1),
                         round(st.get("input_dist", 0.0), 2), round(r.get("data_wait_ms", 0.0), 2),
                         " / ".join(str(round(x["samples_per_s"])) for x in runs[on])])  # fmt: skip
    header = ["setup", "optimizer", "samples/s (median)", "vs not pipelined", "ms/step",
              "waited on id exchange ms/step", "waited on data ms/step", "samples/s of each run"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (f"config {args.config}, global batch {args.batch_size}, {args.steps} timed steps after {args.warmup} "
                 f"warm-up, {args.repeats} runs each, interleaved, median shown. Pipelined: batch i+1's id all-to-all "
                 "runs on a background thread while batch i computes (neorec/train/pipeline.py); 'waited on id "
                 "exchange' is the time the step blocked on it (rank 0). Batches are made before timing, so the "
                 "data wait is 0 here; `neorec train` reports it from the prefetch thread.")  # fmt: skip
        append_results(f"Pipelining: {args.nproc} processes, {args.config}", table, notes)


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="criteo_kaggle")
    p.add_argument("--optimizers", default="sgd,adagrad", help="comma-separated: sgd, adagrad")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40; 100 with --nproc)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=None,
                   help="processes per pair, interleaved; median shown (default 3; 5 with --nproc)")  # fmt: skip
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--set", action="append", help="config override passed to both sides")
    p.add_argument("--malloc", choices=["keep", "system"], default="keep",
                   help="keep: both sides keep freed memory for reuse (neorec/utils/host.py); system: glibc default")  # fmt: skip
    p.add_argument("--plain-precision", choices=["fp32", "bf16"], default="fp32",
                   help="the plain model's dense math: fp32 (as facebookresearch/dlrm) or bf16 autocast")  # fmt: skip
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--nproc", type=int, default=None, help="compare 1 process with N processes (see above)")
    p.add_argument("--pipeline-compare", action="store_true", help="with --nproc: pipelined vs not pipelined")
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "OPTIMIZER"), help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    # a 2-process step runs at the pace of the slower virtual CPU, which changes from run to run: the
    # scaling comparison takes more and longer runs (one 3 x 40 run's ratio moved by +-0.08 here)
    if args.steps is None:
        args.steps = 100 if args.nproc and not args.worker else 40
    if args.repeats is None:
        args.repeats = 5 if args.nproc and not args.worker else 3
    if args.worker:
        args.impl, args.optimizer = args.worker
        res = worker(args)
        if args.result_file is None:
            print(json.dumps(res))
        else:  # rank 0's is the result; the others' lie beside it (<file>.rank<r>), to compare ranks
            rank = int(os.environ.get("RANK", "0"))
            Path(args.result_file + (f".rank{rank}" if rank else "")).write_text(json.dumps(res))
        return
    if args.nproc and args.pipeline_compare:
        pipeline_compare(args)
        return
    if args.nproc:
        scaling(args)
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
            cfg = config_for(args, opt)
            plain = "plain PyTorch DCNv2" if cfg.model.arch == "dcnv2" else "plain PyTorch DLRM"
            plain += f" (EmbeddingBag, sparse grads, {args.plain_precision} dense)"
            label = plain if impl == "plain" else f"neorec (fused engine, {cfg.model.precision} dense)"
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
