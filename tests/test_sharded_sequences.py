"""Sequence features (pooling none) in the sharded collection on real gloo processes: training with
tw, rw, cw and dp sequence tables matches one process on the global batch (losses, weights and
optimizer state to 1e-5), on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import NUM_DENSE, make_batches, optimizer_config, run_steps, spawn
from torch import nn

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError

pytestmark = pytest.mark.distributed

STEPS, BATCH, MAX_LEN = 8, 8, 3


def make_tables() -> list[TableConfig]:
    """Two pooled tables (one mean) and two sequence tables, one shared by two features, one of
    dim 4."""
    return [
        TableConfig(name="t0", rows=37, dim=8, features=["f0"]),
        TableConfig(name="t1", rows=50, dim=8, features=["f1"], pooling="mean"),
        TableConfig(name="s0", rows=60, dim=8, features=["h0", "h0b"], pooling="none"),
        TableConfig(name="s1", rows=45, dim=4, features=["h1"], pooling="none"),
    ]


class SequenceModel(nn.Module):
    """Pooled features and the last MAX_LEN rows of each sequence (position by position, so the
    order of rows and the truncation matter) into one linear layer."""

    def __init__(self, embeddings) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.embeddings = embeddings
        self.bottom = nn.Linear(NUM_DENSE, 4)
        width = 4 + embeddings.output_dim + MAX_LEN * sum(embeddings.sequence_dims)
        self.top = nn.Linear(width, 1)

    def forward(self, batch) -> torch.Tensor:
        pooled, sequences = self.embeddings.embed(batch.sparse)
        parts = [torch.relu(self.bottom(batch.dense)), pooled]
        for f in self.embeddings.sequence_names:
            padded, _ = sequences[f].to_padded(MAX_LEN)
            parts.append(padded.flatten(1))
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def train(embeddings, batches, world=1, rank=0, comms=None, pipeline=False):
    model = SequenceModel(embeddings)
    emb_opt = embeddings.build_optimizer()
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    opt = torch.optim.SGD(dense, lr=0.05)
    return run_steps(model, embeddings, emb_opt, opt, batches, rank, world, comms, pipeline=pipeline)


def sharded_run(topo: Topology, plan: dict, optimizer_name: str, pipeline: bool = False):
    tables = make_tables()
    batches = make_batches(tables, STEPS, BATCH)
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(tables, optimizer_config(optimizer_name), ShardingPlan.from_dict(plan), comms)
    losses = train(emb, batches, topo.world_size, topo.rank, comms, pipeline)
    return losses, emb.gather_tables()


def check_against_single(results, optimizer_name: str) -> None:
    tables = make_tables()
    emb = FusedEmbeddingCollection(tables, optimizer_config(optimizer_name))
    losses = train(emb, make_batches(tables, STEPS, BATCH))
    state = emb.state_dict()
    for rank, (d_losses, d_tables) in results.items():
        torch.testing.assert_close(torch.tensor(d_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for t in tables:
            for key in ("weight", "momentum1", "momentum2"):
                full_key = f"tables.{t.name}.{key}"
                if full_key in state and (key == "weight" or state[full_key].dim() == 2):
                    torch.testing.assert_close(torch.as_tensor(d_tables[t.name][key]), state[full_key],
                                               rtol=1e-5, atol=1e-6, msg=f"rank {rank} {full_key}")  # fmt: skip


def plan_of(kinds: dict[str, dict]) -> dict:
    return {"tables": {"t0": {"kind": "tw", "ranks": [1]}, "t1": {"kind": "rw", "ranks": [0, 1]}, **kinds}}


PLANS_2 = {
    "tw": plan_of({"s0": {"kind": "tw", "ranks": [0]}, "s1": {"kind": "tw", "ranks": [1]}}),
    "rw": plan_of({"s0": {"kind": "rw", "ranks": [1, 0]}, "s1": {"kind": "rw", "ranks": [0, 1]}}),
    "cw": plan_of({"s0": {"kind": "cw", "ranks": [0, 1, 1, 0]}, "s1": {"kind": "cw", "ranks": [1, 0]}}),
    "dp": plan_of({"s0": {"kind": "dp"}, "s1": {"kind": "dp"}}),
}


@pytest.mark.parametrize("kind", list(PLANS_2))
def test_two_ranks_match_single_process(kind, tmp_path):
    results = spawn(2, sharded_run, (PLANS_2[kind], "adagrad"), tmp_path=tmp_path)
    check_against_single(results, "adagrad")


def test_pipelined_training_matches_single_process(tmp_path):
    """The next batch's id exchange on a background thread (neorec.train.pipeline) changes nothing."""
    results = spawn(2, sharded_run, (PLANS_2["rw"], "rowwise_adagrad", True), tmp_path=tmp_path)
    check_against_single(results, "rowwise_adagrad")


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_four_ranks_mixed_plan(optimizer_name, tmp_path):
    plan = {
        "tables": {
            "t0": {"kind": "cw", "ranks": [2, 3]},
            "t1": {"kind": "dp"},
            "s0": {"kind": "rw", "ranks": [3, 1, 0, 2]},
            "s1": {"kind": "cw", "ranks": [1, 2]},
        }
    }
    results = spawn(4, sharded_run, (plan, optimizer_name), tmp_path=tmp_path)
    check_against_single(results, optimizer_name)


def test_hierarchical_kinds_refuse_sequence_tables():
    tables = make_tables()
    plan = ShardingPlan.from_dict(plan_of({"s0": {"kind": "twrw", "node": 0}, "s1": {"kind": "tw", "ranks": [0]}}))
    with pytest.raises(ConfigError, match=r"table 's0' \(twrw\).*pooling none"):
        plan.validate(tables, Topology(2, 0, 2))


def build_for_checkpoint(emb):
    model = SequenceModel(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return model, {"dense": torch.optim.SGD(dense, lr=0.05, momentum=0.9), "embedding": emb.build_optimizer()}


def save_then_continue(topo: Topology, plan: dict, root: str):
    """Train half the batches, save, train the rest: the reference for a load under another layout."""
    from neorec.checkpoint import save_checkpoint

    tables = make_tables()
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(tables, optimizer_config("adam"), ShardingPlan.from_dict(plan), comms)
    model, opts = build_for_checkpoint(emb)
    batches = make_batches(tables, STEPS, BATCH)
    run_steps(model, emb, opts["embedding"], opts["dense"], batches[: STEPS // 2], topo.rank, topo.world_size, comms)
    save_checkpoint(root, STEPS // 2, emb, model, opts, {})
    losses = run_steps(model, emb, opts["embedding"], opts["dense"], batches[STEPS // 2 :], topo.rank,
                       topo.world_size, comms)  # fmt: skip
    return losses, emb.gather_tables()


def test_checkpoint_of_sharded_sequence_tables_loads_in_one_process(tmp_path):
    """Saved by 2 ranks (sequence tables row- and column-split), loaded by the single-process engine:
    the rest of the run is the same."""
    from neorec.checkpoint import latest_checkpoint, load_checkpoint

    root = str(tmp_path / "ckpt")
    plan = plan_of({"s0": {"kind": "rw", "ranks": [1, 0]}, "s1": {"kind": "cw", "ranks": [1, 0]}})
    ref_losses, ref_tables = spawn(2, save_then_continue, (plan, root), tmp_path=tmp_path / "a")[0]
    tables = make_tables()
    emb = FusedEmbeddingCollection(tables, optimizer_config("adam"), seed=5)  # other init: overwritten
    model, opts = build_for_checkpoint(emb)
    load_checkpoint(latest_checkpoint(root), emb, model, opts)
    batches = make_batches(tables, STEPS, BATCH)
    losses = run_steps(model, emb, opts["embedding"], opts["dense"], batches[STEPS // 2 :])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    state = emb.state_dict()
    for t in tables:
        for key in ("weight", "momentum1", "momentum2"):
            torch.testing.assert_close(torch.as_tensor(ref_tables[t.name][key]), state[f"tables.{t.name}.{key}"],
                                       rtol=1e-5, atol=1e-6, msg=f"{t.name}.{key}")  # fmt: skip


def routes_run(topo: Topology, plan: dict):
    """Per batch: whether the sequence routes built from the exchanged batch (its host counts) equal
    those counted from the tensors, and the reads back the former made."""
    from dist_helpers import count_host_reads

    from neorec.distributed.sequence_dist import build_routes
    from neorec.sparse import SparseBatch

    tables = make_tables()
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(tables, optimizer_config("adagrad"), ShardingPlan.from_dict(plan), comms)
    b = BATCH // topo.world_size
    out = []
    for batch in make_batches(tables, 3, BATCH):
        sparse = batch.sparse.slice_samples(topo.rank * b, (topo.rank + 1) * b)
        local = emb.input_dist(sparse).wait()
        plain = SparseBatch(local.keys, local.values, local.lengths, local.weights)
        counted = build_routes(emb.layout, sparse, plain)
        count, _ = count_host_reads()
        known = build_routes(emb.layout, sparse, local)
        reads = count[0]
        same = known.recv == counted.recv and known.send == counted.send
        same &= all(torch.equal(known.restore[f], counted.restore[f]) for f in counted.restore)
        out.append((same, reads))
    return out


ROUTES_4 = {
    "tables": {
        "t0": {"kind": "cw", "ranks": [2, 3]},
        "t1": {"kind": "rw", "ranks": [1, 2, 0]},
        "s0": {"kind": "rw", "ranks": [3, 1, 0, 2]},
        "s1": {"kind": "cw", "ranks": [1, 2]},
    }
}


@pytest.mark.parametrize("world, plan", [(2, PLANS_2["rw"]), (4, ROUTES_4)])
def test_sequence_routes_come_from_the_input_distributions_host_counts(world, plan, tmp_path):
    """Row counts of the sequence exchange: taken from what the id exchange knows on the host
    (input_dist.ExchangedBatch), the same as counted from the tensors, with nothing read back."""
    results = spawn(world, routes_run, (plan,), tmp_path=tmp_path)
    for rank, batches in results.items():
        for same, reads in batches:
            assert same, f"rank {rank}: the routes differ"
            assert reads == 0, f"rank {rank}: {reads} reads back"
