"""The fused engine on a GPU: the torch path on CUDA tensors, and the Triton kernels against it.

Needs a CUDA device (skipped without one). The Triton tests also run on the CPU through Triton's
interpreter when TRITON_INTERPRET=1 is set and triton is installed (slow, but it checks the kernels on
a machine without a GPU):

    TRITON_INTERPRET=1 python -m pytest tests/test_fused_cuda.py
"""

from __future__ import annotations

import os

import pytest
import torch
from test_fused_engine import assert_matches, make_tables, train_both

from neorec.embedding.fused import FusedEmbeddingCollection, triton_kernels
from neorec.embedding.fused.lookup import sort_by_row
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET and triton_kernels.triton is not None:  # Triton's interpreter turns scalars into int()
    # with int(array of one element), which NumPy >= 2.4 refuses; read the element instead
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# where the Triton kernels can run: the GPU, else the CPU under Triton's interpreter
KERNEL_DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_kernels.usable(torch.device(KERNEL_DEVICE)),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1 with triton installed)",
)


@needs_cuda
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_torch_path_on_cuda_matches_float64_reference(name: str, weight_decay: float) -> None:
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, initial_accumulator=0.01)
    engine, ref, outputs = train_both(make_tables(), opt, steps=5, seed=3, device="cuda", kernels="torch")
    assert engine.weights[0].tensor.is_cuda
    assert_matches(engine, ref, outputs)


@needs_triton
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_triton_kernels_match_float64_reference(name: str, weight_decay: float) -> None:
    """Mixed dims (3, 8, 16), mean and sum pooling, weights, empty bags, duplicates, lr schedule."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, initial_accumulator=0.01)
    engine, ref, outputs = train_both(
        make_tables(), opt, steps=5, seed=7, device=KERNEL_DEVICE, kernels="triton"
    )
    assert all(engine.triton_update(gi, torch.device(KERNEL_DEVICE), engine.group_hparams(gi, torch.device(KERNEL_DEVICE)))
               for gi in range(len(engine.layout.groups)))  # fmt: skip
    assert_matches(engine, ref, outputs)


@needs_triton
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_triton_one_hot_and_fallback_rules(name: str) -> None:
    """One id per bag; adam has no fused kernel (its lookup is Triton, its update the torch path)."""
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, initial_accumulator=0.01)
    engine, ref, outputs = train_both(
        make_tables(),
        opt,
        steps=4,
        seed=11,
        weighted=False,
        one_hot=True,
        device=KERNEL_DEVICE,
        kernels="triton",
    )
    assert_matches(engine, ref, outputs)


def _zipf_batch(tables: list[TableConfig], gen: torch.Generator, batch: int, max_len: int) -> SparseBatch:
    """Bags of 0..max_len ids, most of them a handful of hot rows (long runs of one row to sum)."""
    features = {}
    for t in tables:
        for f in t.features:
            lengths = torch.randint(0, max_len + 1, (batch,), generator=gen)
            n = int(lengths.sum())
            hot = torch.randint(0, 4, (n,), generator=gen)
            cold = torch.randint(0, t.rows, (n,), generator=gen)
            ids = torch.where(torch.rand(n, generator=gen) < 0.6, hot, cold)
            features[f] = (ids, lengths, torch.rand(n, generator=gen) + 0.5)
    return SparseBatch.from_features(features)


def _run(kernels: str, tables, opt, batches, grads, device: str) -> tuple[list[torch.Tensor], dict]:
    engine = FusedEmbeddingCollection(tables, opt, device=device, kernels=kernels)
    outs = []
    for sparse, g in zip(batches, grads, strict=True):
        pooled = engine(sparse.to(device))
        outs.append(pooled.detach().cpu())
        pooled.backward(g.to(device))
    return outs, {k: v.cpu() for k, v in engine.state_dict().items()}


@needs_triton
@pytest.mark.parametrize(
    "dtype,chunk", [("fp32", None), ("fp32", 8), ("fp16", None), ("bf16", None), ("bf16", 8)]
)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_triton_matches_torch_path_with_hot_rows(name: str, dtype: str, chunk: int | None, monkeypatch) -> None:
    """Larger batches with rows repeated hundreds of times, odd dims (24 and 200: column blocks of
    the lookup and a masked tail), fp16/bf16 storage: the kernels against the torch path.
    chunk 8: hot rows' ids are summed in chunks of 8 by programs of their own, then added up."""
    if chunk is not None:
        monkeypatch.setattr(triton_kernels, "LONG_ROW_CHUNK", chunk)
    tables = [
        TableConfig(name="a", rows=300, dim=24, features=["a", "a2"], pooling="mean", dtype=dtype),
        TableConfig(name="b", rows=1000, dim=200, features=["b"], dtype=dtype),
        TableConfig(name="c", rows=50, dim=64, features=["c"], dtype=dtype),
    ]
    opt = EmbeddingOptimizerConfig(name=name, lr=0.03, weight_decay=0.001, initial_accumulator=0.01)
    gen = torch.Generator().manual_seed(5)
    batches = [
        _zipf_batch(tables, gen, batch=96 if INTERPRET and not CUDA else 512, max_len=6) for _ in range(3)
    ]
    width = sum(t.dim * len(t.features) for t in tables)
    grads = [torch.randn(b.batch_size, width, generator=gen) for b in batches]
    out_t, state_t = _run("torch", tables, opt, batches, grads, KERNEL_DEVICE)
    out_k, state_k = _run("triton", tables, opt, batches, grads, KERNEL_DEVICE)
    # fp32: hot rows sum hundreds of gradients in another order; AdaGrad divides by sqrt(G), which
    # turns the rounding of a small, cancelling sum into up to ~1e-6 of a weight (seen on an H100)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "fp32" else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out_k[0], out_t[0], rtol=1e-5, atol=1e-6)  # the same stored weights
    for a, b in zip(out_k[1:], out_t[1:], strict=True):  # fp16/bf16: a row rounded one ulp apart
        assert float((a - b).norm() / b.norm()) < (1e-5 if dtype == "fp32" else 1e-2)
    assert state_k.keys() == state_t.keys()
    for key in state_t:
        if dtype != "fp32" and key.endswith("weight"):  # a stored row may round one ulp apart at a step,
            w = state_t[key].float()  # and later steps carry that ulp (of a larger value) along
            diff = (state_k[key].float() - w).abs()  # so: an ulp of the row's largest value
            ulp = w.abs().amax(dim=1, keepdim=True) * (2**-7 if dtype == "bf16" else 2**-10)
            assert bool((diff <= 3 * ulp).all()), key
        else:
            torch.testing.assert_close(state_k[key].float(), state_t[key].float(), **tol)


@needs_triton
def test_triton_kernels_are_deterministic() -> None:
    tables = [TableConfig(name="a", rows=200, dim=32, features=["a", "b"])]
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)
    gen = torch.Generator().manual_seed(2)
    batches = [_zipf_batch(tables, gen, batch=128, max_len=8) for _ in range(2)]
    grads = [torch.randn(b.batch_size, 64, generator=gen) for b in batches]
    first = _run("triton", tables, opt, batches, grads, KERNEL_DEVICE)
    second = _run("triton", tables, opt, batches, grads, KERNEL_DEVICE)
    for a, b in zip(first[0], second[0], strict=True):
        assert torch.equal(a, b)
    for key in first[1]:
        assert torch.equal(first[1][key], second[1][key]), key


@needs_triton
def test_pool_kernel_empty_bags_and_poisoned_output() -> None:
    """Every output element is written (the output starts as garbage), empty bags give zeros."""
    device = torch.device(KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(40, 13, generator=gen).to(device)
    lengths = torch.tensor([0, 3, 0, 1, 5, 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    rows = torch.randint(0, 40, (int(lengths.sum()),), generator=gen).to(device)
    scales = (torch.rand(rows.numel(), generator=gen) + 0.5).to(device)
    out = triton_kernels.pool(weight, rows, offsets, scales).cpu().double()
    expected = torch.zeros(6, 13, dtype=torch.float64)
    w64, r, s = weight.cpu().double(), rows.cpu(), scales.cpu().double()
    pos = 0
    for b, n in enumerate(lengths.tolist()):
        for i in range(pos, pos + n):
            expected[b] += s[i] * w64[r[i]]
        pos += n
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[lengths == 0], torch.zeros(3, 13, dtype=torch.float64))


@needs_triton
@pytest.mark.parametrize("chunk", [None, 2])
def test_fused_update_kernel_sums_duplicates_before_one_update(chunk: int | None) -> None:
    """Row-wise adagrad on one row hit 5 times: the accumulator gets mean((sum of the 5 grads)^2)
    once, not five separate updates. chunk 2: the 5 ids are summed as 2 + 2 + 1 first."""
    device = torch.device(KERNEL_DEVICE)
    weight = torch.zeros(4, 8, device=device)
    state = torch.full((4,), 0.5, device=device)
    grad = torch.arange(40, dtype=torch.float32).view(5, 8).to(device) / 10
    rows = torch.tensor([2, 2, 2, 2, 2], device=device)
    bags = torch.arange(5, device=device)
    from neorec.embedding.fused.lookup import GroupBatch

    gb = GroupBatch(rows, bags, torch.arange(6, device=device), None, 5, 1)
    unique, offsets, sorted_bags, scales = sort_by_row(gb)
    triton_kernels.fused_update(
        "rowwise_adagrad", unique, offsets, sorted_bags, scales, grad, weight, state, 0.1, 1e-8, 0.0
    )
    g = grad.cpu().double().sum(0)
    acc = 0.5 + float((g * g).mean())
    torch.testing.assert_close(state.cpu().double()[2], torch.tensor(acc, dtype=torch.float64))
    torch.testing.assert_close(weight.cpu().double()[2], -0.1 * g / (acc**0.5 + 1e-8))
    assert torch.equal(weight.cpu()[[0, 1, 3]], torch.zeros(3, 8)) and torch.equal(
        state.cpu()[[0, 1, 3]], torch.full((3,), 0.5)
    )


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dlrm_trains_on_cuda(precision: str) -> None:
    """The whole model (fused engine with its default kernels + MLPs) takes steps on a GPU and the
    loss goes down on a batch it sees again and again."""
    from test_fused_engine import random_batch

    from neorec.data.batch import Batch
    from neorec.model.dlrm import DLRM

    tables = [
        TableConfig(name="u", rows=50, dim=8, features=["user", "friend"]),
        TableConfig(name="i", rows=30, dim=8, features=["item"], pooling="mean"),
    ]
    engine = FusedEmbeddingCollection(
        tables, EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1), device="cuda"
    )
    torch.manual_seed(0)
    model = DLRM(4, engine, bottom_mlp=[16, 8], top_mlp=[16], precision=precision).cuda()
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(64, 4, generator=gen), random_batch(tables, gen, batch_size=64),
                  torch.randint(0, 2, (64,), generator=gen).float()).to("cuda")  # fmt: skip
    before = engine.state_dict()["tables.u.weight"].clone()
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(float(loss.detach()))
    assert engine.triton_lookup(0, torch.device("cuda")) == triton_kernels.usable(torch.device("cuda"))
    assert not torch.equal(before, engine.state_dict()["tables.u.weight"])
    assert losses[-1] < 0.7 * losses[0], losses
