"""Helpers for the multi-process tests: random batches, a small DLRM, and a training run that is
the same code for one process (the fused engine on the global batch) and for W gloo processes
(the sharded collection, each rank on its slice of the same global batches)."""

from __future__ import annotations

import os
import subprocess
import traceback
from pathlib import Path

import torch

from neorec.data.batch import Batch
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch

DIM = 8
NUM_DENSE = 4


def neorec_train(out: Path, sets: list[str], nproc: int = 1, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`neorec train --nproc N --set ... --output-dir out` in a fresh process (tests/forked.py); its result, not checked."""
    from forked import run_neorec

    argv = ["train", "--nproc", str(nproc), *[x for kv in sets for x in ("--set", kv)], "--output-dir", str(out)]
    return run_neorec(argv, cwd=cwd, timeout=300)


def make_tables(pooling_mean: bool = True) -> list[TableConfig]:
    """Mixed sizes, one table shared by two features, a mean-pooled table, different optimizers."""
    return [
        TableConfig(name="t0", rows=37, dim=DIM, features=["f0"]),
        TableConfig(name="t1", rows=50, dim=DIM, features=["f1", "f1b"]),
        TableConfig(name="t2", rows=64, dim=DIM, features=["f2"], pooling="mean" if pooling_mean else "sum"),
        TableConfig(name="t3", rows=29, dim=DIM, features=["f3"]),
        TableConfig(name="t4", rows=41, dim=DIM, features=["f4"]),
        TableConfig(name="t5", rows=70, dim=DIM, features=["f5"], pooling="mean" if pooling_mean else "sum"),
    ]


def make_batches(tables: list[TableConfig], steps: int, batch: int, seed: int = 0) -> list[Batch]:
    """Multi-hot bags of 0-4 ids (empty bags included, duplicates likely), per-id weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    rows = {f: t.rows for t in tables for f in t.features}
    for _ in range(steps):
        feats = {}
        for f, n in rows.items():
            lengths = torch.randint(0, 5, (batch,), generator=g)
            ids = torch.randint(0, n, (int(lengths.sum()),), generator=g)
            weights = torch.rand(ids.numel(), generator=g) + 0.5
            feats[f] = (ids, lengths, weights)
        sparse = SparseBatch.from_features(feats)
        dense = torch.randn(batch, NUM_DENSE, generator=g)
        labels = (torch.rand(batch, generator=g) < 0.4).float()
        out.append(Batch(dense, sparse, labels))
    return out


def local_slice(batch: Batch, rank: int, world: int) -> Batch:
    b = len(batch) // world
    s = batch.sparse
    keep = torch.zeros(s.batch_size, dtype=torch.bool)
    keep[rank * b : (rank + 1) * b] = True
    feats = {}
    for k in s.keys:
        ids, lengths, weights = s.feature(k)
        bag = torch.arange(s.batch_size).repeat_interleave(lengths)
        m = keep[bag]
        feats[k] = (ids[m], lengths[rank * b : (rank + 1) * b], weights[m])
    sl = slice(rank * b, (rank + 1) * b)
    return Batch(batch.dense[sl], SparseBatch.from_features(feats), batch.labels[sl])


def build_model(embeddings):
    from neorec.model.dlrm import DLRM

    torch.manual_seed(123)
    return DLRM(NUM_DENSE, embeddings, [8, DIM], [8], self_interaction=False)


def train(
    embeddings, batches, world: int = 1, rank: int = 0, comms=None, dense_precision: str = "fp32", pipeline=False
):
    """SGD on the dense part, the fused optimizer on the rows. Returns (global losses, model).
    pipeline: start each next batch's id exchange before the current step (neorec.train.pipeline)."""

    model = build_model(embeddings)
    emb_opt = embeddings.build_optimizer()
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    opt = torch.optim.SGD(dense_params, lr=0.05)
    losses = run_steps(model, embeddings, emb_opt, opt, batches, rank, world, comms, dense_precision, pipeline)
    return losses, model


def run_steps(model, embeddings, emb_opt, dense_opt, batches, rank=0, world=1, comms=None, dense_precision="fp32", pipeline=False):
    """Train over `batches` (global batches; each rank takes its slice); returns the mean loss over
    ranks of each step."""
    from neorec.distributed.dense import DenseGradSync
    from neorec.train.pipeline import pipelined

    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    sync = DenseGradSync(dense_params, comms, dense_precision) if comms is not None else None
    losses = []

    def cut(batch):
        return local_slice(batch, rank, world) if world > 1 else batch

    for _, batch in pipelined(batches, cut, embeddings, depth=1 if pipeline else 0):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        if sync is not None:
            sync.start().wait()
        dense_opt.step()
        emb_opt.step()
        value = loss.detach().clone()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def optimizer_config(name: str) -> EmbeddingOptimizerConfig:
    lr = {"sgd": 0.3, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.02}[name]
    return EmbeddingOptimizerConfig(name=name, lr=lr)


def run_rank(rank: int, world: int, local_world: int, init_file: str, fn, args, result_queue) -> None:
    """Entry point of one spawned process: join the gloo group, run fn(topo, *args), report."""
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from neorec.distributed.topology import Topology

        out = fn(Topology(world, rank, local_world), *args)
        result_queue.put((rank, _plain(out), None))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent test
        result_queue.put((rank, None, traceback.format_exc()))


def fit_rank(topo, sets: list[str], out: str, resume: bool = False, config: str = "default") -> None:
    """One rank of `neorec train --config CONFIG --set ...` (the Trainer a worker of `--nproc N` runs)
    in the process group that spawn made: the Trainer joins it. Tests of what trains over several
    processes use it; the launcher itself has tests of its own (test_launch*.py, test_preemption.py)."""
    from neorec.config.load import load_config
    from neorec.train.trainer import Trainer

    os.environ.update(RANK=str(topo.rank), WORLD_SIZE=str(topo.world_size), LOCAL_RANK=str(topo.local_rank),
                      LOCAL_WORLD_SIZE=str(topo.local_world_size))  # fmt: skip
    Trainer(load_config(config, sets), Path(out), resume=resume).fit()


def _plain(x):
    """Tensors as numpy arrays: a queue would pass tensors through shared memory, which breaks once
    the sending process exits."""
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().copy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_plain(v) for v in x)
    return x


def spawn(world: int, fn, args=(), local_world: int | None = None, tmp_path=None, timeout: float = 240.0) -> dict:
    """Run fn on `world` real processes; returns {rank: result}; raises with a rank's traceback. The
    process group's file is in `tmp_path`, or in a temporary folder removed at the end."""
    import tempfile

    if tmp_path is None:
        with tempfile.TemporaryDirectory(prefix="neorec-pg-") as folder:
            return spawn(world, fn, args, local_world, folder, timeout)
    from forked import context

    ctx = context()  # ranks fork from a server that has imported torch and neorec
    queue = ctx.Queue()
    init_dir = tmp_path
    os.makedirs(init_dir, exist_ok=True)
    init_file = os.path.join(str(init_dir), "pg_init")
    procs = [
        ctx.Process(target=run_rank, args=(r, world, local_world or world, init_file, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, out, err = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results


# Calls that, on a GPU, read a tensor's values back to the host or size their output by them (the
# host then waits for the device). CPU-only branches (numpy views of host tensors) are not listed:
# they never run on a GPU.
def _read_calls() -> list[tuple[object, str]]:
    from neorec.utils import index_ops

    return [
        (torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "cpu"), (torch.Tensor, "nonzero"),
        (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"), (torch.Tensor, "__index__"), (torch, "nonzero"),
        (torch, "unique"), (torch, "unique_consecutive"), (torch, "bincount"), (index_ops, "where"),
        (index_ops, "split"),
    ]  # fmt: skip


def count_host_reads(
    inside=None, outside=(), main_thread_only: bool = False, device_only: bool = False
) -> tuple[list[int], list[str]]:
    """Patch (for the rest of this process) the calls that read a GPU tensor back, and
    repeat_interleave without output_size, to count themselves; returns ([count], [names called]).
    Only calls made while inside one of `inside` ((owner, function name) pairs; None: anywhere), and
    not inside one of `outside`, count; functions returned by an `inside` one count as inside too.
    main_thread_only: calls on other threads (a pipeline's) do not count. device_only: only calls
    on tensors in device memory count (on a GPU; without it CPU tensors stand in for them)."""
    import threading

    count, calls, depth, shut = [0], [], [0 if inside else 1], [0]

    def note(name: str, args) -> None:
        if not depth[0] or shut[0]:
            return
        if main_thread_only and threading.current_thread() is not threading.main_thread():
            return
        if device_only and not any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args[:2]):
            return
        count[0] += 1
        calls.append(name)

    def counted(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            note(name, args)
            return fn(*args, **kwargs)

        setattr(owner, name, wrapper)

    for owner, name in _read_calls():
        counted(owner, name)
    for owner in (torch, torch.Tensor):
        fn = owner.repeat_interleave

        def repeat(*args, _fn=fn, **kwargs):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                note("repeat_interleave", (repeats,))
            return _fn(*args, **kwargs)

        owner.repeat_interleave = repeat

    def scoped(fn, counter):
        def wrapper(*args, **kwargs):
            counter[0] += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                counter[0] -= 1
            return scoped(out, counter) if callable(out) and counter is depth else out

        return wrapper

    for owner, name in inside or ():
        setattr(owner, name, scoped(getattr(owner, name), depth))
    for owner, name in outside:
        setattr(owner, name, scoped(getattr(owner, name), shut))
    return count, calls
