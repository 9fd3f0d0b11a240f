"""The row cache (neorec/embedding/cache): exact training through it (CPU, and the device path). Reads
ahead, stats and policies: tests/test_cache_reads.py; SSD files and the cache's config:
tests/test_cache_ssd.py.

Exactness is checked bitwise against the same engine without a cache (which test_fused_engine checks
against a float64 reference), with the cache far smaller than the rows the batches touch, so that
rows and their optimizer state are evicted and brought back many times.
"""

from __future__ import annotations

import io

import pytest
import torch
from test_fused_engine import Float64Reference, assert_matches, step_with_reference

from neorec.config.load import load_config
from neorec.embedding.cache import CacheSettings, SsdBacking, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
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


TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=2048", "data.synthetic.eval_samples=512", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=4",
]  # fmt: skip
