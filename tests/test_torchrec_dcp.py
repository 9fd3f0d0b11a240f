"""TorchRec's checkpoints (torch.distributed.checkpoint) against real TorchRec, both ways.

One spawn of 2 gloo ranks does everything TorchRec does: a DistributedModelParallel DLRM (a table
kept whole, two split by columns; row-wise Adagrad and Adagrad fused into backward) trains, is saved
with DCP and trains on; a second DMP, sharded otherwise, loads the checkpoint neorec wrote and looks
its batches up. neorec then loads TorchRec's checkpoint on 1 and on 3 processes (other plans) and
trains on: its losses are TorchRec's. The 3-process run writes its own DCP checkpoint, which one
process reads back as the state the 1-process run reached.
"""

import pytest

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (see docs/torchrec.md)")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from dist_helpers import local_slice, spawn  # noqa: E402

from neorec.data.batch import Batch  # noqa: E402
from neorec.distributed.comms import Comms  # noqa: E402
from neorec.distributed.plan import ShardingPlan  # noqa: E402
from neorec.distributed.sharded import ShardedEmbeddingCollection  # noqa: E402
from neorec.distributed.topology import Topology  # noqa: E402
from neorec.embedding.fused.collection import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.errors import NeorecError  # noqa: E402
from neorec.interop.torchrec import load_dcp, save_dcp  # noqa: E402
from neorec.model.dlrm import DLRM  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402

DIM, NUM_DENSE, BATCH = 8, 4, 6  # the global batch: 3 samples a TorchRec rank, 2 a neorec rank of 3
LR, EPS = 0.1, 1e-8
ROWWISE = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=LR, eps=EPS)
ADAGRAD = EmbeddingOptimizerConfig(name="adagrad", lr=LR, eps=EPS)
TABLES = [  # (name, rows, optimizer, TorchRec sharding of the model neorec imports, of the one it exports to)
    ("t0", 40, ROWWISE, ("table_wise", 0), ("column_wise", [0, 1])),
    ("t1", 30, ADAGRAD, ("column_wise", [0, 1]), ("table_wise", 1)),
    ("t2", 20, ROWWISE, ("column_wise", [1, 0]), ("table_wise", 0)),  # rank 1 holds columns 0-3
]
STEPS = 2  # trained before the checkpoint, and after it on each side
# the TorchRec DLRM's feature order: a DMP's state_dict sorts its keys, which loses the tables' order
FEATURES = [f"f{n[1]}" for n, *_ in TABLES]


def tables() -> list[TableConfig]:
    return [
        TableConfig(name=n, rows=r, dim=DIM, features=[f"f{n[1]}"], optimizer=o) for n, r, o, _, _ in TABLES
    ]


def batches(seed: int) -> list[Batch]:
    """Global batches of 0-3 ids per bag; unit weights (TorchRec's unweighted bags)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        feats = {}
        for t in tables():
            lengths = torch.randint(0, 4, (BATCH,), generator=g)
            ids = torch.randint(0, t.rows, (int(lengths.sum()),), generator=g)
            feats[t.features[0]] = (ids, lengths, torch.ones(ids.numel()))
        dense = torch.randn(BATCH, NUM_DENSE, generator=g)
        out.append(
            Batch(dense, SparseBatch.from_features(feats), (torch.rand(BATCH, generator=g) < 0.5).float())
        )
    return out


def neorec_model(embeddings) -> DLRM:
    torch.manual_seed(7)
    return DLRM(NUM_DENSE, embeddings, [8, DIM], [8])


def neorec_steps(model, batches_, rank: int = 0, world: int = 1, comms=None) -> list[float]:
    """SGD(0.05) on the dense layers (gradients averaged over ranks), the fused optimizers on the rows;
    the mean loss over ranks of each global batch."""
    from dist_helpers import run_steps

    dense = torch.optim.SGD(
        [p for n, p in model.named_parameters() if not n.startswith("embeddings.")], lr=0.05
    )
    return run_steps(
        model, model.embeddings, model.embeddings.build_optimizer(), dense, batches_, rank, world, comms
    )


# ---- the TorchRec side: 2 gloo ranks ------------------------------------------------------------
def _dmp(topo: Topology, column: int):
    """A TorchRec DLRM under DistributedModelParallel, its tables sharded as TABLES' column `column` says."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f{n[1]}"]) for n, r, *_ in TABLES]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = TorchRecDLRM(
        embedding_bag_collection=ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
    )  # fmt: skip
    for name, _, opt, *_ in TABLES:
        kind = RowWiseAdagrad if opt.name == "rowwise_adagrad" else torch.optim.Adagrad
        apply_optimizer_in_backward(kind, [ebc.embedding_bags[name].weight], {"lr": LR, "eps": EPS})
    kinds = {"table_wise": lambda r: table_wise(rank=r), "column_wise": lambda r: column_wise(ranks=r)}
    per_table = {row[0]: kinds[row[column][0]](row[column][1]) for row in TABLES}
    tables_plan = construct_module_sharding_plan(
        ebc, per_table, local_size=2, world_size=2, device_type="cpu"
    )
    plan = TorchRecPlan({"sparse_arch.embedding_bag_collection": tables_plan})
    sharders = [EmbeddingBagCollectionSharder()]
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _torchrec_step(dmp, dense_opt, batch: Batch, rank: int) -> float:
    import torch.distributed as dist

    from neorec.interop.torchrec import kjt_from_sparse

    local = local_slice(batch, rank, 2)
    sparse = SparseBatch(local.sparse.keys, local.sparse.values, local.sparse.lengths)  # unweighted bags
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        dmp(local.dense, kjt_from_sparse(sparse)).squeeze(1), local.labels
    )
    dense_opt.zero_grad()
    loss.backward()  # the tables update inside backward (fused)
    dense_opt.step()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / 2


def _in_feature_order(pooled) -> torch.Tensor:
    """A KeyedTensor's columns in the tables' feature order (a sharded collection groups them by sharding)."""
    return torch.cat([pooled[f"f{name[1]}"] for name, *_ in TABLES], dim=1)


def _torchrec_side(topo: Topology, saved: str, exported: str) -> dict:
    """Train, save with DCP, train on (losses); load neorec's export into a DMP sharded otherwise and
    look a batch up (pooled outputs, logits) before and after one step."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from neorec.interop.torchrec import gather_torchrec_state, kjt_from_sparse

    dmp = _dmp(topo, column=3)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=0.05)
    )
    first, after = batches(1), batches(2)
    for b in first:
        _torchrec_step(dmp, dense_opt, b, topo.rank)
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=saved)
    weights = gather_torchrec_state(dmp.state_dict())
    losses = [_torchrec_step(dmp, dense_opt, b, topo.rank) for b in after]

    other = _dmp(topo, column=4)
    state = {"model": other.state_dict(), "optim": other.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=exported)
    other.load_state_dict(state["model"])
    other.fused_optimizer.load_state_dict(state["optim"])
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(other.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=0.05)
    )
    probe = local_slice(batches(3)[0], topo.rank, 2)
    kjt = kjt_from_sparse(SparseBatch(probe.sparse.keys, probe.sparse.values, probe.sparse.lengths))
    ebc = other.module.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        pooled = [_in_feature_order(ebc(kjt))]
        logits = other(probe.dense, kjt).squeeze(1)
    _torchrec_step(other, dense_opt, batches(3)[1], topo.rank)
    with torch.no_grad():
        pooled.append(_in_feature_order(ebc(kjt)))
    return {"losses": losses, "weights": weights, "pooled": pooled, "logits": logits}


# ---- the neorec side ----------------------------------------------------------------------------
PLAN_1 = {
    "t0": {"kind": "tw", "ranks": [0]},
    "t1": {"kind": "tw", "ranks": [0]},
    "t2": {"kind": "cw", "ranks": [0, 0]},
}
PLAN_3 = {"t0": {"kind": "rw", "ranks": [0, 1, 2]}, "t1": {"kind": "cw", "ranks": [0, 1]}, "t2": {"kind": "cw", "ranks": [1, 2]}}  # fmt: skip


def _sharded(topo: Topology, plan: dict, comms=None) -> ShardedEmbeddingCollection:
    return ShardedEmbeddingCollection(
        tables(), ROWWISE, ShardingPlan.from_dict({"tables": plan}), comms or Comms(topo), seed=3
    )


def _neorec_side(topo: Topology, saved: str, resaved: str) -> list[float]:
    """One of 3 ranks: read TorchRec's checkpoint under PLAN_3, train on, write a DCP checkpoint."""
    comms = Comms(topo)
    model = neorec_model(_sharded(topo, PLAN_3, comms))
    load_dcp(model, saved, feature_names=FEATURES)
    losses = neorec_steps(model, batches(2), topo.rank, topo.world_size, comms)
    save_dcp(model, resaved)  # collective
    return losses


def _tables_and_state(model) -> dict[str, torch.Tensor]:
    """Every table's weight and optimizer state, whole, and the dense layers (one process)."""
    from neorec.checkpoint.pieces import slots, storages
    from neorec.embedding.fused.storage import read_storage

    out = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    for slot in slots(model.embeddings):
        for state, (storage, first) in storages(slot).items():
            n = slot.rows[1] - slot.rows[0]
            out[f"{slot.table}.{state}.{slot.rows}.{slot.cols}"] = read_storage(
                storage, first, first + n
            ).clone()
    return out


def test_dmp_checkpoint_trains_on_in_neorec_and_neorec_checkpoint_loads_into_dmp(tmp_path):
    saved, exported, resaved = (str(tmp_path / n) for n in ("torchrec", "neorec", "neorec-3"))
    # what neorec exports: a trained single-process model
    source = neorec_model(FusedEmbeddingCollection(tables(), ROWWISE, seed=11))
    neorec_steps(source, batches(4))
    report = save_dcp(source, exported, row_state_columns={"t0": [0, 4]})  # TorchRec splits t0 in two there
    assert report.optimizer_state["t1"] == [
        "optim.state.sparse_arch.embedding_bag_collection.embedding_bags.t1.weight.t1.momentum1"
    ]

    torchrec_ranks = spawn(2, _torchrec_side, (saved, exported), tmp_path=tmp_path / "pg2")

    # TorchRec's checkpoint, on one process (t2 split by columns as TorchRec split it): TorchRec's losses
    single = neorec_model(_sharded(Topology(), PLAN_1))
    with pytest.raises(NeorecError, match="keys were sorted.*feature_names="):
        load_dcp(single, saved)
    report = load_dcp(single, saved, feature_names=FEATURES)
    assert sorted(report.optimizer_state) == ["t0", "t1", "t2"] and len(report.dense) == 8
    for t in tables():
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{t.name}.weight"
        gathered = torch.from_numpy(torchrec_ranks[0]["weights"][key])
        assert torch.equal(single.embeddings.gather_tables()[t.name]["weight"], gathered), t.name
    expected = torchrec_ranks[0]["losses"]
    assert expected == torchrec_ranks[1]["losses"]
    assert neorec_steps(single, batches(2)) == pytest.approx(expected, abs=1e-6)

    # on three processes, another plan: the same losses; its DCP checkpoint is the state reached
    losses = spawn(3, _neorec_side, (saved, resaved), tmp_path=tmp_path / "pg3")
    for rank in range(3):
        assert losses[rank] == pytest.approx(expected, abs=1e-6)
    back = neorec_model(_sharded(Topology(), PLAN_1))
    load_dcp(back, resaved)
    reached, again = _tables_and_state(single), _tables_and_state(back)
    assert reached.keys() == again.keys()
    for key, value in reached.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=1e-6, msg=key)

    # neorec's checkpoint in a DMP sharded otherwise: the same pooled outputs and logits, before and
    # after a step (which reads the optimizer state)
    probe = batches(3)
    with torch.no_grad():
        pooled = [source.embeddings(probe[0].sparse)]
        logits = source(probe[0])
    neorec_steps(source, probe[1:2])
    with torch.no_grad():
        pooled.append(source.embeddings(probe[0].sparse))
    for rank in range(2):
        rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        got = torchrec_ranks[rank]
        for step in range(2):
            theirs = torch.from_numpy(got["pooled"][step]).view(BATCH // 2, -1)
            torch.testing.assert_close(theirs, pooled[step][rows], rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(got["logits"]), logits[rows], rtol=0, atol=1e-5)
