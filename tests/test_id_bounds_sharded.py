"""Ids outside their tables under sharding: each rank checks its batch against the whole tables
before the id exchange routes anything (neorec/distributed/sharded.py), on real gloo processes.

warn: W ranks training on batches with bad ids match one process training on the same batches
without them (to the tolerance of tests/test_distributed.py), and the ranks' counts add up to the
ids dropped. error: every rank stops on its bad id before any exchange, with the feature, table and
id named, and no row of any shard changes.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import build_model, make_batches, make_tables, optimizer_config, run_steps, spawn
from test_distributed import PLANS_2

from neorec.data.batch import Batch
from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.errors import DataError
from neorec.sparse import SparseBatch

pytestmark = pytest.mark.distributed

STEPS, BATCH = 6, 16

# every sharding kind on 4 ranks (two nodes of two: twrw and twcw keep a table inside one node)
PLAN_4_ALL = {
    "tables": {
        "t0": {"kind": "tw", "ranks": [3]},
        "t1": {"kind": "rw", "ranks": [0, 1, 2, 3]},
        "t2": {"kind": "twrw", "node": 1},
        "t3": {"kind": "cw", "ranks": [1, 2, 0, 3]},
        "t4": {"kind": "dp"},
        "t5": {"kind": "twcw", "node": 0},
    }
}


def with_bad_ids(batch: Batch, every: int = 5) -> tuple[Batch, Batch, dict[str, int]]:
    """(the batch with every `every`-th id of each feature replaced by one outside its table, the
    batch without those ids, ids replaced per feature). Bad ids alternate between the table's row
    count (the next table's first row) and -1 (the previous table's last)."""
    rows = {f: t.rows for t in make_tables() for f in t.features}
    s = batch.sparse
    dirty, clean, count = {}, {}, {}
    for k in s.keys:
        ids, lengths, weights = s.feature(k)
        bad = torch.zeros(ids.numel(), dtype=torch.bool)
        bad[::every] = True
        replaced = ids.clone()
        replaced[bad] = torch.where(torch.arange(int(bad.sum())) % 2 == 0, rows[k], -1)
        bags = torch.arange(s.batch_size).repeat_interleave(lengths)
        kept_lengths = lengths - torch.bincount(bags[bad], minlength=s.batch_size)
        dirty[k] = (replaced, lengths, weights)
        clean[k] = (ids[~bad], kept_lengths, weights[~bad])
        count[k] = int(bad.sum())

    def rebuilt(feats):
        return Batch(batch.dense, SparseBatch.from_features(feats), batch.labels)

    return rebuilt(dirty), rebuilt(clean), count


def warn_run(topo: Topology, plan_dict: dict, pipeline: bool):
    tables = make_tables()
    batches = [with_bad_ids(b)[0] for b in make_batches(tables, STEPS, BATCH)]
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(
        tables,
        optimizer_config("adagrad"),
        ShardingPlan.from_dict(plan_dict),
        comms,
        seed=0,
        bounds_check="warn",
    )
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    losses = run_steps(
        model, emb, emb.build_optimizer(), torch.optim.SGD(dense, lr=0.05), batches, topo.rank, topo.world_size,
        comms, pipeline=pipeline,
    )  # fmt: skip
    return losses, {k: v["weight"] for k, v in emb.gather_tables().items()}, emb.dropped_ids()


def check_warn(results: dict, world: int) -> None:
    tables = make_tables()
    pairs = [with_bad_ids(b) for b in make_batches(tables, STEPS, BATCH)]
    single = FusedEmbeddingCollection(tables, optimizer_config("adagrad"), seed=0)
    model = build_model(single)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    losses = run_steps(
        model, single, single.build_optimizer(), torch.optim.SGD(dense, lr=0.05), [c for _, c, _ in pairs]
    )
    expected: dict[str, int] = {}
    for _, _, count in pairs:
        for k, n in count.items():
            expected[k] = expected.get(k, 0) + n
    dropped: dict[str, int] = {}
    for rank, (d_losses, d_weights, d_dropped) in results.items():
        torch.testing.assert_close(torch.tensor(d_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, w in single.table_weights().items():
            torch.testing.assert_close(
                torch.as_tensor(d_weights[name]), w, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )
        for k, n in d_dropped.items():
            dropped[k] = dropped.get(k, 0) + n
    assert dropped == expected, f"{world} ranks dropped {dropped}, the batches hold {expected}"


@pytest.mark.parametrize("pipeline", [False, True])
def test_two_ranks_warn_match_one_process_without_the_ids(pipeline, tmp_path):
    results = spawn(2, warn_run, (PLANS_2["mixed"], pipeline), tmp_path=tmp_path)
    check_warn(results, 2)


def test_four_ranks_every_kind_warn(tmp_path):
    results = spawn(4, warn_run, (PLAN_4_ALL, True), local_world=2, tmp_path=tmp_path)
    check_warn(results, 4)


def error_run(topo: Topology, plan_dict: dict):
    """Two clean steps, then a batch with a bad id in every rank's slice: each rank must stop on it,
    and the tables (gathered before and after, both collectives) must be bitwise the same."""
    tables = make_tables()
    batches = make_batches(tables, 3, BATCH)
    s = batches[2].sparse
    ids, lengths, weights = s.feature("f1")
    per_rank = BATCH // topo.world_size
    firsts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    bad = ids.clone()
    for r in range(topo.world_size):  # the first id of each rank's slice that has one
        sample = next(i for i in range(r * per_rank, (r + 1) * per_rank) if lengths[i] > 0)
        bad[firsts[sample]] = 50  # t1 has 50 rows: would be t2's row 0 (and rank r's sample `sample`)
    feats = {k: s.feature(k) for k in s.keys}
    feats["f1"] = (bad, lengths, weights)
    batches[2] = Batch(batches[2].dense, SparseBatch.from_features(feats), batches[2].labels)
    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(
        tables, optimizer_config("adagrad"), ShardingPlan.from_dict(plan_dict), comms
    )
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    emb_opt, opt = emb.build_optimizer(), torch.optim.SGD(dense, lr=0.05)
    run_steps(model, emb, emb_opt, opt, batches[:2], topo.rank, topo.world_size, comms)
    before = emb.gather_tables()
    try:
        run_steps(model, emb, emb_opt, opt, batches[2:], topo.rank, topo.world_size, comms)
    except DataError as e:
        message = str(e)
    else:
        message = None
    after = emb.gather_tables()
    same = all(torch.equal(before[t][k], after[t][k]) for t in before for k in before[t])
    return message, same


@pytest.mark.parametrize("world, plan, local_world", [(2, PLANS_2["mixed"], None), (4, PLAN_4_ALL, 2)])
def test_error_stops_every_rank_before_the_exchange(world, plan, local_world, tmp_path):
    results = spawn(world, error_run, (plan,), local_world=local_world, tmp_path=tmp_path)
    for rank, (message, same) in results.items():
        assert message is not None, f"rank {rank} trained on id 50 of t1"
        assert "feature 'f1' (table 't1', 50 rows): id 50 of sample" in message
        assert same, f"rank {rank}: rows changed"
