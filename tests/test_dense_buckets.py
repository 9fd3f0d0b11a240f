"""Dense gradients averaged in buckets that start during backward (neorec/distributed/dense.py):
the buckets follow backward's order, their all-reduces start before backward returns, and training
matches single-process training and the one-all-reduce path."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import build_model, local_slice, make_batches, make_tables, optimizer_config, spawn
from test_distributed import PLAN_4, PLANS_2, STEPS, check_against_single

from neorec.distributed.comms import Comms
from neorec.distributed.dense import DenseGradSync, make_buckets
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology

pytestmark = pytest.mark.distributed


def test_buckets_follow_backward_order_and_close_at_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 200, 10)]
    mib = 250 * 4 / 2**20  # 250 fp32 values
    buckets = make_buckets(params, mib)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 200, 50], [300], [100]]
    assert make_buckets(params, 0) == [params]
    assert make_buckets([], 1.0) == []


def bucketed_run(topo: Topology, plan_dict: dict, bucket_mib: float):
    """SGD on the dense part over gloo's own collectives; returns (mean losses over ranks, gathered
    tables, bytes counted, buckets, buckets whose all-reduce had started when backward returned)."""
    import torch.distributed as dist

    tables = make_tables()
    batches = make_batches(tables, STEPS, 16)
    comms = Comms(topo, transport="backend")
    emb = ShardedEmbeddingCollection(tables, optimizer_config("sgd"), ShardingPlan.from_dict(plan_dict), comms, seed=0)
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    opt, emb_opt = torch.optim.SGD(dense, lr=0.05), emb.build_optimizer()
    sync = DenseGradSync(dense, comms, "fp32", bucket_mib)
    losses, early = [], []
    for batch in batches:
        batch = local_slice(batch, topo.rank, topo.world_size)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        opt.zero_grad(set_to_none=True)
        sync.arm()
        loss.backward()
        early.append(sum(s is not None for s in sync._started))
        sync.start().wait()
        opt.step()
        emb_opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value / topo.world_size))
    full = emb.gather_tables()
    return losses, {k: v["weight"] for k, v in full.items()}, {k: v for k, v in full.items()}, comms.stats.take(), \
        len(sync.buckets), early  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_bucketed_all_reduce_matches_single_process(world, tmp_path):
    plan = PLANS_2["mixed"] if world == 2 else PLAN_4
    results = spawn(world, bucketed_run, (plan, 1e-4), tmp_path=tmp_path)  # ~26 values a bucket
    check_against_single({r: v[:4] for r, v in results.items()}, "sgd")
    for _, _, _, _, buckets, early in results.values():
        assert buckets >= 3
        assert all(n == buckets for n in early)  # every bucket had started inside backward


def test_bucketed_and_single_all_reduce_agree_bitwise_on_two_ranks(tmp_path):
    """Two ranks: a sum of two values is the same whatever the bucketing, so the runs agree bitwise,
    and they move the same number of bytes."""
    plan = PLANS_2["mixed"]
    flat = spawn(2, bucketed_run, (plan, 0.0), tmp_path=tmp_path / "a")
    bucketed = spawn(2, bucketed_run, (plan, 1e-4), tmp_path=tmp_path / "b")
    for rank in (0, 1):
        assert flat[rank][0] == bucketed[rank][0]
        assert flat[rank][3] == bucketed[rank][3]
        assert flat[rank][4] == 1 and flat[rank][5] == [0] * STEPS  # one all-reduce, after backward
