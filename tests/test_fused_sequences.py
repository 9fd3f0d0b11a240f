"""Sequence features (pooling none) in the fused engine, against a float64 reference written with
loops: rows per id (times the id's weight), and the fused backward and update of every optimizer,
with duplicate ids, empty samples, weights, odd dims, fp16 storage and small update blocks."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_fused_engine import DTYPES, Float64Reference, random_batch

from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.reference import ReferenceEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch


def make_tables(dtype: str = "fp32") -> list[TableConfig]:
    """Pooled tables next to sequence tables; "history" has the dim of "users" (separate groups
    all the same), two features, and "tags" an odd dim."""
    specs = [
        ("users", 40, 8, ["user", "friend"], "sum"),
        ("history", 30, 8, ["clicks", "views"], "none"),
        ("products", 30, 3, ["item"], "mean"),
        ("tags", 25, 5, ["tag"], "none"),
    ]
    return [TableConfig(name=n, rows=r, dim=d, features=f, pooling=p, dtype=dtype) for n, r, d, f, p in specs]


class SequenceReference(Float64Reference):
    """Float64Reference for pooled features, plus one row (times its weight) per id of sequences."""

    def pooled_tables(self) -> list[TableConfig]:
        return [t for t in self.tables if t.pooling != "none"]

    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        cols = []
        for t in self.pooled_tables():
            for f in t.features:
                out = torch.zeros(sparse.batch_size, t.dim, dtype=torch.float64)
                for b, items in self._bags(sparse, t, f):
                    for row, scale in items:
                        out[b] += scale * self.weights[t.name][row]
                cols.append(out)
        return torch.cat(cols, dim=1)

    def sequences(self, sparse: SparseBatch) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.tables:
            if t.pooling == "none":
                for f in t.features:
                    rows = [s * self.weights[t.name][r] for _, items in self._bags(sparse, t, f) for r, s in items]
                    out[f] = torch.stack(rows) if rows else torch.zeros(0, t.dim, dtype=torch.float64)
        return out

    def backward_and_update(self, sparse, grad_out, grad_rows, lrs) -> None:  # type: ignore[override]
        grads = {t.name: torch.zeros(t.rows, t.dim, dtype=torch.float64) for t in self.tables}
        touched: dict[str, set[int]] = {t.name: set() for t in self.tables}
        col = 0
        for t in self.tables:
            for f in t.features:
                k = 0
                for b, items in self._bags(sparse, t, f):
                    for row, scale in items:
                        if t.pooling == "none":
                            grads[t.name][row] += scale * grad_rows[f][k].double()
                            k += 1
                        else:
                            grads[t.name][row] += scale * grad_out[b, col : col + t.dim].double()
                        touched[t.name].add(row)
                if t.pooling != "none":
                    col += t.dim
        self.step += 1
        for t in self.tables:
            for row in sorted(touched[t.name]):
                self._update(t.name, row, grads[t.name][row], lrs[t.name])


def train(tables, opt, steps: int, seed: int, weighted: bool = True, chunk_elements: int | None = 1 << 17,
          device: str = "cpu", kernels: str = "auto", batch_size: int = 9):  # fmt: skip
    """Train the engine and the reference side by side on batches of `batch_size` samples; returns
    both and every step's outputs (on the CPU). device, kernels: where the engine runs and with
    which kernels."""
    gen = torch.Generator().manual_seed(seed)
    engine = FusedEmbeddingCollection(tables, opt, device=device, kernels=kernels)
    engine.chunk_elements = chunk_elements
    ref = SequenceReference(tables, opt)
    optimizer = engine.build_optimizer()
    outputs = []
    for _ in range(steps):
        sparse = random_batch(tables, gen, batch_size=batch_size, weighted=weighted)
        pooled, seqs = engine.embed(sparse.to(device))
        outputs.append(((pooled.detach().cpu(), {f: r.values.detach().cpu() for f, r in seqs.items()}),
                        ref.forward(sparse), ref.sequences(sparse)))  # fmt: skip
        for f, rows in seqs.items():
            assert torch.equal(rows.lengths.cpu(), sparse.feature(f)[1])
        grad_out = torch.randn(pooled.shape, generator=gen)
        grad_rows = {f: torch.randn(r.values.shape, generator=gen) for f, r in seqs.items()}
        torch.autograd.backward([pooled, *(seqs[f].values for f in grad_rows)],
                                [grad_out.to(device), *(g.to(device) for g in grad_rows.values())])  # fmt: skip
        ref.backward_and_update(sparse, grad_out, grad_rows, {t.name: opt.lr for t in tables})
        optimizer.step()
    return engine, ref, outputs


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weighted", [True, False])
def test_sequences_match_float64_reference(name: str, weighted: bool) -> None:
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=0.01 if name == "adagrad" else 0.0,
                                   initial_accumulator=0.01)  # fmt: skip
    assert_matches_reference(*train(make_tables(), opt, steps=4, seed=len(name) + weighted, weighted=weighted))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (scripts/install-test-deps.sh)")
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_triton_kernels_match_float64_reference(name: str, monkeypatch) -> None:
    """The Triton lookup and fused update of sequence groups (on a GPU, or the CPU through Triton's
    interpreter: tests/conftest.py), with no group left to the torch path; two steps of six samples
    (the interpreter's cost is per program), with duplicate ids and empty samples."""
    from test_triton_kernels import DEVICE, torch_path_update

    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    engine, ref, outputs = train(
        make_tables(), opt, steps=2, seed=7, device=DEVICE, kernels="triton", batch_size=6
    )
    assert all(engine.triton_update(gi, torch.device(DEVICE)) for gi in range(len(engine.layout.groups)))
    first = random_batch(make_tables(), torch.Generator().manual_seed(7), batch_size=6)  # train's first batch
    for f in ("clicks", "views", "tag"):
        ids, lengths, _ = first.feature(f)
        assert ids.unique().numel() < ids.numel() and bool((lengths == 0).any()), f
    assert_matches_reference(engine, ref, outputs)


def assert_matches_reference(engine, ref, outputs) -> None:
    tables = ref.tables
    for (pooled, seqs), want_pooled, want_seqs in outputs:
        assert list(seqs) == ["clicks", "views", "tag"]
        torch.testing.assert_close(pooled.double(), want_pooled, rtol=1e-5, atol=1e-6)
        for f, rows in seqs.items():
            assert rows.dtype == torch.float32
            torch.testing.assert_close(rows.double(), want_seqs[f], rtol=1e-5, atol=1e-6)
    state = {k: v.cpu() for k, v in engine.state_dict().items()}
    for t in tables:
        torch.testing.assert_close(state[f"tables.{t.name}.weight"].double(), ref.weights[t.name], rtol=1e-5, atol=1e-6)
        for k, v in ref.state[t.name].items():
            torch.testing.assert_close(state[f"tables.{t.name}.{k}"].double(), v, rtol=1e-5, atol=1e-6)


def test_fp16_sequences_widen_to_fp32_and_update_in_blocks() -> None:
    tables = make_tables("fp16")
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.02)
    engine, ref, outputs = train(tables, opt, steps=3, seed=11, chunk_elements=24)
    (pooled, seqs), _, want_seqs = outputs[0]
    for f, rows in seqs.items():
        assert rows.dtype == torch.float32
        torch.testing.assert_close(rows.double(), want_seqs[f], rtol=1e-6, atol=1e-7)
    for name, w in engine.table_weights().items():
        assert w.dtype == DTYPES["fp16"]
        torch.testing.assert_close(w.double(), ref.weights[name], rtol=4e-3, atol=1e-3)


def test_unused_sequences_leave_their_rows_and_match_the_reference_engine() -> None:
    """Training only the pooled output leaves sequence tables untouched; the fused engine's
    outputs equal the per-table reference engine's."""
    tables = make_tables()
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    fused, reference = FusedEmbeddingCollection(tables, opt), ReferenceEmbeddingCollection(tables, opt)
    sparse = random_batch(tables, torch.Generator().manual_seed(2), batch_size=6, weighted=False)
    (pooled, seqs), (want, want_seqs) = fused.embed(sparse), reference.embed(sparse)
    torch.testing.assert_close(pooled, want)
    for f in fused.sequence_names:
        torch.testing.assert_close(seqs[f].values, want_seqs[f].values)
    before = {n: w.clone() for n, w in fused.table_weights().items()}
    pooled.sum().backward()
    after = fused.table_weights()
    assert torch.equal(after["history"], before["history"]) and torch.equal(after["tags"], before["tags"])
    assert not torch.equal(after["users"], before["users"])


def test_only_sequence_tables_and_empty_batches() -> None:
    tables = [TableConfig(name="history", rows=12, dim=4, features=["clicks"], pooling="none")]
    engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="adam", lr=0.1))
    assert engine.output_dim == 0 and engine.sequence_dims == [4]
    empty = SparseBatch.from_features({"clicks": (torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))})
    pooled, seqs = engine.embed(empty)
    assert pooled.shape == (3, 0) and seqs["clicks"].values.shape == (0, 4)
    sparse = SparseBatch.from_features({"clicks": (torch.tensor([3, 3, 5]), torch.tensor([2, 0, 1]))})
    before = engine.table_weights()["history"].clone()
    pooled, seqs = engine.embed(sparse)
    torch.testing.assert_close(seqs["clicks"].values, before[[3, 3, 5]])
    seqs["clicks"].to_padded()[0].sum().backward()
    changed = (engine.table_weights()["history"] != before).any(dim=1).nonzero().view(-1).tolist()
    assert changed == [3, 5]


@pytest.mark.parametrize(
    "kernels",
    [
        "torch",
        pytest.param(
            "triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
        ),
    ],
)
@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_cached_sequence_tables_train_as_plain_ones(tier: str, kernels: str, tmp_path) -> None:
    """Sequence tables behind a row cache (a tenth of the rows in RAM, prefetched a batch ahead as
    the pipeline does; three batches of five samples, in which rows of the sequence table "tags" are
    evicted and written back) give bitwise the rows and updates of plain tables, on the torch path
    and through the Triton kernels (Triton's interpreter without a GPU)."""
    from test_cache import cached_engine

    tables = make_tables()
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)
    plain = FusedEmbeddingCollection(tables, opt, kernels=kernels)
    cached = cached_engine(tables, opt, tmp_path, tier=tier, kernels=kernels)
    gen = torch.Generator().manual_seed(9)
    batches = [random_batch(tables, gen, batch_size=5) for _ in range(3)]
    for i, sparse in enumerate(batches):
        if i + 1 < len(batches):
            cached.prefetch(batches[i + 1])
        (pa, sa), (pb, sb) = plain.embed(sparse), cached.embed(sparse)
        assert torch.equal(pa, pb) and all(torch.equal(sa[f].values, sb[f].values) for f in sa)
        grads = [torch.randn(pa.shape, generator=gen), *(torch.randn(r.values.shape, generator=gen) for r in sa.values())]
        torch.autograd.backward([pa, *(r.values for r in sa.values())], grads)
        torch.autograd.backward([pb, *(r.values for r in sb.values())], grads)
    want, got = plain.state_dict(), cached.state_dict()
    for key, value in want.items():
        assert torch.equal(torch.as_tensor(got[key]), value), key
    tags = cached.cache_stats()["tags"]
    assert tags["evictions"] > 0 and tags["writebacks"] > 0
