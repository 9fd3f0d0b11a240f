"""The fused engine against a float64 reference written plainly here (loops, textbook formulas).

The reference keeps a dense float64 gradient per table and loops over every id, so it shares no
code or trick with the engine (no sort, no segment sums, no embedding_bag): agreement means the
engine's grouping, sample-major reordering and fused updates are right.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.init import init_rows
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import DataError
from neorec.sparse import SparseBatch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_tables(
    dtype: str = "fp32", overrides: dict[str, EmbeddingOptimizerConfig] | None = None
) -> list[TableConfig]:
    """Mixed dims (8, 3, 16, 8: the two dim-8 tables are not adjacent in the output), mixed pooling,
    and one table shared by two features."""
    overrides = overrides or {}
    specs = [("users", 40, 8, ["user", "friend"], "sum"), ("products", 30, 3, ["item"], "mean")]
    specs += [("tags", 25, 16, ["tag"], "sum"), ("cats", 20, 8, ["cat"], "mean")]
    return [
        TableConfig(name=n, rows=r, dim=d, features=f, pooling=p, dtype=dtype, optimizer=overrides.get(n))
        for n, r, d, f, p in specs
    ]


def random_batch(
    tables: list[TableConfig], gen: torch.Generator, batch_size: int = 7, weighted: bool = True,
    one_hot: bool = False,
) -> SparseBatch:
    """Lengths 0..4 (sample 0 always empty), ids from a third of the rows (many duplicates).
    one_hot: exactly one id per bag (the engine's gather path)."""
    features = {}
    for t in tables:
        for f in t.features:
            lengths = torch.randint(0, 5, (batch_size,), generator=gen)
            lengths[0] = 0
            if one_hot:
                lengths = torch.ones(batch_size, dtype=torch.int64)
            n = int(lengths.sum())
            ids = torch.randint(0, max(1, t.rows // 3), (n,), generator=gen)
            w = torch.rand(n, generator=gen) + 0.5
            features[f] = (ids, lengths, w) if weighted else (ids, lengths)
    return SparseBatch.from_features(features)


class Float64Reference:
    """Per-table loops, a dense float64 gradient per table, textbook optimizer formulas."""

    def __init__(self, tables: list[TableConfig], optimizer: EmbeddingOptimizerConfig, seed: int = 0) -> None:
        self.tables = tables
        self.configs = {t.name: t.optimizer or optimizer for t in tables}
        # start from the stored (possibly fp16/bf16-rounded) initial weights
        self.weights = {t.name: init_rows(t, seed).to(DTYPES[t.dtype]).double() for t in tables}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for t in tables:
            c = self.configs[t.name]
            if c.name == "adagrad":
                self.state[t.name] = {
                    "momentum1": torch.full((t.rows, t.dim), c.initial_accumulator).double()
                }
            elif c.name == "rowwise_adagrad":
                self.state[t.name] = {"momentum1": torch.full((t.rows,), c.initial_accumulator).double()}
            elif c.name == "adam":
                zeros = torch.zeros(t.rows, t.dim, dtype=torch.float64)
                self.state[t.name] = {"momentum1": zeros.clone(), "momentum2": zeros.clone()}
            else:
                self.state[t.name] = {}
        self.step = 0

    def _bags(self, sparse: SparseBatch, t: TableConfig, f: str):
        """Yield (sample, [(id, scale)]) for every bag of feature f."""
        values, lengths, weights = sparse.feature(f)
        pos = 0
        for b in range(sparse.batch_size):
            n = int(lengths[b])
            items = []
            for i in range(pos, pos + n):
                scale = float(weights[i]) if weights is not None else 1.0
                if t.pooling == "mean":
                    scale /= n
                items.append((int(values[i]), scale))
            pos += n
            yield b, items

    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        cols = []
        for t in self.tables:
            for f in t.features:
                out = torch.zeros(sparse.batch_size, t.dim, dtype=torch.float64)
                for b, items in self._bags(sparse, t, f):
                    for row, scale in items:
                        out[b] += scale * self.weights[t.name][row]
                cols.append(out)
        return torch.cat(cols, dim=1)

    def backward_and_update(self, sparse: SparseBatch, grad_out: torch.Tensor, lrs: dict[str, float]) -> None:
        grad_out = grad_out.double()
        grads = {t.name: torch.zeros(t.rows, t.dim, dtype=torch.float64) for t in self.tables}
        touched: dict[str, set[int]] = {t.name: set() for t in self.tables}
        col = 0
        for t in self.tables:
            for f in t.features:
                for b, items in self._bags(sparse, t, f):
                    for row, scale in items:
                        grads[t.name][row] += scale * grad_out[b, col : col + t.dim]
                        touched[t.name].add(row)
                col += t.dim
        self.step += 1
        for t in self.tables:
            for row in sorted(touched[t.name]):
                self._update(t.name, row, grads[t.name][row], lrs[t.name])

    def _update(self, name: str, r: int, g: torch.Tensor, lr: float) -> None:
        c, w, s, t = self.configs[name], self.weights[name], self.state[name], self.step
        g = g + c.weight_decay * w[r]
        if c.name == "sgd":
            w[r] = w[r] - lr * g
        elif c.name == "adagrad":
            s["momentum1"][r] += g * g
            w[r] = w[r] - lr * g / (s["momentum1"][r].sqrt() + c.eps)
        elif c.name == "rowwise_adagrad":
            s["momentum1"][r] += (g * g).mean()
            w[r] = w[r] - lr * g / (math.sqrt(s["momentum1"][r]) + c.eps)
        elif c.name == "adam":
            m, v = s["momentum1"], s["momentum2"]
            m[r] = c.beta1 * m[r] + (1 - c.beta1) * g
            v[r] = c.beta2 * v[r] + (1 - c.beta2) * g * g
            m_hat, v_hat = m[r] / (1 - c.beta1**t), v[r] / (1 - c.beta2**t)
            w[r] = w[r] - lr * m_hat / (v_hat.sqrt() + c.eps)


def run_steps(
    engine: FusedEmbeddingCollection, batches: list[SparseBatch], grads: list[torch.Tensor], device
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Train `engine` on `batches` with output gradients `grads` (on `device`): the pooled outputs
    and the final state, on the CPU."""
    outs = []
    for sparse, g in zip(batches, grads, strict=True):
        pooled = engine(sparse.to(device))
        outs.append(pooled.detach().cpu())
        pooled.backward(g.to(device))
    return outs, {k: v.cpu() for k, v in engine.state_dict().items()}


def train_both(
    tables: list[TableConfig],
    opt: EmbeddingOptimizerConfig,
    steps: int,
    seed: int,
    weighted: bool = True,
    chunk_elements: int | None = 1 << 17,
    one_hot: bool = False,
    device: str = "cpu",
    kernels: str = "auto",
    batch_size: int = 7,
) -> tuple[FusedEmbeddingCollection, Float64Reference, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run `steps` fwd/bwd/updates on both, with a decaying lr schedule driven through param_groups.

    Small chunk_elements split the update (and fp16/bf16 lookups) into blocks of a few rows.
    device, kernels: where the engine runs and with which kernels (batches are drawn on the CPU).
    batch_size: samples per batch (random_batch's)."""
    gen = torch.Generator().manual_seed(seed)
    engine = FusedEmbeddingCollection(tables, opt, device=device, kernels=kernels)
    ref = Float64Reference(tables, opt)
    engine.chunk_elements = chunk_elements
    optimizer = engine.build_optimizer()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.8**k)
    outputs = []
    for _ in range(steps):
        sparse = random_batch(tables, gen, batch_size=batch_size, weighted=weighted, one_hot=one_hot)
        lrs = {g["table"]: g["lr"] for g in optimizer.param_groups}
        pooled, expected = engine(sparse.to(device)), ref.forward(sparse)
        outputs.append((pooled.detach().cpu(), expected))
        grad_out = torch.randn(pooled.shape, generator=gen)
        pooled.backward(grad_out.to(device))
        ref.backward_and_update(sparse, grad_out, lrs)
        optimizer.step()
        schedule.step()
    return engine, ref, outputs


def step_with_reference(engine, ref: Float64Reference, batches, gen: torch.Generator, device: str = "cpu") -> list:
    """Train `engine` (its batches moved to `device`) and `ref` on the same batches and random output
    gradients at each table's configured (constant) learning rate; returns (pooled, expected) per
    batch for assert_matches."""
    outputs = []
    for sparse in batches:
        pooled, expected = engine(sparse.to(device)), ref.forward(sparse)
        outputs.append((pooled.detach().cpu().clone(), expected))
        grad = torch.randn(pooled.shape, generator=gen)
        pooled.backward(grad.to(device))
        ref.backward_and_update(sparse, grad, {t.name: ref.configs[t.name].lr for t in ref.tables})
    return outputs


def assert_matches(
    engine: FusedEmbeddingCollection, ref: Float64Reference, outputs, rtol=1e-5, atol=1e-6
) -> None:
    for pooled, expected in outputs:
        assert pooled.dtype == torch.float32
        torch.testing.assert_close(pooled.double(), expected, rtol=rtol, atol=atol)
    state = engine.state_dict()
    for t in ref.tables:
        torch.testing.assert_close(
            state[f"tables.{t.name}.weight"].cpu().double(), ref.weights[t.name], rtol=rtol, atol=atol
        )
        assert set(k for k in state if k.startswith(f"tables.{t.name}.")) == {
            f"tables.{t.name}.{k}" for k in ["weight", "step", *ref.state[t.name]]
        }
        for k, v in ref.state[t.name].items():
            torch.testing.assert_close(state[f"tables.{t.name}.{k}"].cpu().double(), v, rtol=rtol, atol=atol)
        assert int(state[f"tables.{t.name}.step"]) == ref.step


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_matches_float64_reference(name: str, weight_decay: float) -> None:
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, initial_accumulator=0.01)
    engine, ref, outputs = train_both(make_tables(), opt, steps=5, seed=len(name) + int(weight_decay * 100))
    assert_matches(engine, ref, outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_writes_on_one_thread_equal_index_copy(dtype) -> None:
    """On one intra-op thread, rows are written through numpy (faster than index_copy_ there):
    the same table afterwards, whatever the dtype."""
    from neorec.embedding.fused.storage import TensorStorage

    gen = torch.Generator().manual_seed(3)
    table = torch.randn(1000, 24, generator=gen).to(dtype)
    rows = torch.randperm(1000, generator=gen)[:337]
    values = torch.randn(337, 24, generator=gen).to(dtype)
    want = table.clone().index_copy_(0, rows, values)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        storage = TensorStorage(table.clone())
        storage.write(rows, values)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(storage.tensor, want)


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_one_thread_matches_float64_reference(name: str) -> None:
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        engine, ref, outputs = train_both(make_tables(), opt, steps=4, seed=5)
    finally:
        torch.set_num_threads(threads)
    assert_matches(engine, ref, outputs)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_one_hot_batches_match_float64_reference(name: str, dtype: str) -> None:
    """All bags of one id and no weights: the gather forward and (sgd) the one-pass update."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    engine, ref, outputs = train_both(make_tables(dtype), opt, steps=4, seed=11, weighted=False, one_hot=True)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == "fp32" else {"rtol": 2e-3, "atol": 2e-3}
    assert_matches(engine, ref, outputs, **tol)


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam"])
def test_large_eps_goes_outside_the_square_root(name: str) -> None:
    """eps 0.1 is far above rounding: the rules add it to sqrt(G) (adam: to sqrt(v_hat))."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, eps=0.1)
    engine, ref, outputs = train_both(make_tables(), opt, steps=3, seed=13)
    assert_matches(engine, ref, outputs)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_weighted_one_hot_batches_match_float64_reference(name: str) -> None:
    """All bags of one id, with per-id weights: the weights scale the rows (not the plain gather)."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    engine, ref, outputs = train_both(make_tables(), opt, steps=3, seed=12, weighted=True, one_hot=True)
    assert_matches(engine, ref, outputs)


def test_per_table_optimizer_overrides() -> None:
    """Different rules per table, and two adam tables of one dim with different hyper-parameters
    (they share a buffer, so their lr/eps/betas/decay become per-row tensors)."""
    overrides = {
        "users": EmbeddingOptimizerConfig(name="adam", lr=0.02, beta1=0.8, beta2=0.99),
        "cats": EmbeddingOptimizerConfig(name="adam", lr=0.05, weight_decay=0.01, eps=1e-6),
        "tags": EmbeddingOptimizerConfig(name="adagrad", lr=0.1, initial_accumulator=0.1),
    }
    tables = make_tables(overrides=overrides)
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    engine, ref, outputs = train_both(tables, opt, steps=5, seed=3, chunk_elements=40)
    assert len(engine.layout.groups) == 3  # adam dim 8 (users + cats), sgd dim 3, adagrad dim 16
    assert_matches(engine, ref, outputs)


@settings(max_examples=12, deadline=None)
@given(
    batch_size=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    weighted=st.booleans(),
    name=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam"]),
)
def test_random_batches_one_step(batch_size: int, seed: int, weighted: bool, name: str) -> None:
    tables = make_tables()
    gen = torch.Generator().manual_seed(seed)
    opt = EmbeddingOptimizerConfig(name=name, lr=0.1)
    engine, ref = FusedEmbeddingCollection(tables, opt), Float64Reference(tables, opt)
    sparse = random_batch(tables, gen, batch_size=batch_size, weighted=weighted)
    pooled = engine(sparse)
    torch.testing.assert_close(pooled.double(), ref.forward(sparse), rtol=1e-5, atol=1e-6)
    grad_out = torch.randn(pooled.shape, generator=gen)
    pooled.backward(grad_out)
    ref.backward_and_update(sparse, grad_out, {t.name: 0.1 for t in tables})
    for name_, w in engine.table_weights().items():
        torch.testing.assert_close(w.double(), ref.weights[name_], rtol=1e-5, atol=1e-6)


def test_batch_keys_in_any_order_with_extra_features() -> None:
    tables = make_tables()
    engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig())
    sparse = random_batch(tables, torch.Generator().manual_seed(5))
    extra = SparseBatch(["extra"], torch.arange(7), torch.ones(7, dtype=torch.int64), torch.ones(7))
    shuffled = SparseBatch.concat([extra, sparse.permute([3, 0, 4, 2, 1])])
    torch.testing.assert_close(engine(shuffled), engine(sparse), rtol=0, atol=0)
    with pytest.raises(DataError, match="no feature"):
        engine(sparse.select(["user", "item"]))


def test_all_bags_empty() -> None:
    tables = make_tables()
    engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="adam"))
    names = [f for t in tables for f in t.features]
    sparse = SparseBatch(names, torch.empty(0, dtype=torch.int64), torch.zeros(5 * 3, dtype=torch.int64))
    before = {k: v.clone() for k, v in engine.table_weights().items()}
    pooled = engine(sparse)
    assert pooled.shape == (3, engine.output_dim) and not pooled.any()
    pooled.sum().backward()
    for k, v in engine.table_weights().items():
        assert torch.equal(v, before[k])


def test_no_table_gradient_and_no_parameters() -> None:
    """The tables are not autograd leaves: nothing for a dense optimizer to find, no .grad to fill."""
    engine = FusedEmbeddingCollection(make_tables(), EmbeddingOptimizerConfig())
    assert list(engine.parameters()) == []
    pooled = engine(random_batch(engine.tables, torch.Generator().manual_seed(0)))
    assert pooled.requires_grad
    with torch.no_grad():
        assert not engine(random_batch(engine.tables, torch.Generator().manual_seed(0))).requires_grad


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_storage_accumulates_in_fp32(dtype: str) -> None:
    """Forward of fp16/bf16 rows agrees with float64 to fp32 accuracy (fp16 accumulation would be off
    by ~1e-3); after updates, weights stay within a few units in the last place of the storage type."""
    tables = make_tables(dtype)
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.02)
    engine, ref, outputs = train_both(tables, opt, steps=3, seed=4, chunk_elements=40)
    for pooled, expected in outputs[:1]:
        assert pooled.dtype == torch.float32
        torch.testing.assert_close(pooled.double(), expected, rtol=1e-5, atol=1e-6)
    tol = {"fp16": (4e-3, 1e-3), "bf16": (3e-2, 4e-3)}[dtype]
    for name, w in engine.table_weights().items():
        assert w.dtype == DTYPES[dtype]
        torch.testing.assert_close(w.double(), ref.weights[name], rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("name", ["adagrad", "sgd"])
def test_gradient_hook_sees_whole_groups_and_updates_in_blocks(name: str) -> None:
    """A gradient hook (the sharded collection's replica sum) gets each group's unique rows once per
    backward, all of them, however small the blocks; its result is applied in blocks of
    chunk_elements, which gives bitwise the tables of one block and no hook."""
    tables = make_tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.1)
    blocked, whole = FusedEmbeddingCollection(tables, opt), FusedEmbeddingCollection(tables, opt)
    blocked.chunk_elements, whole.chunk_elements = 40, None
    calls = []

    def hook(gi: int, rows: torch.Tensor, grads: torch.Tensor):
        calls.append((gi, rows.clone()))
        return rows, grads * 1.0  # a new tensor, as the replica sum returns

    blocked.grad_hook = hook
    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        sparse = random_batch(tables, gen, batch_size=9)
        grad = torch.randn(9, blocked.output_dim, generator=gen)
        calls.clear()
        blocked(sparse).backward(grad)
        whole(sparse).backward(grad)
        assert [gi for gi, _ in calls] == list(range(len(blocked.layout.groups)))
        prepared = blocked._prepare(sparse)
        for (_, rows), gb in zip(calls, prepared, strict=True):
            assert torch.equal(rows, torch.unique(gb.rows))  # every touched row, once, ascending
        assert any(rows.numel() * blocked.layout.groups[gi].dim > 40 for gi, rows in calls)  # several blocks
    for a, b in zip(blocked.state_dict().values(), whole.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_a_hook_that_returns_a_wait_is_applied_at_the_end_of_backward(name: str) -> None:
    """A gradient hook may return a function that waits for its result (an exchange in flight):
    the engine then applies that group's update once the rest of the backward pass has run
    (autograd's final callback), with bitwise the result of a hook that returns at once."""
    tables = make_tables()
    opt = EmbeddingOptimizerConfig(name=name, lr=0.1)
    later, now = FusedEmbeddingCollection(tables, opt), FusedEmbeddingCollection(tables, opt)
    events: list[str] = []

    def start(gi: int, rows: torch.Tensor, grads: torch.Tensor):
        events.append(f"started {gi}")

        def finish():
            events.append(f"finished {gi}")
            return rows, grads * 1.0

        return finish

    class After(torch.autograd.Function):  # created before the lookup, so its backward runs after it
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            events.append("rest of backward")
            return g

    later.grad_hook = start
    now.grad_hook = lambda gi, rows, grads: (rows, grads * 1.0)
    groups = len(later.layout.groups)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        sparse = random_batch(tables, gen, batch_size=9)
        grad = torch.randn(9, later.output_dim, generator=gen)
        events.clear()
        leaf = torch.ones(1, requires_grad=True)
        before = After.apply(leaf)
        (later(sparse) * before).backward(grad)
        now(sparse).backward(grad)
        assert events == [f"started {gi}" for gi in range(groups)] + ["rest of backward"] + [
            f"finished {gi}" for gi in range(groups)
        ]
    for a, b in zip(later.state_dict().values(), now.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_in_place_deltas_equal_the_rule_on_gathered_rows(name: str, monkeypatch) -> None:
    """On plain fp32 tables without weight decay the step adds each rule's deltas in place
    (index_add_); with that path turned off, the rows are gathered, stepped and written back. Both
    compute w + delta, so the tables and states agree bitwise, with per-table hyper-parameters in
    one group too (two adam/adagrad tables of one dim with different learning rates)."""
    overrides = {"cats": EmbeddingOptimizerConfig(name=name, lr=0.03, initial_accumulator=0.02)}
    tables = make_tables(overrides=overrides)
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    in_place, _, _ = train_both(tables, opt, steps=4, seed=8, chunk_elements=40)
    monkeypatch.setattr(FusedEmbeddingCollection, "adds_in_place", lambda self, gi: False)
    gathered, _, _ = train_both(tables, opt, steps=4, seed=8, chunk_elements=40)
    want, got = gathered.state_dict(), in_place.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
