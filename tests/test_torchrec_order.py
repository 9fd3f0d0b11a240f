"""The order of a DLRM's features, which its interaction (and so its top MLP's first layer) follows.

A TorchRec DLRM whose tables come in another order than the neorec DLRM's moves over, through a
state_dict or a DCP checkpoint, with the top MLP's columns matched, and scores as TorchRec does;
its weights go back into a TorchRec DLRM of either order. Where the TorchRec side does not record
the order (a table's features, a DistributedModelParallel's sorted keys, a DCP checkpoint without
planner_data), the load is refused unless `feature_names` gives it.
"""

import pytest

torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (see docs/torchrec.md)")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM as TorchRecDLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402

from neorec.data.batch import Batch  # noqa: E402
from neorec.embedding.fused.collection import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.errors import NeorecError  # noqa: E402
from neorec.interop.torchrec import (  # noqa: E402
    gather_torchrec_state,
    load_dcp,
    load_torchrec_dense,
    load_torchrec_state,
    save_dcp,
    sparse_from_kjt,
    torchrec_state,
)
from neorec.model.dlrm import DLRM  # noqa: E402

DIM, NUM_DENSE, ROWS = 4, 3, 10
OURS, THEIRS = ["a", "b", "c"], ["c", "a", "b"]  # the same tables, listed in another order
SHARED = {"a": ["a", "a2"]}  # table a with two features (TorchRec's lists them the other way)


def torchrec_dlrm(order: list[str], features: dict | None = None, seed: int = 0) -> TorchRecDLRM:
    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(
            name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=(features or {}).get(n, [n])
        )
        for n in order
    ]
    return TorchRecDLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=configs),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
    )


def neorec_dlrm(order: list[str], features: dict | None = None) -> DLRM:
    tables = [TableConfig(name=n, rows=ROWS, dim=DIM, features=(features or {}).get(n, [n])) for n in order]
    embeddings = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="sgd"))
    return DLRM(NUM_DENSE, embeddings, [8, DIM], [8])


def assert_same_scores(theirs: TorchRecDLRM, ours: DLRM) -> None:
    """Both score a batch of 1-3 ids per bag over every feature alike."""
    g = torch.Generator().manual_seed(1)
    keys = list(ours.embeddings.feature_names)
    lengths = torch.randint(1, 4, (len(keys) * 5,), generator=g)
    kjt = KeyedJaggedTensor(
        keys=keys, values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=g), lengths=lengths
    )
    dense = torch.randn(5, NUM_DENSE, generator=g)
    with torch.no_grad():
        expected = theirs(dense, kjt).squeeze(1)
        got = ours(Batch(dense, sparse_from_kjt(kjt), torch.zeros(5)))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_state_dict_with_tables_in_another_order_scores_as_torchrec():
    theirs = torchrec_dlrm(THEIRS)
    state = {"model." + k: v for k, v in theirs.state_dict().items()}  # as DLRMTrain keeps it
    ours = neorec_dlrm(OURS)
    load_torchrec_state(ours, state)
    assert_same_scores(theirs, ours)

    dense_only = neorec_dlrm(OURS)  # tables loaded apart, the layers alone: the same order
    load_torchrec_state(dense_only.embeddings, state)
    load_torchrec_dense(dense_only, state)
    assert_same_scores(theirs, dense_only)
    assert list(gather_torchrec_state(state)) == list(state)  # the order that tells the tables' order


def test_weights_go_back_to_a_torchrec_dlrm_of_either_order():
    ours = neorec_dlrm(OURS)
    load_torchrec_state(ours, torchrec_dlrm(THEIRS).state_dict())

    same = torchrec_dlrm(OURS, seed=3)  # over the neorec tables' order (configs_from_tables gives it)
    same.load_state_dict(torchrec_state(ours))
    assert_same_scores(same, ours)

    other = torchrec_dlrm(THEIRS, seed=4)
    state = torchrec_state(ours, feature_names=other.sparse_arch.sparse_feature_names)
    assert [k.split(".")[-2] for k in state if "embedding_bags" in k] == THEIRS
    other.load_state_dict(state)
    assert_same_scores(other, ours)


def test_dcp_checkpoints_with_tables_in_another_order(tmp_path):
    theirs = torchrec_dlrm(THEIRS)
    dcp.save({"model": theirs.state_dict()}, checkpoint_id=tmp_path / "torchrec")
    ours = neorec_dlrm(OURS)
    load_dcp(ours, tmp_path / "torchrec")
    assert_same_scores(theirs, ours)

    # neorec -> TorchRec of another order, and neorec -> neorec of another order
    other = torchrec_dlrm(THEIRS, seed=5)
    save_dcp(ours, tmp_path / "for-torchrec", feature_names=other.sparse_arch.sparse_feature_names)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "for-torchrec")
    other.load_state_dict(state["model"])
    assert_same_scores(other, ours)
    save_dcp(ours, tmp_path / "neorec")
    again = neorec_dlrm(["b", "c", "a"])
    load_dcp(again, tmp_path / "neorec")
    same = torchrec_dlrm(OURS, seed=6)
    same.load_state_dict(torchrec_state(ours))
    assert_same_scores(same, again)


def test_an_order_the_torchrec_side_does_not_record_is_refused(tmp_path):
    theirs = torchrec_dlrm(THEIRS, {"a": ["a2", "a"]})
    order = theirs.sparse_arch.sparse_feature_names
    state = theirs.state_dict()
    ours = neorec_dlrm(OURS, SHARED)
    before = torchrec_state(ours)
    with pytest.raises(NeorecError, match=r"table 'a' has features \['a', 'a2'\].*feature_names="):
        load_torchrec_state(ours, state)
    assert all(torch.equal(v, torchrec_state(ours)[k]) for k, v in before.items())  # nothing written
    load_torchrec_state(ours, state, feature_names=order)
    assert_same_scores(theirs, ours)

    with pytest.raises(NeorecError, match=r"feature_names \['a', 'b', 'c'\]: expected .*'a2'"):
        load_torchrec_state(ours, state, feature_names=["a", "b", "c"])
    with pytest.raises(NeorecError, match="splits the features of table 'a'"):
        load_torchrec_state(ours, state, feature_names=["a", "c", "a2", "b"])
    with pytest.raises(NeorecError, match=r"tables in the order \['a', 'b', 'c'\].*\['c', 'a', 'b'\]"):
        load_torchrec_state(ours, state, feature_names=["a", "a2", "b", "c"])
    layers = {k: v for k, v in state.items() if "sparse_arch" not in k}
    with pytest.raises(NeorecError, match="holds no tables.*feature order is unknown.*feature_names="):
        load_torchrec_dense(ours, layers)
    load_torchrec_dense(ours, layers, order)
    assert_same_scores(theirs, ours)

    # a DCP checkpoint saved without flattening has no planner_data, the record of the tables' order
    single = torchrec_dlrm(THEIRS)
    flat = DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(single.state_dict(), checkpoint_id=tmp_path / "flat", planner=flat)
    ours = neorec_dlrm(OURS)
    with pytest.raises(NeorecError, match=r"flat: its \.metadata .*planner_data.*feature_names="):
        load_dcp(ours, tmp_path / "flat")
    load_dcp(ours, tmp_path / "flat", feature_names=single.sparse_arch.sparse_feature_names)
    assert_same_scores(single, ours)


def test_a_sorted_state_dict_as_distributed_model_parallel_gives_is_refused(tmp_path):
    """DistributedModelParallel.state_dict sorts its keys (the bottom MLP before the tables), which
    loses the order of the tables, in the state_dict and in a DCP checkpoint of it."""
    theirs = torchrec_dlrm(THEIRS)
    state = dict(sorted(theirs.state_dict().items()))
    ours = neorec_dlrm(OURS)
    with pytest.raises(NeorecError, match=r"the state_dict lists the bottom MLP .* sorted.*feature_names="):
        load_torchrec_state(ours, state)
    dcp.save({"model": state}, checkpoint_id=tmp_path / "dmp")
    with pytest.raises(NeorecError, match=r"dmp: the saved dict lists the bottom MLP .* sorted"):
        load_dcp(ours, tmp_path / "dmp")
    load_dcp(ours, tmp_path / "dmp", feature_names=theirs.sparse_arch.sparse_feature_names)
    assert_same_scores(theirs, ours)
