"""DIN over 2 gloo processes against 1 on the same global batches: the Trainer of `neorec train
--config movielens_seq` on a tiny MovieLens-format folder, in one process and on each of 2 ranks,
the sequence tables sharded row-wise so the history rows cross ranks. Each rank logs its own loss,
so the runs are compared by their final weights and held-out metrics."""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import fit_rank, spawn

from neorec.config.load import load_config
from neorec.train.trainer import Trainer
from tests.test_din import write_tiny_movielens

pytestmark = pytest.mark.distributed


def test_din_over_two_processes_matches_one(tmp_path):
    root = write_tiny_movielens(tmp_path / "ml")
    sets = [f"data.movielens.root={root}", "data.batch_size=32", "data.eval_batch_size=64", "train.max_steps=6",
            "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
            "embedding.optimizer={name: sgd, lr: 0.05}", "train.dense_optimizer={name: sgd, lr: 0.02}",
            "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
            "distributed.sharding={history: {kind: rw, ranks: [0, 1]}, movie: {kind: rw, ranks: [1, 0]}}"]  # fmt: skip
    outs = {1: tmp_path / "n1", 2: tmp_path / "n2"}
    Trainer(load_config("movielens_seq", sets), outs[1]).fit()
    spawn(2, fit_rank, (sets, str(outs[2]), False, "movielens_seq"), tmp_path=tmp_path / "pg")
    a, b = (torch.load(outs[n] / "model.pt", weights_only=True) for n in (1, 2))
    assert a.keys() == b.keys() and any(k.startswith("embeddings.") and "history" in k for k in a)
    for k in a:
        if not k.endswith(".step"):
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)
    one, two = (json.loads((outs[n] / "summary.json").read_text()) for n in (1, 2))
    assert two["eval_auc"] == pytest.approx(one["eval_auc"], abs=1e-5)
    assert two["eval_log_loss"] == pytest.approx(one["eval_log_loss"], abs=1e-5)
