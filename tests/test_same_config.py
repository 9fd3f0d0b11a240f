"""The processes of a run compare their configs when they start (neorec/train/same_config.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neorec.config.load import load_config
from neorec.errors import ConfigError
from neorec.train.trainer import Trainer

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=2048", "data.synthetic.eval_samples=512", "data.batch_size=256",
    "train.progress=false", "logging.tensorboard=false", "logging.plot=false",
]  # fmt: skip


def start_rank(topo, out: str, per_rank: dict) -> str:
    """Rank `topo.rank` of a run whose ranks got the settings `per_rank[rank]` on top of TINY: the
    error its Trainer gives ("" when it starts)."""
    os.environ.update(RANK=str(topo.rank), WORLD_SIZE=str(topo.world_size), LOCAL_RANK=str(topo.local_rank),
                      LOCAL_WORLD_SIZE=str(topo.local_world_size))  # fmt: skip
    try:
        Trainer(load_config("default", TINY + per_rank.get(topo.rank, [])), Path(out))
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.distributed
def test_ranks_given_other_settings_are_refused_on_every_rank(tmp_path):
    """Rank 1 given another seed and learning rate (a --set on one node) trained other data with
    other rates under rank 0's config.yaml, without a word; node-local folders may differ."""
    from dist_helpers import spawn

    other = ["seed=7", "embedding.optimizer.lr=0.9", f"train.kernel_cache={tmp_path / 'k1'}",
             "train.threads=1"]  # fmt: skip
    got = spawn(2, start_rank, (str(tmp_path / "run"), {1: other}), tmp_path=tmp_path / "pg")
    assert got[0] == got[1] and got[0].startswith("the processes of this run were given different configs")
    assert "rank 1 has, against rank 0's, embedding.optimizer.lr: 0.1 -> 0.9; seed: 0 -> 7." in got[0], got[0]
    assert "kernel_cache" not in got[0] and "threads" not in got[0]
