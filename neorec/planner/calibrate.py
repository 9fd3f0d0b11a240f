"""Measure this machine's speeds for the cost model: `neorec plan --calibrate`.

The benchmarks run in `world_size` processes at once (gloo, one thread each unless told otherwise),
the way `neorec train --nproc N` runs, so that cores, caches and memory bandwidth are shared as
they will be in training. Each process measures, and rank 0 writes the mean over ranks:
- the fused lookup and the fused backward+update (embedding/fused) of one 2^20-row table with
  Zipf-distributed ids at dims 4 and 256: the line through the two times against bytes gives the
  cost per byte of rows (slope) and per id (intercept / ids);
- elementwise work on exchange buffers: the fp16 codec and a column gather of a [B, 1664] block;
- all-to-all between the processes at two message sizes: latency and bytes per second;
- the SSD tier (`measure_ssd`): random single-row reads and writes of a file that is not in the
  page cache, as a row cache's misses and write-backs do them (backing.py), in bytes of pages per
  second.
Takes 20-40 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from neorec.errors import ConfigError, MachineError, failure
from neorec.planner.hardware import CALIBRATION_KEYS, calibration_path, calibration_values, load_calibration
from neorec.utils.files import write_json

ROWS = 1 << 20
BATCH = 2048
FEATURES = 26
DIMS = (4, 256)  # almost all per-id cost, then mostly bytes
REPEATS = 7


def zipf_ids(rows: int, n: int, alpha: float = 1.05, seed: int = 0) -> np.ndarray:
    """n ids with Zipf(alpha) popularity, popular ids scattered over the table (as synthetic.py)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, rows + 1) ** alpha
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    return (ranks * 2654435761 + 12345) % rows


def _median_time(fn, repeats: int = REPEATS, sync=None) -> float:
    fn()  # warm-up: allocations, caches
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_compute(sync=None) -> dict[str, float]:
    """Per-id and per-byte cost of the fused lookup and update (see module doc)."""
    from neorec.embedding.fused import FusedEmbeddingCollection
    from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
    from neorec.sparse import SparseBatch

    keys = [f"f{i}" for i in range(FEATURES)]
    ids = torch.from_numpy(zipf_ids(ROWS, BATCH * FEATURES))
    sparse = SparseBatch(keys, ids, torch.ones(BATCH * FEATURES, dtype=torch.int64))
    n = ids.numel()
    unique = int(torch.unique(ids).numel())
    fwd, bwd = {}, {}
    for dim in DIMS:
        table = TableConfig(name="t", rows=ROWS, dim=dim, features=keys)
        emb = FusedEmbeddingCollection([table], EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.01))
        grad = torch.full((BATCH, FEATURES * dim), 1e-3)
        fwd[dim] = _median_time(lambda emb=emb: emb(sparse), sync=sync)

        def step(emb=emb, grad=grad) -> None:
            emb(sparse).backward(grad)

        bwd[dim] = max(_median_time(step, sync=sync) - fwd[dim], 1e-6)
        del emb
    # lookup: t = n * per_id + (n * dim * 4 + pooled bytes) / bandwidth
    fwd_bytes = {d: n * d * 4 + BATCH * FEATURES * d * 4 for d in DIMS}
    fwd_per_byte, fwd_fixed = _solve(fwd_bytes, fwd)
    # update: t = n * per_id + (n * dim * 4 + unique * (2 dim * 4 + 2 * 4 + 8 dim)) / bandwidth
    bwd_bytes = {d: n * d * 4 + unique * (2 * d * 4 + 2 * 4 + 8 * d) for d in DIMS}
    bwd_per_byte, bwd_fixed = _solve(bwd_bytes, bwd)
    fwd_per_id, bwd_per_id = max(fwd_fixed / n, 1e-10), max(bwd_fixed / n, 1e-10)
    return {
        "lookup_bandwidth": 1 / fwd_per_byte,
        "lookup_per_id": fwd_per_id,
        "update_bandwidth": 1 / bwd_per_byte,
        "update_per_id": bwd_per_id,
    }


def measure_op_overhead(sync=None) -> dict[str, float]:
    """Seconds per small tensor op of the id routing (input_dist.py's per-shard sequence on the ids
    of one feature for B / 2 samples): the fixed cost the cost model charges per op."""
    b = BATCH // 2
    ids = torch.from_numpy(zipf_ids(ROWS, b, seed=1))
    lengths = torch.ones(b, dtype=torch.int64)
    bag = torch.arange(b).repeat_interleave(lengths)
    inner = torch.tensor([ROWS // 2])
    owner = torch.bucketize(ids, inner, right=True)
    per_round = 20

    def route() -> None:
        for _ in range(per_round):
            sel = (owner == 1).nonzero().squeeze(1)
            mine = ids.index_select(0, sel) - 7
            torch.bincount(bag.index_select(0, sel), minlength=b)
            mine.to(torch.int32)

    return {"op_overhead": _median_time(route, sync=sync) / (per_round * 6)}


def _solve(x: dict[int, float], y: dict[int, float]) -> tuple[float, float]:
    """(per byte, fixed) through the two points: the small dim fixes the per-id part, the large
    dim the per-byte part (a line through two well-separated points is stable; a least-squares
    fit over close dims is not, run to run)."""
    lo, hi = sorted(x)
    per_byte = max((y[hi] - y[lo]) / (x[hi] - x[lo]), 1e-13)
    return per_byte, max(y[lo] - per_byte * x[lo], 0.0)


def measure_stream(sync=None) -> dict[str, float]:
    """Bytes per second of the elementwise work around exchanges (codec, column gather)."""
    from neorec.distributed.codecs import Codec

    x = torch.randn(BATCH, 26 * 64)
    codec = Codec("fp16")
    perm = torch.randperm(x.shape[1])

    def work() -> None:
        wire = codec.encode(x)
        codec.decode(wire)
        x.index_select(1, perm)

    # bytes as cost.py counts them: encode (4 + 2), decode (2 + 4), gather (4 + 4) per element
    return {"stream_bandwidth": x.numel() * (6 + 6 + 8) / _median_time(work, sync=sync)}


def measure_links(world: int, sync=None) -> dict[str, float]:
    """all_to_all latency and bandwidth (bytes sent + received per second per rank), through the
    transport training uses (neorec/distributed/comms.py: shared memory between ranks of this
    machine where available, else the process group)."""
    from neorec.distributed.comms import Comms
    from neorec.distributed.topology import Topology

    comms = Comms(Topology.from_env() if "RANK" in os.environ else _topology())

    def a2a(numel: int) -> float:
        send = torch.ones(numel * world)
        splits = [numel] * world
        return _median_time(lambda: comms.all_to_all(send, splits, splits, "calibrate").wait(), repeats=9, sync=sync)

    small, big = 16, 1 << 21  # floats per peer
    t_small, t_big = a2a(small), a2a(big)
    moved = 2 * (world - 1) * big * 4  # sent + received by one rank
    return {"latency": max(t_small, 1e-6), "link_bandwidth": moved / max(t_big - t_small, 1e-9)}


SSD_FILE_BYTES = 256 << 20
SSD_ROWS = 4096  # random rows (one per page) read, then written
PAGE = 4096
SSD_RECORD = 512  # bytes of a row written back (dim 64 with AdaGrad)


def measure_ssd(directory: str | Path | None = None, threads: int = 16) -> dict[str, float]:
    """Bytes of 4 KiB pages per second that a row cache's misses (positioned reads of one row per
    random page) and write-backs (positioned writes of a 512-byte row into a random page, then
    fsync) move, from `threads` threads as backing.py issues them, on a file that is not in the page
    cache. The file goes to `directory` (default: the temp dir)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(0)
    pages = SSD_FILE_BYTES // PAGE
    offsets = [int(x) * PAGE for x in rng.choice(pages, size=2 * SSD_ROWS, replace=False)]
    record = bytes(SSD_RECORD)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "ssd.bin"
        try:
            with path.open("wb") as f:
                chunk = rng.bytes(1 << 20)
                for _ in range(SSD_FILE_BYTES // len(chunk)):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise MachineError(
                f"cannot write the disk probe {path} ({SSD_FILE_BYTES >> 20} MiB: the calibration measures the "
                f"disk of the temporary folder, $TMPDIR): {e.strerror or e}; free some space there, or lift the "
                "file-size limit (ulimit -f)"
            ) from None
        fd = os.open(path, os.O_RDWR)
        try:
            reads, writes = offsets[:SSD_ROWS], offsets[SSD_ROWS:]
            with ThreadPoolExecutor(threads) as pool:
                start = time.perf_counter()
                list(pool.map(lambda at: os.pread(fd, SSD_RECORD, at), reads))
                read = time.perf_counter() - start
                start = time.perf_counter()
                list(pool.map(lambda at: os.pwrite(fd, record, at), writes))
                os.fsync(fd)
                write = time.perf_counter() - start
        finally:
            os.close(fd)
    moved = SSD_ROWS * PAGE
    return {"ssd_read_bandwidth": moved / read, "ssd_write_bandwidth": moved / write}


def _topology():
    import torch.distributed as dist

    from neorec.distributed.topology import Topology

    return Topology(dist.get_world_size(), dist.get_rank(), dist.get_world_size())


def _rank_main(rank: int, world: int, init_file: str, threads: int, queue) -> None:
    import torch.distributed as dist

    from neorec.utils.host import keep_freed_memory

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    keep_freed_memory()  # as training does (train.keep_freed_memory): no page faults on reused buffers
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        sync = dist.barrier if world > 1 else None
        out = measure_compute(sync)
        out.update(measure_stream(sync))
        out.update(measure_op_overhead(sync))
        if world > 1:
            out.update(measure_links(world, sync))
        out.update(measure_ssd())
        queue.put((rank, out, None))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported by the parent: (a failure of the machine?, what)
        known = failure(e)
        machine = known is not None and known[0] == 1
        queue.put((rank, None, (machine, known[1] if machine else repr(e))))


_DAMAGED_BYTES = 64 * 1024  # a calibration is under 1 KiB; a larger file is something else


def check_calibration_target(target: Path) -> None:
    """The file a calibration is written to: new, or an earlier calibration, which it replaces (also a
    damaged one: a small .json file that is not another JSON object); any other file (a run's model.pt
    or summary.json given by mistake) is refused before anything is measured."""
    if target.is_dir():
        raise ConfigError(f"--calibration {target}: is a folder; give the path of the calibration file")
    if not target.exists():
        return
    try:
        load_calibration(target)
        return
    except ConfigError:
        pass
    other = target.suffix != ".json" or target.stat().st_size > _DAMAGED_BYTES
    if not other:
        try:
            data = json.loads(target.read_bytes())
            other = isinstance(data, dict) and not any(k in data for k in CALIBRATION_KEYS)
        except (ValueError, OSError):  # not JSON (or not UTF-8): a damaged calibration
            pass
    if other:
        raise ConfigError(
            f"--calibration {target}: is a file that is not a calibration; a calibration replaces only an "
            "earlier one: give a new path"
        )


def calibrate(
    world_size: int = 2, threads: int = 1, path: str | Path | None = None, timeout: float = 300
) -> dict:
    """Run the benchmarks on `world_size` processes; save and return the mean speeds."""
    import tempfile

    import torch.multiprocessing as mp

    target = Path(path) if path else calibration_path()
    check_calibration_target(target)

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, init_file, threads, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = [], []
        try:
            for _ in range(world_size):
                rank, out, err = queue.get(timeout=timeout)
                if err:
                    errors.append((not err[0], f"rank {rank}: {err[1]}"))  # the machine's failures first
                else:
                    results.append(out)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if errors:  # a failure of the machine (a full disk, a file-size limit), else every rank's failure
        errors.sort()
        if not errors[0][0]:
            raise MachineError(f"calibration failed: {errors[0][1]}")  # a peer of that rank reports a lost link
        raise RuntimeError("calibration failed: " + "; ".join(e for _, e in errors))
    merged = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
    if world_size == 1:  # no peer to measure links against: assume a memory copy
        merged.setdefault("latency", 20e-6)
        merged.setdefault("link_bandwidth", merged["stream_bandwidth"])
    calibration = {k: merged[k] for k in CALIBRATION_KEYS}
    calibration["measured"] = {
        "world_size": world_size,
        "threads": threads,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    calibration_values(calibration, f"calibration of this machine for {target}")  # a NaN speed is never written
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, calibration, "calibration file", indent=2)  # atomic, with a "crc32" of its content
    return calibration
