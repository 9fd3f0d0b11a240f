"""Two-tower retrieval over several processes: the in-batch negatives are the global batch's items
(gathered across ranks), so W gloo ranks train the model one process trains on the same global
batches, and every rank reports the recall of the whole held-out set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_helpers import fit_rank, spawn
from test_models import needs_movielens, tiny_movielens

from neorec.config.load import load_config
from neorec.distributed.topology import Topology
from neorec.train.trainer import Trainer

pytestmark = [pytest.mark.distributed, needs_movielens]

SETS = [
    "train.max_steps=10", "train.eval_every=5", "train.progress=false", "logging.plot=false",
    "logging.tensorboard=false", "data.batch_size=256", "data.eval_batch_size=999",  # held-out batches pad
    "model.two_tower.tower_mlp=[32, 16]", "embedding.dim=16",
    "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
    # plain SGD: adaptive optimizers divide by tiny accumulators at first, which turns float rounding
    # (sums over ranks in another order) into visible differences
    "embedding.optimizer={name: sgd, lr: 0.5}", "train.dense_optimizer={name: sgd, lr: 0.5}",
]  # fmt: skip


def _rank_run(topo: Topology, sets: list[str], out: str) -> dict:
    """One rank of a run in the process group dist_helpers.spawn made (the Trainer joins it)."""
    os.environ.update(RANK=str(topo.rank), WORLD_SIZE=str(topo.world_size), LOCAL_RANK=str(topo.rank),
                      LOCAL_WORLD_SIZE=str(topo.world_size))  # fmt: skip
    result = Trainer(load_config("movielens_two_tower", sets), Path(out)).fit()
    return {"losses": result.losses, "eval": result.eval, "bytes": result.comm_bytes_per_step}


def _model(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in torch.load(out / "model.pt", weights_only=True).items() if not k.endswith(".step")}


@pytest.mark.parametrize("world, transport", [(2, "shm"), (4, "backend")])
def test_two_tower_over_processes_trains_like_one(tmp_path, world, transport):
    sets = [*SETS, f"data.movielens.root={tiny_movielens(tmp_path)}", f"distributed.transport={transport}"]
    one = Trainer(load_config("movielens_two_tower", sets), tmp_path / "one").fit()
    ranks = spawn(world, _rank_run, (sets, str(tmp_path / "many")), tmp_path=tmp_path / "pg")

    # each rank's loss is its users' share of the global batch's loss, times W: the losses a run reads
    # back are their mean over the ranks, the global batch's, the same on every rank
    for r in ranks.values():
        torch.testing.assert_close(
            torch.tensor(r["losses"], dtype=torch.float64), torch.tensor(one.losses, dtype=torch.float64),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip
    assert len(set(map(tuple, (r["losses"] for r in ranks.values())))) == 1

    a, b = _model(tmp_path / "one"), _model(tmp_path / "many")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)

    assert one.eval["num_items"] == len(a["embeddings.tables.movie.weight"])  # the whole catalogue
    for r in ranks.values():  # every rank: the figures of the whole held-out set
        assert r["eval"]["num_queries"] == one.eval["num_queries"] and r["eval"]["num_items"] == one.eval["num_items"]
        for k in ("recall@10", "recall@100"):
            assert r["eval"][k] == pytest.approx(one.eval[k], abs=1.5 / one.eval["num_queries"]), k
    assert ranks[0]["bytes"]["in_batch"] > 0 and ranks[0]["bytes"]["in_batch_bwd"] > 0



def test_neorec_train_runs_two_tower_over_two_processes(tmp_path):
    """What a worker of `neorec train --config movielens_two_tower --nproc 2` runs, on each of 2 ranks."""
    import json

    sets = [*SETS, f"data.movielens.root={tiny_movielens(tmp_path)}", "train.max_steps=4", "train.eval_every=null"]
    out = tmp_path / "run"
    spawn(2, fit_rank, (sets, str(out), False, "movielens_two_tower"), tmp_path=tmp_path / "pg")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 4
    assert summary["eval_num_queries"] > 0 and 0 <= summary["eval_recall@10"] <= summary["eval_recall@100"] <= 1
    assert summary["comm_bytes_per_step"]["in_batch"] > 0  # the item vectors crossed
