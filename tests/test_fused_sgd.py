"""Plain SGD on plain fp32 tables: the in-place path (lookup.add_row_gradients) and the CPU sort.

The in-place path must give bitwise the rows of the general path (read, rule, write through a
storage, in blocks), be bitwise deterministic across runs and thread counts, and match the float64
reference; sort_by_row must order ids exactly as a stable sort by row does.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_determinism import multi_hot
from test_fused_engine import Float64Reference, assert_matches, make_tables, random_batch, step_with_reference

from neorec.embedding.fused import FusedEmbeddingCollection, build_tensor_storage, lookup
from neorec.embedding.fused.bags import GroupBatch
from neorec.embedding.fused.row_gradients import sort_by_row
from neorec.embedding.fused.storage import RowInit
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig


class ReadWriteStorage:
    """A plain tensor seen only through read/write: the engine takes its general path on it."""

    def __init__(
        self, num_rows: int, width: int, dtype: torch.dtype, device: torch.device, init: RowInit
    ) -> None:
        self.inner = build_tensor_storage(num_rows, width, dtype, device, init)
        self.num_rows, self.width, self.dtype = num_rows, width, dtype

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.inner.read(rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.write(rows, values)


@pytest.fixture
def in_place_calls(monkeypatch) -> list[int]:
    """Counts the groups updated by the in-place path, so a test fails if the path is not taken."""
    calls: list[int] = []
    original = lookup.add_row_gradients

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(lookup, "add_row_gradients", counted)
    return calls


def assert_same_state(a: FusedEmbeddingCollection, b: FusedEmbeddingCollection) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("kind", ["weighted", "unweighted", "one_hot"])
def test_in_place_sgd_is_the_general_path_bitwise_and_matches_float64(kind: str, in_place_calls) -> None:
    """Duplicates, empty bags, per-id weights, mean pooling, a table shared by two features, four
    groups; a decaying lr schedule. The general path runs in blocks of a few rows."""
    tables = make_tables()
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.05)
    plain = FusedEmbeddingCollection(tables, opt)
    general = FusedEmbeddingCollection(tables, opt, storage_factory=ReadWriteStorage)
    general.chunk_elements = 40
    ref = Float64Reference(tables, opt)
    optimizers = [plain.build_optimizer(), general.build_optimizer()]
    gen = torch.Generator().manual_seed(7)
    outputs = []
    for step in range(5):
        sparse = random_batch(tables, gen, weighted=kind == "weighted", one_hot=kind == "one_hot")
        a, b, expected = plain(sparse), general(sparse), ref.forward(sparse)
        assert torch.equal(a, b)
        outputs.append((a.detach().clone(), expected))
        grad = torch.randn(a.shape, generator=gen)
        a.backward(grad)
        b.backward(grad)
        ref.backward_and_update(sparse, grad, {t.name: 0.05 * 0.7**step for t in tables})
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] *= 0.7
    assert len(in_place_calls) == 5 * len(plain.layout.groups)
    assert_same_state(plain, general)
    assert_matches(plain, ref, outputs)


def test_weight_decay_and_per_table_lr_take_the_general_path(in_place_calls) -> None:
    """The in-place path is only plain SGD: weight decay, or two learning rates in one group, is not."""
    decayed = EmbeddingOptimizerConfig(name="sgd", lr=0.05, weight_decay=0.01)
    overrides = {"cats": EmbeddingOptimizerConfig(name="sgd", lr=0.2)}  # shares the dim-8 group with users
    plain = EmbeddingOptimizerConfig(name="sgd", lr=0.05)
    for tables, opt in [(make_tables(), decayed), (make_tables(overrides=overrides), plain)]:
        engine, ref = FusedEmbeddingCollection(tables, opt), Float64Reference(tables, opt)
        gen = torch.Generator().manual_seed(3)
        batches = (random_batch(tables, gen) for _ in range(3))
        assert_matches(engine, ref, step_with_reference(engine, ref, batches, gen))
    assert len(in_place_calls) == 3 * 2  # only the second engine's dim-3 and dim-16 groups


def sgd_run(threads: int, storage_factory=None) -> dict[str, torch.Tensor]:
    """~120k ids per batch (above torch's grain size: sums and scatter go multi-threaded at threads > 1),
    a weighted mean-pooled group and an unweighted one-hot-like group."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tables = [
            TableConfig(name="a", rows=5000, dim=32, features=["a1", "a2"]),
            TableConfig(name="b", rows=3000, dim=16, features=["b1"], pooling="mean"),
        ]
        engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="sgd", lr=0.05),
                                          storage_factory=storage_factory)  # fmt: skip
        for step in range(3):
            pooled = engine(multi_hot(tables, batch_size=2048, max_len=40, seed=step))
            pooled.backward(torch.randn(pooled.shape, generator=torch.Generator().manual_seed(100 + step)))
        return {k: v.clone() for k, v in engine.state_dict().items()}
    finally:
        torch.set_num_threads(before)


def test_in_place_sgd_bitwise_across_runs_thread_counts_and_the_general_path(in_place_calls) -> None:
    first = sgd_run(2)
    assert len(in_place_calls) == 3 * 2
    for other in (sgd_run(2), sgd_run(1), sgd_run(2, storage_factory=ReadWriteStorage)):
        assert first.keys() == other.keys()
        for k in first:
            assert torch.equal(first[k], other[k]), k


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("top", [50, 2**40, 2**60])
def test_sort_by_row_is_a_stable_sort_by_row(weighted: bool, top: int) -> None:
    """Rows up to 2^60 (keys of row and bag no longer fit in 63 bits: torch's stable sort instead),
    many duplicates within and across bags, empty bags."""
    gen = torch.Generator().manual_seed(top % 1000 + weighted)
    lengths = torch.randint(0, 6, (3000,), generator=gen)
    n = int(lengths.sum())
    rows = torch.randint(0, 50, (n,), generator=gen) * (top // 50)
    bags = torch.arange(3000).repeat_interleave(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    scales = torch.rand(n, generator=gen) if weighted else None
    unique_rows, row_offsets, sorted_bags, sorted_scales = sort_by_row(
        GroupBatch(rows, bags, offsets, scales, batch_size=1000, num_features=3)
    )
    expected_rows, order = torch.sort(rows, stable=True)
    assert torch.equal(unique_rows, torch.unique(rows))
    assert torch.equal(unique_rows.repeat_interleave(torch.diff(row_offsets)), expected_rows)
    assert torch.equal(sorted_bags, bags[order])
    if weighted:
        assert torch.equal(sorted_scales, scales[order])
    else:
        assert sorted_scales is None
