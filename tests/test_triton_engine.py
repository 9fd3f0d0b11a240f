"""The Triton kernels inside the fused engine (neorec/embedding/fused): one launch of each kernel per
group, bitwise repeats, cached groups whose records are updated in place, the GPU cache path, hot rows
and every feature kind, the torch path for wide rows, and compilation for H100.

On a machine with a CUDA device they run there; without one they run on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there), as tests/test_triton_kernels.py does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fused_engine import (
    Float64Reference,
    assert_matches,
    make_tables,
    random_batch,
    run_steps,
    step_with_reference,
    train_both,
)
from test_triton_kernels import (
    CUDA,
    DEVICE,
    exact_num_chunks,
    pytestmark,  # noqa: F401 - the same marks: skipped without triton, the interpreter's warnings ignored
    torch_path_update,
)

from neorec.embedding.cache import CacheSettings, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection, triton_fused_update, triton_pool
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch


def zipf_batch(
    tables: list[TableConfig], gen: torch.Generator, batch: int, max_len: int, weighted: bool = True
) -> SparseBatch:
    """Bags of 0..max_len ids, most of them a handful of hot rows; weighted: with per-sample weights."""
    features = {}
    for t in tables:
        for f in t.features:
            lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
            n = int(lengths.sum())
            ids = torch.where(torch.rand(n, generator=gen) < 0.6, torch.randint(0, 3, (n,), generator=gen),
                              torch.randint(0, t.rows, (n,), generator=gen))  # fmt: skip
            weights = torch.rand(n, generator=gen) + 0.5
            features[f] = (ids, lengths, weights) if weighted else (ids, lengths)
    return SparseBatch.from_features(features)


def hot_row_chunks(tables: list[TableConfig], batch: SparseBatch, chunk: int) -> list[int]:
    """Per table, the chunks of `chunk` ids that the update splits the batch's hot rows into (a
    table's ids over all its features)."""
    return [exact_num_chunks(torch.cat([batch.feature(f)[0] for f in t.features]), chunk) for t in tables]


def train_steps(
    tables: list[TableConfig],
    opt: EmbeddingOptimizerConfig,
    batches: list[SparseBatch],
    grads: list[torch.Tensor],
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The pooled outputs and the final state of a Triton engine (stochastic rounding) trained on
    `batches` with output gradients `grads`."""
    engine = FusedEmbeddingCollection(tables, opt, device=DEVICE, kernels="triton", stochastic_rounding=True)
    return run_steps(engine, batches, grads, DEVICE)


def assert_bitwise_equal(a: tuple[list[torch.Tensor], dict[str, torch.Tensor]], b) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key


class CountingKernel:
    """Stands in for a Triton kernel: counts its launches (kernel[grid](...)) and runs them."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def count_launches(monkeypatch) -> dict[str, CountingKernel]:
    """Counters around the pooling, partial-sum and update kernels, by name."""
    counters = {}
    kernels = (
        (triton_pool, "_pool_kernel"),
        (triton_fused_update, "_partial_kernel"),
        (triton_fused_update, "_update_kernel"),
    )
    for module, name in kernels:
        counters[name] = CountingKernel(getattr(module, name))
        monkeypatch.setattr(module, name, counters[name])
    return counters


def test_mixed_dims_take_one_launch_of_each_kernel(monkeypatch) -> None:
    """make_tables' fp32 groups of dims 8 (two tables, features not adjacent in the output), 3 and
    16 under one optimizer: each step is one pooling launch, one launch of the hot rows' partial
    sums (chunks of 4 ids) and one update launch for all three, and the results equal the float64
    reference."""
    monkeypatch.setattr(triton_fused_update, "LONG_ROW_CHUNK", 4)
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    counters = count_launches(monkeypatch)
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05, weight_decay=0.01)
    engine, ref, outputs = train_both(make_tables(), opt, steps=2, seed=13, device=DEVICE, kernels="triton")
    assert sorted(g.dim for g in engine.layout.groups) == [3, 8, 16]
    assert {name: c.launches for name, c in counters.items()} == {
        "_pool_kernel": 2, "_partial_kernel": 2, "_update_kernel": 2
    }  # fmt: skip
    assert_matches(engine, ref, outputs)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_one_launch_is_bitwise_one_launch_per_group_and_repeats(name: str, monkeypatch) -> None:
    """Row-wise adagrad (a sum across the row) and adam on bf16 rows with stochastic rounding, groups
    of dims 5 (two tables with their own hyper-parameters), 12 and 3, no per-sample weights but one
    mean-pooled feature (so one group has scales and two have none), hot rows of every table in
    chunks of 3 ids: all groups in one launch of each kernel give bitwise the outputs, rows and
    state of a launch per group (with narrower blocks), and two runs give bitwise the same."""
    monkeypatch.setattr(triton_fused_update, "LONG_ROW_CHUNK", 3)
    opt = EmbeddingOptimizerConfig(name=name, lr=0.01, weight_decay=0.01)
    tables = [
        TableConfig(name="a", rows=30, dim=5, features=["a", "a2"], pooling="mean", dtype="bf16"),
        TableConfig(name="b", rows=20, dim=12, features=["b"], dtype="bf16"),
        TableConfig(name="c", rows=10, dim=3, features=["c"], dtype="bf16"),
        TableConfig(name="d", rows=15, dim=5, features=["d"], dtype="bf16",
                    optimizer=EmbeddingOptimizerConfig(name=name, lr=0.03, beta1=0.8)),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    batches = [zipf_batch(tables, gen, batch=5, max_len=5, weighted=False) for _ in range(2)]
    assert all(n >= 2 for b in batches for n in hot_row_chunks(tables, b, 3))  # every table's, each step
    grads = [torch.randn(b.batch_size, 30, generator=gen) for b in batches]
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    counters = count_launches(monkeypatch)

    combined = train_steps(tables, opt, batches, grads)
    assert [c.launches for c in counters.values()] == [2, 2, 2]
    assert_bitwise_equal(combined, train_steps(tables, opt, batches, grads))

    pool, update = triton_pool.pool, triton_fused_update.fused_update
    monkeypatch.setattr(triton_pool, "pool", lambda groups: [pool([g]) for g in groups])
    monkeypatch.setattr(
        triton_fused_update, "fused_update", lambda groups, step: [update([g], step) for g in groups]
    )
    per_group = train_steps(tables, opt, batches, grads)
    # two runs of one launch each, then three groups of two steps
    assert counters["_pool_kernel"].launches == counters["_update_kernel"].launches == 4 + 6
    assert_bitwise_equal(combined, per_group)


def kernels_only_with_cached_tags(monkeypatch, tables, opt, fraction: float) -> FusedEmbeddingCollection:
    """The Triton engine with "tags" behind a row cache over host memory of `fraction` of its rows;
    the torch path's update and pooling fail the test if anything takes them."""
    from neorec.embedding.fused import lookup

    factory = cached_storage_factory({"tags": "dram"}, CacheSettings(fraction=fraction, io_thread=False))
    engine = FusedEmbeddingCollection(
        tables, opt, device=DEVICE, kernels="triton", group_storage_factory=factory,
        table_tiers={"tags": "dram"},
    )  # fmt: skip
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    monkeypatch.setattr(lookup, "pool", lambda *args: pytest.fail("a group was pooled by the torch path"))
    return engine


def test_cached_group_joins_the_launches_and_updates_its_records_in_place(monkeypatch) -> None:
    """make_tables with "tags" (dim 16) behind a row cache over host memory that holds every row of a
    batch: the kernels take it with the other two groups, one launch each, reading and updating the
    cache's records at the rows' slots (nothing goes through the torch path), the slots are marked
    for write-back, and all of it matches the float64 reference."""

    tables, opt = make_tables(), EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
    engine = kernels_only_with_cached_tags(monkeypatch, tables, opt, fraction=1.0)
    cached = [gi for gi, g in enumerate(engine.layout.groups) if g.dim == 16]
    assert len(cached) == 1 and not engine.triton_lookup(cached[0], torch.device(DEVICE))
    counters = count_launches(monkeypatch)
    ref, gen = Float64Reference(tables, opt), torch.Generator().manual_seed(8)
    outputs = step_with_reference(engine, ref, [random_batch(tables, gen) for _ in range(2)], gen, DEVICE)
    assert counters["_pool_kernel"].launches == counters["_update_kernel"].launches == 2
    cache = engine.weights[cached[0]].cache
    assert bool(cache.dirty.any()) and int(cache.dirty.sum()) <= int((cache.row_of >= 0).sum())
    assert_matches(engine, ref, outputs)


def test_a_cache_on_a_device_named_without_its_index_takes_the_kernels() -> None:
    """A cache built for "cuda" holds tensors on cuda:0, the device a batch's tensors name: the cache
    names its device as its tensors do, so the kernels take its group (they compared "cuda" with
    cuda:0 and sent every cached group through the torch path). On the CPU: "cpu:0" against "cpu"."""
    factory = cached_storage_factory({"tags": "dram"}, CacheSettings(fraction=1.0, io_thread=False))
    engine = FusedEmbeddingCollection(
        make_tables(), EmbeddingOptimizerConfig(name="adagrad", lr=0.05), device="cuda" if CUDA else "cpu:0",
        kernels="triton", group_storage_factory=factory, table_tiers={"tags": "dram"},
    )  # fmt: skip
    (gi,) = [gi for gi, storage in enumerate(engine.weights) if hasattr(storage, "cache")]
    batch_device = torch.zeros(1, device="cuda" if CUDA else "cpu").device
    assert engine.cached_kernels(gi, batch_device) and engine.cached_kernels(gi, batch_device, update=True)


def test_cached_group_with_more_rows_than_its_cache_goes_through_copies(monkeypatch) -> None:
    """A cache of 3 rows for "tags": a batch's rows do not all get slots, so the kernels pool copies
    of its rows read through the cache and update copies of its unique rows, which go back through
    the cache's writes (the cached ones to their slots, the others to host memory); nothing takes
    the torch path, and it matches the float64 reference."""
    from neorec.embedding.cache.cached_storage import CachedStorage

    tables, opt = make_tables(), EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    engine = kernels_only_with_cached_tags(monkeypatch, tables, opt, fraction=0.1)
    written = []
    write = CachedStorage.write

    def counted(self, rows, values) -> None:
        written.append(self.name)
        write(self, rows, values)

    monkeypatch.setattr(CachedStorage, "write", counted)
    ref, gen = Float64Reference(tables, opt), torch.Generator().manual_seed(9)
    outputs = step_with_reference(engine, ref, [random_batch(tables, gen) for _ in range(2)], gen, DEVICE)
    assert written == ["weight", "momentum1"] * 2  # each step's copies of the weights and the state
    assert_matches(engine, ref, outputs)


@pytest.mark.skipif(CUDA, reason="CPU tensors through Triton's interpreter stand in for a GPU here; on a GPU, "
                    "test_cache.py's test_gpu_cache_over_host_memory_is_bitwise_uncached runs the same path")
@pytest.mark.parametrize(
    ("name", "policy"), [("rowwise_adagrad", "lru"), ("adam", "lfu"), ("adagrad", "lru")]
)
def test_kernels_through_the_gpu_cache_path_are_bitwise_uncached(
    tmp_path, staged_on_cpu, monkeypatch, name, policy
):
    """What a GPU cache over host memory runs with the Triton kernels (reads ahead on the worker,
    write-backs without a host read; CPU tensors standing in for device memory), under eviction
    pressure (a tenth of the rows cached: every table evicts and writes back within three batches of
    six samples): the cached groups' batches go through the kernels at their slots, and training is
    bitwise training the tables in memory with the same kernels."""
    from test_cache import assert_same_state, cached_engine
    from test_cache import tables as cache_tables
    from test_cache import train_both as train_cached

    ts = cache_tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=0.01, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt, kernels="triton")
    cached = cached_engine(
        ts, opt, tmp_path, policy, tier="dram", fraction=0.1, io_thread=True, kernels="triton"
    )
    in_place = []
    update = triton_fused_update.fused_update

    def seen(groups, step):
        in_place.extend(g.addresses is not None for g in groups)
        return update(groups, step)

    monkeypatch.setattr(triton_fused_update, "fused_update", seen)
    train_cached(plain, cached, torch.Generator().manual_seed(5), 3, ts, prefetch=True, batch_size=6)
    assert_same_state(plain, cached)
    stats = cached.cache_stats()
    assert set(stats) == {"users", "items", "tags"}
    assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats.values())
    assert staged_on_cpu and any(in_place)


def test_engine_is_bitwise_deterministic_with_hot_rows_and_every_feature(monkeypatch) -> None:
    """Adam on bf16 rows with stochastic rounding, row-wise adagrad on fp16, adagrad on fp32 with odd
    dims, mean pooling, hot rows of every table split into chunks of 3 ids: two runs give bitwise
    the same."""
    monkeypatch.setattr(triton_fused_update, "LONG_ROW_CHUNK", 3)
    tables = [
        TableConfig(name="a", rows=30, dim=5, features=["a", "a2"], pooling="mean", dtype="bf16",
                    optimizer=EmbeddingOptimizerConfig(name="adam", lr=0.01, weight_decay=0.01)),
        TableConfig(name="b", rows=20, dim=12, features=["b"], dtype="fp16",
                    optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)),
        TableConfig(name="c", rows=10, dim=3, features=["c"]),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    batches = [zipf_batch(tables, gen, batch=6, max_len=5) for _ in range(2)]
    assert all(n >= 2 for b in batches for n in hot_row_chunks(tables, b, 3))  # every table's, each step
    grads = [torch.randn(b.batch_size, 25, generator=gen) for b in batches]
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
    assert_bitwise_equal(train_steps(tables, opt, batches, grads), train_steps(tables, opt, batches, grads))


def test_wide_rows_take_the_torch_path(monkeypatch) -> None:
    """A group wider than the update kernel takes is updated by the torch path, and still matches."""
    monkeypatch.setattr(triton_fused_update, "MAX_UPDATE_DIM", 8)
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
    engine, ref, outputs = train_both(make_tables(), opt, steps=2, seed=5, device=DEVICE, kernels="triton")
    dims = [g.dim for g in engine.layout.groups]
    assert [engine.triton_update(gi, torch.device(DEVICE)) for gi in range(len(dims))] == [
        d <= 8 for d in dims
    ]
    assert_matches(engine, ref, outputs)


def test_kernels_compile_for_h100(tmp_path) -> None:
    """What the interpreter never does, generating GPU code: every kernel, each update rule with the
    options that change its code, compiles for sm_90 with Triton's compiler and ptxas
    (tests/compile_kernels.py, in a process of its own without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, rather than find an earlier run's binaries
    script = Path(__file__).resolve().parent / "compile_kernels.py"
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled for sm_90") == 8, result.stdout
