"""Managed-collision tables on 2 gloo ranks (tw and rw) against one process: the same losses, weights
and id maps, with and without the pipelined id exchange; a checkpoint of 2 ranks loaded into one
process continues the same way; kinds that cannot hold an id map are refused."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import build_model, make_batches, run_steps, spawn

from neorec.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from neorec.data.batch import Batch
from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, ManagedCollisionConfig, TableConfig
from neorec.errors import ConfigError
from neorec.sparse import SparseBatch

pytestmark = pytest.mark.distributed

STEPS, BEFORE, BATCH, VOCAB = 8, 4, 16, 40
OPTIMIZER = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)
PLAN = {
    "tables": {
        "m0": {"kind": "tw", "ranks": [1]},
        "m1": {"kind": "rw", "ranks": [1, 0]},
        "m2": {"kind": "rw", "ranks": [0, 1]},
        "p": {"kind": "tw", "ranks": [0]},
    }
}


def mc(eviction: str, buckets: int) -> ManagedCollisionConfig:
    return ManagedCollisionConfig(eviction=eviction, buckets=buckets)


def make_tables() -> list[TableConfig]:
    """Three tables of raw ids over a vocabulary larger than their rows (evictions every step), one plain."""
    return [
        TableConfig(name="m0", rows=12, dim=8, features=["f0"], managed_collision=mc("lru", 1)),
        TableConfig(name="m1", rows=16, dim=8, features=["f1", "f1b"], pooling="mean", managed_collision=mc("lfu", 4)),
        TableConfig(name="m2", rows=20, dim=8, features=["f2"], managed_collision=mc("lru", 2)),
        TableConfig(name="p", rows=30, dim=8, features=["f3"]),
    ]  # fmt: skip


def make_raw_batches() -> list[Batch]:
    """Ids drawn from VOCAB per feature, then spread over 63 bits for the managed-collision features."""
    vocab = [t.model_copy(update={"rows": VOCAB if t.managed_collision else t.rows}) for t in make_tables()]
    out = []
    raw = {f for t in make_tables() if t.managed_collision for f in t.features}
    for b in make_batches(vocab, STEPS, BATCH):
        feats = {}
        for k in b.sparse.keys:
            ids, lengths, weights = b.sparse.feature(k)
            feats[k] = (ids * 1_000_000_007 + 3 if k in raw else ids, lengths, weights)
        out.append(Batch(b.dense, SparseBatch.from_features(feats), b.labels))
    return out


def dense_optimizer(model):
    return torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("embeddings.")], lr=0.05)


def map_state(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if ".mc_" in k}


def sharded_run(topo: Topology, root: str) -> tuple:
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(make_tables(), OPTIMIZER, ShardingPlan.from_dict(PLAN), comms, seed=0)
    model = build_model(emb)
    emb_opt, dense_opt = emb.build_optimizer(), dense_optimizer(model)
    batches = make_raw_batches()
    losses = run_steps(model, emb, emb_opt, dense_opt, batches[:BEFORE], topo.rank, topo.world_size, comms)
    save_checkpoint(root, BEFORE, emb, model, {"dense": dense_opt, "embedding": emb_opt})
    # pipelined: each next batch's ids are exchanged before this step; they are mapped in its lookup
    losses += run_steps(
        model, emb, emb_opt, dense_opt, batches[BEFORE:], topo.rank, topo.world_size, comms, pipeline=True
    )
    full = emb.gather_tables()
    return losses, {name: {k: v for k, v in entries.items()} for name, entries in full.items()}, emb.id_map_stats()


def single_process(batches: list[Batch], root: str | None = None):
    emb = FusedEmbeddingCollection(make_tables(), OPTIMIZER, seed=0)
    model = build_model(emb)
    emb_opt, dense_opt = emb.build_optimizer(), dense_optimizer(model)
    if root is not None:
        load_checkpoint(latest_checkpoint(root), emb, model, {"dense": dense_opt, "embedding": emb_opt})
    losses = run_steps(model, emb, emb_opt, dense_opt, batches)
    return losses, emb


def test_two_ranks_match_one_process_and_resume_in_one(tmp_path):
    root = str(tmp_path / "ckpt")
    results = spawn(2, sharded_run, (root,), tmp_path=tmp_path)
    batches = make_raw_batches()
    losses, emb = single_process(batches)
    state = emb.state_dict()
    stats = emb.id_map_stats()
    assert all(stats[t]["evictions"] > 0 for t in ("m0", "m1", "m2"))
    for rank, (d_losses, d_full, _) in results.items():
        torch.testing.assert_close(torch.tensor(d_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for t in ("m0", "m1", "m2", "p"):
            torch.testing.assert_close(
                torch.as_tensor(d_full[t]["weight"]), state[f"tables.{t}.weight"], rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(
                torch.as_tensor(d_full[t]["momentum1"]), state[f"tables.{t}.momentum1"], rtol=1e-5, atol=1e-6
            )
        for key, value in map_state(state).items():
            table, name = key.removeprefix("tables.").split(".")
            assert torch.equal(torch.as_tensor(d_full[table][name]), value), f"rank {rank} {key}"
    # each rank counts its own shards; the inserts and evictions of both add up to one process's
    for field in ("inserts", "evictions", "dropped", "occupied"):
        for t in ("m1", "m2"):
            assert results[0][2][t][field] + results[1][2][t][field] == stats[t][field], (t, field)

    resumed, emb = single_process(batches[BEFORE:], root)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[BEFORE:]), rtol=1e-5, atol=1e-6)
    for key, value in map_state(emb.state_dict()).items():
        assert torch.equal(value, map_state(state)[key]), key


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"kind": "cw", "ranks": [0, 1]}, "'m2' \\(cw\\): a managed-collision table is sharded tw or rw only"),
        ({"kind": "dp"}, "'m2' \\(dp\\): a managed-collision table is sharded tw or rw only"),
        ({"kind": "rw", "ranks": [0, 1, 2]}, "'m2' \\(rw\\): 3 row shards need managed_collision.buckets to be a multiple of 3"),
    ],
)  # fmt: skip
def test_kinds_without_an_id_map_are_refused(entry, message):
    plan = ShardingPlan.from_dict({"tables": {**PLAN["tables"], "m2": entry}})
    with pytest.raises(ConfigError, match=message):
        plan.validate(make_tables(), Topology(4, 0, 4))
