"""neorec.interop.torchrec against real TorchRec: batches, table configs, DLRM weights both ways."""

import pytest

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (see docs/torchrec.md)")

import torch  # noqa: E402
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM as TorchRecDLRM  # noqa: E402
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType  # noqa: E402

from neorec.data.batch import Batch  # noqa: E402
from neorec.embedding.fused.collection import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.reference import ReferenceEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.errors import NeorecError  # noqa: E402
from neorec.interop.torchrec import (  # noqa: E402
    configs_from_tables,
    kjt_from_sparse,
    load_torchrec_dense,
    load_torchrec_state,
    sparse_from_kjt,
    tables_from_configs,
    torchrec_state,
)
from neorec.model.dlrm import DLRM  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402

DIM = 8
NUM_DENSE = 5
BOTTOM = [16, DIM]
OVER = [12, 6, 1]  # TorchRec's over_arch sizes end in the logit; neorec's top_mlp leaves it out
# the TorchRec DLRM's feature order: "users" has two features, whose order no state_dict holds
FEATURES = ["user", "friend", "item", "tag"]


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="users", embedding_dim=DIM, num_embeddings=40, feature_names=["user", "friend"]
        ),
        EmbeddingBagConfig(name="products", embedding_dim=DIM, num_embeddings=30, feature_names=["item"]),
        EmbeddingBagConfig(
            name="tags", embedding_dim=DIM, num_embeddings=20, feature_names=["tag"], pooling=PoolingType.MEAN
        ),
    ]


def torchrec_dlrm(seed: int = 0) -> TorchRecDLRM:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
    return TorchRecDLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=BOTTOM,
        over_arch_layer_sizes=OVER,
    )


def neorec_dlrm(engine: str = "fused", self_interaction: bool = False) -> DLRM:
    tables = tables_from_configs(configs())
    opt = EmbeddingOptimizerConfig()
    emb = (
        FusedEmbeddingCollection(tables, opt)
        if engine == "fused"
        else ReferenceEmbeddingCollection(tables, opt)
    )
    return DLRM(NUM_DENSE, emb, BOTTOM, OVER[:-1], self_interaction=self_interaction)


def random_kjt(batch_size: int = 6, seed: int = 1) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    rows = {"user": 40, "friend": 40, "item": 30, "tag": 20}
    lengths = torch.randint(0, 4, (len(rows) * batch_size,), generator=g)  # empty bags too
    per_key = lengths.view(len(rows), batch_size).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, r, (n,), generator=g) for r, n in zip(rows.values(), per_key, strict=True)]
    )
    return KeyedJaggedTensor(keys=list(rows), values=values, lengths=lengths)


# ---- batches ------------------------------------------------------------------------------------
def test_kjt_to_sparse_batch_and_back_shares_ids_and_weights():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([2, 0, 1, 3, 1, 1], dtype=torch.int32)
    values = torch.randint(0, 10, (8,), generator=g)
    weights = torch.rand(8, generator=g)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, weights=weights)

    sparse = sparse_from_kjt(kjt, weighted=True)
    assert sparse.keys == ["a", "b"] and sparse.batch_size == 3
    assert sparse.values.data_ptr() == values.data_ptr()
    assert sparse.weights.data_ptr() == weights.data_ptr()
    assert sparse.lengths.dtype == torch.int64 and sparse.lengths.tolist() == lengths.tolist()
    sparse.validate({"a": 10, "b": 10})
    a_values, a_lengths, _ = sparse.feature("a")
    assert torch.equal(a_values, kjt["a"].values()) and a_lengths.tolist() == kjt["a"].lengths().tolist()

    back = kjt_from_sparse(sparse)
    assert back.keys() == ["a", "b"] and back.stride() == 3
    assert back.values().data_ptr() == values.data_ptr()
    assert back.lengths().data_ptr() == sparse.lengths.data_ptr()
    assert back.weights().data_ptr() == weights.data_ptr()
    assert torch.equal(back.offsets(), sparse.offsets())


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_weights_are_pooled_as_the_torchrec_module_pools_them(weighted):
    """An unweighted EmbeddingBagCollection (sum and mean tables) ignores a KJT's weights, a weighted
    one (sum: TorchRec's weighted bags) pools with them; the collection moved over does the same."""
    import dataclasses

    tables = [dataclasses.replace(c, pooling=PoolingType.SUM) if weighted else c for c in configs()]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    moved = tables_from_configs(ebc.embedding_bag_configs())
    emb = FusedEmbeddingCollection(moved, EmbeddingOptimizerConfig())
    load_torchrec_state(emb, ebc.state_dict())
    plain = random_kjt()
    g = torch.Generator().manual_seed(4)
    kjt = KeyedJaggedTensor(
        keys=plain.keys(), values=plain.values(), lengths=plain.lengths(),
        weights=torch.rand(plain.values().numel(), generator=g) + 0.5,
    )  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(
            emb(sparse_from_kjt(kjt, weighted=ebc.is_weighted())), ebc(kjt).values(), rtol=0, atol=1e-6
        )
    with pytest.raises(NeorecError, match=r"\['user', 'friend', 'item', 'tag'\] carries weights.*weighted="):
        sparse_from_kjt(kjt)
    with pytest.raises(NeorecError, match="weighted=True, but .* carries no weights"):
        sparse_from_kjt(plain, weighted=True)
    assert sparse_from_kjt(plain).weights is None


def test_kjt_built_from_offsets_like_torchrecs_examples():
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"],
        values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]),
    )
    sparse = sparse_from_kjt(kjt)
    assert sparse == SparseBatch(["f1", "f2"], torch.arange(8), torch.tensor([2, 0, 1, 1, 1, 3]))
    assert sparse.weights is None and kjt_from_sparse(sparse).weights_or_none() is None


def test_kjt_with_int32_ids_and_lengths_is_widened():
    """TorchRec takes int32 and int64 ids: int32 ones become neorec's int64, every value kept."""
    ids = torch.tensor([1, 2, 2**31 - 1, -1, 7], dtype=torch.int32)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=ids, lengths=torch.tensor([2, 0, 1, 2], dtype=torch.int32))
    sparse = sparse_from_kjt(kjt)
    assert sparse.values.dtype == torch.int64 and sparse.lengths.dtype == torch.int64
    assert sparse.values.tolist() == ids.tolist() and sparse.lengths.tolist() == [2, 0, 1, 2]
    with pytest.raises(NeorecError, match=r"feature 'b': negative id -1"):
        sparse.validate({"a": 10, "b": 2**31})  # a negative id stays negative, and is caught


def test_kjts_without_ids_or_features_say_what_is_wrong():
    with pytest.raises(NeorecError, match=r"no features \(keys \[\]\), so there is nothing to look up"):
        sparse_from_kjt(KeyedJaggedTensor.empty())
    floats = KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), lengths=torch.tensor([0, 0]))
    with pytest.raises(NeorecError, match=r"torch.float32, not ids.*torch.empty\(0, dtype=torch.int64\)"):
        sparse_from_kjt(floats)
    small = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1], dtype=torch.int16), lengths=torch.tensor([1]))
    with pytest.raises(NeorecError, match="torch.int16, of neither id type: neorec reads int64 or int32"):
        sparse_from_kjt(small)


def test_kjt_with_variable_batch_is_refused():
    vbe = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )
    with pytest.raises(NeorecError, match="batch size per feature"):
        sparse_from_kjt(vbe)


# ---- table configs ------------------------------------------------------------------------------
def test_embedding_bag_configs_to_tables_and_back():
    tables = tables_from_configs(configs())
    assert tables[0] == TableConfig(name="users", rows=40, dim=DIM, features=["user", "friend"])
    assert tables[2].pooling == "mean" and tables[2].dtype == "fp32"
    half = tables_from_configs(
        [
            EmbeddingBagConfig(
                name="h", embedding_dim=4, num_embeddings=9, feature_names=["x"], data_type=DataType.FP16
            )
        ]
    )
    assert half[0].dtype == "fp16"
    back = configs_from_tables(tables)
    for ours, theirs in zip(back, configs(), strict=True):
        assert (ours.name, ours.num_embeddings, ours.embedding_dim, ours.feature_names, ours.pooling) == (
            theirs.name,
            theirs.num_embeddings,
            theirs.embedding_dim,
            theirs.feature_names,
            theirs.pooling,
        )


def test_configs_without_a_neorec_counterpart_are_refused():
    bad = EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=9, feature_names=["x"], pooling=PoolingType.NONE
    )
    with pytest.raises(NeorecError, match="'t'.*pooling NONE"):
        tables_from_configs([bad])
    int8 = EmbeddingBagConfig(
        name="q", embedding_dim=4, num_embeddings=9, feature_names=["x"], data_type=DataType.INT8
    )
    with pytest.raises(NeorecError, match="'q'.*INT8"):
        tables_from_configs([int8])


# ---- weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["fused", "reference"])
def test_torchrec_dlrm_round_trip_is_bitwise_and_scores_agree(engine):
    theirs = torchrec_dlrm()
    ours = neorec_dlrm(engine)
    used = load_torchrec_state(ours, theirs.state_dict(), theirs.sparse_arch.sparse_feature_names)
    assert sorted(used) == sorted(theirs.state_dict())

    back = torchrec_state(ours)
    assert sorted(back) == sorted(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key

    kjt = random_kjt()
    dense = torch.randn(kjt.stride(), NUM_DENSE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(dense_features=dense, sparse_features=kjt).squeeze(1)
        got = ours(Batch(dense, sparse_from_kjt(kjt), torch.zeros(kjt.stride())))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    fresh = torchrec_dlrm(seed=7)
    fresh.load_state_dict(back)  # strict: exactly TorchRec's keys and shapes
    with torch.no_grad():
        assert torch.equal(fresh(dense_features=dense, sparse_features=kjt), theirs(dense, kjt))


def test_trained_neorec_weights_go_back_to_torchrec():
    """Weights changed on the neorec side (one fused SGD step) are what TorchRec then scores with."""
    ours = neorec_dlrm()
    load_torchrec_state(ours, torchrec_dlrm().state_dict(), FEATURES)
    kjt = random_kjt(seed=3)
    dense = torch.randn(kjt.stride(), NUM_DENSE)
    ours(Batch(dense, sparse_from_kjt(kjt), torch.ones(kjt.stride()))).sum().backward()

    theirs = torchrec_dlrm(seed=5)
    theirs.load_state_dict(torchrec_state(ours))
    with torch.no_grad():
        expected = ours(Batch(dense, sparse_from_kjt(kjt), torch.ones(kjt.stride())))
        got = theirs(dense_features=dense, sparse_features=kjt).squeeze(1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not torch.equal(
        torchrec_state(ours)["sparse_arch.embedding_bag_collection.embedding_bags.users.weight"],
        torchrec_dlrm().state_dict()["sparse_arch.embedding_bag_collection.embedding_bags.users.weight"],
    )


def test_dense_layers_alone_load_and_leave_the_tables():
    theirs = torchrec_dlrm().state_dict()
    ours = neorec_dlrm()
    tables_before = torchrec_state(ours.embeddings)
    used = load_torchrec_dense(ours, {"model." + k: v for k, v in theirs.items()}, FEATURES)
    assert sorted(used) == sorted("model." + k for k in theirs if "sparse_arch" not in k)
    back = torchrec_state(ours)
    for key, value in theirs.items():
        if "sparse_arch" in key:
            assert torch.equal(back[key], tables_before[key.removeprefix("sparse_arch.embedding_bag_collection.")])
        else:
            assert torch.equal(back[key], value), key  # the top MLP's input columns are permuted back
    with pytest.raises(NeorecError, match="needs a neorec DLRM"):
        load_torchrec_dense(ours.embeddings, theirs)
    with pytest.raises(NeorecError, match="layers of one TorchRec DLRM"):
        load_torchrec_dense(ours, {"embedding_bags.users.weight": torch.zeros(40, DIM)})


def test_embedding_bag_collection_state_and_outer_prefixes():
    ebc = EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
    emb = FusedEmbeddingCollection(tables_from_configs(configs()), EmbeddingOptimizerConfig())
    load_torchrec_state(emb, ebc.state_dict())
    assert all(torch.equal(torchrec_state(emb)[k], v) for k, v in ebc.state_dict().items())

    # DLRMTrain keeps the DLRM under `model.`; a DistributedModelParallel wrapper may add `module.`
    theirs = torchrec_dlrm()
    wrapped = {"module.model." + k: v for k, v in theirs.state_dict().items()}
    ours = neorec_dlrm()
    load_torchrec_state(ours, wrapped, FEATURES)
    assert torch.equal(
        torchrec_state(ours)["over_arch.model.1.weight"], theirs.state_dict()["over_arch.model.1.weight"]
    )


def test_mismatched_state_dicts_name_the_key():
    state = torchrec_dlrm().state_dict()
    key = "sparse_arch.embedding_bag_collection.embedding_bags.products.weight"

    small = dict(state, **{key: torch.zeros(29, DIM)})
    with pytest.raises(NeorecError, match=r"embedding_bags\.products\.weight.*\(29, 8\).*\(30, 8\)"):
        load_torchrec_state(neorec_dlrm(), small)

    missing = {k: v for k, v in state.items() if ".tags." not in k}
    with pytest.raises(NeorecError, match=r"missing in the state_dict: \['tags'\]"):
        load_torchrec_state(neorec_dlrm(), missing)

    deeper = dict(state, **{"over_arch.model.0._mlp.2._linear.weight": torch.zeros(6, 6)})
    with pytest.raises(NeorecError, match=r"over_arch\.model\.0\._mlp\.2\._linear\.weight"):
        load_torchrec_state(neorec_dlrm(), deeper, FEATURES)

    with pytest.raises(NeorecError, match="self_interaction"):
        load_torchrec_state(neorec_dlrm(self_interaction=True), state)

    with pytest.raises(NeorecError, match="no TorchRec embedding tables"):
        load_torchrec_state(neorec_dlrm(), {"dense_arch.model._mlp.0._linear.weight": torch.zeros(16, 5)})

    before = torchrec_state(ours := neorec_dlrm())
    with pytest.raises(NeorecError):
        load_torchrec_state(ours, small)
    assert all(torch.equal(v, torchrec_state(ours)[k]) for k, v in before.items())  # nothing half-loaded


DMP_SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM as TorchRecDLRM
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import test_torchrec_interop as t
from neorec.data.batch import Batch
from neorec.errors import NeorecError
from neorec.interop.torchrec import gather_torchrec_state, load_torchrec_state, sparse_from_kjt, torchrec_state

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
torch.manual_seed(0)
ebc = EmbeddingBagCollection(tables=t.configs(), device=torch.device("meta"))
model = TorchRecDLRM(
    embedding_bag_collection=ebc, dense_in_features=t.NUM_DENSE,
    dense_arch_layer_sizes=t.BOTTOM, over_arch_layer_sizes=t.OVER,
)
constraints = {c.name: ParameterConstraints(sharding_types=["table_wise"]) for c in t.configs()}
planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
sharders = [EmbeddingBagCollectionSharder()]
plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)

state = dmp.state_dict()
assert any(type(v).__name__ == "ShardedTensor" for v in state.values()), "tables are not sharded"
try:  # a sharded table has to be gathered first, and the error says so
    load_torchrec_state(t.neorec_dlrm(), state)
    raise AssertionError("a ShardedTensor table loaded without gathering")
except NeorecError as e:
    assert "embedding_bags." in str(e) and "gather_torchrec_state" in str(e), e
full = gather_torchrec_state(state)
assert list(full) == list(state)
ours = t.neorec_dlrm()
try:  # DMP's state_dict sorts its keys: the order of the tables is lost
    load_torchrec_state(ours, full)
    raise AssertionError("a sorted state_dict loaded without feature_names")
except NeorecError as e:
    assert "keys were sorted" in str(e), e
load_torchrec_state(ours, full, t.FEATURES)
back = torchrec_state(ours)
assert sorted(back) == sorted(full)
for key, value in full.items():
    assert torch.equal(back[key], value), key

kjt = t.random_kjt()
dense = torch.randn(kjt.stride(), t.NUM_DENSE)
with torch.no_grad():
    expected = dmp(dense_features=dense, sparse_features=kjt).squeeze(1)
    got = ours(Batch(dense, sparse_from_kjt(kjt), torch.zeros(kjt.stride())))
torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

# back into a sharded TorchRec model
fresh = t.torchrec_dlrm(seed=9)
resharded = DistributedModelParallel(fresh, device=torch.device("cpu"), plan=plan, sharders=sharders)
resharded.load_state_dict(dict(back))  # it renames the keys of the dict it is given
again = gather_torchrec_state(resharded.state_dict())
for key, value in back.items():
    assert torch.equal(again[key], value), key
dist.destroy_process_group()
print("DMP-OK")
"""


def test_distributed_model_parallel_state_gathered_to_one_process(tmp_path):
    """A DMP with table-wise sharded tables (ShardedTensor values) loads once gathered, and scores alike."""
    import os
    import socket
    import subprocess
    import sys

    script = tmp_path / "dmp.py"
    script.write_text(DMP_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, str(script), os.path.abspath(__file__), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "DMP-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]



def test_the_migration_page_runs():
    """docs/torchrec.md's python blocks, in order, are one script that moves TorchRec's DLRM example,
    then an EmbeddingCollection, and goes through a sharded collection and its checkpoints."""
    import re
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "torchrec.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 6
    exec(compile("\n".join(blocks), "docs/torchrec.md", "exec"), {"__name__": "docs_torchrec"})


def test_without_torchrec_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchrec", None)  # import torchrec now fails
    sparse = SparseBatch(["a"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(NeorecError, match=r"pip install --no-deps torchrec.*docs/torchrec\.md"):
        kjt_from_sparse(sparse)
