"""The Triton kernels (neorec/embedding/fused/triton_pool.py, triton_fused_update.py) against the
float64 reference, the torch path's rounding, and themselves (bitwise determinism); inside the engine:
tests/test_triton_engine.py.

On a machine with a CUDA device they run there; without one they run on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there). Skipped where triton is not installed
(scripts/install-test-deps.sh installs it). The interpreter runs every program in Python, so sizes
here are tiny; hot rows are split into many chunks by lowering the chunk size.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fused_engine import (
    assert_matches,
    make_tables,
    random_batch,
    train_both,
)

from neorec.embedding.fused import FusedEmbeddingCollection, rounding, triton_fused_update, triton_pool
from neorec.embedding.fused.bags import GroupBatch
from neorec.embedding.fused.optimizers import RULES, Hparams
from neorec.embedding.fused.row_gradients import sort_by_row, sort_by_row_on_device
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="needs triton (scripts/install-test-deps.sh)"
    ),
    # the interpreter computes with NumPy, which warns about the inf and NaN that rounding meets on purpose
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]
RULE_NAMES = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
# ids of one row in a batch; the interpreter is slow: a whole chunk of the default size and one id
HOT_IDS = 100_000 if CUDA else triton_fused_update.LONG_ROW_CHUNK + 1


def torch_path_update(*args, **kwargs) -> None:
    """Stands in for FusedEmbeddingCollection.apply_update where every group must take the kernel."""
    raise AssertionError("a group was updated by the torch path, not the fused kernel")


def low_precision_tol(dtype: str) -> dict[str, float]:
    """Weights stored in fp16/bf16 are rounded at every step, the float64 reference never is: a few
    units in the last place of the storage type (as tests/test_fused_engine.py allows the torch path)."""
    return {"fp32": {"rtol": 1e-5, "atol": 1e-6}, "fp16": {"rtol": 4e-3, "atol": 1e-3},
            "bf16": {"rtol": 3e-2, "atol": 4e-3}}[dtype]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", RULE_NAMES)
def test_kernels_match_float64_reference(name: str, dtype: str, monkeypatch) -> None:
    """Every rule and dtype: mixed dims (3, 8, 16; the dim-8 group holds two tables), mean and sum
    pooling, per-sample weights, empty bags, duplicate ids, weight decay, a decaying lr schedule
    (two steps of five samples: the interpreter's cost is per program)."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=0.01, initial_accumulator=0.01)
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    engine, ref, outputs = train_both(
        make_tables(dtype), opt, steps=2, seed=7, device=DEVICE, kernels="triton", batch_size=5
    )
    assert all(engine.triton_update(gi, torch.device(DEVICE)) for gi in range(len(engine.layout.groups)))
    # train_both's first batch: duplicate ids and empty bags
    ids, lengths, _ = random_batch(
        make_tables(dtype), torch.Generator().manual_seed(7), batch_size=5
    ).feature("user")
    assert ids.unique().numel() < ids.numel() and bool((lengths == 0).any())
    # the first lookup reads the initial rows, which the reference holds exactly
    torch.testing.assert_close(outputs[0][0].double(), outputs[0][1], rtol=1e-5, atol=1e-6)
    assert_matches(engine, ref, outputs, **low_precision_tol(dtype))


def test_kernels_per_table_hyperparameters_and_one_hot(monkeypatch) -> None:
    """Two adam tables with different lr, betas, eps and weight decay in one buffer (one group, a row
    of hyper-parameters per table), one id per bag, no weights."""
    overrides = {
        "users": EmbeddingOptimizerConfig(name="adam", lr=0.02, beta1=0.8, beta2=0.99),
        "cats": EmbeddingOptimizerConfig(name="adam", lr=0.05, weight_decay=0.01, eps=1e-6),
        "tags": EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1, initial_accumulator=0.1),
    }
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    monkeypatch.setattr(FusedEmbeddingCollection, "apply_update", torch_path_update)
    engine, ref, outputs = train_both(
        make_tables(overrides=overrides), opt, steps=3, seed=3, weighted=False, one_hot=True,
        device=DEVICE, kernels="triton",
    )  # fmt: skip
    assert len(engine.layout.groups[0].tables) == 2
    assert isinstance(engine.group_hparams(0, torch.device(DEVICE))["lr"], torch.Tensor)
    assert_matches(engine, ref, outputs)


def test_pool_kernel_empty_bags_weights_and_low_precision() -> None:
    """Every output element is written (the output starts as NaN), empty bags give zeros; fp16 and
    bf16 rows are summed in fp32. Four groups fill one output side by side: fp32 of dims 13 and 3
    (one launch; the dim-3 group without scales), fp16 of dim 200 (two column blocks, the second one
    masked) and bf16 of dim 5, each dtype a launch of its own."""
    gen = torch.Generator().manual_seed(9)
    lengths = torch.tensor([0, 3, 0, 1, 5, 0, 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    scales = torch.rand(rows.numel(), generator=gen) + 0.5
    specs = [(torch.float32, 13, True), (torch.float16, 200, True), (torch.bfloat16, 5, True),
             (torch.float32, 3, False)]  # fmt: skip
    out = torch.full((lengths.numel(), sum(dim for _, dim, _ in specs)), float("nan"), device=DEVICE)
    groups, expected, column = [], [], 0
    for dtype, dim, scaled in specs:
        weight = torch.randn(40, dim, generator=gen).to(dtype)
        s = scales if scaled else None
        on_device = [t.to(DEVICE) if t is not None else None for t in (weight, rows, offsets, s)]
        groups.append(triton_pool.PoolGroup(*on_device, 1, out, [column]))
        want = torch.zeros(lengths.numel(), dim, dtype=torch.float64)
        w64, s64, pos = weight.double(), (scales if scaled else torch.ones(rows.numel())).double(), 0
        for b, n in enumerate(lengths.tolist()):
            for i in range(pos, pos + n):
                want[b] += s64[i] * w64[rows[i]]
            pos += n
        expected.append(want)
        column += dim
    triton_pool.pool(groups)
    torch.testing.assert_close(out.cpu().double(), torch.cat(expected, dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.cpu()[lengths == 0], torch.zeros(3, column))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_bitwise_the_torch_paths(dtype: torch.dtype) -> None:
    """The kernel's hash and rounding give rounding.py's bits for the same fp32 values: signed zeros,
    values beyond the format's range, subnormals, rows past 2^32, negative and 64-bit seeds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 37, generator=gen) * torch.logspace(-9, 5, 8).unsqueeze(1)
    x[0, :4] = torch.tensor([0.0, -0.0, -1e-30, 3e-8])
    x[1, :2] = torch.tensor([1e6, -7e4])
    seeds = torch.tensor([123456789012345, 5, -3, 2**40 + 7, 0, 99, 1, 2], dtype=torch.int64)
    rows = torch.tensor([0, 1, 2**33 + 5, 17, 12345678, 3, 4, 4], dtype=torch.int64)
    for step in (1, 7, 2**32 + 3):
        expected = rounding.stochastic_round(x, dtype, rounding.uniform_noise(seeds, rows, step, x.shape[1]))
        keys = rounding.step_keys(seeds, step)
        got = triton_fused_update.stochastic_round_rows(
            x.to(DEVICE), dtype, keys.to(DEVICE), rows.to(DEVICE)
        ).cpu()
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
        assert not torch.equal(got, x.to(dtype))  # it is not round-to-nearest


def dyadic_batches(
    tables: list[TableConfig], gen: torch.Generator, steps: int
) -> list[tuple[SparseBatch, torch.Tensor]]:
    """Sum-pooled bags with weights and output gradients that are powers of two: every fp32 sum and
    SGD step is then exact on either path, so both round the same fp32 values."""
    out = []
    for _ in range(steps):
        features = {}
        for t in tables:
            for f in t.features:
                lengths = torch.randint(0, 3, (6,), generator=gen)
                n = int(lengths.sum())
                weights = 2.0 ** torch.randint(-2, 1, (n,), generator=gen).float()
                features[f] = (torch.randint(0, t.rows, (n,), generator=gen), lengths, weights)
        sparse = SparseBatch.from_features(features)
        width = sum(t.dim * len(t.features) for t in tables)
        signs = torch.randint(0, 2, (6, width), generator=gen).float() * 2 - 1
        out.append((sparse, signs * 2.0 ** torch.randint(-3, 0, (6, width), generator=gen).float()))
    return out


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_stochastic_rounding_in_the_update_equals_the_torch_path(dtype: str) -> None:
    """SGD steps around half a unit in the last place of the weights, which stochastic rounding
    keeps on average and round-to-nearest mostly drops; with exact fp32 updates (powers of two) the
    kernel's rows are bitwise the torch path's, across two tables of one group."""
    tables = [TableConfig(name="a", rows=9, dim=5, features=["a", "a2"], dtype=dtype),
              TableConfig(name="b", rows=7, dim=5, features=["b"], dtype=dtype)]  # fmt: skip
    opt = EmbeddingOptimizerConfig(name="sgd", lr=2.0**-14)
    batches = dyadic_batches(tables, torch.Generator().manual_seed(4), steps=3)
    results = {}
    for kernels, stochastic in [("torch", True), ("triton", True), ("torch", False)]:
        engine = FusedEmbeddingCollection(
            tables, opt, device=DEVICE, kernels=kernels, stochastic_rounding=stochastic
        )
        for sparse, grad in batches:
            engine(sparse.to(DEVICE)).backward(grad.to(DEVICE))
        results[kernels, stochastic] = {
            k: v.cpu().view(torch.int16) for k, v in engine.table_weights().items()
        }
    for name, expected in results["torch", True].items():
        assert torch.equal(results["triton", True][name], expected)
        assert not torch.equal(results["torch", False][name], expected)  # the rounding was stochastic


def update_once(
    name: str,
    dtype: torch.dtype,
    rows: torch.Tensor,
    chunk: int | None,
    seed: int = 0,
    num_rows: int = 6,
    sort=sort_by_row,
):
    """One fused_update of a [num_rows, 7] table from ids `rows` (one bag each, weighted); returns
    the weights, the state and the inputs."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, 7, generator=gen).to(dtype)
    state = {
        k: torch.rand((num_rows, 7) if per_element else (num_rows,), generator=gen)
        for k, per_element in RULES[name].state.items()
    }
    grad = torch.randn(rows.numel(), 7, generator=gen)
    scales = torch.rand(rows.numel(), generator=gen) + 0.5
    batch = GroupBatch(
        rows, torch.arange(rows.numel()), torch.arange(rows.numel() + 1), scales, rows.numel(), 1
    )
    inputs = (weight.clone(), {k: v.clone() for k, v in state.items()}, grad, scales)
    hp = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999}
    w, s = weight.to(DEVICE), {k: v.to(DEVICE) for k, v in state.items()}
    on_device = GroupBatch(
        *(t.to(DEVICE) for t in (batch.rows, batch.bags, batch.offsets, batch.scales)), rows.numel(), 1
    )
    group = triton_fused_update.UpdateGroup(
        name, sort(on_device), grad.to(DEVICE), 1, [0], w, s, hp,
        row_starts=torch.zeros(1, dtype=torch.int64, device=DEVICE),
    )  # fmt: skip
    triton_fused_update.fused_update([group], step=3, chunk=chunk)
    return w.cpu(), {k: v.cpu() for k, v in s.items()}, inputs, hp


@pytest.mark.parametrize("name", RULE_NAMES)
def test_hot_row_split_over_programs_matches_reference_and_repeats_bitwise(name: str) -> None:
    """Row 2 takes 600 of 606 ids; chunks of 20 ids (30 partial sums added in chunk order, each chunk
    a whole block of 16 ids and 4 more) give one update with the whole row's sum, equal to float64 to
    fp32 rounding, bitwise the same twice."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.full((600,), 2), torch.tensor([0, 5, 5, 1, 4, 0])])[
        torch.randperm(606, generator=gen)
    ]
    assert exact_num_chunks(rows, 20) == 30
    w, s, (w0, s0, grad, scales), hp = update_once(name, torch.float32, rows, chunk=20)
    w_again, s_again, *_ = update_once(name, torch.float32, rows, chunk=20)
    assert torch.equal(w, w_again) and all(torch.equal(s[k], s_again[k]) for k in s)

    g = torch.zeros(6, 7, dtype=torch.float64).index_add_(
        0, rows, scales.double().unsqueeze(1) * grad.double()
    )
    touched = torch.unique(rows)
    w64, s64 = w0.double()[touched], {k: v.double()[touched] for k, v in s0.items()}
    hp64 = Hparams(**hp)
    w64, s64 = RULES[name].update(w64, g[touched], s64, 3, hp64)
    torch.testing.assert_close(w[touched].double(), w64, rtol=1e-5, atol=1e-6)
    for k in s:
        torch.testing.assert_close(s[k][touched].double(), s64[k], rtol=1e-5, atol=1e-6)
    untouched = torch.tensor([3])
    assert torch.equal(w[untouched], w0[untouched])


def exact_num_chunks(rows: torch.Tensor, chunk: int) -> int:
    """The number of chunks fused_update splits the ids `rows` into (rows with more than `chunk` ids)."""
    counts = torch.bincount(rows)
    return int(torch.where(counts > chunk, (counts + chunk - 1) // chunk, 0).sum())


@pytest.mark.parametrize("name", RULE_NAMES)
def test_chunk_grid_bound_gives_bitwise_the_exact_grids_result(name: str, monkeypatch) -> None:
    """Hot rows of 17, 50 and 32 ids (2, 4 and 2 chunks of 16), one of exactly 16 (not split) and
    100 cold ids over 300 rows: the chunk programs launched over the host's bound (25 for 8 chunks),
    over the exact count, or over 40 times it give bitwise the same rows and state, within fp32
    rounding of the float64 sum."""
    gen = torch.Generator().manual_seed(5)
    hot = [torch.full((n,), r) for r, n in [(3, 17), (17, 50), (150, 32), (42, 16)]]
    cold = torch.randint(200, 300, (100,), generator=gen)
    rows = torch.cat([*hot, cold])[torch.randperm(115 + 100, generator=gen)]
    exact = exact_num_chunks(rows, 16)
    assert exact == 8 and triton_fused_update.max_chunks(rows.numel(), 16) == 25
    results = {}
    for grid in ("bound", exact, 40 * exact):
        if grid != "bound":
            monkeypatch.setattr(triton_fused_update, "max_chunks", lambda num_ids, chunk, grid=grid: grid)
        results[grid] = update_once(name, torch.float32, rows, chunk=16, num_rows=300)
    w, s, (w0, s0, grad, scales), hp = results["bound"]
    for grid in (exact, 40 * exact):
        assert torch.equal(results[grid][0], w) and all(torch.equal(results[grid][1][k], s[k]) for k in s)

    g = torch.zeros(300, 7, dtype=torch.float64).index_add_(
        0, rows, scales.double().unsqueeze(1) * grad.double()
    )
    touched = torch.unique(rows)
    w64, s64 = RULES[name].update(
        w0.double()[touched], g[touched], {k: v.double()[touched] for k, v in s0.items()}, 3, Hparams(**hp)
    )
    torch.testing.assert_close(w[touched].double(), w64, rtol=1e-5, atol=1e-6)
    for k in s:
        torch.testing.assert_close(s[k][touched].double(), s64[k], rtol=1e-5, atol=1e-6)


def test_ids_sorted_on_the_device_are_sort_by_rows_padded() -> None:
    """sort_by_row_on_device: sort_by_row's unique rows, offsets, bags and scales in its first U
    entries, then padding (row 0, empty runs); U as a tensor."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 40, (500,), generator=gen)
    rows[:90] = 7  # a hot row
    batch = GroupBatch(rows, torch.randint(0, 64, (500,), generator=gen).sort().values,
                       torch.arange(65), torch.rand(500, generator=gen), 64, 1)  # fmt: skip
    unique, offsets, bags, scales = sort_by_row(batch)
    p_unique, p_offsets, p_bags, p_scales, count = sort_by_row_on_device(batch)
    u = unique.numel()
    assert count.shape == (1,) and int(count) == u and p_unique.numel() == 500 and p_offsets.numel() == 501
    assert torch.equal(p_unique[:u], unique) and torch.equal(p_offsets[: u + 1], offsets)
    assert torch.equal(p_bags, bags) and torch.equal(p_scales, scales)
    assert bool((p_unique[u:] == 0).all()) and bool((p_offsets[u:] == 500).all())


@pytest.mark.parametrize("name", RULE_NAMES)
def test_update_over_padded_ids_is_bitwise_the_exact_one(name: str) -> None:
    """The update over the ids sorted on the device (unique rows padded to one entry per id; the
    padding's rows are never updated) changes the same rows to bitwise the same values as the one
    over the exact unique rows, a hot row's chunks of 16 ids included."""
    gen = torch.Generator().manual_seed(12)
    rows = torch.cat([torch.full((40,), 2), torch.randint(0, 50, (80,), generator=gen)])
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    assert exact_num_chunks(rows, 16) >= 3 and torch.unique(rows).numel() < rows.numel()
    exact = update_once(name, torch.float32, rows, chunk=16, num_rows=50)
    padded = update_once(name, torch.float32, rows, chunk=16, num_rows=50, sort=sort_by_row_on_device)
    assert torch.equal(exact[0], padded[0]) and all(torch.equal(exact[1][k], padded[1][k]) for k in exact[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40), st.integers(1, 70))
def test_max_chunks_bounds_every_split(counts: list[int], chunk: int) -> None:
    """However the ids fall on rows, the host's bound holds the chunks they split into, and is 0
    when no row can be split."""
    num_ids = sum(counts)
    num_chunks = sum(-(-c // chunk) for c in counts if c > chunk)
    assert num_chunks <= triton_fused_update.max_chunks(num_ids, chunk)
    if num_ids <= chunk:
        assert triton_fused_update.max_chunks(num_ids, chunk) == 0


def test_hot_row_in_default_chunks_is_deterministic() -> None:
    """The hot-row case at the default chunk size (1,024 ids): 10^5 ids of one row on a GPU, 1,025
    under the interpreter (2 chunks, the second of one id); bitwise the same on two runs, equal to
    the float64 sum to fp32 rounding."""
    rows = torch.full((HOT_IDS,), 4)
    assert exact_num_chunks(rows, triton_fused_update.LONG_ROW_CHUNK) >= 2
    w, s, (w0, s0, grad, scales), hp = update_once("rowwise_adagrad", torch.float32, rows, chunk=None)
    w_again, s_again, *_ = update_once("rowwise_adagrad", torch.float32, rows, chunk=None)
    assert torch.equal(w, w_again) and torch.equal(s["momentum1"], s_again["momentum1"])
    g = (scales.double().unsqueeze(1) * grad.double()).sum(0, keepdim=True)
    w64, s64 = RULES["rowwise_adagrad"].update(
        w0.double()[4:5], g, {"momentum1": s0["momentum1"].double()[4:5]}, 3, Hparams(**hp)
    )
    torch.testing.assert_close(w[4:5].double(), w64, rtol=1e-5, atol=1e-6)


def test_float_hyper_parameters_are_the_torch_paths_and_kept_between_steps():
    """hparam_table of floats: the values optimizers.py computes with Python floats (adam's bias
    corrections of the step included), rounded to fp32; the same values and step give back the same
    device table, other ones a table of their own."""
    import math

    from neorec.embedding.fused.triton_rules import HPARAM_COLUMNS

    hp = {"lr": 0.03, "eps": 1e-8, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999}
    table = triton_fused_update.hparam_table(hp, 7, 3, torch.device(DEVICE))
    expected = {"lr": 0.03, "eps": 1e-8, "weight_decay": 0.0, "one_minus_beta1": 1.0 - 0.9,
                "one_minus_beta2": 1.0 - 0.999, "adam_lr": 0.03 / (1.0 - 0.9**7),
                "adam_sqrt_bias2": math.sqrt(1.0 - 0.999**7)}  # fmt: skip
    want = torch.tensor([[expected[c] for c in HPARAM_COLUMNS]], dtype=torch.float32)
    assert torch.equal(table.cpu(), want)
    assert triton_fused_update.hparam_table(dict(hp), 7, 3, torch.device(DEVICE)) is table
    other = triton_fused_update.hparam_table({**hp, "lr": 0.02}, 7, 3, torch.device(DEVICE))
    assert other is not table and other[0, 0].item() == pytest.approx(0.02)
    assert triton_fused_update.hparam_table(hp, 8, 3, torch.device(DEVICE)) is not table
    # tables' own values (fp32, as group_hparams gives them): one row per table, computed on the device
    per_table = {**hp, "lr": torch.tensor([0.03, 0.01, 0.02], device=DEVICE)}
    rows = triton_fused_update.hparam_table(per_table, 7, 3, torch.device(DEVICE))
    assert rows.shape == (3, len(HPARAM_COLUMNS)) and rows.device.type == torch.device(DEVICE).type
    torch.testing.assert_close(rows[0].cpu(), want[0], rtol=1e-6, atol=0)


def test_int_tables_are_aligned_views_of_one_copy():
    from neorec.embedding.fused.triton_launch import _int_tables

    columns = {"a": [1, 2, 3], "b": [], "c": [7], "d": [4, 5]}
    tables = _int_tables(columns, torch.device(DEVICE))
    base = tables["a"].untyped_storage().data_ptr()
    for name, values in columns.items():
        view = tables[name]
        assert view.untyped_storage().data_ptr() == base  # one tensor, copied once
        assert view.data_ptr() % 16 == 0, name  # Triton specialises on 16-byte aligned pointers
        assert view[: len(values)].tolist() == values
