"""Replicated tables' rows counted one batch ahead (ReplicaSync.count_ahead, on by default on a GPU):
the backward's exchanges and the owners' updates then know every size on the host, and the rows
merged from several ranks come padded with copies (neorec/distributed/replicas.py). On real gloo
processes, forced on with CPU tensors: bitwise the results of the exact path (which reads its counts
back), for every path of the exchange, and no read back in the replicas' part of the backward."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import count_host_reads, make_batches, make_tables, optimizer_config, spawn, train
from test_distributed import BATCH, PLANS_2, STEPS, check_against_single
from test_replicas import ALL_DP

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.replicas import ReplicaSync
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.embedding.fused import row_gradients
from neorec.embedding.tables import EmbeddingOptimizerConfig

pytestmark = pytest.mark.distributed


def ahead_run(
    topo, optimizer_name: str, plan: dict, read_ahead: bool, dense_bytes: int, weight_decay: float = 0.0,
    batch: int = BATCH,
):
    """Train with the pipeline, counting rows ahead or not; (losses, tables, gathered tables, reads
    back in the replicas' backward, updates that saw a row more than once)."""
    from neorec.distributed import replicas

    replicas.DENSE_BYTES = dense_bytes  # 0: always the sparse exchange; large: the dense all-reduce
    tables = make_tables()
    lr = optimizer_config(optimizer_name).lr
    config = EmbeddingOptimizerConfig(name=optimizer_name, lr=lr, weight_decay=weight_decay)
    comms = Comms(topo, transport="backend")
    emb = ShardedEmbeddingCollection(tables, config, ShardingPlan.from_dict(plan), comms, seed=0)
    emb._replicas.read_ahead = read_ahead
    if read_ahead:
        emb.replicated.chunk_elements = None  # one block, as on a GPU
    count, _ = count_host_reads(
        inside=[(ReplicaSync, "start_gradients"), (ReplicaSync, "share_updated"), (row_gradients, "sort_by_row")],
        main_thread_only=True,
    )
    repeated = [0]
    apply_update = emb.replicated.apply_update

    def recording(gi, rows, *args, **kwargs):
        repeated[0] += int(torch.unique(rows).numel() < rows.numel())
        return apply_update(gi, rows, *args, **kwargs)

    emb.replicated.apply_update = recording
    batches = make_batches(tables, STEPS, batch)
    losses, _ = train(emb, batches, topo.world_size, topo.rank, comms, pipeline=True)
    full = emb.gather_tables()
    weights = {k: v["weight"] for k, v in full.items()}
    return losses, weights, dict(full.items()), count[0], repeated[0]


def both_paths(topo, optimizer_name: str, plan: dict, dense_bytes: int, weight_decay: float):
    """ahead_run counting ahead, then on fresh tables, optimizers and batches the exact path, in one
    process group: (ahead's results, exact's results)."""
    ahead = ahead_run(topo, optimizer_name, plan, True, dense_bytes, weight_decay)
    return ahead, ahead_run(topo, optimizer_name, plan, False, dense_bytes, weight_decay)


CASES = [  # (ranks, rule, DENSE_BYTES, plan): owners' sparse exchange and all-reduce, SGD's gather and all-reduce
    (2, "adagrad", 0, ALL_DP),
    (4, "adagrad", 0, ALL_DP),
    (2, "adam", 0, PLANS_2["mixed"]),
    (2, "rowwise_adagrad", 1 << 30, ALL_DP),
    (4, "rowwise_adagrad", 1 << 30, ALL_DP),
    (4, "sgd", 0, ALL_DP),
    (2, "sgd", 1 << 30, PLANS_2["mixed"]),
]


@pytest.mark.parametrize("world, optimizer_name, dense_bytes, plan", CASES)
def test_counted_ahead_is_bitwise_the_exact_path(world, optimizer_name, dense_bytes, plan, tmp_path):
    # weight decay: both paths then update through the same read, rule and write (on CPU the exact
    # path may otherwise add deltas in place, which rounds differently from the rule's own update)
    both = spawn(world, both_paths, (optimizer_name, plan, dense_bytes, 1e-3), tmp_path=tmp_path)
    ahead = {rank: out[0] for rank, out in both.items()}
    exact = {rank: out[1] for rank, out in both.items()}
    for rank in range(world):
        losses, weights, full, reads, repeated = ahead[rank]
        if plan is ALL_DP:  # (with sharded tables too, sort_by_row counts their backward's reads on CPU)
            assert reads == 0, f"rank {rank} read {reads} values back in the replicas' backward"
        assert losses == exact[rank][0], f"rank {rank}"
        for name, w in weights.items():
            assert torch.equal(torch.as_tensor(w), torch.as_tensor(exact[rank][1][name])), (rank, name)
            for key, value in full[name].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(exact[rank][2][name][key])), (rank, name, key)
        assert exact[rank][3] > 0, f"rank {rank}: the exact path reads its counts back (the count works)"
    assert sum(out[4] for out in ahead.values()) > 0  # padding happened: rows merged from several ranks
    assert sum(out[4] for out in exact.values()) == 0


# batch 256: every row of the small tables is touched, so an owner updates every row it holds
@pytest.mark.parametrize(
    "optimizer_name, dense_bytes, batch",
    [("sgd", 0, BATCH), ("adam", 0, BATCH), ("adagrad", 1 << 30, BATCH), ("adagrad", 1 << 30, 256)],
)
def test_counted_ahead_matches_one_process(optimizer_name, dense_bytes, batch, tmp_path):
    """Without weight decay (on CPU, SGD's learning rate folded into the sums): the usual tolerance."""
    results = spawn(2, ahead_run, (optimizer_name, ALL_DP, True, dense_bytes, 0.0, batch), tmp_path=tmp_path)
    check_against_single({r: out[:3] + ({},) for r, out in results.items()}, optimizer_name, batch=batch)
    assert all(out[3] == 0 for out in results.values())
