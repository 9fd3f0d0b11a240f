"""DIN over 2 gloo processes against 1 on the same global batches: `neorec train --nproc` on a tiny
MovieLens-format folder, the sequence tables sharded row-wise so the history rows cross ranks. Each
rank logs its own loss, so the runs are compared by their final weights and held-out metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.test_din import write_tiny_movielens

pytestmark = pytest.mark.distributed


def test_din_over_two_processes_matches_one(tmp_path):
    root = write_tiny_movielens(tmp_path / "ml")
    sets = [f"data.movielens.root={root}", "data.batch_size=32", "data.eval_batch_size=64", "train.max_steps=6",
            "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
            "embedding.optimizer={name: sgd, lr: 0.05}", "train.dense_optimizer={name: sgd, lr: 0.02}",
            "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
            "distributed.sharding={history: {kind: rw, ranks: [0, 1]}, movie: {kind: rw, ranks: [1, 0]}}"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    outs = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        p = subprocess.run([sys.executable, "-m", "neorec", "train", "--config", "movielens_seq", "--nproc", str(nproc),
                            "--output-dir", str(out), *args], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        outs[nproc] = out
    a, b = (torch.load(outs[n] / "model.pt", weights_only=True) for n in (1, 2))
    assert a.keys() == b.keys() and any(k.startswith("embeddings.") and "history" in k for k in a)
    for k in a:
        if not k.endswith(".step"):
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)
    one, two = (json.loads((outs[n] / "summary.json").read_text()) for n in (1, 2))
    assert two["eval_auc"] == pytest.approx(one["eval_auc"], abs=1e-5)
    assert two["eval_log_loss"] == pytest.approx(one["eval_log_loss"], abs=1e-5)
