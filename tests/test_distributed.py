"""Sharded embeddings on real gloo processes, step by step against one process on the global batch.

Tolerance: fp32 exchanges change only the order of float additions (a row-split bag is summed per
shard, then the shards' partial sums are added; gradients are scaled by 1/W before, not after,
the sum), so losses and weights agree to 1e-5 relative (absolute 1e-6 near zero)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import make_batches, make_tables, optimizer_config, spawn, train

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan, TablePlan, default_plan
from neorec.distributed.replicas import ReplicaSync
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.errors import ConfigError

pytestmark = pytest.mark.distributed

STEPS, BATCH = 20, 16


def single_process(tables, optimizer, batches):
    emb = FusedEmbeddingCollection(tables, optimizer, seed=0)
    losses, _ = train(emb, batches)
    return losses, {t.name: emb.table_weights()[t.name].clone() for t in tables}, emb


def sharded_run(
    topo: Topology,
    plan_dict: dict,
    optimizer_name: str,
    precisions=("fp32", "fp32", "fp32"),
    pipeline=False,
    transport="shm",
    batch=BATCH,
    stage=False,
):
    tables = make_tables()
    batches = make_batches(tables, STEPS, batch)
    comms = Comms(topo, transport=transport, stage=stage)
    emb = ShardedEmbeddingCollection(
        tables, optimizer_config(optimizer_name), ShardingPlan.from_dict(plan_dict), comms, seed=0,
        forward_precision=precisions[0], backward_precision=precisions[1],
    )  # fmt: skip
    losses, _ = train(emb, batches, topo.world_size, topo.rank, comms, precisions[2], pipeline)
    full = emb.gather_tables()
    return (
        losses,
        {k: v["weight"] for k, v in full.items()},
        {k: v for k, v in full.items()},
        comms.stats.take(),
    )


def check_against_single(results, optimizer_name, batch=BATCH):
    tables = make_tables()
    batches = make_batches(tables, STEPS, batch)
    losses, weights, emb = single_process(tables, optimizer_config(optimizer_name), batches)
    state = emb.state_dict()
    for rank, (d_losses, d_weights, d_full, _) in results.items():
        torch.testing.assert_close(torch.tensor(d_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, w in weights.items():
            torch.testing.assert_close(
                torch.as_tensor(d_weights[name]), w, rtol=1e-5, atol=1e-6, msg=f"rank {rank} table {name}"
            )
            for key in ("momentum1", "momentum2"):
                full_key = f"tables.{name}.{key}"
                if full_key in state and state[full_key].dim() == 2:
                    torch.testing.assert_close(
                        torch.as_tensor(d_full[name][key]), state[full_key], rtol=1e-5, atol=1e-6
                    )


PLANS_2 = {
    "tw": {"tables": {f"t{i}": {"kind": "tw", "ranks": [i % 2]} for i in range(6)}},
    "rw": {"tables": {f"t{i}": {"kind": "rw", "ranks": [0, 1] if i % 2 else [1, 0]} for i in range(6)}},
    "cw": {"tables": {f"t{i}": {"kind": "cw", "ranks": [0, 1, 1, 0] if i % 2 else [1, 0]} for i in range(6)}},
    "dp": {"tables": {f"t{i}": {"kind": "dp"} for i in range(6)}},
    "mixed": {
        "tables": {
            "t0": {"kind": "tw", "ranks": [1]},
            "t1": {"kind": "rw", "ranks": [0, 1]},
            "t2": {"kind": "rw", "ranks": [1, 0]},
            "t3": {"kind": "cw", "ranks": [1, 0]},
            "t4": {"kind": "dp"},
            "t5": {"kind": "twrw", "node": 0},
        }
    },
    # each rank looks up exactly two features (rank 1: the two of t1), from both ranks' samples
    "two_each": {
        "tables": {
            "t0": {"kind": "tw", "ranks": [0]},
            "t2": {"kind": "tw", "ranks": [0]},
            "t1": {"kind": "tw", "ranks": [1]},
            **{f"t{i}": {"kind": "dp"} for i in (3, 4, 5)},
        }
    },
}


@pytest.mark.parametrize("kind", list(PLANS_2))
def test_two_ranks_match_single_process(kind, tmp_path):
    results = spawn(2, sharded_run, (PLANS_2[kind], "adagrad"), tmp_path=tmp_path)
    check_against_single(results, "adagrad")


@pytest.mark.parametrize("optimizer_name", ["sgd", "rowwise_adagrad", "adam"])
def test_two_ranks_mixed_plan_every_optimizer(optimizer_name, tmp_path):
    plan = PLANS_2["mixed"]
    if optimizer_name == "rowwise_adagrad":  # one accumulator per column shard: not the unsharded rule
        plan = {"tables": {**plan["tables"], "t3": {"kind": "tw", "ranks": [0]}}}
    results = spawn(2, sharded_run, (plan, optimizer_name), tmp_path=tmp_path)
    check_against_single(results, optimizer_name)


PLAN_4 = {
    "tables": {
        "t0": {"kind": "tw", "ranks": [3]},
        "t1": {"kind": "rw", "ranks": [0, 1, 2, 3]},
        "t2": {"kind": "rw", "ranks": [2, 0, 3]},
        "t3": {"kind": "cw", "ranks": [1, 2, 0, 3]},
        "t4": {"kind": "dp"},
        "t5": {"kind": "tw", "ranks": [1]},
    }
}

PLAN_2x2 = {
    "tables": {
        "t0": {"kind": "twrw", "node": 1},
        "t1": {"kind": "twcw", "node": 0},
        "t2": {"kind": "twrw", "node": 0},
        "t3": {"kind": "twcw", "node": 1},
        "t4": {"kind": "rw", "ranks": [3, 0]},
        "t5": {"kind": "tw", "ranks": [2]},
    }
}


def test_four_ranks_mixed_plan(tmp_path):
    results = spawn(4, sharded_run, (PLAN_4, "adagrad"), tmp_path=tmp_path)
    check_against_single(results, "adagrad")


def dense_replicas_run(topo: Topology, plan_dict: dict, batch: int, optimizer_name: str = "adagrad"):
    """sharded_run with the sparse gather of replica gradients switched off: the dense all-reduce
    must be the path taken."""

    def no_gather(*args, **kwargs):
        raise AssertionError("the dense all-reduce of the replicas' gradients should have been chosen")

    ReplicaSync._gather = ReplicaSync._to_owners = no_gather
    return sharded_run(topo, plan_dict, optimizer_name, batch=batch)


@pytest.mark.parametrize("optimizer_name", ["adagrad", "sgd", "adam"])
def test_four_ranks_dense_replica_gradients(optimizer_name, tmp_path):
    """Replicated tables whose rows most of the batch touches: every rank's row count makes the dense
    all-reduce of the group's whole gradient cheaper than gathering rows, so that path runs, and it
    still matches one process. SGD sums gradients already weighted by -lr (folded_lr) and adds them
    to the rows in place."""
    plan = {"tables": {f"t{i}": {"kind": "dp"} for i in range(6)}}
    results = spawn(4, dense_replicas_run, (plan, 256, optimizer_name), tmp_path=tmp_path)
    check_against_single(results, optimizer_name, batch=256)


def test_two_nodes_of_two_hierarchical(tmp_path):
    """4 processes as 2 nodes x 2 local ranks: twrw/twcw tables go through the two-hop exchange."""
    results = spawn(4, sharded_run, (PLAN_2x2, "adagrad"), local_world=2, tmp_path=tmp_path)
    check_against_single(results, "adagrad")
    sent = results[0][3]
    assert sent["fwd"] > 0 and sent["bwd"] > 0 and sent["input_dist"] > 0


def test_pipelined_training_gives_identical_results(tmp_path):
    """The pipeline (next batch's id exchange on a background thread) changes timing only."""
    plan = PLANS_2["mixed"]
    plain = spawn(2, sharded_run, (plan, "adagrad"), tmp_path=tmp_path / "a")
    piped = spawn(2, sharded_run, (plan, "adagrad", ("fp16", "bf16", "fp32"), True), tmp_path=tmp_path / "b")
    again = spawn(2, sharded_run, (plan, "adagrad", ("fp16", "bf16", "fp32"), False), tmp_path=tmp_path / "c")
    check_against_single(plain, "adagrad")
    for rank in (0, 1):
        assert piped[rank][0] == again[rank][0]  # losses, bitwise
        for name, w in again[rank][1].items():
            assert (piped[rank][1][name] == w).all()


def test_shared_memory_and_backend_transports_agree(tmp_path):
    """Every test above exchanges through shared memory (the default on one machine); the same run
    through gloo's own collectives matches single-process training, and the two transports give
    bitwise the same losses (they move the same bytes; all-reduce sums in rank order)."""
    plan = PLANS_2["mixed"]
    shm = spawn(
        2, sharded_run, (plan, "adagrad", ("fp16", "bf16", "fp32"), False, "shm"), tmp_path=tmp_path / "a"
    )
    gloo = spawn(
        2, sharded_run, (plan, "adagrad", ("fp16", "bf16", "fp32"), False, "backend"), tmp_path=tmp_path / "b"
    )
    for rank in (0, 1):
        torch.testing.assert_close(
            torch.tensor(shm[rank][0]), torch.tensor(gloo[rank][0]), rtol=1e-6, atol=1e-7
        )
        assert shm[rank][3] == gloo[rank][3]  # the same bytes counted
    plain = spawn(2, sharded_run, (plan, "sgd", ("fp32",) * 3, False, "backend"), tmp_path=tmp_path / "c")
    check_against_single(plain, "sgd")


def test_single_process_sharded_equals_fused():
    """World of one: every kind degenerates to local shards, and must still train identically."""
    topo = Topology(1, 0, 1)
    plan = {"tables": {"t0": {"kind": "tw", "ranks": [0]}, "t1": {"kind": "rw", "ranks": [0]},
                       "t2": {"kind": "cw", "ranks": [0, 0]}, "t3": {"kind": "dp"},
                       "t4": {"kind": "twrw", "node": 0}, "t5": {"kind": "twcw", "node": 0}}}  # fmt: skip
    results = {0: sharded_run(topo, plan, "adam")}
    check_against_single(results, "adam")


def test_plan_errors_name_the_table():
    tables = make_tables()
    topo = Topology(2, 0, 2)
    bad = [
        ({"t0": {"kind": "tw", "ranks": [2]}}, "t0.*rank.*\\[2\\] do not exist"),
        ({"t1": {"kind": "cw", "ranks": [0, 1, 0]}}, "t1.*3 column shards do not divide the dim 8"),
        ({"t3": {"kind": "rw", "ranks": [0, 1]}}, None),
        ({"t9": {"kind": "tw", "ranks": [0]}}, "t9"),
        ({"t2": {"kind": "twrw", "node": 3}}, "t2.*node"),
    ]
    base = default_plan(tables, topo).to_dict()["tables"]
    for override, pattern in bad:
        plan = ShardingPlan.from_dict({"tables": {**base, **override}})
        if pattern is None:
            plan.validate(tables, topo)
            continue
        with pytest.raises(ConfigError, match=pattern):
            plan.validate(tables, topo)
    tiny = [t.model_copy(update={"rows": 1}) if t.name == "t0" else t for t in tables]
    plan = ShardingPlan.from_dict({"tables": {**base, "t0": {"kind": "rw", "ranks": [0, 1]}}})
    with pytest.raises(ConfigError, match="t0.*2 row shards but the table has only 1 rows"):
        plan.validate(tiny, topo)
    with pytest.raises(ConfigError, match="kind"):
        ShardingPlan.from_dict({"tables": {"t0": {"kind": "diagonal"}}})
    assert isinstance(plan.tables["t0"], TablePlan)


def test_plan_files_refuse_booleans_as_ranks_and_ranks_on_a_replicated_table():
    for entry in ({"kind": "tw", "ranks": [True]}, {"kind": "twrw", "node": False}):
        with pytest.raises(ConfigError, match="must be .*whole number"):
            ShardingPlan.from_dict({"tables": {"t0": entry}})
    base = default_plan(make_tables(), Topology(2, 0, 2)).to_dict()["tables"]
    plan = ShardingPlan.from_dict({"tables": {**base, "t0": {"kind": "dp", "ranks": [0]}}})
    with pytest.raises(ConfigError, match=r"table 't0' \(dp\): data-parallel tables live on every rank"):
        plan.validate(make_tables(), Topology(2, 0, 2))


def test_default_plan_balances_and_round_trips(tmp_path):
    tables = make_tables()
    plan = default_plan(tables, Topology(4, 0, 4))
    plan.validate(tables, Topology(4, 0, 4))
    used = {p.ranks[0] for p in plan.tables.values()}
    assert used == {0, 1, 2, 3}
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json").to_dict() == plan.to_dict()
