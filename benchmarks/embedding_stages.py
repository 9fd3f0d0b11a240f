"""Where an embedding step's time goes, stage by stage, against the bytes each stage must move.

The fused engine (neorec/embedding/fused) on embedding_ops.py's cases and Zipf ids, one
implementation at a time in this process: its Triton kernels (a GPU; or Triton's interpreter with
TRITON_INTERPRET=1, only to check this script on tiny sizes) or its torch path. A few forward +
backward passes run under torch.profiler, whose ranges for the engine's stages (check_ids,
prepare_bags, lookup, sort, row_sums, partial_sums, update_setup, update: neorec/utils/stages.py)
give each stage's host time and, on a GPU, the device time of the kernels that ran inside it. The
passes themselves are timed apart, without the profiler, as embedding_ops*.py time them.

Bytes per stage: what the stage as built reads and writes at the least, counted on each batch (ids
n, bags, unique rows U, D columns of 4 bytes, S floats of optimizer state per row, ids of rows
with more than the update kernel's chunk of ids):
- check_ids: the ids read (8n);
- prepare_bags: ids read, rows and bags written (24n), bag offsets (8 per bag);
- lookup: a row read per id (4Dn), its row number (8n), offsets, the pooled output (4D per bag);
- sort: rows and bags read, sorted bags written (24n), unique rows and their offsets (16U);
- row_sums (torch path): a gradient row read per id with its bag (n(4D + 8)), U sums written;
- partial_sums (Triton path): the same for the ids of rows summed in chunks, a row per chunk written;
- update: the Triton path's sums of the other ids as above, chunks' sums read, and every unique
  row's weights and state read and written (U(8D + 8S)); the torch path's update reads the sums too.
The gradient row of a bag is read once per id of the bag, not once: that is how the sums are
formed (ids sorted by row), and it is most of the backward's bytes on a multi-hot batch. The
"minimal bytes" of embedding_ops*.py (the target's measure) count it once per bag.

--host-only (no GPU needed): the Triton path with its kernels left out (their launches do nothing;
the rest runs on CPU tensors, Triton's interpreter only building the kernels), on a small batch: what
the host spends per pass around the kernels, stage by stage (a GPU pays it as launches and Python
before its kernels can run).

    python benchmarks/embedding_stages.py                        # CPU: the torch path, CPU batches
    python benchmarks/embedding_stages.py --device cuda --scales 8   # GPU: Triton and torch paths
    python benchmarks/embedding_stages.py --host-only --batch 64 --rows 1000
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if "--host-only" in sys.argv:  # the kernels are built for Triton's interpreter, before neorec imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from benchmarks.embedding_ops import CASES, STATE_FLOATS_PER_ROW, copy_bandwidth_gbs, fits, make_batches  # noqa: E402
from neorec.embedding.fused import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.fused.triton_fused_update import LONG_ROW_CHUNK  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402
from neorec.utils.malloc import keep_freed_memory  # noqa: E402
from neorec.utils.stages import NAMES, PREFIX  # noqa: E402

LABELS = {"triton": "Triton kernels", "torch_ops": "torch ops", "host_only": "Triton path, kernels left out"}


class _NoLaunch:
    """A Triton kernel whose launches do nothing (--host-only)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def leave_out_kernels() -> None:
    """Replace the fused engine's Triton kernels by launches that do nothing (--host-only)."""
    from neorec.embedding.fused import triton_fused_update, triton_launch, triton_pool

    if not triton_launch.usable(torch.device("cpu")):
        raise SystemExit("--host-only needs the triton package (the kernels are built for its interpreter)")
    triton_pool._pool_kernel = _NoLaunch()
    triton_fused_update._update_kernel = _NoLaunch()
    triton_fused_update._partial_kernel = _NoLaunch()


def batch_counts(emb: FusedEmbeddingCollection, sparse: SparseBatch, chunk: int) -> dict[str, int]:
    """The counts the byte model needs, summed over the engine's groups: ids, bags, unique rows, the
    ids of rows with more than `chunk` ids and those rows' chunks."""
    out = dict.fromkeys(("ids", "bags", "unique", "chunked_ids", "chunks"), 0)
    for gb in emb.prepare(sparse):
        _, counts = torch.unique(gb.rows, return_counts=True)
        long = counts[counts > chunk]
        out["ids"] += gb.rows.numel()
        out["bags"] += gb.offsets.numel() - 1
        out["unique"] += counts.numel()
        out["chunked_ids"] += int(long.sum())
        out["chunks"] += int(((long + chunk - 1) // chunk).sum())
    return out


def stage_bytes(c: dict[str, int], dim: int, state: int, impl: str) -> dict[str, float]:
    """Bytes each stage moves at the least for a batch of counts `c` (the module's doc)."""
    n, bags, u = c["ids"], c["bags"], c["unique"]
    grad_per_id = 4 * dim + 8  # a bag's gradient row and the bag's number
    rows_and_state = u * (8 * dim + 8 * state)
    out = {
        "check_ids": 8 * n,
        "prepare_bags": 24 * n + 8 * bags,
        "lookup": (4 * dim + 8) * n + 8 * bags + 4 * dim * bags,
        "sort": 24 * n + 16 * u,
    }
    if impl == "triton":
        out["partial_sums"] = c["chunked_ids"] * grad_per_id + 4 * dim * c["chunks"]
        out["update"] = (n - c["chunked_ids"]) * grad_per_id + 4 * dim * c["chunks"] + rows_and_state
    else:
        out["row_sums"] = n * grad_per_id + 4 * dim * u
        out["update"] = 4 * dim * u + rows_and_state
    return out


def on_device(evt) -> bool:
    return evt.device_type != torch.autograd.DeviceType.CPU


def stage_device_ms(events) -> dict[str, float]:
    """Device time of each stage in a profile's events: the kernels, copies and fills that ran inside
    the stage's range on the device (the profiler's device-side copy of a range spans its first
    kernel's start to its last one's end), each counted once, in the innermost range that holds it.
    The device-side ranges, not the kernels' links to the CPU range that launched them: on an H200
    with torch 2.11 the kernels Triton launches in the backward were linked to no CPU range, and
    their stages read 0 ms."""
    windows = sorted(
        ((e.time_range.start, e.time_range.end, e.name[len(PREFIX) :]) for e in events
         if on_device(e) and e.name.startswith(PREFIX)),
        key=lambda w: (w[0], -w[1]),
    )  # fmt: skip
    totals: dict[str, float] = {}
    for e in events:
        if not on_device(e) or e.name.startswith(PREFIX) or getattr(e, "is_user_annotation", False):
            continue
        start, end = e.time_range.start, e.time_range.end
        inner = None
        for w_start, w_end, name in windows:  # outer ranges sort before the ones nested in them
            if w_start > start:
                break
            if end <= w_end:
                inner = name
        if inner is not None:
            totals[inner] = totals.get(inner, 0.0) + (end - start) / 1e3
    return totals


def stage_times(prof, passes: int) -> dict[str, tuple[float, float]]:
    """(host ms, device ms) per pass of each engine stage in a profile: the CPU ranges' totals, less
    any stage range nested in them, and the device time of the work inside each range on the device
    (stage_device_ms), divided by the passes."""
    totals: dict[str, list[float]] = {}

    def nested(evt):  # the stage ranges nearest below evt
        for child in evt.cpu_children:
            if child.name.startswith(PREFIX):
                yield child
            else:
                yield from nested(child)

    events = prof.events()
    for evt in events:
        if not evt.name.startswith(PREFIX) or on_device(evt):
            continue
        host = evt.cpu_time_total - sum(e.cpu_time_total for e in nested(evt))
        totals.setdefault(evt.name[len(PREFIX) :], [0.0, 0.0])[0] += host / 1e3
    for name, ms in stage_device_ms(events).items():
        totals.setdefault(name, [0.0, 0.0])[1] += ms
    return {name: (h / passes, d / passes) for name, (h, d) in totals.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(impl: str, opt: str, case: dict, batches: list, device: torch.device, args) -> dict:
    """One implementation on one case: pass times without the profiler, then stage times with it."""
    t, dim, b = case["tables"], case["dim"], case["batch"]
    tables = [TableConfig(name=f"t{i}", rows=case["rows"], dim=dim, features=[f"f{i}"]) for i in range(t)]
    emb = FusedEmbeddingCollection(
        tables, EmbeddingOptimizerConfig(name=opt, lr=0.01), device=device,
        kernels="torch" if impl == "torch_ops" else "triton",
        row_init=lambda ti, lo, hi: torch.zeros(hi - lo, dim),  # filled below, on the device
    )  # fmt: skip
    for w in emb.weights:
        w.tensor.uniform_(-0.01, 0.01, generator=torch.Generator(device=device).manual_seed(0))
    keys = [f"f{i}" for i in range(t)]
    inputs = []
    for ids, offsets in batches:
        host = SparseBatch(keys, ids, torch.diff(offsets))
        host.length_per_key()  # counted on the host, as the device feed counts them: a GPU batch
        host.id_limits()  # then reads neither back (the id check and the bags wait on nothing)
        inputs.append(host.to(device))
    grad = torch.randn(b, t * dim, generator=torch.Generator().manual_seed(1)).to(device) * 1e-3

    fwd, bwd = [], []
    for i, x in enumerate(inputs[: args.warmup + args.batches]):
        sync(device)
        t0 = time.perf_counter()
        out = emb(x)
        sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        sync(device)
        if i >= args.warmup:
            fwd.append(1e3 * (t1 - t0))
            bwd.append(1e3 * (time.perf_counter() - t1))

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiled = inputs[args.warmup + args.batches :]
    per_pass = []  # a profile of each pass: the median over passes leaves out a pass the machine held up
    for x in profiled:
        with profile(activities=activities) as prof:
            emb(x).backward(grad)
            sync(device)
        per_pass.append(stage_times(prof, 1))
    stages = {
        name: tuple(statistics.median(t.get(name, (0.0, 0.0))[k] for t in per_pass) for k in (0, 1))
        for name in set().union(*per_pass)
    }
    counts = [batch_counts(emb, x, LONG_ROW_CHUNK) for x in profiled]
    mean_counts = {k: statistics.mean(c[k] for c in counts) for k in counts[0]}
    return {
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "stages": stages,
        # the kernels left out (--host-only) move nothing
        "bytes": {} if impl == "host_only" else stage_bytes(mean_counts, dim, STATE_FLOATS_PER_ROW[opt](dim), impl),
        "counts": mean_counts,
    }


def table_row(case_name: str, opt: str, impl: str, b: int, r: dict, on_gpu: bool) -> list:
    """One row: each stage's time (device time on a GPU, host time on CPU) and the rate at which it
    moves its bytes, "-" for a stage the implementation has not; then the stages' host time
    together (on a GPU: the launches and Python around the kernels) and the passes' time."""
    cells = []
    for name in NAMES:
        if name not in r["stages"]:
            cells.append("-")
            continue
        host, dev = r["stages"][name]
        ms = dev if on_gpu else host
        moved = r["bytes"].get(name)
        rate = f" · {moved / ms / 1e6:,.0f} GB/s" if moved and ms > 0 else ""
        cells.append(f"{ms:.2f}{rate}")
    stage_ms = sum((d if on_gpu else h) for h, d in r["stages"].values())
    host_ms = sum(h for h, _ in r["stages"].values())
    return [case_name, f"{b:,}", opt, LABELS[impl], *cells, round(stage_ms, 2), round(host_ms, 2),
            round(r["fwd_ms"] + r["bwd_ms"], 2)]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", default="onehot,multihot")
    p.add_argument("--scales", default="1", help="batch multipliers of each case (GPU batches are larger: 8)")
    p.add_argument("--optimizers", default="sgd,rowwise_adagrad,adam")
    p.add_argument("--impls", default=None, help="triton,torch_ops (default: both on a GPU, torch_ops on CPU)")
    p.add_argument("--rows", type=int, help="rows per table (default: the case's, fewer where they do not fit)")
    p.add_argument("--batch", type=int, help="samples per batch instead of the case's times --scales")
    p.add_argument("--host-only", action="store_true", help="the Triton path with its kernels left out (module doc)")
    p.add_argument("--batches", type=int, default=10, help="timed passes without the profiler (median)")
    p.add_argument("--profiled", type=int, default=5, help="passes under the profiler (their median per stage)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--results", default=None, help="records file (default: benchmarks/records/embedding_stages.jsonl)")
    p.add_argument("--no-record", action="store_true", help="print the table only")
    args = p.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    impls = (args.impls or ("triton,torch_ops" if on_gpu else "torch_ops")).split(",")
    if args.host_only:
        if on_gpu:
            raise SystemExit("--host-only runs on CPU tensors; leave out --device cuda")
        leave_out_kernels()
        impls = ["host_only"]
    if on_gpu:
        from benchmarks.embedding_ops_gpu import copy_bandwidth_gbs as device_copy_gbs

        copy_gbs = device_copy_gbs()
        where = torch.cuda.get_device_name()
    else:  # as training does on CPU (neorec/utils/host.py): freed temporaries are not faulted in anew
        keep_freed_memory()
        copy_gbs = copy_bandwidth_gbs(args.threads)
        where = f"CPU, {args.threads} threads"
    print(f"{where}: copy bandwidth {copy_gbs:.0f} GB/s (1 GiB copy, read + write)", flush=True)

    header = ["case", "batch", "optimizer", "implementation", *[f"{n} ms" for n in NAMES],
              "stages ms", "stages host ms", "pass ms"]  # fmt: skip
    rows, sizes = [], []
    for case_name in args.cases.split(","):
        for scale in [int(s) for s in args.scales.split(",")]:
            case = {**CASES[case_name]}
            case["batch"] = args.batch or case["batch"] * scale
            case["rows"] = args.rows or case["rows"]
            while not on_gpu and not fits(case, "adam", case["rows"]):
                case["rows"] //= 2
            data = make_batches(case, args.warmup + args.batches + args.profiled, args.zipf, seed=0)
            sizes.append(f"{case_name} {case['rows']:,} rows/table")
            for opt in args.optimizers.split(","):
                for impl in impls:
                    r = measure(impl, opt, case, data["batches"], device, args)
                    print(case_name, case["batch"], opt, impl, {k: r[k] for k in ("fwd_ms", "bwd_ms", "counts")},
                          flush=True)  # fmt: skip
                    rows.append(table_row(case_name, opt, impl, case["batch"], r, on_gpu))
                    gc.collect()  # this engine's tables, before the next one's
                    if on_gpu:
                        torch.cuda.empty_cache()
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"{where}. 26 tables ({', '.join(sizes)}; fp32), ids Zipf({args.zipf}) scattered over each table, lr 0.01. "
        f"Each stage (torch.profiler ranges of neorec/utils/stages.py): its time per pass, the median over "
        f"{args.profiled} passes, each profiled by itself ({'device time: the kernels that ran inside the stage on the device' if on_gpu else 'host time'}), "
        "and the rate at which it moves the bytes it must (the least the stage as built reads and writes: the "
        f"script's doc), against a 1 GiB copy at {copy_gbs:.0f} GB/s. stages ms: the stages together; stages host "
        f"ms: their host time (on a GPU: Python and launches); pass ms: forward + backward, the median of "
        f"{args.batches} passes without the profiler."
    )
    if args.host_only:
        notes += (
            " The Triton path with its kernels' launches doing nothing, on CPU tensors: each stage's host "
            "work around the kernels (the profiler adds its own cost to every op it records, so stages of "
            "many small ops read high; the pass is timed without it)."
        )
    if not args.no_record:
        title = "Embedding step by stage (benchmarks/embedding_stages.py)"
        if args.host_only:
            title = "Host work of the Triton path by stage, kernels left out (benchmarks/embedding_stages.py --host-only)"
        append_results(title, table, notes,
                       path=Path(args.results) if args.results else None)  # fmt: skip


if __name__ == "__main__":
    main()
