"""Replicated (dp) tables with optimizer state: each row updated by its owner rank, the new row sent
to every rank (neorec/distributed/replicas.py). Real gloo processes against one process."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import make_batches, make_tables, optimizer_config, spawn, train
from test_distributed import BATCH, STEPS, check_against_single

from neorec.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.replicas import ReplicaSync, updates_by_owner
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.embedding.fused import FusedEmbeddingCollection

pytestmark = pytest.mark.distributed

ALL_DP = {"tables": {f"t{i}": {"kind": "dp"} for i in range(6)}}


def owner_run(topo, optimizer_name: str, root: str | None = None, dense_bytes: int | None = None):
    """Every table replicated, rows sent to their owners (the dense all-reduce switched off).
    Records which rows this rank updated; with `root`, saves a checkpoint right after training,
    without gathering the tables first (the save must bring the state up to date itself).
    dense_bytes: the size under which groups may be all-reduced (0: the row counts are not
    exchanged first, they travel with the rows)."""
    from neorec.distributed import replicas

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("the sparse exchange of the replicas' gradients should have been chosen")

    ReplicaSync._all_reduce = no_all_reduce
    if dense_bytes is not None:
        replicas.DENSE_BYTES = dense_bytes
    tables = make_tables()
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(
        tables, optimizer_config(optimizer_name), ShardingPlan.from_dict(ALL_DP), comms
    )
    updated = []
    apply_update = emb.replicated.apply_update

    def recording(gi, rows, *args, **kwargs):
        updated.append(rows.clone())
        return apply_update(gi, rows, *args, **kwargs)

    emb.replicated.apply_update = recording
    losses, _ = train(emb, make_batches(tables, STEPS, BATCH), topo.world_size, topo.rank, comms)
    own = emb.replicated.table_weights()  # this rank's copy, before anything is gathered
    if root is not None:
        save_checkpoint(root, STEPS, emb)
    full = emb.gather_tables()
    updated_rows = torch.cat(updated)
    return (
        losses,
        {k: v.clone() for k, v in own.items()},
        dict(full.items()),
        comms.stats.take(),
        int(updated_rows.numel()),
        bool((updated_rows % topo.world_size == topo.rank).all()),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "optimizer_name, dense_bytes",
    [("adagrad", None), ("adam", None), ("rowwise_adagrad", None), ("adagrad", 0)],
)
def test_owners_update_their_rows_and_replicas_stay_equal(world, optimizer_name, dense_bytes, tmp_path):
    results = spawn(world, owner_run, (optimizer_name, None, dense_bytes), tmp_path=tmp_path)
    check_against_single({r: out[:4] for r, out in results.items()}, optimizer_name)
    for rank, (*_, num_updated, only_owned) in results.items():
        assert num_updated > 0 and only_owned, f"rank {rank} updated rows it does not own"
    for rank in range(1, world):  # every copy bitwise equal, without any gathering
        for name, w in results[0][1].items():
            assert torch.equal(torch.as_tensor(results[rank][1][name]), torch.as_tensor(w)), (rank, name)


def test_checkpoint_of_owner_updated_state_loads_into_one_process(tmp_path):
    """The optimizer state is current on the owners only until a save brings it up to date: a
    checkpoint written right after training holds the single-process state, weights and sums."""
    root = tmp_path / "ckpt"
    spawn(2, owner_run, ("adagrad", str(root)), tmp_path=tmp_path)
    tables = make_tables()
    trained = FusedEmbeddingCollection(tables, optimizer_config("adagrad"), seed=0)
    train(trained, make_batches(tables, STEPS, BATCH))
    loaded = FusedEmbeddingCollection(tables, optimizer_config("adagrad"), seed=5)
    load_checkpoint(latest_checkpoint(root), loaded)
    want, got = trained.state_dict(), loaded.state_dict()
    for key, value in want.items():
        if not key.endswith(".step"):
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_which_rules_update_by_owner():
    assert not updates_by_owner("sgd")  # no state: every rank applies the same step
    assert all(updates_by_owner(n) for n in ("adagrad", "rowwise_adagrad", "adam"))
