"""The pooled exchange overlapped with the bottom MLP (ShardedEmbeddingCollection.start_pooled,
neorec/distributed/output_dist.py): in forward the exchange starts before the bottom MLP runs, in
backward the gradient's exchange starts before the bottom MLP's backward and is waited for after
it; training is bitwise what the exchange-then-wait order gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import build_model, local_slice, make_batches, make_tables, optimizer_config, spawn
from test_distributed import PLANS_2, STEPS

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.topology import Topology

pytestmark = pytest.mark.distributed


def traced_step(topo: Topology, plan_dict: dict) -> list[str]:
    """One training step over gloo, recording when the pooled exchanges start, when the bottom MLP
    runs forward and accumulates its gradients, and when the gradient exchange is waited for."""
    from neorec.distributed import output_dist
    from neorec.distributed.sharded import ShardedEmbeddingCollection

    events: list[str] = []
    comms = Comms(topo, transport="backend")
    exchange = comms.exchange

    def logged(blocks, recv_shapes, codec, direction, *args, **kwargs):
        events.append(f"exchange {direction}")
        return exchange(blocks, recv_shapes, codec, direction, *args, **kwargs)

    comms.exchange = logged
    wait = output_dist.AwaitGradient.backward

    def logged_wait(ctx, grad):
        events.append("await gradient")
        return wait(ctx, grad)

    output_dist.AwaitGradient.backward = staticmethod(logged_wait)
    tables = make_tables()
    emb = ShardedEmbeddingCollection(tables, optimizer_config("sgd"), ShardingPlan.from_dict(plan_dict), comms, seed=0)
    model = build_model(emb)
    model.bottom.register_forward_hook(lambda *_: events.append("bottom forward"))
    for p in model.bottom.parameters():
        p.register_post_accumulate_grad_hook(lambda _: events.append("bottom gradient"))
    batch = local_slice(make_batches(tables, 1, 16)[0], topo.rank, topo.world_size)
    torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
    return events


def collapse(events: list[str]) -> list[str]:
    """Runs of the same event as one."""
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]


@pytest.mark.parametrize("kind", ["tw", "rw"])
def test_exchanges_travel_during_the_bottom_mlp(kind, tmp_path):
    for events in spawn(2, traced_step, (PLANS_2[kind],), tmp_path=tmp_path).values():
        assert collapse(events) == [
            "exchange fwd", "bottom forward", "exchange bwd", "bottom gradient", "await gradient",
        ]  # fmt: skip


def test_two_hop_layouts_exchange_after_the_bottom_mlp(tmp_path):
    """twrw shards (in the mixed plan) take the sequential path: no gradient left to wait for."""
    for events in spawn(2, traced_step, (PLANS_2["mixed"],), tmp_path=tmp_path).values():
        order = collapse(events)
        assert order.index("bottom forward") < order.index("exchange fwd")
        assert "await gradient" not in order
        assert order.index("exchange bwd") < order.index("bottom gradient")


def overlap_run(topo: Topology, plan_dict: dict, overlap: bool):
    """STEPS of SGD over gloo; returns (losses, gathered tables, dense parameters)."""
    import torch.distributed as dist

    from neorec.distributed.dense import DenseGradSync
    from neorec.distributed.sharded import ShardedEmbeddingCollection
    from neorec.embedding.collection import EmbeddingCollection

    if not overlap:  # the base class's start_pooled: everything at finish, after the bottom MLP
        ShardedEmbeddingCollection.start_pooled = EmbeddingCollection.start_pooled
    tables = make_tables()
    comms = Comms(topo, transport="backend")
    emb = ShardedEmbeddingCollection(tables, optimizer_config("adagrad"), ShardingPlan.from_dict(plan_dict), comms, seed=0)
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    opt, emb_opt = torch.optim.SGD(dense, lr=0.05), emb.build_optimizer()
    sync = DenseGradSync(dense, comms, "fp32", 1e-4)
    losses = []
    for batch in make_batches(tables, STEPS, 16):
        batch = local_slice(batch, topo.rank, topo.world_size)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        opt.zero_grad(set_to_none=True)
        sync.arm()
        loss.backward()
        sync.start().wait()
        opt.step()
        emb_opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value))
    return losses, {k: v["weight"] for k, v in emb.gather_tables().items()}, [p.detach().clone() for p in dense]


def test_overlapped_training_is_bitwise_the_sequential_one(tmp_path):
    plan = PLANS_2["cw"]
    overlapped = spawn(2, overlap_run, (plan, True), tmp_path=tmp_path / "a")
    sequential = spawn(2, overlap_run, (plan, False), tmp_path=tmp_path / "b")
    for rank in (0, 1):
        assert overlapped[rank][0] == sequential[rank][0]
        for name, table in overlapped[rank][1].items():
            assert np.array_equal(table, sequential[rank][1][name]), name
        assert all(np.array_equal(a, b) for a, b in zip(overlapped[rank][2], sequential[rank][2], strict=True))
