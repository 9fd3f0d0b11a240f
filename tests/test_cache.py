"""The row cache (neorec/embedding/cache): exact training through it, SSD tables, stats, config errors.

Exactness is checked bitwise against the same engine without a cache (which test_fused_engine checks
against a float64 reference), with the cache far smaller than the rows the batches touch, so that
rows and their optimizer state are evicted and brought back many times.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from test_fused_engine import Float64Reference, assert_matches, step_with_reference

from neorec.config.load import load_config
from neorec.embedding.cache import CacheSettings, DramBacking, RowCache, SsdBacking, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.init import init_rows
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.sparse import SparseBatch

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


def tables() -> list[TableConfig]:
    """Two groups (dims 8 and 4); one table shared by two features; mean pooling."""
    return [
        TableConfig(name="users", rows=300, dim=8, features=["user", "friend"]),
        TableConfig(name="items", rows=200, dim=8, features=["item"], pooling="mean"),
        TableConfig(name="tags", rows=120, dim=4, features=["tag"]),
    ]


def batch(
    gen: torch.Generator, ts: list[TableConfig], batch_size: int = 16, one_hot: bool = False
) -> SparseBatch:
    """Ids over every row, skewed (x^2), 0-4 per bag (weighted) or exactly one."""
    features = {}
    for t in ts:
        for f in t.features:
            lengths = (
                torch.ones(batch_size, dtype=torch.int64)
                if one_hot
                else torch.randint(0, 5, (batch_size,), generator=gen)
            )
            n = int(lengths.sum())
            ids = (torch.rand(n, generator=gen).square() * t.rows).long()
            features[f] = (ids, lengths) if one_hot else (ids, lengths, torch.rand(n, generator=gen) + 0.5)
    return SparseBatch.from_features(features)


def cached_engine(
    ts,
    opt,
    tmp_path,
    policy="lru",
    tier="ssd",
    fraction=0.1,
    seed=0,
    device="cpu",
    io_thread=True,
    kernels="auto",
) -> FusedEmbeddingCollection:
    # a write log of 5% of the rows: its halves swap and are folded into the files all the time;
    # reads ahead and write-backs on the worker thread unless io_thread=False (auto would pick by cores)
    settings = CacheSettings(
        policy=policy,
        fraction=fraction,
        directory=tmp_path / f"tables-{seed}",
        ssd_log=0.05,
        io_thread=io_thread,
    )
    factory = cached_storage_factory({t.name: tier for t in ts}, settings)
    return FusedEmbeddingCollection(
        ts, opt, seed=seed, group_storage_factory=factory, device=device, kernels=kernels
    )


def train_both(a, b, gen, steps, ts, prefetch=False, one_hot=False, device="cpu", batch_size=16) -> None:
    """Same batches (of `batch_size` samples) and output gradients through both engines; forward
    outputs must agree bitwise."""
    batches = [batch(gen, ts, batch_size, one_hot=one_hot).to(device) for _ in range(steps)]
    for i, sparse in enumerate(batches):
        if prefetch and i + 1 < len(batches):  # as the pipeline does: the next batch before this step
            b.prefetch(batches[i + 1])
        pa, pb = a(sparse), b(sparse)
        assert torch.equal(pa, pb), f"step {i}: pooled outputs differ"
        grad = torch.randn(pa.shape, generator=gen).to(device)
        pa.backward(grad)
        pb.backward(grad)


def assert_same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cached_training_is_bitwise_uncached_training(tmp_path, name, policy) -> None:
    ts = tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=0.01, initial_accumulator=0.01)
    plain, cached = FusedEmbeddingCollection(ts, opt), cached_engine(ts, opt, tmp_path, policy)
    for engine in (plain, cached):
        engine.chunk_elements = 64  # several update blocks per batch
    train_both(plain, cached, torch.Generator().manual_seed(len(name)), 12, ts, prefetch=name != "sgd")
    assert_same_state(plain, cached)
    stats = cached.cache_stats()
    assert set(stats) == {"users", "items", "tags"}
    # eviction pressure: 10% of rows cached, far fewer than the rows the batches touched
    assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats.values())
    assert sum(s["misses"] for s in stats.values()) > sum(t.rows for t in ts) * 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gpu_cache_over_host_memory_is_bitwise_uncached(tmp_path, name, policy, kernels) -> None:
    """The cache in GPU memory (records and bookkeeping on the device), every row in host memory:
    training through it is bitwise training the tables in GPU memory, under eviction pressure, with
    the torch path or the Triton kernels (reading and updating the cache's records in place)."""
    ts = tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt, device="cuda", kernels=kernels)
    cached = cached_engine(
        ts, opt, tmp_path, policy, tier="dram", fraction=0.1, device="cuda", kernels=kernels
    )
    assert cached.weights[0].cache.records.is_cuda and cached.weights[0].cache.slot_of.is_cuda
    train_both(plain, cached, torch.Generator().manual_seed(4), 12, ts, prefetch=True, device="cuda")
    assert_same_state(plain, cached)
    stats = cached.cache_stats()
    assert (
        sum(s["evictions"] for s in stats.values()) > 0 and sum(s["writebacks"] for s in stats.values()) > 0
    )


def restore_and_continue(plain, cached, restored, gen, steps, ts, opt, device="cpu", kernels="torch") -> None:
    """Continue `plain` and `cached` for `steps`, then the same batches through `restored` (loaded
    from `cached`'s checkpoint beforehand) from a plain engine loaded with that checkpoint: all end
    where `plain` does."""
    checkpoint = roundtrip(cached.state_dict())
    restored.load_state_dict(checkpoint)
    state = gen.get_state()
    train_both(plain, cached, gen, steps, ts, prefetch=True, device=device)
    gen.set_state(state)
    fresh = FusedEmbeddingCollection(ts, opt, device=device, kernels=kernels)
    fresh.load_state_dict(checkpoint)
    train_both(fresh, restored, gen, steps, ts, prefetch=True, device=device)
    assert_same_state(plain, restored)
    assert_same_state(plain, cached)


def roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` through torch.save and torch.load, as a checkpoint holds it."""
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    return torch.load(saved)


@pytest.mark.parametrize(("fraction", "io_thread"), [(0.2, True), (0.2, False), (0.005, True)])
def test_ssd_cache_through_the_device_path_is_bitwise_uncached(tmp_path, staged_on_cpu, fraction, io_thread):
    """What a GPU cache over SSD files runs, on the CPU: training through it, and through a
    checkpoint's save and load, is bitwise training in memory (0.005: 2 rows, smaller than a batch,
    so rows also go straight to the files)."""
    from neorec.embedding.cache.device_io import DeviceIO

    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt)
    cached = cached_engine(ts, opt, tmp_path, tier="ssd", fraction=fraction, io_thread=io_thread)
    caches = [w.cache for w in cached.weights]
    assert all(isinstance(c.io, DeviceIO) and c.io.background == io_thread for c in caches)
    gen = torch.Generator().manual_seed(6)
    train_both(plain, cached, gen, 8, ts, prefetch=True)
    assert_same_state(plain, cached)
    assert sum(s["writebacks"] for s in cached.cache_stats().values()) > 0
    # reads ahead on the worker thread, staged in host buffers (none without the worker; a cache
    # of 2 rows never has room for a coming batch beside the one in flight)
    assert bool(staged_on_cpu) == (io_thread and fraction > 0.01)
    restored = cached_engine(ts, opt, tmp_path, tier="ssd", fraction=fraction, seed=1, io_thread=io_thread)
    restore_and_continue(plain, cached, restored, gen, 4, ts, opt)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dram_cache_through_the_device_path_is_bitwise_uncached(tmp_path, staged_on_cpu, name, policy):
    """What a GPU cache over host memory runs, on the CPU: coming batches' misses read ahead on the
    worker, evictions written back by it without a read on the training thread; training through it,
    and through a checkpoint's save and load (which empties slots that evictions then reuse), is
    bitwise training in memory."""
    from neorec.embedding.cache.device_io import DeviceIO

    ts = tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=0.01, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt)
    # io_thread auto is on with a GPU (the CPU stand-in would pick by cores)
    cached = cached_engine(ts, opt, tmp_path, policy, tier="dram", fraction=0.2, io_thread=True)
    caches = [w.cache for w in cached.weights]
    assert all(isinstance(c.io, DeviceIO) and c.io.background for c in caches)
    gen = torch.Generator().manual_seed(7)
    train_both(plain, cached, gen, 10, ts, prefetch=True)
    assert_same_state(plain, cached)
    stats = cached.cache_stats()
    assert (
        sum(s["evictions"] for s in stats.values()) > 0 and sum(s["writebacks"] for s in stats.values()) > 0
    )
    assert staged_on_cpu  # the misses came in through reads ahead
    restored = cached_engine(ts, opt, tmp_path, policy, tier="dram", fraction=0.2, seed=1, io_thread=True)
    restore_and_continue(plain, cached, restored, gen, 4, ts, opt)


READS = [  # what reads a device tensor back to the host (numpy: index_ops' CPU path)
    (torch.Tensor, "cpu"), (torch.Tensor, "item"), (torch.Tensor, "numpy"), (torch.Tensor, "nonzero"),
    (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"), (torch, "unique"), (torch, "nonzero"),
]  # fmt: skip


def count_host_reads(monkeypatch, cache_cls) -> tuple[dict[str, int], list[str]]:
    """Host reads of tensors on the training thread, by phase: inside RowCache.prefetch(ahead=True)
    ('ahead'); else in the phase the caller pushes on the returned list: 'lookup' counts every read,
    'update' those inside the cache's methods (none pushed: not counted)."""
    import threading

    main, counts, phase, depth = threading.main_thread(), {"ahead": 0, "lookup": 0, "update": 0}, [], [0]

    def counted(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if phase and threading.current_thread() is main and (phase[-1] != "update" or depth[0]):
                counts[phase[-1]] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in READS:
        counted(owner, name)

    def inside(name):
        fn = getattr(cache_cls, name)

        def wrapper(self, *args, **kwargs):
            ahead = name == "prefetch" and kwargs.get("ahead", args[2] if len(args) > 2 else False)
            phase.append("ahead") if ahead else None
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                phase.pop() if ahead else None

        monkeypatch.setattr(cache_cls, name, wrapper)

    for name in ("prefetch", "read", "write"):
        inside(name)
    return counts, phase


def test_device_path_reads_one_count_per_read_ahead_and_nothing_else(tmp_path, staged_on_cpu, monkeypatch):
    """The device path of the cache in the steady state: a coming batch's read ahead reads one thing
    back to the host (its counts of unique, missing and pinned rows), its lookup and its update none
    (on a GPU each read is a sync, which stalls the step). Counted on the CPU stand-in: every tensor
    read the training thread makes in the cache's read ahead, in the forward, and in the cache during
    the update, with victims chosen by topk as on a GPU."""
    from neorec.embedding.cache import slots as slots_module

    monkeypatch.setattr(slots_module, "smallest", lambda key, k: torch.topk(key, k, largest=False).indices)
    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt)
    cached = cached_engine(ts, opt, tmp_path, tier="dram", fraction=0.5, io_thread=True)
    gen = torch.Generator().manual_seed(11)
    batches = [batch(gen, ts) for _ in range(16)]
    grads = [torch.randn(16, plain.output_dim, generator=gen) for _ in batches]
    for i in range(8):  # fills the caches: evictions from here on
        cached.prefetch(batches[i + 1])
        cached(batches[i]).backward(grads[i])
        plain(batches[i]).backward(grads[i])
    evictions = sum(s["evictions"] for s in cached.cache_stats().values())
    assert evictions > 0
    counts, phase = count_host_reads(monkeypatch, RowCache)
    for i in range(8, len(batches) - 1):
        cached.prefetch(batches[i + 1])  # as the pipeline does: before batch i runs
        phase.append("lookup")
        pooled = cached(batches[i])
        phase[-1] = "update"
        pooled.backward(grads[i])
        phase.pop()
        plain(batches[i]).backward(grads[i])
    assert counts == {"ahead": 7 * len(cached.weights), "lookup": 0, "update": 0}
    monkeypatch.undo()
    assert sum(s["evictions"] for s in cached.cache_stats().values()) > evictions
    assert_same_state(plain, cached)  # and the sums without a read of their count are exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpu_cache_steps_sync_once_per_read_ahead(tmp_path, policy) -> None:
    """A GPU cache over host memory in the steady state, under torch.cuda.set_sync_debug_mode("warn"),
    counting the training thread's syncs: one per coming batch's read ahead (its counts), none in
    the lookup or the update; and still bitwise training the tables in GPU memory."""
    import threading
    import warnings

    ts = [  # one group: the engine's own prefetch reads no per-feature sizes
        TableConfig(name="users", rows=3000, dim=8, features=["user", "friend"]),
        TableConfig(name="items", rows=2000, dim=8, features=["item"], pooling="mean"),
    ]
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt, device="cuda")  # the Triton kernels, as the cached engine
    cached = cached_engine(
        ts, opt, tmp_path, policy, tier="dram", fraction=0.3, device="cuda", io_thread="auto"
    )
    assert len(cached.weights) == 1 and cached.weights[0].cache.io.background
    gen = torch.Generator().manual_seed(12)
    # 128 samples: two batches' rows fit in the cache beside each other, so every read ahead is complete
    batches = [batch(gen, ts, batch_size=128).to("cuda") for _ in range(20)]
    grads = [torch.randn(128, plain.output_dim, generator=gen).to("cuda") for _ in batches]
    syncs = {"ahead": 0, "lookup": 0, "update": 0}
    phase: list[str] = []
    main = threading.main_thread()

    def seen(*args, **kwargs) -> None:
        if phase and threading.current_thread() is main:
            syncs[phase[-1]] += 1

    for i in range(len(batches) - 1):
        counting = i >= 12  # the cache is full by then: evictions every step
        if counting:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            phase.append("ahead")
            cached.prefetch(batches[i + 1])
            phase[-1] = "lookup"
            pooled = cached(batches[i])
            phase[-1] = "update"
            pooled.backward(grads[i])
            phase.pop()
        torch.cuda.set_sync_debug_mode("default")
        reference = plain(batches[i])
        assert torch.equal(pooled, reference), f"step {i}"
        reference.backward(grads[i])
        if not counting:
            syncs = dict.fromkeys(syncs, 0)
    assert syncs == {"ahead": 7, "lookup": 0, "update": 0}, syncs
    assert_same_state(plain, cached)
    assert sum(s["evictions"] for s in cached.cache_stats().values()) > 0


def test_device_reads_ahead_land_in_their_slots_only_at_result() -> None:
    """DeviceIO's read ahead follows the writes submitted before it (one worker, in order), and the
    worker fills a host buffer only: the records reach their slots when result() is asked, on the
    caller's thread (on a GPU, in its stream's order)."""
    import threading

    from neorec.embedding.cache.background import BackgroundIO
    from neorec.embedding.cache.device_io import DeviceIO

    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    layout = backing.layout
    io_ = DeviceIO(BackgroundIO(backing, background=True), torch.device("cpu"))
    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([3]), layout.pack({"weight": torch.full((1, 4), -1.0)}))
    buffer = layout.pack({"weight": torch.zeros(3, 4)})
    ahead = io_.read_ahead(torch.tensor([2, 3]), buffer, torch.tensor([2, 0]))
    release.set()
    io_.drain()  # the worker's read is done...
    assert not ahead.done() and bool((layout.view(buffer, "weight") == 0).all())  # ...the slots untouched
    ahead.result()
    assert ahead.done()
    assert torch.equal(
        layout.view(buffer, "weight"), torch.tensor([[-1.0, -1, -1, -1], [0, 0, 0, 0], [8, 9, 10, 11]])
    )
    ahead.result()  # once only
    io_.close()


def test_ssd_tables_with_train_device_cuda_are_built(tmp_path, monkeypatch) -> None:
    """train.device: cuda with tables in tier ssd builds the fused engine over a cache on the GPU of
    the tables' files, with reads ahead on the worker thread (io_thread auto). No GPU here: the
    engine and the cache are stand-ins that record what they are given (the GPU tests below and in
    test_train_cuda.py train through the real ones)."""
    from types import SimpleNamespace

    import neorec.embedding.cache.build as cache_build
    import neorec.embedding.fused as fused
    from neorec.embedding.fused.storage import StorageSpec
    from neorec.train.embeddings import build_embeddings

    engine: dict = {}
    monkeypatch.setattr(fused, "FusedEmbeddingCollection", lambda tables, optimizer, **kw: engine.update(kw))

    def row_cache(tables, backing, capacity, policy, device, io_thread):
        engine["cache"] = (backing, capacity, device, io_thread)
        return SimpleNamespace(layout=backing.layout, num_rows=backing.num_rows)

    monkeypatch.setattr(cache_build, "RowCache", row_cache)
    sets = ["train.device=cuda", "embedding.tier=ssd", f"embedding.cache.directory={tmp_path}"]
    cfg = load_config("default", TINY + sets)
    build_embeddings(cfg, [TableConfig(name="C1", rows=50, dim=4, features=["C1"])])
    assert engine["device"] == "cuda" and engine["table_tiers"] == {"C1": "ssd"}
    specs = {"weight": StorageSpec(50, 4, torch.float32, lambda a, b: torch.zeros(b - a, 4))}
    storages = engine["group_storage_factory"]([("C1", 0, 50)], specs, torch.device("cuda"))
    backing, capacity, device, io_thread = engine["cache"]
    assert isinstance(backing, SsdBacking) and backing.path == tmp_path / "C1.rows.bin"
    assert (capacity, device, io_thread) == (10, torch.device("cuda"), True)
    assert set(storages) == {"weight"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_gpu_cache_over_ssd_files_is_bitwise_uncached_and_restores(
    tmp_path, monkeypatch, name, policy, kernels
) -> None:
    """The cache in GPU memory (20% of the rows), every row in files, reads ahead staged through
    pinned host buffers on the worker thread: training through it, and through a checkpoint's save
    and load into another GPU cache over other files, is bitwise training the tables in GPU memory."""
    from neorec.embedding.cache import device_io

    pinned: list[bool] = []

    class CheckedRead(device_io.StagedRead):
        def __init__(self, read, host, buffer, slots) -> None:
            super().__init__(read, host, buffer, slots)
            pinned.append(host.is_pinned() and buffer.is_cuda)

    monkeypatch.setattr(device_io, "StagedRead", CheckedRead)
    ts = tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt, device="cuda", kernels=kernels)
    cached = cached_engine(
        ts, opt, tmp_path, policy, tier="ssd", fraction=0.2, device="cuda", kernels=kernels
    )
    cache = cached.weights[0].cache
    assert cache.records.is_cuda and cache.slot_of.is_cuda and isinstance(cache.backing, SsdBacking)
    gen = torch.Generator().manual_seed(4)
    train_both(plain, cached, gen, 10, ts, prefetch=True, device="cuda")
    assert_same_state(plain, cached)
    stats = cached.cache_stats()
    assert (
        sum(s["evictions"] for s in stats.values()) > 0 and sum(s["writebacks"] for s in stats.values()) > 0
    )
    assert pinned and all(pinned)
    restored = cached_engine(
        ts, opt, tmp_path, policy, tier="ssd", fraction=0.2, seed=1, device="cuda", kernels=kernels
    )
    restore_and_continue(plain, cached, restored, gen, 5, ts, opt, "cuda", kernels)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize(("tier", "io_thread"), [("dram", False), ("ssd", True), ("ssd", False)])
def test_one_hot_and_tiny_cache_are_exact(tmp_path, tier, io_thread, prefetch) -> None:
    """A cache of 2 rows, smaller than one batch: rows that do not fit go straight to the backing tier
    (with prefetch: while the next batch's rows are being read ahead, so staged rows go stale)."""
    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adam", lr=0.05)
    plain, cached = (
        FusedEmbeddingCollection(ts, opt),
        cached_engine(ts, opt, tmp_path, tier=tier, fraction=0.005, io_thread=io_thread),
    )
    assert cached.weights[0].cache.io.background == io_thread
    gen = torch.Generator().manual_seed(3)
    train_both(plain, cached, gen, 4, ts, prefetch=prefetch, one_hot=True)
    train_both(plain, cached, gen, 4, ts, prefetch=prefetch)
    assert_same_state(plain, cached)
    assert any(s["write_through"] > 0 for s in cached.cache_stats().values())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cached_training_matches_float64_reference(tmp_path, name) -> None:
    ts = tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    engine, ref = cached_engine(ts, opt, tmp_path, "lfu", fraction=0.05), Float64Reference(ts, opt)
    gen = torch.Generator().manual_seed(5)
    batches = (batch(gen, ts) for _ in range(4))
    assert_matches(engine, ref, step_with_reference(engine, ref, batches, gen))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_checkpoint_restore_is_bitwise(tmp_path, policy) -> None:
    """Save a cached engine mid-training, restore into a fresh one (other seed, other files) and into
    a plain one; all three continue bitwise like an uncached run."""
    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adam", lr=0.05)
    plain, cached = FusedEmbeddingCollection(ts, opt), cached_engine(ts, opt, tmp_path, policy)
    gen = torch.Generator().manual_seed(9)
    train_both(plain, cached, gen, 5, ts)
    saved = io.BytesIO()
    torch.save(cached.state_dict(), saved)
    saved.seek(0)
    checkpoint = torch.load(saved)
    restored = cached_engine(ts, opt, tmp_path, policy, seed=1)
    restored.load_state_dict(checkpoint)
    plain_restored = FusedEmbeddingCollection(ts, opt, seed=1)
    plain_restored.load_state_dict(checkpoint)
    state = gen.get_state()
    train_both(plain, cached, gen, 5, ts, prefetch=True)
    for other in (restored, plain_restored):
        gen.set_state(state)
        fresh = FusedEmbeddingCollection(ts, opt)
        fresh.load_state_dict(checkpoint)
        train_both(fresh, other, gen, 5, ts)
        assert_same_state(plain, other)
    assert_same_state(plain, cached)


def test_ssd_table_is_created_without_materialising(tmp_path) -> None:
    """A 512 MiB table (weights) goes to disk window by window; its state_dict entry is a view of the
    file: resident memory grows by far less than the table."""
    t = TableConfig(name="big", rows=2_000_000, dim=64, features=["big"])
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    before = _rss_mib()
    engine = cached_engine([t], opt, tmp_path, fraction=0.001)
    backing = engine.weights[0].cache.backing
    assert isinstance(backing, SsdBacking)
    assert backing.layout.record_bytes == t.dim * 4  # sgd: the weights alone, 256 bytes
    assert backing.path.stat().st_size == t.rows * t.dim * 4
    weight = engine.state_dict()["tables.big.weight"]
    assert weight.shape == (t.rows, t.dim)
    assert torch.equal(weight[123_456:123_460], init_rows(t, 0, 123_456, 123_460))
    assert _rss_mib() - before < 150, "creating or saving the table loaded it into memory"


@pytest.mark.parametrize("release_bytes", [1 << 12, 256 << 20])
def test_ssd_reads_from_the_map_equal_positioned_reads(tmp_path, release_bytes) -> None:
    """Both ways of reading missed rows (reads="map", the default, and "pread" on I/O threads) give
    the records written, for single rows, runs of neighbours, the first and last rows, more rows than
    one piece, and none; with a tiny release size the map's pages are dropped after every piece."""
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 24, torch.float32), ("momentum1", 0, torch.float32)])
    rows_total = 20_000
    values = torch.randn(rows_total, 24, generator=torch.Generator().manual_seed(3))
    inits = {
        "weight": lambda a, b: values[a:b],
        "momentum1": lambda a, b: torch.arange(a, b, dtype=torch.float32),
    }
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, rows_total, inits)
    by_map = SsdBacking(path, layout, rows_total, release_bytes, reads="map")
    by_pread = SsdBacking(path, layout, rows_total, release_bytes, reads="pread")
    by_map.piece_rows = 1000  # rows not in ascending order: pieces of 1000, each followed by the check
    picks = torch.cat([torch.tensor([0, 5, 6, 7, 19_999]), torch.randperm(rows_total)[:4321]])
    for rows in (torch.unique(picks), torch.arange(100, 3100), torch.empty(0, dtype=torch.int64)):
        got = by_map.read(rows)
        assert torch.equal(got, by_pread.read(rows))
        assert torch.equal(layout.view(got, "weight"), values[rows])
        assert torch.equal(layout.view(got, "momentum1"), rows.to(torch.float32))
    shuffled = picks[torch.randperm(picks.numel())]
    got = by_map._gather(by_map._words, by_map.fd, shuffled).view(torch.uint8)
    assert torch.equal(
        got, by_pread.read(torch.unique(picks))[torch.searchsorted(torch.unique(picks), shuffled)]
    )
    with pytest.raises(ValueError, match="ssd reads"):
        SsdBacking(path, layout, rows_total, reads="mmap")


def test_ssd_map_reads_stay_within_release_bytes(tmp_path, monkeypatch) -> None:
    """Gathering many scattered rows (from the table file and from the write log) never lets the
    process's resident file pages grow past release_bytes over the last drop, even where each row
    maps a 2 MiB page-cache folio; checked after every gather."""
    from neorec.embedding.cache import backing as backing_module
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 64, torch.float32), ("momentum1", 64, torch.float32)])
    rows_total = 100_000  # 49 MiB of 512-byte records
    path = tmp_path / "t.rows.bin"
    zeros = {name: (lambda a, b: torch.zeros(b - a, 64)) for name in ("weight", "momentum1")}
    create_ssd_file(path, layout, rows_total, zeros)
    release = 8 << 20
    store = SsdBacking(path, layout, rows_total, release, reads="map", log_fraction=0.5)
    worst = 0
    gather = torch.index_select

    def checked(*args, **kwargs):
        nonlocal worst
        out = gather(*args, **kwargs)
        worst = max(worst, backing_module._resident_file_bytes() - store._baseline)
        return out

    gen = torch.Generator().manual_seed(5)
    written = torch.unique(torch.randint(0, rows_total, (6000,), generator=gen))
    store.write(written, layout.empty(written.numel()))  # now in the write log
    monkeypatch.setattr(torch, "index_select", checked)
    for _ in range(6):
        store.read(torch.unique(torch.randint(0, rows_total, (5000,), generator=gen)))
    assert 0 < worst <= release


@pytest.mark.parametrize("reads", ["map", "pread"])
def test_write_log_keeps_every_rows_last_record(tmp_path, reads) -> None:
    """Rows written back go to the write log (write_log.py): a log of 10% of the rows, so its halves
    fill, swap and are folded into the table file many times, in windows of 64 rows. After every
    write, rows read back (from the log or the file), ranges read in windows, a field written over a
    range and a map view of the file all hold each row's last written record."""
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 6, torch.float32), ("momentum1", 6, torch.float32)])
    n = 3_000
    gen = torch.Generator().manual_seed(7)
    expected = {"weight": torch.randn(n, 6, generator=gen), "momentum1": torch.zeros(n, 6)}
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, n, {k: (lambda a, b, v=v: v[a:b].clone()) for k, v in expected.items()})
    backing = SsdBacking(path, layout, n, 1 << 16, reads=reads, log_fraction=0.1)
    log = backing.log
    log._window_rows = 64
    for step in range(60):
        rows = torch.unique(
            torch.randint(0, n, (int(torch.randint(1, 400, (1,), generator=gen)),), generator=gen)
        )
        values = {k: torch.randn(rows.numel(), 6, generator=gen) for k in expected}
        backing.write(rows, layout.pack(values))
        for k in expected:
            expected[k][rows] = values[k]
        probe = torch.unique(torch.randint(0, n, (500,), generator=gen))
        assert torch.equal(layout.view(backing.read(probe), "weight"), expected["weight"][probe]), step
        if step % 20 == 19:
            assert torch.equal(backing.read_range("momentum1", 0, n), expected["momentum1"])
    assert log.appended > 5 * log.half and log.compacted_windows > 0  # it swapped and folded
    backing.write_range("weight", 100, 900, torch.full((800, 6), 2.0))
    expected["weight"][100:900] = 2.0
    assert torch.equal(backing.read(torch.arange(n)), layout.pack(expected))
    assert bool((log.where[100:900] < 0).all())  # those rows live in the file again
    assert torch.equal(backing.view_range("momentum1", 0, n), expected["momentum1"])  # the file itself
    assert bool((log.where < 0).all())
    with pytest.raises(ValueError, match="write log"):
        SsdBacking(path, layout, n, log_fraction=1.5)


def test_write_log_reads_race_appends_and_folds(tmp_path) -> None:
    """A thread reads rows while another appends new versions of them, filling, swapping and folding
    the log's halves: every record read is whole (all its words from one version of that row) and no
    older than the last version written before the read began."""
    import threading

    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 16, torch.float32)])  # 64 bytes: 8 int64 words a record
    n = 500
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, n, {"weight": lambda a, b: torch.zeros(b - a, 16)})
    backing = SsdBacking(path, layout, n, 1 << 16, log_fraction=0.2)
    backing.log._window_rows = 25
    version = torch.zeros(n, dtype=torch.int64)  # last version written per row
    done, errors = threading.Event(), []

    def writer() -> None:
        gen = torch.Generator().manual_seed(1)
        for v in range(1, 100):
            rows = torch.unique(torch.randint(0, n, (40,), generator=gen))
            records = (rows * 1_000_000 + v).unsqueeze(1).expand(-1, 8).contiguous()  # words: row, version
            backing.write(rows, records.view(torch.uint8))
            version[rows] = v
        done.set()

    def reader() -> None:
        while not done.is_set():
            rows = torch.arange(n)
            floor = version.clone()
            words = backing.read(rows).view(torch.int64)
            seen = words[:, 0] % 1_000_000
            if not bool((words == words[:, :1]).all()):
                errors.append("torn record")
            elif not bool(((words[:, 0] // 1_000_000 == rows) | (words[:, 0] == 0)).all()):
                errors.append("another row's record")
            elif not bool((seen >= floor).all()):
                errors.append("a stale record")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert backing.log.compacted_windows > 0, "the log never folded"
    final = backing.read(torch.arange(n)).view(torch.int64)[:, 0] % 1_000_000
    assert torch.equal(final, version)


def test_rows_read_ahead_are_pinned_until_their_lookup() -> None:
    """A batch read ahead keeps its slots until it is looked up: a lookup in between that needs room
    evicts other rows (or reads past the cache), never those; the records arrive intact."""
    from neorec.embedding.cache.background import BackgroundIO

    weights = torch.arange(80, dtype=torch.float32).view(20, 4)
    backing = DramBacking.from_tensors({"weight": weights.clone()})
    cache = RowCache([("t", 0, 20)], backing, capacity=4, policy="lru")
    cache.io = BackgroundIO(backing, background=True)  # reads ahead on a worker thread
    a, b = torch.tensor([0, 1, 2]), torch.tensor([5, 6])
    cache.prefetch(a, lookup=True)
    cache.prefetch(b, lookup=True, ahead=True)
    resident = set(cache.row_of.tolist())
    assert {5, 6} <= resident and len(resident & {0, 1, 2}) == 2  # b has slots at once (one of a's out)
    c = torch.tensor([7, 8, 9])
    cache.prefetch(c, lookup=True)  # room for 2 beside b's pinned slots; 9 read past the cache
    assert {5, 6} <= set(cache.row_of.tolist())
    assert torch.equal(cache.read("weight", c), weights[c])
    cache.write("weight", c, torch.zeros(3, 4))
    cache.prefetch(b, lookup=True)  # its lookup: the records read ahead are placed
    assert torch.equal(cache.read("weight", b), weights[b])
    cache.flush()
    assert torch.equal(backing.field("weight")[c], torch.zeros(3, 4))
    cache.close()


def test_stats_on_a_hand_checked_sequence() -> None:
    """Capacity 2, rows of 4 fp32 weights (16 bytes). Lookups [0, 1], [1, 2], [0, 2], [2, 3]."""
    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    lru = RowCache([("t", 0, 10)], backing, capacity=2, policy="lru")
    for rows in ([0, 1], [1, 2], [0, 2], [2, 3]):
        lru.prefetch(torch.tensor(rows), lookup=True)
        lru.write("weight", torch.tensor(rows[:1]), torch.zeros(1, 4))  # update the first row
    # misses: 0, 1 | 2 (evicts 0, dirty) | 0 (evicts 1, dirty) | 3 (evicts 0, dirty; 2 was used later)
    s = lru.stats.by_table()["t"]
    assert (s["lookups"], s["misses"], s["evictions"], s["writebacks"]) == (8, 5, 3, 3)
    assert s["hit_rate"] == pytest.approx(1 - 5 / 8)
    # a record of 16 bytes of weights takes 64 (records are padded to multiples of 64 bytes)
    assert s["mib_from_dram"] == pytest.approx(5 * 64 / 2**20) and s["mib_to_dram"] == pytest.approx(
        3 * 64 / 2**20
    )
    assert sorted(lru.row_of.tolist()) == [2, 3]
    # LFU evicts the least used row: 0 (1 use) when 2 comes in, then 2 (1 use; 1 has 3) when 3 comes in
    lfu = RowCache([("t", 0, 10)], DramBacking.from_tensors({"weight": torch.zeros(10, 4)}), 2, "lfu")
    for rows in ([0, 1], [1], [1, 2], [3]):
        lfu.prefetch(torch.tensor(rows), lookup=True)
    assert sorted(lfu.row_of.tolist()) == [1, 3]
    lfu.flush()
    assert lfu.stats.by_table()["t"]["evictions"] == 2


def test_values_survive_eviction_and_flush() -> None:
    backing = DramBacking.from_tensors({"weight": torch.zeros(6, 2)})
    cache = RowCache([("t", 0, 6)], backing, capacity=2)
    cache.prefetch(torch.tensor([4, 5]))
    cache.write("weight", torch.tensor([4, 5]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert backing.field("weight")[4].sum() == 0  # written back only on eviction or flush
    assert torch.equal(
        cache.read("weight", torch.tensor([0, 5, 4])), torch.tensor([[0.0, 0], [3, 4], [1, 2]])
    )
    cache.flush()
    assert torch.equal(backing.field("weight")[4:], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_lfu_counts_decay() -> None:
    """Row 0 is looked up 8 times, then rows 1 and 2 take turns. Without decay row 0 keeps its count
    and its slot for ever; halving the counts every 4 looked-up rows lets it go (hand-checked: its
    count is 3 after its 8 lookups, 1 after the next halving, then it is the oldest of two 1s)."""
    sequence = [[0]] * 8 + [[1], [2], [1], [2], [1]]

    def resident_after(decay_rows: int) -> list[int]:
        backing = DramBacking.from_tensors({"weight": torch.zeros(10, 4)})
        cache = RowCache([("t", 0, 10)], backing, 2, "lfu", lfu_decay_rows=decay_rows)
        for rows in sequence:
            cache.prefetch(torch.tensor(rows), lookup=True)
        return sorted(cache.row_of.tolist())

    assert resident_after(10**9) == [0, 1]
    assert resident_after(4) == [1, 2]


def test_lfu_count_survives_eviction() -> None:
    """A cache of 2. Row 0 is looked up 6 times, pushed out by a batch of rows 1 and 2, and comes back
    with its count (7), pushing out one of them; row 1 is looked up twice (count 2 or 3), then row 3
    comes: the victim is the smaller count, row 1. Counting afresh, row 0 would have come back with
    1 and been the victim instead (hand-checked both ways)."""
    backing = DramBacking.from_tensors({"weight": torch.zeros(10, 4)})
    cache = RowCache([("t", 0, 10)], backing, 2, "lfu")
    for rows in [[0]] * 6 + [[1, 2], [0], [1], [1], [3]]:
        cache.prefetch(torch.tensor(rows), lookup=True)
    assert int(cache.history[0]) == 6 and sorted(cache.row_of.tolist()) == [0, 3]
    assert int(cache.uses[int(cache.slot_of[0])]) == 7


def test_reads_ahead_follow_earlier_writes_and_pending_writes_are_read() -> None:
    """The background jobs' rules (background.py), on a host-memory backing run on a worker thread."""
    import threading

    from neorec.embedding.cache.background import BackgroundIO

    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    io_ = BackgroundIO(backing, background=True)
    layout = backing.layout
    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([3]), layout.pack({"weight": torch.full((1, 4), -1.0)}))
    buffer = layout.empty(3)
    ahead = io_.read_ahead(torch.tensor([2, 3]), buffer, torch.tensor([2, 0]))  # behind the write: sees it
    assert not ahead.done()
    release.set()
    ahead.result()
    assert torch.equal(
        layout.view(buffer, "weight")[[2, 0]], torch.tensor([[8.0, 9, 10, 11], [-1, -1, -1, -1]])
    )
    backing.write = write

    # a write-back still pending: reads take its records, not the backing store's
    import threading

    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([5, 6]), layout.pack({"weight": torch.full((2, 4), 7.0)}))
    assert torch.equal(backing.field("weight")[5], torch.tensor([20.0, 21, 22, 23]))  # not yet written
    got = layout.view(io_.read(torch.tensor([4, 5, 6])), "weight")
    assert torch.equal(got, torch.tensor([[16.0, 17, 18, 19], [7, 7, 7, 7], [7, 7, 7, 7]]))
    release.set()
    io_.close()
    assert torch.equal(backing.field("weight")[5:7], torch.full((2, 4), 7.0))


_SAVE_SCRIPT = """
import ctypes, json, sys, torch
from pathlib import Path
import neorec.checkpoint.pieces as pieces, neorec.checkpoint.stream as stream
import neorec.embedding.cache.backing as backing
from neorec.checkpoint import load_checkpoint, save_checkpoint
from neorec.embedding.cache import CacheSettings, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch
from neorec.utils.files import check_zip

# glibc returns freed blocks of 1 MiB and more at once (M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_ would
# set at start), so the peak counts live memory only
assert ctypes.CDLL(None).mallopt(-3, 1 << 20) == 1
pieces.WINDOW_BYTES = stream.WINDOW_BYTES = backing._WINDOW_BYTES = 8 << 20  # windows of 8 MiB
root = Path(sys.argv[1])
table = TableConfig(name="big", rows=1_000_000, dim=32, features=["big"])
opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)

def ssd_engine(name):
    settings = CacheSettings(fraction=0.01, directory=root / name, release_mib=8)
    factory = cached_storage_factory({"big": "ssd"}, settings)
    return FusedEmbeddingCollection([table], opt, group_storage_factory=factory)

def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

def growth(work):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident memory
    before = kib("VmRSS")
    work()
    return (kib("VmHWM") - before) / 1024

engine = ssd_engine("a")
gen = torch.Generator().manual_seed(0)
for _ in range(3):  # updated rows in the file, and in the cache (dirty) when saving
    ids = torch.randint(0, table.rows, (4096,), generator=gen)
    pooled = engine(SparseBatch.from_features({"big": (ids, torch.ones(4096, dtype=torch.int64))}))
    pooled.backward(torch.randn(pooled.shape, generator=gen))
out = {
    "save": growth(lambda: save_checkpoint(root / "ckpt", 3, engine)),
    "model_pt": growth(lambda: stream.save_model_state(engine.state_dict(), root / "model.pt", engine)),
}
restored = ssd_engine("b")
out["load"] = growth(lambda: load_checkpoint(root / "ckpt" / "step-00000003", restored))
plain = FusedEmbeddingCollection([table], opt, seed=1)
load_checkpoint(root / "ckpt" / "step-00000003", plain)
model_pt = torch.load(root / "model.pt", weights_only=True, mmap=True)
check_zip(root / "model.pt", "model file", "")  # every entry's CRC32, computed by the streaming save
for key, value in plain.state_dict().items():
    assert torch.equal(value, engine.state_dict()[key]), key
    assert torch.equal(value, restored.state_dict()[key]), key
    assert torch.equal(value, model_pt[key]), key
print(json.dumps(out))
"""


def test_ssd_checkpoint_and_model_pt_stream_rows_in_windows(tmp_path) -> None:
    """Saving a 256 MiB SSD table (weights + AdaGrad state) as a sharded checkpoint or as model.pt,
    and loading the checkpoint into another SSD table, raise peak RSS by a few windows (8 MiB here),
    not by the table; what was saved equals the table."""
    from forked import run_python

    # in a process of its own, forked from one that has imported torch and neorec (tests/forked.py)
    run = run_python(["-c", _SAVE_SCRIPT, str(tmp_path)], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    growth = json.loads(run.stdout.strip().splitlines()[-1])
    table_mib = 1_000_000 * 32 * 4 * 2 / 2**20  # 244 MiB
    for step, mib in growth.items():
        assert mib < table_mib / 5, f"{step}: peak RSS grew by {mib:.0f} MiB for a {table_mib:.0f} MiB table"


TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=2048", "data.synthetic.eval_samples=512", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=4",
]  # fmt: skip


def test_trainer_with_ssd_tables_logs_cache_stats_and_matches_memory(tmp_path) -> None:
    from neorec.train.trainer import Trainer

    ssd = [
        "embedding.tier=ssd",
        f"embedding.cache.directory={tmp_path / 'tables'}",
        "embedding.cache.policy=lfu",
    ]
    a = Trainer(load_config("default", TINY), tmp_path / "a").fit()
    b = Trainer(load_config("default", TINY + ssd + ["embedding.cache.fraction=0.5"]), tmp_path / "b").fit()
    assert a.losses == b.losses
    saved_a, saved_b = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in "ab")
    assert saved_a.keys() == saved_b.keys()
    assert all(torch.equal(saved_a[k], saved_b[k]) for k in saved_a)  # model.pt of ssd tables too
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    cache = [r for r in records if r["split"] == "cache"]
    assert cache and 0 <= cache[-1]["hit_rate"] <= 1 and cache[-1]["evictions"] > 0
    assert "mib_from_ssd" in cache[-1]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["embedding.tier=ssd"], "embedding.cache.directory"),
        (["embedding.cache.fraction=0.1", "embedding.cache.size_mib=10"], "embedding.cache.fraction or"),
        (["embedding.tier=disk"], "embedding.tier"),
        (["embedding.cache.policy=fifo"], "embedding.cache.policy"),
        (["embedding.cache.fraction=1.5"], "embedding.cache.fraction"),
        (["embedding.tables={C1: {tier: tape}}"], "embedding.tables.C1.tier"),
        (["embedding.cache.io_thread=sometimes"], "embedding.cache.io_thread"),
    ],
)
def test_bad_cache_config_names_the_key(sets, message) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config("default", TINY + sets)


def test_cache_build_errors_name_tables_and_keys(tmp_path) -> None:
    from neorec.train.trainer import Trainer

    # C1 would share one buffer with C2 (same dim, dtype, optimizer) but has its own tier: its own group
    mixed = TINY + [f"embedding.cache.directory={tmp_path}", "embedding.tables={C1: {tier: ssd}}"]
    emb = Trainer(load_config("default", mixed), tmp_path / "x").embeddings
    assert [len(g.tables) for g in emb.layout.groups] == [1, 3] and set(emb.cache_stats()) == {"C1"}
    with pytest.raises(ConfigError, match=r"different tiers .*'ssd': \['a'\]"):  # the factory's own check
        factory = cached_storage_factory({"a": "ssd"}, CacheSettings(directory=tmp_path))
        FusedEmbeddingCollection([TableConfig(name=n, rows=10, dim=4, features=[n]) for n in "ab"],
                                 EmbeddingOptimizerConfig(name="sgd", lr=0.1), group_storage_factory=factory)  # fmt: skip
    with pytest.raises(ConfigError, match="only the fused engine"):
        Trainer(
            load_config("default", TINY + ["embedding.tier=dram", "embedding.engine=reference"]),
            tmp_path / "y",
        )
    with pytest.raises(ConfigError, match=r"embedding\.cache\.size_mib"):
        settings = CacheSettings(fraction=None, size_mib=1e-6)
        factory = cached_storage_factory({"t": "dram"}, settings, total_cached_rows=10)
        FusedEmbeddingCollection([TableConfig(name="t", rows=10, dim=4, features=["t"])],
                                 EmbeddingOptimizerConfig(name="sgd", lr=0.1), group_storage_factory=factory)  # fmt: skip


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_io_thread_auto_only_where_a_core_is_left(monkeypatch) -> None:
    """auto: a worker thread only when torch's threads of every process on the node leave a core."""
    from neorec.embedding.cache.build import use_io_thread

    assert use_io_thread(True) and not use_io_thread(False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert not use_io_thread("auto")  # 2 cores, 2 intra-op threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert use_io_thread("auto")  # 4 cores, 2 threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not use_io_thread("auto")  # 2 processes x 2 threads on 4 cores
    assert use_io_thread("auto", "cuda")  # the step runs on the GPU, not on the intra-op threads
    assert not use_io_thread(False, "cuda")
    with pytest.raises(ConfigError, match="embedding.cache.io_thread"):
        use_io_thread("sometimes")


def test_release_auto_is_a_quarter_of_memory_per_process_on_the_node(monkeypatch) -> None:
    """release_mib auto: a quarter of physical memory over torchrun's LOCAL_WORLD_SIZE; a number is MiB."""
    from neorec.embedding.cache.build import release_bytes

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert release_bytes("auto") == memory // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert release_bytes("auto") == memory // 4 // 4
    assert release_bytes(256) == 256 << 20 and release_bytes(0.5) == 1 << 19
    for bad in ("sometimes", 0, -1.0):
        with pytest.raises(ConfigError, match="embedding.cache.release_mib"):
            release_bytes(bad)
