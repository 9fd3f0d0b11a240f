"""The reference engine (nn.EmbeddingBag per table, torch.optim) trains the fused engine's rules:
the same pooled outputs and, step after step, the same weights, eps included (adam: SparseAdam's eps
scaled so that it comes after the bias correction)."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_fused_engine import make_tables, random_batch

from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.reference import ReferenceEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig


# eps 0.1 is large enough to tell where the reference adds it (adam: torch.optim.SparseAdam adds it
# before its bias correction; the reference engine scales it so that it comes after, as in the engine)
@pytest.mark.parametrize(("name", "eps"), [("sgd", 1e-8), ("adagrad", 0.1), ("adam", 0.1)])
def test_matches_per_table_embedding_bag_reference(name: str, eps: float) -> None:
    """Against nn.EmbeddingBag + sparse grads + torch.optim (unweighted: it cannot weight mean bags)."""
    tables = make_tables()
    # initial_accumulator stays 0: the reference sets it per param group, which torch.optim.Adagrad
    # ignores (it reads only its constructor argument).
    opt = EmbeddingOptimizerConfig(name=name, lr=0.05, eps=eps)
    fused, ref = FusedEmbeddingCollection(tables, opt), ReferenceEmbeddingCollection(tables, opt)
    f_opt, r_opt = fused.build_optimizer(), ref.build_optimizer()
    gen = torch.Generator().manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's sparse-invariant notice
        for _ in range(4):
            sparse = random_batch(tables, gen, weighted=False)
            a, b = fused(sparse), ref(sparse)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            grad = torch.randn(a.shape, generator=gen)
            a.backward(grad)
            b.backward(grad)
            f_opt.step()
            r_opt.step()
            r_opt.zero_grad()
    for t, w in ref.table_weights().items():
        torch.testing.assert_close(fused.table_weights()[t], w, rtol=1e-5, atol=1e-6)
