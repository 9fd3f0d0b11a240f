"""The sharding planner's arithmetic: exchange bytes of every sharding kind (by hand and against real
gloo runs) and the memory of shards (its search: tests/test_planner_search.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.distributed.topology import Topology
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.planner import build_workload, estimate_plan, this_machine
from neorec.planner.exchanges import plan_traffic
from neorec.planner.hardware import CALIBRATED_CPU
from neorec.planner.options import table_options

# ---- exact bytes of every exchange, by hand ----------------------------------------------------------
# 4 ranks on 2 nodes (ranks 0, 1 | 2, 3), global batch 8 (2 samples per rank), one id per sample and
# feature; forward fp16 (2 bytes + one column per block), backward bf16 (2 bytes).
TOPO = Topology(4, 0, 2)


def small_workload(pooling: str = "sum", sample: bool = True, rows_c: int = 3, optimizer: str = "rowwise_adagrad"):
    tables = [
        TableConfig(name="a", rows=10, dim=4, features=["fa"], pooling=pooling),
        TableConfig(name="b", rows=12, dim=4, features=["fb", "fb2"]),
        TableConfig(name="c", rows=rows_c, dim=4, features=["fc"]),
    ]
    # ids of the 8 samples: half of table a's ids in rows [0, 5), two distinct ids per rank's samples
    samples = {"a": [[np.array([1, 6] * 4)]], "c": [[np.array([0, 1] * 4)]]} if sample else None
    return build_workload(tables, optimizer, 8, id_samples=samples)


def sent_by(plan: dict, rank: int = 0, **kw) -> dict[str, float]:
    workload = small_workload(**kw)
    full = {"tables": {"a": {"kind": "dp"}, "b": {"kind": "dp"}, "c": {"kind": "dp"}}}
    full["tables"].update(plan)
    traffic = plan_traffic(ShardingPlan.from_dict(full), workload, TOPO)
    return {d: traffic.sent(rank, d) for d in ("input_dist", "fwd", "bwd")}


def no_dp(plan: dict) -> dict:
    """Put b and c table-wise on rank 3 so that only the table under test is exchanged by rank 0."""
    return {"b": {"kind": "tw", "ranks": [3]}, "c": {"kind": "tw", "ranks": [3]}, **plan}


# rank 0 -> 3: b (2 features) and c; grads. And rank 0's batch size (int64) to each of the 3 others.
B_ON_3 = {"input_dist": 3 * (8 + 2 * 4 + 2 * 8) + 3 * 8, "bwd": 2 * 12 * 2}


def test_sequence_tables_are_costed_by_rows_per_id():
    """A table with pooling none sends one row per id: its exchange grows with the bag size, a
    pooled table's does not; their weights and state take the same memory; no two-hop options."""
    tables = [
        TableConfig(name="p", rows=100, dim=4, features=["fp"]),
        TableConfig(name="s", rows=100, dim=4, features=["fs"], pooling="none"),
    ]
    plan = ShardingPlan.from_dict({"tables": {"p": {"kind": "tw", "ranks": [1]}, "s": {"kind": "tw", "ranks": [2]}}})
    cluster = this_machine(4, calibration=dict(CALIBRATED_CPU), memory=2**34).with_ranks(4, 2)

    def costs(ids: float) -> dict[str, tuple[float, float, dict]]:
        workload = build_workload(tables, "adagrad", 8, ids_per_feature={"fp": ids, "fs": ids})
        traffic = plan_traffic(plan, workload, TOPO)
        out = {}
        for name, owner in (("p", 1), ("s", 2)):  # rank 0's 2 samples: rows in (fp16), gradients out (bf16)
            exchanged = traffic.matrices["fwd"][owner, 0] + traffic.matrices["bwd"][0, owner]
            (option,) = table_options(workload.by_name[name], workload, cluster, ("tw",), ("device",))
            out[name] = (exchanged, option.everyone, option.piece_memory[0])
        return out

    one, five = costs(1.0), costs(5.0)
    per_row = (4 + 1) * 2 + 4 * 2
    assert one["p"][0] == five["p"][0] == 2 * per_row  # one pooled row per bag, whatever the bag size
    empty_block = 2 * 1 * 2  # rank 2's pooled block has no columns, but fp16 sends its scale column
    assert one["s"][0] == 2 * per_row + empty_block and five["s"][0] == 5 * 2 * per_row + empty_block
    assert five["s"][1] - one["s"][1] > five["p"][1] - one["p"][1] > 0  # ids cost both; rows only s
    weights_and_state = {k: v for k, v in one["s"][2].items() if k != "device"}
    assert weights_and_state == {k: v for k, v in one["p"][2].items() if k != "device"}
    workload = build_workload(tables, "adagrad", 8)
    kinds = {o.kind for o in table_options(workload.by_name["s"], workload, cluster, ("tw", "twrw", "twcw", "rw"))}
    assert kinds == {"tw", "rw"}


def test_bytes_table_wise():
    got = sent_by(no_dp({"a": {"kind": "tw", "ranks": [1]}}))
    # ids to rank 1: their count (int64) + 2 lengths (int32) + 2 ids (int64); fwd: rank 0 holds nothing, still one fp16 column
    # per block to each of 3 ranks; bwd: gradients of a (width 4) to rank 1, of b+c (width 12) to rank 3
    assert got == {
        "input_dist": 8 + 2 * 4 + 2 * 8 + B_ON_3["input_dist"],
        "fwd": 3 * 2 * 1 * 2,
        "bwd": 2 * 4 * 2 + B_ON_3["bwd"],
    }
    holder = sent_by(no_dp({"a": {"kind": "tw", "ranks": [1]}}), rank=1)
    assert holder["fwd"] == 3 * 2 * (4 + 1) * 2


def test_bytes_row_wise_and_mean_pooling_weights():
    got = sent_by(no_dp({"a": {"kind": "rw", "ranks": [0, 2]}}))
    # half the ids (rows [5, 10)) go to rank 2; rank 0 pools its own rows: width 4 to 3 ranks
    assert got == {
        "input_dist": 8 + 2 * 4 + 1 * 8 + B_ON_3["input_dist"],
        "fwd": 3 * 2 * 5 * 2,
        "bwd": 2 * 4 * 2 + B_ON_3["bwd"],
    }
    mean = sent_by(no_dp({"a": {"kind": "rw", "ranks": [0, 2]}}), pooling="mean")
    # a mean-pooled row split makes every id of every table carry an fp32 weight
    assert mean["input_dist"] == got["input_dist"] + 4 * (1 + 3 * 2)


def test_bytes_column_wise():
    got = sent_by(no_dp({"a": {"kind": "cw", "ranks": [0, 1]}}))
    # rank 1 needs all ids; rank 0 pools a 2-column slice for 3 ranks; gradients of the slice to rank 1
    assert got == {
        "input_dist": 8 + 2 * 4 + 2 * 8 + B_ON_3["input_dist"],
        "fwd": 3 * 2 * 3 * 2,
        "bwd": 2 * 2 * 2 + B_ON_3["bwd"],
    }


def test_bytes_table_row_wise_two_hops():
    got = sent_by(no_dp({"a": {"kind": "twrw", "node": 1}}))
    # ids: half to rank 2, half to rank 3. fwd: empty flat blocks (3 x 2 bytes x 2 samples), hop 1 to
    # peer rank 1 ([2 nodes x 2 samples, 0 + 1 columns]), hop 2 to rank 2 ([2, 0 + 1]); bwd: node 1's
    # sums (width 4) back to rank 2
    assert got == {"input_dist": 2 * (8 + 2 * 4 + 1 * 8) + B_ON_3["input_dist"], "fwd": 12 + 2 * 2 * 1 * 2 + 2 * 1 * 2,
                   "bwd": 2 * 4 * 2 + B_ON_3["bwd"]}  # fmt: skip
    holder = sent_by(no_dp({"a": {"kind": "twrw", "node": 1}}), rank=2)
    # rank 2 sends its partial sums for rank 3's samples of both nodes (hop 1) and node 1's sums for rank 0
    assert holder["fwd"] == 12 + 2 * 2 * 5 * 2 + 2 * 5 * 2


def test_bytes_table_column_wise_two_hops():
    got = sent_by(no_dp({"a": {"kind": "twcw", "node": 0}}))
    # rank 0 holds columns 0-1: hop 1 sends its slice for rank 1's samples of both nodes, hop 2 the
    # joined 4 columns to rank 2; bwd: the slice gradient back from hop 1 to rank 1
    assert got == {"input_dist": 8 + 2 * 4 + 2 * 8 + B_ON_3["input_dist"], "fwd": 12 + 2 * 2 * 3 * 2 + 2 * 5 * 2,
                   "bwd": 2 * 2 * 2 * 2 + B_ON_3["bwd"]}  # fmt: skip


def test_bytes_replicated_sparse_and_dense():
    """Plain SGD: every rank's rows and gradients go to every rank."""
    workload = small_workload(optimizer="sgd")
    plan = ShardingPlan.from_dict({"tables": {"a": {"kind": "dp"}, "b": {"kind": "tw", "ranks": [3]},
                                              "c": {"kind": "tw", "ranks": [3]}}})  # fmt: skip
    sparse = plan_traffic(plan, workload, TOPO).sent(0, "dp")
    # 2 rows touched per rank: 4 ranks x 2 x (8 + 8) = 128 <= dense 2 x 10 x 5 x 4: count, rows, bf16 grads
    assert sparse == 3 * (8 + 2 * 8 + 2 * 4 * 2)
    # a 3-row table: sparse 128 > dense 120 -> all-reduce of [3, 5] fp32 values in bf16, padded to
    # 4 x 256: reduce-scatter + all-gather of one 256-wide row to 3 ranks, after the count
    wl3 = small_workload(rows_c=3, optimizer="sgd")
    plan3 = ShardingPlan.from_dict({"tables": {"a": {"kind": "tw", "ranks": [3]}, "b": {"kind": "tw", "ranks": [3]},
                                               "c": {"kind": "dp"}}})  # fmt: skip
    assert plan_traffic(plan3, wl3, TOPO).sent(0, "dp") == 3 * 8 + 2 * 3 * 256 * 2


def test_bytes_replicated_by_owner():
    """Rules with state (here rowwise adagrad): per peer, the 4 counts (a group this small may take
    the dense all-reduce), the rows it owns (expected: a quarter of the rank's 2 touched rows) after
    their size and, after the update, a quarter of the 2 rows touched in the global batch as int64 +
    fp32 weights, after their size."""
    plan = ShardingPlan.from_dict({"tables": {"a": {"kind": "dp"}, "b": {"kind": "tw", "ranks": [3]},
                                              "c": {"kind": "tw", "ranks": [3]}}})  # fmt: skip
    sparse = plan_traffic(plan, small_workload(), TOPO).sent(0, "dp")
    assert sparse == 3 * (4 * 8 + 0.5 * (8 + 4 * 2) + 8 + 8 + 0.5 * (8 + 4 * 4))
    plan3 = ShardingPlan.from_dict({"tables": {"a": {"kind": "tw", "ranks": [3]}, "b": {"kind": "tw", "ranks": [3]},
                                               "c": {"kind": "dp"}}})  # fmt: skip
    dense = plan_traffic(plan3, small_workload(rows_c=3), TOPO).sent(0, "dp")
    assert dense == 3 * 4 * 8 + 2 * 3 * 256 * 2 + 3 * (8 + 0.5 * (8 + 4 * 4))


def test_memory_of_shards_and_dtypes():
    tables = [TableConfig(name="t", rows=1000, dim=16, features=["f"], dtype="fp16")]
    cluster = this_machine(2, calibration=dict(CALIBRATED_CPU), memory=2**34)
    for optimizer, per_row in [("sgd", 16 * 2), ("rowwise_adagrad", 16 * 2 + 4), ("adagrad", 16 * 2 + 16 * 4),
                               ("adam", 16 * 2 + 2 * 16 * 4)]:  # fmt: skip
        wl = build_workload(tables, optimizer, 64)
        rw = estimate_plan(ShardingPlan({"t": TablePlan("rw", [0, 1])}), wl, cluster)
        assert [r.weights["device"] for r in rw.ranks] == [500 * per_row, 500 * per_row]
        cw = estimate_plan(ShardingPlan({"t": TablePlan("cw", [1, 0])}), wl, cluster)
        slice_row = per_row // 2 if optimizer != "rowwise_adagrad" else 8 * 2 + 4  # one accumulator per slice
        assert [r.weights["device"] for r in cw.ranks] == [1000 * slice_row] * 2


# ---- predicted bytes against CommStats on real processes ---------------------------------------------------
MIXED_PLAN = {"tables": {
    "a": {"kind": "tw", "ranks": [1]}, "b": {"kind": "rw", "ranks": [0, 3]}, "c": {"kind": "cw", "ranks": [1, 2]},
    "d": {"kind": "twrw", "node": 1}, "e": {"kind": "twcw", "node": 0}, "f": {"kind": "dp"}, "g": {"kind": "dp"},
}}  # fmt: skip


def mixed_tables() -> list[TableConfig]:
    return [
        TableConfig(name="a", rows=20, dim=4, features=["fa"]),
        TableConfig(name="b", rows=30, dim=4, features=["fb", "fb2"], pooling="mean"),
        TableConfig(name="c", rows=25, dim=4, features=["fc"]),
        TableConfig(name="d", rows=40, dim=4, features=["fd"]),
        TableConfig(name="e", rows=16, dim=8, features=["fe"]),
        TableConfig(name="f", rows=50, dim=4, features=["ff"]),
        TableConfig(name="g", rows=3, dim=8, features=["fg"]),
    ]


def mixed_local_batch(b: int = 4):
    """Every rank's samples are the same, so a rank's counts equal the expected ones exactly."""
    from neorec.sparse import SparseBatch

    g = torch.Generator().manual_seed(3)
    feats = {}
    for t in mixed_tables():
        for f in t.features:
            lengths = torch.tensor([1, 2, 0, 3][:b])
            feats[f] = (torch.randint(0, t.rows, (int(lengths.sum()),), generator=g), lengths)
    return SparseBatch.from_features(feats)


def _count_bytes(topo: Topology, counted_ahead: bool = False):
    """Bytes of one step; counted_ahead: the replicated rows counted one batch ahead (forced on, as
    on a GPU), the batch prefetched as the pipeline does."""
    from neorec.distributed.comms import Comms
    from neorec.distributed.sharded import ShardedEmbeddingCollection
    from neorec.embedding.cache import CacheSettings

    comms = Comms(topo)
    plan = MIXED_PLAN
    if counted_ahead:  # and b behind a row cache: a prefetched batch brings its rows in ahead too
        plan = {"tables": {**MIXED_PLAN["tables"], "b": {**MIXED_PLAN["tables"]["b"], "tier": "cached"}}}
    emb = ShardedEmbeddingCollection(
        mixed_tables(), EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1),
        ShardingPlan.from_dict(plan), comms, forward_precision="fp16", backward_precision="bf16",
        cache=CacheSettings(fraction=0.5),
    )  # fmt: skip
    emb._replicas.read_ahead = counted_ahead
    emb.replicated.chunk_elements = None if counted_ahead else emb.replicated.chunk_elements
    emb.build_optimizer()
    comms.stats.take()
    local = mixed_local_batch()
    ahead = mixed_local_batch()  # prefetched second: the first batch's rows come into b's cache then
    if counted_ahead:
        emb.prefetch(local)
        emb.prefetch(ahead)
    out = emb(local)
    out.backward(torch.ones_like(out))
    assert (emb._replicas.current is not None) == counted_ahead
    if counted_ahead:  # then the batch prefetched and never trained, and an evaluation: no step's bytes
        emb.eval()
        with torch.no_grad(), comms.stats.counted_as("eval"):
            emb(mixed_local_batch())
        emb.train()
        emb.clear_prefetched()
        sent = comms.stats.take()
        assert sent.pop("eval") > 0
        return sent
    return comms.stats.take()


SEQUENCE_TABLES = [
    TableConfig(name="p", rows=20, dim=4, features=["fp"]),
    TableConfig(name="s", rows=30, dim=4, features=["fs", "fs2"], pooling="none"),
    TableConfig(name="c", rows=10, dim=8, features=["fc"], pooling="none"),
]
SEQUENCE_PLAN = {"tables": {"p": {"kind": "tw", "ranks": [1]}, "s": {"kind": "rw", "ranks": [1, 0]},
                            "c": {"kind": "cw", "ranks": [0, 1]}}}  # fmt: skip


def sequence_local_batch():
    from neorec.sparse import SparseBatch

    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([2, 0, 3, 1])
    return SparseBatch.from_features(
        {f: (torch.randint(0, t.rows, (6,), generator=g), lengths) for t in SEQUENCE_TABLES for f in t.features}
    )


def _count_sequence_bytes(topo: Topology):
    from neorec.distributed.comms import Comms
    from neorec.distributed.sharded import ShardedEmbeddingCollection

    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(
        SEQUENCE_TABLES, EmbeddingOptimizerConfig(name="adagrad", lr=0.1), ShardingPlan.from_dict(SEQUENCE_PLAN),
        comms, forward_precision="fp16", backward_precision="bf16",
    )  # fmt: skip
    emb.build_optimizer()
    comms.stats.take()
    pooled, sequences = emb.embed(sequence_local_batch())
    torch.autograd.backward([pooled, *(r.values for r in sequences.values())],
                            [torch.ones_like(pooled), *(torch.ones_like(r.values) for r in sequences.values())])  # fmt: skip
    return comms.stats.take()


@pytest.mark.distributed
def test_predicted_sequence_bytes_equal_counted_bytes_on_two_gloo_processes(tmp_path):
    from dist_helpers import spawn

    from neorec.planner import measure_access
    from neorec.sparse import SparseBatch

    counted = spawn(2, _count_sequence_bytes, tmp_path=tmp_path)
    local = sequence_local_batch()
    parts = {k: local.feature(k)[:2] for k in local.keys}
    everyone = SparseBatch.from_features({k: (ids.repeat(2), lengths.repeat(2)) for k, (ids, lengths) in parts.items()})
    ids, samples, weighted = measure_access(SEQUENCE_TABLES, [everyone])
    workload = build_workload(SEQUENCE_TABLES, "adagrad", 8, ids, samples, "fp16", "bf16", weighted)
    traffic = plan_traffic(ShardingPlan.from_dict(SEQUENCE_PLAN), workload, Topology(2, 0, 2))
    for rank, got in counted.items():
        for direction in ("input_dist", "fwd", "bwd"):
            assert traffic.sent(rank, direction) == pytest.approx(got.get(direction, 0), abs=1e-6), (rank, direction)


@pytest.mark.distributed
@pytest.mark.parametrize("counted_ahead", [False, True])
def test_predicted_bytes_equal_counted_bytes_on_four_gloo_processes(tmp_path, counted_ahead):
    from dist_helpers import spawn

    from neorec.planner import measure_access
    from neorec.sparse import SparseBatch

    counted = spawn(4, _count_bytes, (counted_ahead,), local_world=2, tmp_path=tmp_path)
    local = mixed_local_batch()  # the global batch: every rank's (identical) samples, rank 0's first
    parts = {k: local.feature(k)[:2] for k in local.keys}
    everyone = SparseBatch.from_features(
        {k: (ids.repeat(4), lengths.repeat(4)) for k, (ids, lengths) in parts.items()}
    )
    ids, samples, weighted = measure_access(mixed_tables(), [everyone])
    workload = build_workload(mixed_tables(), "rowwise_adagrad", 16, ids, samples, "fp16", "bf16", weighted)
    traffic = plan_traffic(ShardingPlan.from_dict(MIXED_PLAN), workload, Topology(4, 0, 2), counted_ahead)
    for rank, got in counted.items():
        for direction in ("input_dist", "fwd", "bwd"):
            assert traffic.sent(rank, direction) == pytest.approx(got.get(direction, 0), abs=1e-6), (
                rank,
                direction,
            )
    # replicated tables under a rule with state send rows to their owners (row % W): the model has
    # every rank own 1/W of the rows touched, exact over all ranks (every rank has the same rows)
    predicted = sum(traffic.sent(rank, "dp") for rank in range(4))
    assert predicted == pytest.approx(sum(got.get("dp", 0) for got in counted.values()), abs=1e-6)


def test_step_time_sums_the_slowest_rank_of_each_phase():
    from neorec.planner.cost import STAGES, PlanEstimate, RankEstimate

    def rank(r: int, stage: str) -> RankEstimate:
        return RankEstimate(r, {**dict.fromkeys(STAGES, 0.0), stage: 1.0}, {}, {}, 0, 0)

    estimate = PlanEstimate([rank(0, "input_dist"), rank(1, "update")], None)
    assert estimate.step_time == 2.0 and estimate.max_cost == 1.0


def test_cpu_memory_counts_the_initialisation_window_when_it_is_larger_than_the_buffers():
    wl = build_workload([TableConfig(name="a", rows=1_000_000, dim=64, features=["f"])], "sgd", 64)
    cluster = this_machine(1, calibration=dict(CALIBRATED_CPU))
    r = estimate_plan(ShardingPlan({"a": TablePlan("tw", [0])}), wl, cluster).ranks[0]
    assert r.init > r.buffers
    assert r.memory["device"] == r.weights["device"] + cluster.reserved + r.init


def test_cpu_ranks_count_two_parities_of_their_shared_memory_pages():
    from neorec.planner.cost import transport_bytes

    tables = [TableConfig(name=n, rows=1000, dim=16, features=[f"f{n}"]) for n in "ab"]
    wl, cluster = build_workload(tables, "sgd", 256), this_machine(2, calibration=dict(CALIBRATED_CPU))
    plan = ShardingPlan({"a": TablePlan("tw", [0]), "b": TablePlan("rw", [0, 1])})
    traffic = estimate_plan(plan, wl, cluster).traffic
    for r in (0, 1):
        send = max(traffic.sent(r, d) for d in traffic.matrices)
        received = max(traffic.received(r, d) for d in traffic.matrices)
        assert 0 < send < 16 << 20 and transport_bytes(traffic, r, cluster) == int(2 * send + 2 * received)
