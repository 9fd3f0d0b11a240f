"""The fused engine on a GPU: the torch path on CUDA tensors, the Triton kernels against it at GPU
sizes, and a whole model training there. Needs a CUDA device (skipped without one).

The kernels' own tests (every rule and dtype against the float64 reference, stochastic rounding,
determinism with hot rows) are tests/test_triton_kernels.py and test_triton_engine.py, which run on the
GPU where there is one and through Triton's interpreter on CPU otherwise.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_engine import assert_matches, make_tables, run_steps, train_both

from neorec.embedding.fused import FusedEmbeddingCollection, triton_fused_update, triton_launch
from neorec.embedding.fused.bags import GroupBatch
from neorec.embedding.fused.row_gradients import sort_by_row
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_torch_path_on_cuda_matches_float64_reference(name: str, weight_decay: float) -> None:
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, initial_accumulator=0.01)
    engine, ref, outputs = train_both(make_tables(), opt, steps=5, seed=3, device="cuda", kernels="torch")
    assert engine.weights[0].tensor.is_cuda
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
    return run_steps(FusedEmbeddingCollection(tables, opt, device=device, kernels=kernels), batches, grads, device)


@needs_cuda
@pytest.mark.parametrize(
    "dtype,chunk", [("fp32", None), ("fp32", 8), ("fp16", None), ("bf16", None), ("bf16", 8)]
)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_triton_matches_torch_path_with_hot_rows(name: str, dtype: str, chunk: int | None, monkeypatch) -> None:
    """Larger batches with rows repeated hundreds of times, odd dims (24 and 200: column blocks of
    the lookup and a masked tail), fp16/bf16 storage: the kernels against the torch path.
    chunk 8: hot rows' ids are summed in chunks of 8 by programs of their own, then added up."""
    if chunk is not None:
        monkeypatch.setattr(triton_fused_update, "LONG_ROW_CHUNK", chunk)
    tables = [
        TableConfig(name="a", rows=300, dim=24, features=["a", "a2"], pooling="mean", dtype=dtype),
        TableConfig(name="b", rows=1000, dim=200, features=["b"], dtype=dtype),
        TableConfig(name="c", rows=50, dim=64, features=["c"], dtype=dtype),
    ]
    opt = EmbeddingOptimizerConfig(name=name, lr=0.03, weight_decay=0.001, initial_accumulator=0.01)
    gen = torch.Generator().manual_seed(5)
    batches = [_zipf_batch(tables, gen, batch=512, max_len=6) for _ in range(3)]
    width = sum(t.dim * len(t.features) for t in tables)
    grads = [torch.randn(b.batch_size, width, generator=gen) for b in batches]
    out_t, state_t = _run("torch", tables, opt, batches, grads, "cuda")
    out_k, state_k = _run("triton", tables, opt, batches, grads, "cuda")
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


@needs_cuda
@pytest.mark.skipif(not triton_launch.usable(torch.device("cuda")), reason="needs triton")
def test_fused_update_reads_nothing_back_to_the_host() -> None:
    """Given sorted ids (sort_by_row's unique_consecutive reads its size back), the update's
    kernels go out without a host synchronisation, which sync debug mode "error" would raise on:
    hot rows split into chunks of 64 ids, adam's bias corrections and a new lr at every step. The
    rows and state are bitwise those of the same steps run outside that mode."""
    gen = torch.Generator().manual_seed(0)
    n, dim = 5000, 32
    hot = torch.rand(n, generator=gen) < 0.5
    rows = torch.where(
        hot, torch.randint(0, 3, (n,), generator=gen), torch.randint(0, 1000, (n,), generator=gen)
    )
    scales = torch.rand(n, generator=gen) + 0.5
    bags, offsets = torch.arange(n), torch.arange(n + 1)
    sorted_ids = sort_by_row(GroupBatch(*(t.cuda() for t in (rows, bags, offsets, scales)), n, 1))
    grad = torch.randn(n, dim, generator=gen).cuda()
    weight0 = torch.randn(1000, dim, generator=gen).cuda()
    row_starts = torch.zeros(1, dtype=torch.int64, device="cuda")

    def run(debug: bool) -> list[torch.Tensor]:
        weight = weight0.clone()
        state = {"momentum1": torch.zeros_like(weight), "momentum2": torch.zeros_like(weight)}
        for step, lr in enumerate([0.1, 0.05, 0.02], start=1):
            hp = {"lr": lr, "eps": 1e-8, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999}
            torch.cuda.set_sync_debug_mode("error" if debug else 0)
            try:
                group = triton_fused_update.UpdateGroup(
                    "adam", sorted_ids, grad, 1, [0], weight, state, hp, row_starts=row_starts
                )
                triton_fused_update.fused_update([group], step=step, chunk=64)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return [weight, *state.values()]

    expected = run(debug=False)  # also compiles the kernels
    for got, want in zip(run(debug=True), expected, strict=True):
        assert torch.equal(got, want)


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
    assert engine.triton_lookup(0, torch.device("cuda")) == triton_launch.usable(torch.device("cuda"))
    assert not torch.equal(before, engine.state_dict()["tables.u.weight"])
    assert losses[-1] < 0.7 * losses[0], losses
