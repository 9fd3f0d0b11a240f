"""DeepFM, multi-task heads and two-tower retrieval: their math against float64 references, their
training through the Trainer, and the mistakes their configs can hold."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.errors import ConfigError
from neorec.metrics.evaluation import binary_metrics
from neorec.model.deepfm import fm_interaction
from neorec.model.multitask import MultiTaskDLRM
from neorec.model.two_tower import logq_softmax_loss, recall_at
from neorec.train.trainer import Trainer

ML_ROOT = Path(__file__).parents[2] / "shared" / "data" / "ml-latest-small"
needs_movielens = pytest.mark.skipif(
    not (ML_ROOT / "ratings.csv").is_file(), reason=f"shared MovieLens latest-small not found at {ML_ROOT}"
)
TINY = [
    "data.synthetic.train_samples=4096", "data.synthetic.eval_samples=1024", "data.synthetic.max_rows=300",
    "data.synthetic.num_sparse=4", "data.synthetic.num_dense=3", "data.batch_size=256", "data.eval_batch_size=512",
    "model.bottom_mlp=[16,8]", "model.top_mlp=[16]", "embedding.dim=8", "train.progress=false",
    "logging.plot=false", "logging.tensorboard=false", "train.eval_every=null",
]  # fmt: skip


def train(tmp_path: Path, extra: list[str], name: str = "run", base: str | None = None):
    trainer = Trainer(load_config(base, (TINY if base is None else []) + extra), tmp_path / name)
    return trainer, trainer.fit()


# ---- DeepFM --------------------------------------------------------------------------------------
def test_fm_term_equals_the_pairwise_sum_of_dot_products():
    fields = torch.randn(5, 6, 4, dtype=torch.float64)
    explicit = sum(
        (fields[:, i] * fields[:, j]).sum(dim=1) for i, j in itertools.combinations(range(fields.shape[1]), 2)
    )
    torch.testing.assert_close(fm_interaction(fields), explicit, rtol=1e-12, atol=1e-12)


def test_deepfm_trains_beats_chance_and_exports(tmp_path):
    from neorec.serving.export import export_model

    _, result = train(tmp_path, ["model.arch=deepfm", "train.epochs=2"])
    assert sum(result.losses[-4:]) < sum(result.losses[:4])
    assert result.eval["auc"] > 0.6
    report = export_model(tmp_path / "run", tmp_path / "model.nrx")
    assert report.eval["fp32"]["auc"] == pytest.approx(result.eval["auc"], abs=1e-6)


def test_deepfm_needs_one_dim_ending_the_bottom_mlp():
    with pytest.raises(ConfigError, match="model.bottom_mlp must end in embedding.dim .8. for deepfm"):
        load_config(None, [*TINY, "model.arch=deepfm", "model.bottom_mlp=[16,4]"])


# ---- multi-task heads ----------------------------------------------------------------------------
def test_one_task_trains_bitwise_like_the_single_task_model(tmp_path):
    """The multi-task model of one task (labels [B, 1], weight 1) is the DLRM of the same trunk."""
    _, single = train(tmp_path, ["model.arch=dlrm"], "single")
    trainer, multi = train(tmp_path, ["model.arch=multitask", "model.tasks=[{name: click}]"], "multi")
    assert next(iter(trainer.source.train_batches(8, 0))).labels.shape == (8, 1)
    assert multi.losses == single.losses
    a = torch.load(tmp_path / "single" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "multi" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert multi.eval["click/auc"] == multi.eval["auc"] == single.eval["auc"]


def test_multitask_loss_and_metrics_per_task():
    model = MultiTaskDLRM.__new__(MultiTaskDLRM)  # the heads' loss and metrics need no trunk
    model.task_names, model.task_weights = ["a", "b"], [1.0, 0.25]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 2, generator=g)
    labels = (torch.rand(64, 2, generator=g) < 0.4).float()
    batch = Batch(torch.zeros(64, 1), None, labels)
    y, z = labels.double(), logits.double()
    bce = -(y * torch.sigmoid(z).log() + (1 - y) * (1 - torch.sigmoid(z)).log()).mean(dim=0)
    assert model.loss(logits, batch).item() == pytest.approx(float(bce[0] + 0.25 * bce[1]), rel=1e-6)
    metrics = model.held_out_metrics(logits, labels)
    for t, name in enumerate("ab"):
        expected = binary_metrics(logits[:, t], labels[:, t])
        assert metrics[f"{name}/auc"] == expected["auc"] and metrics[f"{name}/log_loss"] == expected["log_loss"]
    pos, neg = torch.sigmoid(logits[:, 1])[labels[:, 1] == 1], torch.sigmoid(logits[:, 1])[labels[:, 1] == 0]
    by_hand = ((pos[:, None] > neg[None, :]).double().mean()).item()  # no ties among random floats
    assert metrics["b/auc"] == pytest.approx(by_hand, abs=1e-12)
    assert metrics["auc"] == metrics["a/auc"]
    assert metrics["weighted_log_loss"] == pytest.approx(metrics["a/log_loss"] + 0.25 * metrics["b/log_loss"])


def test_multitask_trains_and_reports_every_task(tmp_path):
    tasks = "model.tasks=[{name: click}, {name: conversion, weight: 0.5}]"
    trainer, result = train(tmp_path, ["model.arch=multitask", "model.trunk=dcnv2", "model.low_rank=4", tasks])
    labels = next(iter(trainer.source.eval_batches(1024))).labels
    assert labels.shape == (1024, 2) and bool((labels[:, 1] <= labels[:, 0]).all())  # converting needs a click
    assert result.eval["click/auc"] > 0.55 and result.eval["conversion/auc"] > 0.55
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"eval_conversion/auc"' in summary and '"eval_click/log_loss"' in summary
    from neorec.serving.export import export_model

    report = export_model(tmp_path / "run", tmp_path / "model.nrx")  # every task's head (test_export_models.py)
    assert report.eval["fp32"]["conversion/auc"] == pytest.approx(result.eval["conversion/auc"], abs=1e-12)


def test_the_teacher_ceiling_is_the_click_label_s_and_shown_only_where_click_is_the_primary_task():
    """The teacher's probabilities are the click label's: its AUC is the ceiling of a run whose
    primary (first) task is click, and of no other."""
    from neorec.data.synthetic import SyntheticSource, spec_from_config

    c = load_config(None, TINY).data.synthetic
    alone = SyntheticSource(spec_from_config(c, 0), cache=False).teacher_auc()
    first = SyntheticSource(spec_from_config(c, 0, ["click", "conversion"]), cache=False).teacher_auc()
    assert first == alone and 0.5 < alone < 1
    assert SyntheticSource(spec_from_config(c, 0, ["conversion", "click"]), cache=False).teacher_auc() is None


def test_multitask_config_mistakes_are_named():
    with pytest.raises(ConfigError, match="model.arch multitask needs model.tasks"):
        load_config(None, ["model.arch=multitask"])
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, ["model.arch=multitask", "model.tasks=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match="model.tasks is for model.arch multitask"):
        load_config(None, ["model.tasks=[{name: a}]"])
    weightless = "model.tasks=[{name: a, weight: 0}, {name: b, weight: 0}]"  # a loss of 0: nothing trains
    with pytest.raises(ConfigError, match="at least one task needs a weight > 0"):
        load_config(None, ["model.arch=multitask", weightless])
    cfg = load_config(None, [*TINY, "model.arch=multitask", "model.tasks=[{name: click}, {name: purchase}]"])
    with pytest.raises(ConfigError, match=r"labels \['purchase'\] that synthetic data does not make"):
        Trainer(cfg)


@needs_movielens
def test_movielens_makes_its_labels_by_name():
    from neorec.data.movielens import MovieLensSource

    src = MovieLensSource(ML_ROOT, labels=["ok", "like", "love"])
    rows = torch.arange(0, len(src.rating), 97)
    labels = src.batch(rows).labels
    rating = src.rating[rows]
    assert torch.equal(labels, torch.stack([rating >= 3, rating >= 4, rating >= 4.5], dim=1).float())
    with pytest.raises(ConfigError, match=r"\['hate'\] that MovieLens does not make"):
        MovieLensSource(ML_ROOT, labels=["hate"])


@needs_movielens
def test_data_inspect_gives_each_task_its_positive_rate():
    from neorec.data.inspect import inspect_source

    text = inspect_source("movielens_multitask", [f"data.movielens.root={ML_ROOT}"], num_batches=2)
    assert "sampled 512 training samples: positive rate like 0." in text and " love 0." in text and " ok 0." in text


@needs_movielens
def test_data_inspect_table_fits_long_feature_names():
    from neorec.data.inspect import inspect_source

    text = inspect_source("movielens_seq", [f"data.movielens.root={ML_ROOT}"], num_batches=1)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("feature "))
    table = lines[start : start + 2 + 6]  # header, rule, one row per feature
    assert any(line.startswith("history_liked ") for line in table)
    assert len({len(line) for line in table}) == 1, table  # every column lines up


@pytest.mark.distributed
def test_multitask_over_two_processes_matches_one(tmp_path):
    from dist_helpers import fit_rank, spawn

    from neorec.config.load import load_config
    from neorec.train.trainer import Trainer

    # neorec/configs/default.yaml's preset (criteo_kaggle) has its own 26 tables
    tiny = [s for s in TINY if not s.startswith("data.synthetic.num_sparse=")]
    sets = [*tiny, "model.arch=multitask", "model.tasks=[{name: click}, {name: conversion, weight: 0.5}]",
            "train.max_steps=8", "embedding.optimizer={name: sgd, lr: 0.5}", "train.dense_optimizer={name: sgd, lr: 0.05}",
            "distributed.forward_precision=fp32", "distributed.backward_precision=fp32"]  # fmt: skip
    outs = {1: tmp_path / "n1", 2: tmp_path / "n2"}
    Trainer(load_config("default", sets), outs[1]).fit()  # what `neorec train` runs, in 1 and 2 processes
    spawn(2, fit_rank, (sets, str(outs[2])), tmp_path=tmp_path / "pg")
    a, b = (torch.load(outs[n] / "model.pt", weights_only=True) for n in (1, 2))
    assert a.keys() == b.keys()
    for k in a:
        if not k.endswith(".step"):
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    import json

    one, two = (json.loads((outs[n] / "summary.json").read_text()) for n in (1, 2))
    assert two["eval_conversion/auc"] == pytest.approx(one["eval_conversion/auc"], abs=1e-3)


# ---- two-tower retrieval -------------------------------------------------------------------------
def test_logq_softmax_loss_equals_a_float64_hand_computation():
    g = torch.Generator().manual_seed(0)
    user = F.normalize(torch.randn(5, 3, generator=g), dim=1)
    item = F.normalize(torch.randn(5, 3, generator=g), dim=1)
    ids = torch.tensor([7, 2, 7, 4, 1])  # item 7 twice: rows 0 and 2 are not each other's negatives
    log_q = torch.log(torch.tensor([0.3, 0.1, 0.3, 0.05, 0.2]))
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])  # row 1 is not a positive
    temperature = 0.5
    total, count = 0.0, 0
    for i in range(5):
        if weights[i] == 0:
            continue
        terms = {
            j: float(user[i].double() @ item[j].double()) / temperature - float(log_q[j].double())
            for j in range(5) if j == i or ids[j] != ids[i]
        }  # fmt: skip
        total += -(terms[i] - math.log(sum(math.exp(v) for v in terms.values())))
        count += 1
    got = logq_softmax_loss(user, item, ids, log_q, weights, temperature)
    assert got.item() == pytest.approx(total / count, rel=1e-6)


def test_logq_softmax_loss_of_row_blocks_sums_to_the_whole_batch():
    """What each of several ranks computes: its users against every item of the global batch, divided
    by the global weight; the blocks' losses add up to the one-process loss."""
    g = torch.Generator().manual_seed(1)
    user = F.normalize(torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1)
    item = F.normalize(torch.randn(6, 4, generator=g, dtype=torch.float64), dim=1)
    ids = torch.tensor([3, 5, 3, 8, 5, 1])  # duplicates across the blocks' boundary too
    log_q = torch.rand(6, generator=g, dtype=torch.float64).log()
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    whole = logq_softmax_loss(user, item, ids, log_q, weights, 0.1)
    total = weights.sum()
    blocks = [logq_softmax_loss(user[a:a + 2], item, ids, log_q, weights[a:a + 2], 0.1, first=a, weight_total=total)
              for a in (0, 2, 4)]  # fmt: skip
    torch.testing.assert_close(sum(blocks), whole, rtol=1e-12, atol=0)


def test_recall_at_k_on_a_hand_made_case():
    scores = torch.tensor([
        [0.9, 0.1, 0.5, 0.3],  # ranking 0, 2, 3, 1
        [0.2, 0.8, 0.7, 0.1],  # ranking 1, 2, 0, 3
        [0.0, 0.1, 0.2, 0.3],  # ranking 3, 2, 1, 0
    ])  # fmt: skip
    targets = torch.tensor([2, 1, 0])  # ranks 2, 1 and 4
    assert recall_at(scores, targets, (1, 2, 3, 10)) == {1: 1, 2: 2, 3: 2, 10: 3}


def test_seen_items_leave_the_ranking_but_the_held_out_item_stays():
    from neorec.model.two_tower import SeenItems
    from neorec.sparse import SparseBatch

    class Train:  # user 0 rated items 1 and 3 in training, user 2 item 0, user 1 nothing
        def train_batches(self, batch_size, epoch):
            one = torch.ones(3, dtype=torch.int64)
            sparse = SparseBatch.from_features({"u": (torch.tensor([2, 0, 0]), one), "i": (torch.tensor([0, 3, 1]), one)})
            yield Batch(torch.zeros(3, 1), sparse, torch.ones(3))

    seen = SeenItems(Train(), "u", "i", num_users=3)
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.8], [0.1, 0.9, 0.2, 0.8], [0.5, 0.4, 0.3, 0.2]])
    users, targets = torch.tensor([0, 1, 2]), torch.tensor([2, 2, 0])  # user 2's held-out item is a seen one
    inf = float("inf")
    expected = torch.tensor([[0.1, -inf, 0.2, -inf], [0.1, 0.9, 0.2, 0.8], [0.5, 0.4, 0.3, 0.2]])
    assert torch.equal(seen.mask(scores, users, targets), expected)
    assert recall_at(seen.mask(scores, users, targets), targets, (1,)) == {1: 2}  # user 0's item 2 now first


def tiny_movielens(tmp_path: Path, ratings: int = 6000) -> Path:
    root = tmp_path / "ml"
    root.mkdir()
    lines = (ML_ROOT / "ratings.csv").read_text().splitlines()[: ratings + 1]
    (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    shutil.copy(ML_ROOT / "movies.csv", root / "movies.csv")
    return root


@needs_movielens
def test_two_tower_training_lowers_the_loss_and_reports_recall(tmp_path):
    root = tiny_movielens(tmp_path)
    sets = [f"data.movielens.root={root}", "train.epochs=3", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false", "data.batch_size=256", "train.eval_every=null"]  # fmt: skip
    trainer, result = train(tmp_path, sets, base="movielens_two_tower")
    per_epoch = len(result.losses) // 3
    assert sum(result.losses[-per_epoch:]) < 0.95 * sum(result.losses[:per_epoch])
    model = trainer.model
    assert float(model.item_counts.sum()) == len(trainer.source.train_index)
    e = result.eval
    assert e["num_items"] == len(trainer.source.movie_ids)
    assert e["num_queries"] == int(trainer.source.labels[trainer.source.val_index].sum())
    assert 0 <= e["recall@10"] <= e["recall@100"] <= 1
    assert e["recall@100"] > 2 * 100 / e["num_items"]  # well above a random ranking's


def test_two_tower_mistakes_are_named():
    with pytest.raises(ConfigError, match=r"features \['movie'\] are in both"):
        load_config(None, ["model.arch=two_tower", "model.two_tower.user_features=[user, movie]"])
    with pytest.raises(ConfigError, match=r"user_id 'movie' must be one of user_features \['user'\]"):
        load_config(None, ["model.arch=two_tower", "model.two_tower.user_id=movie"])
    tiny = [s for s in TINY if not s.startswith("model.")]  # two_tower has no bottom or top MLP
    cfg = load_config(None, [*tiny, "model.arch=two_tower"])
    with pytest.raises(ConfigError, match=r"names features \['user', 'movie', 'genres', 'year'\] that the data lacks"):
        Trainer(cfg)
    cfg = load_config(None, [*tiny, "model.arch=two_tower", "model.two_tower.user_features=[C1]",
                             "model.two_tower.item_features=[C2, C3]"])  # fmt: skip
    with pytest.raises(ConfigError, match="needs a source that lists its items"):
        Trainer(cfg)


# ---- the reference engine: the float baseline of the fused one -----------------------------------
def test_reference_engine_pools_weighted_mean_bags_as_the_fused_engine():
    """Weighted mean bags (empty ones among them): the weighted sum over the bag's id count, in both
    engines; the pooled vectors, and the tables after an sgd step, agree."""
    import warnings

    from neorec.embedding.fused import FusedEmbeddingCollection
    from neorec.embedding.reference import ReferenceEmbeddingCollection
    from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
    from neorec.sparse import SparseBatch

    tables = [TableConfig(name="a", rows=30, dim=4, features=["x", "y"], pooling="mean"),
              TableConfig(name="b", rows=20, dim=3, features=["z"], pooling="sum")]  # fmt: skip
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.5)
    fused, ref = FusedEmbeddingCollection(tables, opt), ReferenceEmbeddingCollection(tables, opt)
    f_opt, r_opt = fused.build_optimizer(), ref.build_optimizer()
    gen = torch.Generator().manual_seed(3)
    features = {}
    for f, rows in [("x", 30), ("y", 30), ("z", 20)]:
        lengths = torch.tensor([0, 3, 1, 0, 4, 2])
        n = int(lengths.sum())
        ids = torch.randint(0, rows, (n,), generator=gen)
        features[f] = (ids, lengths, torch.rand(n, generator=gen) + 0.5)
    sparse = SparseBatch.from_features(features)
    a, b = fused(sparse), ref(sparse)
    values, lengths, w = sparse.feature("x")
    table = ref.table_weights()["a"]
    by_hand = torch.stack([
        (table[values[s:e]] * w[s:e, None]).sum(0) / max(e - s, 1)
        for s, e in zip(torch.cumsum(lengths, 0) - lengths, torch.cumsum(lengths, 0), strict=True)
    ])  # fmt: skip
    torch.testing.assert_close(b[:, :4], by_hand)
    assert not b[0].any() and not b[3].any()  # empty bags give zeros
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    grad = torch.randn(a.shape, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's sparse-invariant notice
        a.backward(grad)
        b.backward(grad)
        f_opt.step()
        r_opt.step()
    for t, weight in ref.table_weights().items():
        torch.testing.assert_close(fused.table_weights()[t], weight, rtol=1e-6, atol=1e-7)
