"""Fused engine: bitwise determinism, stochastic rounding, no table-sized gradient, the storage seam."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from neorec.embedding.fused import FusedEmbeddingCollection, TensorStorage, build_tensor_storage
from neorec.embedding.fused.storage import RowInit
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch


def multi_hot(tables: list[TableConfig], batch_size: int, max_len: int, seed: int) -> SparseBatch:
    gen = torch.Generator().manual_seed(seed)
    features = {}
    for t in tables:
        for f in t.features:
            lengths = torch.randint(0, max_len + 1, (batch_size,), generator=gen)
            n = int(lengths.sum())
            features[f] = (
                torch.randint(0, t.rows, (n,), generator=gen),
                lengths,
                torch.rand(n, generator=gen),
            )
    return SparseBatch.from_features(features)


def determinism_tables() -> list[TableConfig]:
    """Three groups: adagrad fp32, rowwise adagrad fp32 (same dim), adam bf16 with stochastic rounding."""
    return [
        TableConfig(name="a", rows=2000, dim=32, features=["a1", "a2"]),
        TableConfig(
            name="b", rows=1500, dim=32, features=["b1"], pooling="mean",
            optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05),
        ),
        TableConfig(
            name="c", rows=1000, dim=16, features=["c1"], dtype="bf16",
            optimizer=EmbeddingOptimizerConfig(name="adam", lr=0.01, weight_decay=0.01),
        ),
    ]  # fmt: skip


def run(
    threads: int, steps: int = 3, chunk_elements: int | None = 1 << 17
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """~120k ids per batch (60k in the biggest group): above torch's grain size, so sort, embedding_bag and the elementwise
    updates all take their multi-threaded paths when threads > 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tables = determinism_tables()
        engine = FusedEmbeddingCollection(
            tables, EmbeddingOptimizerConfig(name="adagrad"), stochastic_rounding=True
        )
        outputs = []
        for step in range(steps):
            pooled = engine(multi_hot(tables, batch_size=2048, max_len=30, seed=step))
            outputs.append(pooled.detach().clone())
            pooled.backward(torch.randn(pooled.shape, generator=torch.Generator().manual_seed(100 + step)))
        return outputs, {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        torch.set_num_threads(before)


def test_bitwise_deterministic_across_runs_thread_counts_and_chunk_sizes() -> None:
    """Also independent of how the work is chunked (from ~60 rows per chunk to one chunk)."""
    first, second, single = run(2), run(2), run(1)
    for other in (second, single, run(1, chunk_elements=2000), run(1, chunk_elements=None)):
        for a, b in zip(first[0], other[0], strict=True):
            assert torch.equal(a, b)
        assert first[1].keys() == other[1].keys()
        for k in first[1]:
            assert torch.equal(first[1][k], other[1][k]), k


def sgd_table(dtype: str, rows: int = 1, dim: int = 4096) -> list[TableConfig]:
    return [TableConfig(name="t", rows=rows, dim=dim, features=["f"], dtype=dtype)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_stochastic_rounding_keeps_updates_below_half_an_ulp(dtype: str) -> None:
    """Weights ~U(-1, 1), updates of 1e-4 (bf16's ulp there is up to 8e-3; fp16's up to 5e-4 with
    lr chosen below half of it): round-to-nearest drops every update, stochastic rounding keeps
    them on average."""
    lr = 1e-4 if dtype == "bf16" else 2e-5
    ones = SparseBatch.from_dense_ids(["f"], torch.zeros(1, 1, dtype=torch.int64))
    results = {}
    for sr in (False, True):
        engine = FusedEmbeddingCollection(
            sgd_table(dtype), EmbeddingOptimizerConfig(lr=lr), stochastic_rounding=sr
        )
        start = engine.table_weights()["t"].float().clone()
        big = start.abs() > 0.5  # where half an ulp exceeds the update
        for _ in range(5):
            engine(ones).sum().backward()  # gradient 1 everywhere: w -= lr per step
        results[sr] = (engine.table_weights()["t"].float() - start)[big]
    assert torch.equal(results[False], torch.zeros_like(results[False]))
    mean_change = results[True].mean().item()
    assert mean_change == pytest.approx(-5 * lr, rel=0.25)


def test_stochastic_rounding_depends_on_step_row_and_seed() -> None:
    ones = SparseBatch.from_dense_ids(["f"], torch.tensor([[0], [1]]))

    def train(seed: int, steps: int) -> torch.Tensor:
        engine = FusedEmbeddingCollection(
            sgd_table("bf16", rows=2, dim=512),
            EmbeddingOptimizerConfig(lr=1e-3),
            seed=seed,
            stochastic_rounding=True,
        )
        for _ in range(steps):
            engine(ones).sum().backward()
        return engine.table_weights()["t"].clone()

    assert torch.equal(train(0, 3), train(0, 3))
    change = train(0, 3).float() - train(0, 0).float()
    assert not torch.equal(change[0], change[1])  # same update, different rows: different rounding
    assert not torch.equal(train(1, 3).float() - train(1, 0).float(), change)  # another seed


def max_allocation_during_step(
    module: nn.Module, optimizer: torch.optim.Optimizer, sparse: SparseBatch
) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        module(sparse).sum().backward()
        optimizer.step()
    return max(e.cpu_memory_usage for e in prof.events())


def test_no_table_sized_allocation_in_backward() -> None:
    """Every allocation of a fwd/bwd/update is batch-sized; the same probe sees the [rows, dim]
    gradient of a dense nn.EmbeddingBag, so it would catch one here."""
    rows, dim = 200_000, 16
    table_bytes = rows * dim * 4
    tables = [TableConfig(name="big", rows=rows, dim=dim, features=["f"])]
    sparse = SparseBatch.from_dense_ids(["f"], torch.randint(0, rows, (256, 1)))
    engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="adam"))
    assert max_allocation_during_step(engine, engine.build_optimizer(), sparse) < table_bytes // 20

    dense = nn.EmbeddingBag(rows, dim, mode="sum")
    dense_forward = lambda s: dense(s.values, s.offsets()[:-1])  # noqa: E731
    probe = nn.Module()
    probe.forward = dense_forward  # type: ignore[method-assign]
    assert (
        max_allocation_during_step(probe, torch.optim.SGD(dense.parameters(), lr=0.1), sparse) >= table_bytes
    )


class DictStorage:
    """Rows in a dict, created on first read: a stand-in for a cache that never holds a table."""

    def __init__(
        self, num_rows: int, width: int, dtype: torch.dtype, device: torch.device, init: RowInit
    ) -> None:
        self.num_rows, self.width, self.dtype, self._init = num_rows, width, dtype, init
        self.rows: dict[int, torch.Tensor] = {}

    def _row(self, r: int) -> torch.Tensor:
        if r not in self.rows:
            value = self._init(r, r + 1)[0].to(self.dtype)
            self.rows[r] = value
        return self.rows[r]

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._row(r) for r in rows.tolist()]).clone()

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        for r, v in zip(rows.tolist(), values, strict=True):
            self.rows[r] = v.clone()


def test_storage_seam_matches_plain_tensor() -> None:
    """Through read/write only, the engine gives bitwise the same rows as with a plain tensor."""
    tables = determinism_tables()
    opt = EmbeddingOptimizerConfig(name="adagrad")
    plain = FusedEmbeddingCollection(tables, opt, stochastic_rounding=True)
    lazy = FusedEmbeddingCollection(tables, opt, stochastic_rounding=True, storage_factory=DictStorage)
    assert isinstance(plain.weights[0], TensorStorage) and isinstance(lazy.weights[0], DictStorage)
    for step in range(2):
        sparse = multi_hot(tables, batch_size=8, max_len=4, seed=step)
        a, b = plain(sparse), lazy(sparse)
        assert torch.equal(a, b)
        grad = torch.randn(a.shape)
        a.backward(grad)
        b.backward(grad)
    for gi, storage in enumerate(lazy.weights):
        rows = torch.tensor(sorted(storage.rows))
        assert torch.equal(storage.read(rows), plain.weights[gi].read(rows))
        for name, s in lazy.states[gi].items():
            assert torch.equal(s.read(rows), plain.states[gi][name].read(rows))


def test_table_of_a_trillion_rows_through_a_cache_like_storage() -> None:
    """2^40 rows x 16: any [rows, dim] tensor (table, gradient or state) would fail to allocate."""
    rows = 2**40
    tables = [TableConfig(name="huge", rows=rows, dim=16, features=["f", "g"], dtype="fp16")]
    engine = FusedEmbeddingCollection(
        tables, EmbeddingOptimizerConfig(name="adam"), storage_factory=DictStorage, stochastic_rounding=True
    )
    ids = torch.tensor([[rows - 1, 5], [5, 123_456_789_012], [rows - 1, rows - 1]])
    sparse = SparseBatch.from_dense_ids(["f", "g"], ids)
    before = engine.weights[0].read(torch.tensor([5, rows - 1])).float()
    engine(sparse).sum().backward()
    after = engine.weights[0].read(torch.tensor([5, rows - 1])).float()
    assert (after - before).abs().min() > 0  # every element of the touched rows moved
    assert sorted(engine.weights[0].rows) == [5, 123_456_789_012, rows - 1]


def test_plain_storage_builds_in_windows() -> None:
    calls = []

    def init(a: int, b: int) -> torch.Tensor:
        calls.append((a, b))
        return torch.arange(a, b, dtype=torch.float32)

    storage = build_tensor_storage(5, 0, torch.float16, torch.device("cpu"), init)
    assert storage.width == 0 and storage.tensor.tolist() == [0, 1, 2, 3, 4] and calls == [(0, 5)]
