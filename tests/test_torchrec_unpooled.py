"""neorec.interop.torchrec against real TorchRec for unpooled tables (EmbeddingConfig,
EmbeddingCollection, JaggedTensor), tables of both kinds in one neorec collection, sharded neorec
collections (directly and through a checkpoint), and what the messages say for TorchRec models
neorec's DLRM has no counterpart of."""

import pytest

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (see docs/torchrec.md)")

import torch  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingCollection, JaggedTensor, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.embedding_configs import (  # noqa: E402
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)

from neorec.distributed.comms import Comms  # noqa: E402
from neorec.distributed.plan import ShardingPlan  # noqa: E402
from neorec.distributed.sharded import ShardedEmbeddingCollection  # noqa: E402
from neorec.distributed.topology import Topology  # noqa: E402
from neorec.embedding.fused.collection import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.reference import ReferenceEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.errors import NeorecError  # noqa: E402
from neorec.interop.torchrec import (  # noqa: E402
    configs_from_tables,
    jagged_from_rows,
    jagged_from_sequences,
    kjt_from_sparse,
    load_torchrec_state,
    rows_from_jagged,
    sequences_from_jagged,
    sparse_from_kjt,
    tables_from_configs,
    torchrec_state,
)
from neorec.sparse import JaggedRows  # noqa: E402

DIM = 8  # an EmbeddingCollection's tables all have one dim (TorchRec's rule)
ROWS = {"clicks": 50, "query": 50, "pages": 30, "users": 40, "tags": 20}  # rows per feature's table


def ec_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name="videos", embedding_dim=DIM, num_embeddings=50, feature_names=["clicks", "query"]
        ),
        EmbeddingConfig(name="pages", embedding_dim=DIM, num_embeddings=30, feature_names=["pages"]),
    ]


def ebc_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=40, feature_names=["users"]),
        EmbeddingBagConfig(
            name="tags",
            embedding_dim=DIM,
            num_embeddings=20,
            feature_names=["tags"],
            pooling=PoolingType.MEAN,
        ),
    ]


def torchrec_modules(seed: int = 0) -> tuple[EmbeddingBagCollection, EmbeddingCollection]:
    torch.manual_seed(seed)  # TorchRec draws its random initial weights from torch's generator
    return EmbeddingBagCollection(tables=ebc_configs()), EmbeddingCollection(tables=ec_configs())


def random_kjt(keys: list[str], batch_size: int = 6, seed: int = 1, dtype=torch.int64) -> KeyedJaggedTensor:
    """Bags of 0 to 4 ids (empty ones too) from the whole table, every third id one of rows 0..2, so
    that ids repeat in a bag and across bags."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(keys) * batch_size,), generator=g)
    lengths[0] = 0
    per_key = lengths.view(len(keys), batch_size).sum(1).tolist()
    values = torch.cat(
        [torch.randint(0, ROWS[k], (n,), generator=g) for k, n in zip(keys, per_key, strict=True)]
    )
    values[::3] = torch.randint(0, 3, (len(values[::3]),), generator=g)
    return KeyedJaggedTensor(keys=keys, values=values.to(dtype), lengths=lengths.to(dtype))


def engine(kind: str, tables: list[TableConfig], seed: int = 3):
    cls = FusedEmbeddingCollection if kind == "fused" else ReferenceEmbeddingCollection
    return cls(tables, EmbeddingOptimizerConfig(), seed=seed)


def assert_same_lookup(theirs: dict[str, JaggedTensor], ours: dict[str, JaggedRows]) -> None:
    """Equal rows and lengths, feature by feature, compared both ways through the converters."""
    assert sorted(theirs) == sorted(ours)
    for feature, rows in sequences_from_jagged(theirs).items():
        assert torch.equal(rows.values, ours[feature].values), feature
        assert torch.equal(rows.lengths, ours[feature].lengths.to(torch.int64)), feature
    for feature, jagged in jagged_from_sequences(ours).items():
        assert torch.equal(jagged.values(), theirs[feature].values()), feature
        assert jagged.lengths().tolist() == theirs[feature].lengths().tolist(), feature


def assert_same_pooled(ebc: EmbeddingBagCollection, emb, kjt: KeyedJaggedTensor) -> None:
    theirs = ebc(kjt).to_dict()
    ours = emb.split(emb.embed(sparse_from_kjt(kjt))[0])
    assert sorted(theirs) == sorted(ours)
    for feature, pooled in ours.items():
        torch.testing.assert_close(pooled, theirs[feature], rtol=0, atol=1e-6, msg=feature)


# ---- table configs ------------------------------------------------------------------------------
def test_embedding_configs_to_unpooled_tables_and_back():
    tables = tables_from_configs(ec_configs())
    assert tables[0] == TableConfig(
        name="videos", rows=50, dim=DIM, features=["clicks", "query"], pooling="none"
    )
    assert tables[1].pooling == "none" and tables[1].features == ["pages"]
    half = tables_from_configs(
        [
            EmbeddingConfig(
                name="h", embedding_dim=4, num_embeddings=9, feature_names=["x"], data_type=DataType.FP16
            )
        ]
    )
    assert half[0].dtype == "fp16" and half[0].pooling == "none"

    back = configs_from_tables(tables)
    assert all(type(c) is EmbeddingConfig for c in back)
    for ours, theirs in zip(back, ec_configs(), strict=True):
        fields = ("name", "num_embeddings", "embedding_dim", "feature_names", "data_type")
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    EmbeddingCollection(tables=back)  # TorchRec takes them

    mixed = tables_from_configs([*ebc_configs(), *ec_configs()])  # one neorec collection for both
    assert [t.pooling for t in mixed] == ["sum", "mean", "none", "none"]
    assert [type(c) for c in configs_from_tables(mixed)] == [EmbeddingBagConfig] * 2 + [EmbeddingConfig] * 2
    with pytest.raises(NeorecError, match="TableConfig is not a TorchRec table config"):
        tables_from_configs(mixed)


# ---- lookups and weights ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fused", "reference"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_collection_weights_both_ways_give_equal_lookups(kind, dtype):
    _, ec = torchrec_modules()
    emb = engine(kind, tables_from_configs(ec.embedding_configs()))
    used = load_torchrec_state(emb, ec.state_dict())
    assert sorted(used) == sorted(ec.state_dict()) == ["embeddings.pages.weight", "embeddings.videos.weight"]

    kjt = random_kjt(["clicks", "query", "pages"], dtype=dtype)
    assert (
        kjt.lengths()[0] == 0 and kjt.values().unique().numel() < kjt.values().numel()
    )  # empty bags, repeats
    pooled, ours = emb.embed(sparse_from_kjt(kjt))
    assert pooled.shape == (6, 0)  # no pooled tables
    with torch.no_grad():
        assert_same_lookup(ec(kjt), ours)

    # neorec -> TorchRec: weights changed on the neorec side (one fused SGD step) go back exactly
    emb.build_optimizer()
    sum(rows.values.sum() for rows in ours.values()).backward()
    if kind == "reference":
        for bag in emb.bags:
            bag.weight.data.add_(bag.weight.grad.to_dense(), alpha=-0.1)
    state = torchrec_state(emb)
    assert not torch.equal(state["embeddings.videos.weight"], ec.state_dict()["embeddings.videos.weight"])
    _, fresh = torchrec_modules(seed=9)
    fresh.load_state_dict(state)  # strict: exactly TorchRec's keys and shapes
    with torch.no_grad():
        assert_same_lookup(fresh(kjt), emb.embed(sparse_from_kjt(kjt))[1])


def test_jagged_tensor_and_jagged_rows_share_their_tensors():
    values, lengths = torch.randn(5, DIM), torch.tensor([2, 0, 3], dtype=torch.int32)
    rows = rows_from_jagged(JaggedTensor(values=values, lengths=lengths))
    assert rows.values.data_ptr() == values.data_ptr() and rows.lengths.dtype == torch.int64
    assert rows.lengths.tolist() == [2, 0, 3] and rows.batch_size == 3 and rows.dim == DIM
    jagged = jagged_from_rows(rows)
    assert jagged.values().data_ptr() == values.data_ptr() and jagged.lengths().tolist() == [2, 0, 3]
    assert [t.shape[0] for t in jagged.to_dense()] == [2, 0, 3]
    from_offsets = JaggedTensor(values=values, offsets=torch.tensor([0, 2, 2, 5]))
    assert rows_from_jagged(from_offsets).lengths.tolist() == [2, 0, 3]
    with pytest.raises(NeorecError, match=r"1-d values \(4,\) is not a lookup's rows.*sparse_from_kjt"):
        rows_from_jagged(JaggedTensor(values=torch.arange(4), lengths=torch.tensor([4])))


def test_pooled_and_unpooled_tables_in_one_collection():
    """An EmbeddingBagCollection and an EmbeddingCollection over one neorec collection: the two
    state_dicts side by side in, the same out, both lookups equal."""
    ebc, ec = torchrec_modules()
    emb = FusedEmbeddingCollection(
        tables_from_configs([*ebc_configs(), *ec_configs()]), EmbeddingOptimizerConfig()
    )
    load_torchrec_state(emb, {**ebc.state_dict(), **ec.state_dict()})
    kjt = random_kjt(["tags", "clicks", "users", "pages", "query"], seed=4)
    with torch.no_grad():
        assert_same_pooled(ebc, emb, kjt)
        assert_same_lookup(ec(kjt), emb.embed(sparse_from_kjt(kjt))[1])
    state = torchrec_state(emb)
    assert sorted(state) == sorted([*ebc.state_dict(), *ec.state_dict()])
    fresh_ebc, fresh_ec = torchrec_modules(seed=9)
    fresh_ebc.load_state_dict({k: v for k, v in state.items() if k.startswith("embedding_bags.")})
    fresh_ec.load_state_dict({k: v for k, v in state.items() if k.startswith("embeddings.")})
    assert all(
        torch.equal(v, state[k]) for k, v in {**fresh_ebc.state_dict(), **fresh_ec.state_dict()}.items()
    )


def test_a_table_of_the_other_kind_is_named():
    _, ec = torchrec_modules()
    pooled = [t.model_copy(update={"pooling": "sum"}) for t in tables_from_configs(ec_configs())]
    with pytest.raises(
        NeorecError,
        match=r"missing in the state_dict: \['pages', 'videos'\].*are EmbeddingCollection tables in the "
        r"state_dict \(unpooled \(pooling none\)\) but pooled \(sum or mean\) in the model.*"
        r"one with pooling none of an EmbeddingConfig",
    ):
        load_torchrec_state(FusedEmbeddingCollection(pooled, EmbeddingOptimizerConfig()), ec.state_dict())
    two = {**ec.state_dict(), **{"other." + k: v for k, v in ec.state_dict().items()}}
    with pytest.raises(
        NeorecError, match=r"several EmbeddingCollections: \['embeddings.', 'other.embeddings.'\]"
    ):
        load_torchrec_state(engine("fused", tables_from_configs(ec_configs())), two)


# ---- sharded neorec collections -----------------------------------------------------------------
PLAN = {
    "tables": {
        "users": {"kind": "tw", "ranks": [0]},
        "tags": {"kind": "dp"},
        "videos": {"kind": "cw", "ranks": [0, 0]},  # two column slices
        "pages": {"kind": "dp"},
    }
}


def test_sharded_collection_in_one_process_both_ways():
    """The sharded collection's own code paths (column slices, replicated tables) on one process."""
    ebc, ec = torchrec_modules()
    tables = tables_from_configs([*ebc_configs(), *ec_configs()])
    emb = ShardedEmbeddingCollection(
        tables, EmbeddingOptimizerConfig(), ShardingPlan.from_dict(PLAN), Comms(Topology())
    )
    load_torchrec_state(emb, {**ebc.state_dict(), **ec.state_dict()})
    kjt = random_kjt(["users", "tags", "clicks", "query", "pages"], seed=5)
    with torch.no_grad():
        assert_same_pooled(ebc, emb, kjt)
        assert_same_lookup(ec(kjt), emb.embed(sparse_from_kjt(kjt))[1])
    state = torchrec_state(emb)
    assert sorted(state) == sorted([*ebc.state_dict(), *ec.state_dict()])
    for key, value in {**ebc.state_dict(), **ec.state_dict()}.items():
        assert torch.equal(state[key], value), key


def sharded_rank(topo: Topology, checkpoint_in: str, checkpoint_out: str) -> dict:
    """One rank: TorchRec weights straight in (and lookups on this rank's samples equal TorchRec's),
    a checkpoint written from TorchRec weights by one process loaded, then a step of training, the
    tables out (collective), and a checkpoint of them saved."""
    from neorec.checkpoint import load_checkpoint, save_checkpoint

    plan = ShardingPlan.from_dict({"tables": {
        "users": {"kind": "rw", "ranks": [1, 0]},
        "tags": {"kind": "tw", "ranks": [1]},
        "videos": {"kind": "cw", "ranks": [0, 1]},
        "pages": {"kind": "rw", "ranks": [0, 1]},
    }})  # fmt: skip
    tables = tables_from_configs([*ebc_configs(), *ec_configs()])
    comms = Comms(topo)
    kjt = random_kjt(["users", "tags", "clicks", "query", "pages"], batch_size=8, seed=6)
    b = 8 // topo.world_size
    mine = sparse_from_kjt(kjt).slice_samples(topo.rank * b, (topo.rank + 1) * b)

    for seed, route in ((0, "direct"), (1, "checkpoint")):
        ebc, ec = torchrec_modules(seed)
        emb = ShardedEmbeddingCollection(tables, EmbeddingOptimizerConfig(), plan, comms, seed=7)
        if route == "direct":  # every rank, with the same state_dict
            load_torchrec_state(emb, {**ebc.state_dict(), **ec.state_dict()})
            back = torchrec_state(emb)  # collective
            for key, value in {**ebc.state_dict(), **ec.state_dict()}.items():
                assert torch.equal(back[key], value), key
        else:
            load_checkpoint(checkpoint_in, emb, restore_rng=False)
        with torch.no_grad():
            assert_same_pooled(ebc, emb, kjt_from_sparse(mine))
            assert_same_lookup(ec(kjt_from_sparse(mine)), emb.embed(mine)[1])
    emb.build_optimizer()
    pooled, sequences = emb.embed(mine)
    (pooled.sum() + sum(rows.values.sum() for rows in sequences.values())).backward()
    state = torchrec_state(emb)  # collective: the whole tables on every rank
    save_checkpoint(checkpoint_out, 1, emb)
    return state


@pytest.mark.distributed
def test_sharded_collection_on_two_ranks_and_through_checkpoints(tmp_path):
    from dist_helpers import spawn

    from neorec.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    # TorchRec -> a checkpoint written by one process -> the sharded run loads it under its plan
    tables = tables_from_configs([*ebc_configs(), *ec_configs()])
    ebc, ec = torchrec_modules(seed=1)
    single = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig())
    load_torchrec_state(single, {**ebc.state_dict(), **ec.state_dict()})
    checkpoint_in = save_checkpoint(tmp_path / "in", 0, single)

    results = spawn(2, sharded_rank, (str(checkpoint_in), str(tmp_path / "out")), tmp_path=tmp_path / "pg")
    trained = {k: torch.as_tensor(v) for k, v in results[0].items()}
    assert all(torch.equal(torch.as_tensor(v), trained[k]) for k, v in results[1].items())
    assert not torch.equal(trained["embeddings.videos.weight"], ec.state_dict()["embeddings.videos.weight"])

    # the sharded run's checkpoint -> one process -> TorchRec
    single = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(), seed=11)
    load_checkpoint(latest_checkpoint(tmp_path / "out"), single, restore_rng=False)
    state = torchrec_state(single)
    assert sorted(state) == sorted(trained) and all(torch.equal(state[k], v) for k, v in trained.items())
    fresh_ebc, fresh_ec = torchrec_modules(seed=9)
    fresh_ebc.load_state_dict({k: v for k, v in state.items() if k.startswith("embedding_bags.")})
    fresh_ec.load_state_dict({k: v for k, v in state.items() if k.startswith("embeddings.")})
    kjt = random_kjt(["users", "tags", "clicks", "query", "pages"], seed=8)
    with torch.no_grad():
        assert_same_pooled(fresh_ebc, single, kjt)
        assert_same_lookup(fresh_ec(kjt), single.embed(sparse_from_kjt(kjt))[1])


# ---- TorchRec models neorec's DLRM has no counterpart of ----------------------------------------
def test_dlrm_dcn_tables_load_into_the_collection_and_the_dlrm_says_so():
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    from neorec.model.dlrm import DLRM as NeorecDLRM
    from neorec.model.dlrm import DCNv2

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=20, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    torch.manual_seed(0)
    dcn = DLRM_DCN(
        embedding_bag_collection=EmbeddingBagCollection(tables=configs),
        dense_in_features=3,
        dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
    )
    state = {"model." + k: v for k, v in dcn.state_dict().items()}  # as DLRMTrain holds it
    ours = NeorecDLRM(3, engine("fused", tables_from_configs(configs)), [8, DIM], [8])
    with pytest.raises(
        NeorecError,
        match=r"TorchRec DLRM_DCN \(its interaction has weights: 'model.inter_arch.crossnet.*"
        r"load_torchrec_state\(model.embeddings, state_dict\)",
    ):
        load_torchrec_state(ours, state)

    used = load_torchrec_state(ours.embeddings, state)  # what the message says: the tables alone
    assert sorted(used) == [
        f"model.sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight" for i in range(2)
    ]
    for i in range(2):
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight"
        assert torch.equal(
            torchrec_state(ours.embeddings)[f"embedding_bags.t{i}.weight"], dcn.state_dict()[key]
        )

    torch.manual_seed(0)
    plain = DLRM(EmbeddingBagCollection(tables=configs), 3, [8, DIM], [8, 1])
    dcnv2 = DCNv2(3, engine("fused", tables_from_configs(configs)), [8, DIM], [8])
    with pytest.raises(
        NeorecError, match=r"model is a DCNv2.*load_torchrec_state\(model.embeddings, state_dict\)"
    ):
        load_torchrec_state(dcnv2, plain.state_dict())
    load_torchrec_state(dcnv2.embeddings, plain.state_dict())
