"""Embedding operators: forward, backward+update and total time per batch, as effective GB/s.

Implementations, each in its own process (so peak RSS is its own and tables are freed in between):
- neorec: the fused table-batched engine (one lookup for all tables, optimizer fused into backward);
- torch: one nn.EmbeddingBag(sparse=True) per table + torch.optim SGD / Adagrad (the dlrm way);
- fbgemm: FBGEMM's CPU TBE, SplitTableBatchedEmbeddingBagsCodegen with the matching exact optimizer,
  run with `--fbgemm-python` (default this python; skipped when it cannot import fbgemm);
- floor: not an optimizer, a lower bound for any implementation built from torch operators: only
  the passes none can skip, each one torch call over neorec's huge-page fp32 buffer. Forward: one
  embedding_bag. Backward: the per-row gradient sums (one embedding_bag over ids grouped by row)
  and one index_add_ of those sums into the unique rows. The grouping of ids by row is computed
  before the clock starts, and no rule's arithmetic or optimizer state is touched, so every real
  optimizer on torch operators costs more. Its total against FBGEMM's says how far ahead of FBGEMM
  torch operators can get at all.

Cases (ids Zipf-skewed, popular ids scattered over the table, as in the synthetic data):
- onehot:   26 tables x 1M rows x dim 64, one id per bag, batch 8192;
- multihot: 26 tables x 1M rows x dim 128, MLPerf DLRM-DCNv2 bag sizes (fixed, 214 ids/sample), batch 2048.
Optimizers: sgd, adagrad and rowwise_adagrad (torch.optim has no row-wise AdaGrad: no torch row there).
Every worker gets the same allocator settings (`--malloc`): by default glibc keeps freed memory
for reuse, which saves page faults on large temporaries for all implementations alike.
A case whose tables and optimizer state do not fit in 80% of the available memory is run with fewer
rows per table; the table says how many.

Effective bandwidth counts the bytes an op must move at least: forward = rows read (one per id) +
pooled output written; backward+update = output gradient read + each unique row's weights and
optimizer state read and written once. It is set against the machine's copy bandwidth (a 1 GiB
tensor copy: bytes read + written per second).

    python benchmarks/embedding_ops.py
    python benchmarks/embedding_ops.py --cases onehot --optimizers sgd --impls neorec,torch --batches 5
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

import torch

ROOT = Path(__file__).resolve().parent.parent
# the same settings as neorec.utils.host.MALLOC_ENV (not imported: workers may run in another venv)
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
MLPERF_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
CASES = {
    "onehot": {"tables": 26, "rows": 1_000_000, "dim": 64, "batch": 8192, "bags": [1] * 26},
    "multihot": {"tables": 26, "rows": 1_000_000, "dim": 128, "batch": 2048, "bags": MLPERF_MULTI_HOT},
}
STATE_FLOATS_PER_ROW = {
    "sgd": lambda d: 0, "adagrad": lambda d: d, "rowwise_adagrad": lambda d: 1, "adam": lambda d: 2 * d
}  # fmt: skip
LABELS = {
    "neorec": "neorec fused TBE",
    "torch": "nn.EmbeddingBag x T + torch.optim (sparse grads)",
    "fbgemm": "FBGEMM CPU TBE (SplitTableBatchedEmbeddingBagsCodegen)",
    "floor": "floor of torch operators (pool, row sums, index_add_; grouping untimed)",
}


# ---- the workers: each builds tables, runs warm-up + timed batches, prints one JSON line ---------
def _timed(batches, warmup, forward, backward) -> dict:
    """Median forward and backward+update ms over the timed batches."""
    fwd, bwd = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out = forward(batch)
        t1 = time.perf_counter()
        backward(out)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    fwd.sort(), bwd.sort()
    tot = sorted(f + b for f, b in zip(fwd, bwd, strict=True))
    mid = len(fwd) // 2
    return {"fwd_ms": 1e3 * fwd[mid], "bwd_ms": 1e3 * bwd[mid], "total_ms": 1e3 * tot[mid]}


def _peak_rss_mib() -> float:
    """VmHWM (starts afresh at exec, unlike ru_maxrss); no neorec import, so it runs in any venv."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def worker(impl: str, opt: str, case: dict, data: dict, warmup: int) -> dict:
    t, rows, dim, b = case["tables"], case["rows"], case["dim"], case["batch"]
    lr = 0.01
    batches = data["batches"]
    grad = torch.randn(b, t * dim, generator=torch.Generator().manual_seed(1)) * 1e-3
    start = time.perf_counter()
    if impl == "neorec":
        sys.path.insert(0, str(ROOT))
        from neorec.embedding.fused import FusedEmbeddingCollection
        from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
        from neorec.sparse import SparseBatch

        tables = [TableConfig(name=f"t{i}", rows=rows, dim=dim, features=[f"f{i}"]) for i in range(t)]
        emb = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name=opt, lr=lr), seed=0)
        keys = [f"f{i}" for i in range(t)]
        inputs = [SparseBatch(keys, ids, torch.diff(offsets)) for ids, offsets in batches]

        def forward(sparse):
            return emb(sparse)

        def backward(out):
            out.backward(grad)

    elif impl == "torch":
        inputs, forward, backward = embedding_bag_baseline(case, opt, lr, batches, grad)

    elif impl == "fbgemm":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
                "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[opt]  # fmt: skip
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * t,
            optimizer=kind,
            learning_rate=lr,
            eps=1e-8,
            weights_precision=SparseType.FP32,
            pooling_mode=PoolingMode.SUM,
            device="cpu",
        )
        inputs = batches

        def forward(batch):
            return tbe(batch[0], batch[1])

        def backward(out):
            out.backward(grad)

    elif impl == "floor":
        inputs, forward, backward = torch_operator_floor(case, batches, grad)

    else:
        raise SystemExit(f"unknown implementation {impl!r}")
    setup_s = time.perf_counter() - start
    res = _timed(inputs, warmup, forward, backward)
    return {**res, "setup_s": setup_s, "peak_rss_mib": _peak_rss_mib(), "torch": torch.__version__}


def embedding_bag_baseline(case: dict, opt: str, lr: float, batches, grad, device="cpu", generator=None):
    """One nn.EmbeddingBag(sparse=True) per table + torch.optim SGD / Adagrad (the dlrm way):
    (per-batch inputs, forward, backward). generator: weights uniform in +-0.01 drawn from it
    (else nn.EmbeddingBag's own init)."""
    t, rows, dim, b = case["tables"], case["rows"], case["dim"], case["batch"]
    bags = [torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device) for _ in range(t)]
    if generator is not None:
        for bag in bags:
            bag.weight.data.uniform_(-0.01, 0.01, generator=generator)
    params = [p for bag in bags for p in bag.parameters()]
    optim = torch.optim.SGD(params, lr=lr) if opt == "sgd" else torch.optim.Adagrad(params, lr=lr)
    inputs = []
    for ids, offsets in batches:  # table-major ids -> per-table (ids, offsets), outside the timing
        per = []
        for i in range(t):
            lo, hi = offsets[i * b], offsets[(i + 1) * b]
            per.append((ids[lo:hi], offsets[i * b : (i + 1) * b] - lo))
        inputs.append(per)

    def forward(per):
        return torch.cat([bag(i, o) for bag, (i, o) in zip(bags, per, strict=True)], dim=1)

    def backward(out):
        out.backward(grad)
        optim.step()
        optim.zero_grad(set_to_none=True)

    return inputs, forward, backward


# ---- the driver ---------------------------------------------------------------------------------
def torch_operator_floor(case: dict, batches, grad: torch.Tensor):
    """The `floor` implementation (module doc): inputs with the ids already grouped by row, and
    forward/backward made of the passes no implementation on torch operators can skip."""
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from neorec.utils.host import advise_huge_pages, mapped_empty

    t, rows, dim, b = case["tables"], case["rows"], case["dim"], case["batch"]
    table = mapped_empty((t * rows, dim), torch.float32)  # as neorec's engine allocates a group's buffer
    advise_huge_pages(table)
    table.uniform_(-0.01, 0.01, generator=torch.Generator().manual_seed(0))
    inputs = []
    for ids, offsets in batches:  # table-major bags: bag k is table k // b
        bag = torch.repeat_interleave(torch.arange(t * b), torch.diff(offsets))
        global_rows = ids + (bag // b) * rows
        sorted_rows, order = torch.sort(global_rows, stable=True)
        unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        inputs.append((global_rows, offsets, unique_rows, row_offsets, bag[order]))
    # d(pooled) one row per table-major bag, the same values as the other implementations get
    grad_bags = grad.view(b, t, dim).transpose(0, 1).reshape(t * b, dim)

    def forward(batch):
        global_rows, offsets, *grouped = batch
        return F.embedding_bag(global_rows, table, offsets, mode="sum", include_last_offset=True), grouped

    def backward(out):
        _, (unique_rows, row_offsets, bags) = out
        sums = F.embedding_bag(bags, grad_bags, row_offsets, mode="sum", include_last_offset=True)
        table.index_add_(0, unique_rows, sums)

    return inputs, forward, backward


def make_batches(case: dict, n: int, zipf: float, seed: int) -> dict:
    """n batches of table-major ids (ids [N], offsets [T * B + 1]) and each batch's unique row count."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from neorec.data.synthetic import zipf_ranks

    rng = np.random.default_rng(seed)
    t, rows, b, bag_sizes = case["tables"], case["rows"], case["batch"], case["bags"]
    out, uniques = [], []
    for _ in range(n):
        ids, lengths, unique = [], [], 0
        for i in range(t):
            ranks = zipf_ranks(rng, b * bag_sizes[i], rows, zipf)
            table_ids = (ranks.astype(np.int64) * 2654435761 + 7919 * (i + 1)) % rows
            ids.append(torch.from_numpy(table_ids))
            lengths.append(torch.full((b,), bag_sizes[i], dtype=torch.int64))
            unique += len(np.unique(table_ids))
        lengths = torch.cat(lengths)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out.append((torch.cat(ids), offsets))
        uniques.append(unique)
    return {"batches": out, "unique_rows": uniques}


def copy_bandwidth_gbs(threads: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(1 << 28)  # 1 GiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def fits(case: dict, opt: str, rows: int) -> bool:
    """Weights + optimizer state of all tables within 80% of available memory (one impl at a time)."""
    per_row = 4 * (case["dim"] + STATE_FLOATS_PER_ROW[opt](case["dim"]))
    need = case["tables"] * rows * per_row
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return need <= 0.8 * avail


def run_worker(python: str, impl: str, opt: str, case_name: str, rows: int, data_path: str, args) -> dict | str:
    cmd = [python, __file__, "--worker", impl, opt, case_name, str(rows), data_path, "--warmup", str(args.warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.malloc == "keep":
        env.update(MALLOC_ENV)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit {out.returncode}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def fbgemm_available(python: str) -> str | None:
    """None if `python` can import fbgemm's TBE, else why not."""
    probe = "import fbgemm_gpu.split_table_batched_embeddings_ops_training"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    except OSError as e:
        return str(e)
    return None if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="onehot,multihot")
    p.add_argument("--optimizers", default="sgd,adagrad,rowwise_adagrad", help="sgd, adagrad, rowwise_adagrad")
    p.add_argument("--impls", default="neorec,torch,fbgemm")
    p.add_argument("--rows", type=int, help="rows per table instead of the case's 1M")
    p.add_argument("--batches", type=int, default=8, help="timed batches (median shown)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of id popularity")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--fbgemm-python", default=os.environ.get("FBGEMM_PYTHON", sys.executable),
                   help="a python that can import fbgemm_gpu (this one, or a separate TorchRec environment)")  # fmt: skip
    p.add_argument("--malloc", choices=["keep", "system"], default="keep",
                   help="keep: every process (all implementations alike) keeps freed memory for reuse "
                   "(neorec/utils/host.py); system: glibc's default")  # fmt: skip
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        impl, opt, case_name, rows, data_path = args.worker
        torch.set_num_threads(args.threads)
        case = {**CASES[case_name], "rows": int(rows)}
        data = torch.load(data_path, weights_only=True)
        print(json.dumps(worker(impl, opt, case, data, args.warmup)))
        return

    copy_gbs = copy_bandwidth_gbs(args.threads)
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s (1 GiB fp32 tensor copy, read + write)")
    impls = args.impls.split(",")
    fb_python = args.fbgemm_python
    if "fbgemm" in impls:
        why = fbgemm_available(fb_python)
        if why is not None:
            print(f"fbgemm skipped: {fb_python} cannot import fbgemm_gpu ({why})")
            impls.remove("fbgemm")
    header = ["case", "rows/table", "optimizer", "implementation", "fwd ms", "bwd+update ms", "total ms",
              "vs torch", "fwd GB/s", "bwd+upd GB/s", "bwd+upd / copy", "peak RSS GiB"]  # fmt: skip
    table_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case_name in args.cases.split(","):
            base = CASES[case_name]
            for opt in args.optimizers.split(","):
                rows = args.rows or base["rows"]
                while not fits(base, opt, rows):
                    rows //= 2
                case = {**base, "rows": rows}
                data = make_batches(case, args.warmup + args.batches, args.zipf, seed=0)
                data_path = str(Path(tmp) / f"{case_name}-{rows}.pt")
                torch.save(data, data_path)
                t, d, b = case["tables"], case["dim"], case["batch"]
                num_ids = data["batches"][0][0].numel()
                unique = sorted(data["unique_rows"])[len(data["unique_rows"]) // 2]
                fwd_bytes = 4 * d * (num_ids + b * t)
                bwd_bytes = 4 * b * t * d + 2 * 4 * unique * (d + STATE_FLOATS_PER_ROW[opt](d))
                results = {}
                for impl in impls:
                    if impl == "torch" and opt not in ("sgd", "adagrad"):
                        continue  # torch.optim has no row-wise adagrad
                    if impl == "floor" and opt != args.optimizers.split(",")[0]:
                        continue  # the floor has no optimizer: once per case
                    python = fb_python if impl == "fbgemm" else sys.executable
                    results[impl] = run_worker(python, impl, opt, case_name, rows, data_path, args)
                    print(case_name, rows, opt, impl, results[impl], flush=True)
                ref = results.get("torch")
                for impl, r in results.items():
                    if isinstance(r, str):
                        table_rows.append([case_name, rows, opt, LABELS[impl], "failed: " + r[:80]] + [""] * 7)
                        continue
                    vs = f"{ref['total_ms'] / r['total_ms']:.2f}x" if isinstance(ref, dict) else "-"
                    table_rows.append([
                        case_name, f"{rows:,}", opt, LABELS[impl], round(r["fwd_ms"], 1), round(r["bwd_ms"], 1),
                        round(r["total_ms"], 1), vs, round(fwd_bytes / r["fwd_ms"] / 1e6, 1),
                        round(bwd_bytes / r["bwd_ms"] / 1e6, 1), f"{bwd_bytes / r['bwd_ms'] / 1e6 / copy_gbs:.0%}",
                        round(r["peak_rss_mib"] / 1024, 1),
                    ])  # fmt: skip
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import append_results, markdown_table

    table = markdown_table(header, table_rows)
    print(table)
    if not args.no_record:
        notes = (
            f"{args.batches} timed batches after {args.warmup} warm-up, median per column; {args.threads} threads; "
            f"allocator: {args.malloc} (same for every implementation); "
            f"ids Zipf({args.zipf}) scattered over each table; lr 0.01. Copy bandwidth {copy_gbs:.1f} GB/s. "
            "GB/s = minimal bytes moved / time (forward: one row read per id + output; backward+update: output "
            "gradient + unique rows' weights and state read and written once). FBGEMM ran in the separate "
            f"TorchRec environment ({fb_python})."
        )
        append_results("Embedding operators (benchmarks/embedding_ops.py)", table, notes)


if __name__ == "__main__":
    main()
