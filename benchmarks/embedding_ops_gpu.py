"""Embedding operators on a GPU: neorec's Triton kernels, its torch path on CUDA, and nn.EmbeddingBag.

The GPU counterpart of embedding_ops.py (same cases, same Zipf ids, same byte counts), in one process:
- triton: the fused engine with kernels="triton" (one kernel for the lookup of all tables, one for
  the backward fused with the update: neorec/embedding/fused/triton_pool.py and
  triton_fused_update.py);
- torch ops: the same engine with kernels="torch" (sort, embedding_bag segment sums, the rule in
  torch ops, index_copy_ back);
- nn.EmbeddingBag: one nn.EmbeddingBag(sparse=True) per table + torch.optim SGD / Adagrad (not run
  for row-wise adagrad and adam).
FBGEMM_GPU is not on the lent GPU machines (and too large to carry there), so it is not compared.

Every case is also run at 8x the batch (GPU batches are larger than CPU ones). Each timed batch is
its own (no batch is reused, so L2 holds nothing from the previous one); times are medians of
host-clock intervals around synchronized regions, so they include kernel launches. Effective GB/s
counts the bytes an op must move at least (embedding_ops.py's doc), set against a device-to-device
copy of 1 GiB (read + write).

    python benchmarks/embedding_ops_gpu.py --results $OUT/gpu.jsonl   # the record, to append to records/ here
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from benchmarks.embedding_ops import CASES, STATE_FLOATS_PER_ROW, embedding_bag_baseline, make_batches  # noqa: E402
from neorec.embedding.fused import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402

LABELS = {
    "triton": "neorec fused TBE, Triton kernels",
    "torch_ops": "neorec fused TBE, torch ops",
    "embeddingbag": "nn.EmbeddingBag x T + torch.optim (sparse grads)",
}


def copy_bandwidth_gbs() -> float:
    src = torch.rand(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / sorted(times)[len(times) // 2] / 1e9


def timed(inputs, warmup: int, forward, backward) -> dict:
    fwd, bwd = [], []
    for i, x in enumerate(inputs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        backward(out)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    mid = len(fwd) // 2
    tot = sorted(f + b for f, b in zip(fwd, bwd, strict=True))
    return {"fwd_ms": 1e3 * sorted(fwd)[mid], "bwd_ms": 1e3 * sorted(bwd)[mid], "total_ms": 1e3 * tot[mid]}


def profile_kernels(inputs, forward, backward, title: str, steps: int = 3) -> None:
    """Print the kernels of `steps` forward + backward passes by device time, heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in inputs[-steps:]:
            backward(forward(x))
        torch.cuda.synchronize()
    print(f"-- kernels of {steps} forward + backward passes, {title}")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70))


def run(
    impl: str, opt: str, case: dict, batches: list, warmup: int, profile: bool = False
) -> tuple[dict, torch.Tensor]:
    """Times of one implementation, and its first forward output (to check the two neorec paths agree)."""
    t, rows, dim, b = case["tables"], case["rows"], case["dim"], case["batch"]
    lr = 0.01
    grad = torch.randn(b, t * dim, generator=torch.Generator().manual_seed(1)).cuda() * 1e-3
    torch.cuda.reset_peak_memory_stats()
    if impl in ("triton", "torch_ops"):
        tables = [TableConfig(name=f"t{i}", rows=rows, dim=dim, features=[f"f{i}"]) for i in range(t)]
        emb = FusedEmbeddingCollection(
            tables, EmbeddingOptimizerConfig(name=opt, lr=lr), device="cuda",
            kernels="triton" if impl == "triton" else "torch",
            row_init=lambda ti, lo, hi: torch.zeros(hi - lo, dim),  # filled on the GPU below (fast)
        )  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(0)
        emb.weights[0].tensor.uniform_(-0.01, 0.01, generator=gen)
        keys = [f"f{i}" for i in range(t)]
        inputs = [SparseBatch(keys, ids, torch.diff(offsets)) for ids, offsets in batches]

        def forward(sparse):
            return emb(sparse)

        def backward(out):
            out.backward(grad)

    else:
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs, forward, backward = embedding_bag_baseline(case, opt, lr, batches, grad, "cuda", gen)

    first = forward(inputs[0]).detach().clone()  # a first look-up, untimed (compiles the kernels)
    res = timed(inputs, warmup, forward, backward)
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile:
        profile_kernels(inputs, forward, backward, f"{impl}, {opt}, batch {case['batch']:,}")
    return res, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="onehot,multihot")
    p.add_argument("--scales", default="1,8", help="batch multipliers of each case")
    p.add_argument("--optimizers", default="sgd,adagrad,rowwise_adagrad,adam")
    p.add_argument("--impls", default="triton,torch_ops,embeddingbag")
    p.add_argument("--rows", type=int, help="rows per table instead of the case's 1M")
    p.add_argument("--batches", type=int, default=20, help="timed batches (median shown)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--results", default=None,
                   help="records file to append the run to (default: benchmarks/records/embedding_ops_gpu.jsonl)")  # fmt: skip
    p.add_argument(
        "--profile", action="store_true", help="also print each implementation's kernels by device time"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("embedding_ops_gpu.py needs a CUDA device")

    a = torch.randn(8192, 8192, device="cuda")  # bring the clocks up before anything is timed
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    del a
    copy_gbs = copy_bandwidth_gbs()
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s (1 GiB device copy, read + write)"
    )
    header = ["case", "batch", "optimizer", "implementation", "fwd ms", "bwd+update ms", "total ms",
              "vs nn.EmbeddingBag", "vs torch ops", "fwd GB/s", "bwd+upd GB/s", "bwd+upd / copy", "peak GiB"]  # fmt: skip
    table_rows = []
    for case_name in args.cases.split(","):
        for scale in [int(s) for s in args.scales.split(",")]:
            case = {**CASES[case_name], "rows": args.rows or CASES[case_name]["rows"]}
            case["batch"] *= scale
            data = make_batches(case, args.warmup + args.batches, args.zipf, seed=0)
            batches = [(ids.cuda(), offsets.cuda()) for ids, offsets in data["batches"]]
            t, d, b = case["tables"], case["dim"], case["batch"]
            num_ids = data["batches"][0][0].numel()
            unique = sorted(data["unique_rows"])[len(data["unique_rows"]) // 2]
            for opt in args.optimizers.split(","):
                fwd_bytes = 4 * d * (num_ids + b * t)
                bwd_bytes = 4 * b * t * d + 2 * 4 * unique * (d + STATE_FLOATS_PER_ROW[opt](d))
                results, firsts = {}, {}
                for impl in args.impls.split(","):
                    if impl == "embeddingbag" and opt not in ("sgd", "adagrad"):
                        continue  # torch.optim has no row-wise adagrad; the baseline steps SGD or Adagrad only
                    results[impl], firsts[impl] = run(impl, opt, case, batches, args.warmup, args.profile)
                    print(
                        case_name,
                        b,
                        opt,
                        impl,
                        {k: round(v, 3) for k, v in results[impl].items()},
                        flush=True,
                    )
                    gc.collect()
                    torch.cuda.empty_cache()
                if "triton" in firsts and "torch_ops" in firsts:  # same init, same batch: same lookup
                    a, ref = firsts["triton"], firsts["torch_ops"]
                    rel = float((a - ref).norm() / ref.norm())
                    print(f"  first lookup, triton vs torch ops: relative difference {rel:.2e}")
                    if rel > 1e-5:
                        raise SystemExit(f"the Triton lookup disagrees with the torch path ({rel:.2e})")
                for impl, r in results.items():
                    vs = [f"{results[k]['total_ms'] / r['total_ms']:.2f}x" if k in results else "-"
                          for k in ("embeddingbag", "torch_ops")]  # fmt: skip
                    table_rows.append([
                        case_name, f"{b:,}", opt, LABELS[impl], round(r["fwd_ms"], 2), round(r["bwd_ms"], 2),
                        round(r["total_ms"], 2), *vs, round(fwd_bytes / r["fwd_ms"] / 1e6, 0),
                        round(bwd_bytes / r["bwd_ms"] / 1e6, 0), f"{bwd_bytes / r['bwd_ms'] / 1e6 / copy_gbs:.0%}",
                        round(r["peak_gib"], 1),
                    ])  # fmt: skip
            del batches, data
    table = markdown_table(header, table_rows)
    print(table)
    notes = (
        f"26 tables x {args.rows or 1_000_000:,} rows (fp32), ids Zipf({args.zipf}) scattered over each table, lr 0.01; "
        f"{args.batches} timed batches after {args.warmup} warm-up, each batch its own; median per column. "
        f"Device copy bandwidth {copy_gbs:.0f} GB/s. GB/s = minimal bytes moved / time (forward: one row read per "
        "id + output; backward+update: output gradient + unique rows' weights and state read and written once)."
    )
    append_results(
        "Embedding operators on a GPU (benchmarks/embedding_ops_gpu.py)", table, notes, path=args.results
    )


if __name__ == "__main__":
    main()
