"""Export and predict of the models beyond one pooled click probability: multi-task heads (one
probability column per task), DIN (the user's history read from the model's own data) and tables with
managed collision (the id map travels in the file). Each export scores the held-out batches as the
trained model does; what serving cannot take is refused with a message naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.errors import NeorecError
from neorec.serving import ExportError, export_model, load_export, predict_file
from neorec.serving.export import report_text
from neorec.serving.file_format import read_export
from neorec.train.trainer import Trainer

SYNTHETIC = [
    "data.synthetic.train_samples=2048", "data.synthetic.eval_samples=600", "data.synthetic.max_rows=300",
    "data.synthetic.num_sparse=4", "data.synthetic.num_dense=3", "data.batch_size=128", "data.eval_batch_size=256",
    "model.bottom_mlp=[16,8]", "model.top_mlp=[16]", "embedding.dim=8", "train.progress=false",
    "logging.plot=false", "logging.tensorboard=false", "train.eval_every=null",
]  # fmt: skip


def train_run(root: Path, base: str | None, sets: list[str]) -> tuple[Trainer, dict[str, float]]:
    """A trained run under root/run and its fp32 export root/fp32.nrx: the trainer and held-out metrics."""
    trainer = Trainer(load_config(base, sets), root / "run")
    metrics = trainer.fit().eval
    export_model(root / "run", root / "fp32.nrx", measure=False)
    return trainer, metrics


@torch.no_grad()
def logits_of(model: torch.nn.Module, batches) -> torch.Tensor:
    return torch.cat([model(b) for b in batches])


def check_export_scores_as_trained(trainer: Trainer, metrics: dict, root: Path, int8_atol: float) -> None:
    """fp32: bit for bit; int8: logits within `int8_atol`, and what export measured is what it scores."""
    trained = logits_of(trainer.model.eval(), trainer.source.eval_batches(256))
    fp32 = export_model(root / "run", root / "checked.nrx")
    assert torch.equal(
        logits_of(load_export(root / "checked.nrx").model, trainer.source.eval_batches(256)), trained
    )
    assert fp32.eval["fp32"]["auc"] == pytest.approx(metrics["auc"], abs=1e-12)
    int8 = export_model(root / "run", root / "checked_int8.nrx", int8=True)
    got = logits_of(load_export(root / "checked_int8.nrx").model, trainer.source.eval_batches(256))
    torch.testing.assert_close(got, trained, rtol=0, atol=int8_atol)
    assert not torch.equal(got, trained) and abs(int8.auc_change) <= 0.01


# ---- multi-task -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def multitask(tmp_path_factory):
    root = tmp_path_factory.mktemp("multitask")
    tasks = "model.tasks=[{name: click}, {name: conversion, weight: 0.5}]"
    return root, *train_run(root, None, [*SYNTHETIC, "model.arch=multitask", "model.trunk=dcnv2", tasks])


def test_multitask_export_scores_every_task_as_trained(multitask):
    root, trainer, metrics = multitask
    check_export_scores_as_trained(trainer, metrics, root, int8_atol=0.05)
    text = report_text(export_model(root / "run", root / "again.nrx", int8=True))
    assert "eval conversion/auc fp32" in text and "eval conversion/auc int8" in text, text
    assert load_export(root / "fp32.nrx").task_names == ["click", "conversion"]


def test_multitask_predict_writes_a_column_per_task(multitask, capsys):
    root, trainer, metrics = multitask
    out = root / "pred.csv"
    assert cli_main(["predict", str(root / "fp32.nrx"), "--out", str(out), "--with-labels"]) == 0
    printed = capsys.readouterr().out
    assert "click/auc" in printed and "conversion/auc" in printed
    lines = out.read_text().splitlines()
    assert lines[0] == "click,conversion,click_label,conversion_label" and len(lines) == 601
    table = torch.tensor([[float(x) for x in line.split(",")] for line in lines[1:]], dtype=torch.float64)
    probs = torch.sigmoid(logits_of(trainer.model.eval(), trainer.source.eval_batches(256)))
    labels = torch.cat([b.labels for b in trainer.source.eval_batches(256)])
    torch.testing.assert_close(table[:, :2], probs.double(), rtol=1e-8, atol=0)
    assert torch.equal(table[:, 2:], labels.double())
    r = predict_file(root / "fp32.nrx", root / "plain.csv")
    assert r.num_samples == 600
    assert (root / "plain.csv").read_text().splitlines()[0] == "click,conversion"
    for key in ("click/auc", "conversion/auc", "auc"):
        assert r.metrics[key] == pytest.approx(metrics[key], abs=1e-12)


def test_multitask_pt2_is_refused_naming_what_it_serves(multitask):
    root = multitask[0]
    with pytest.raises(
        ExportError, match="model.arch multitask cannot be exported with --format pt2, which serves"
    ):
        export_model(root / "run", root / "pt2", format="pt2")


def test_two_tower_is_refused_naming_what_export_serves():
    from neorec.serving.export import check_exportable

    cfg = load_config(None, [*[x for x in SYNTHETIC if not x.startswith("model.")], "model.arch=two_tower"])
    with pytest.raises(
        ExportError, match="model.arch two_tower cannot be exported yet; export serves dlrm, .*multitask"
    ):
        check_exportable(cfg, "runs/tt", "nrx")


# ---- DIN --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def din(tmp_path_factory):
    from tests.test_din import write_tiny_movielens

    root = tmp_path_factory.mktemp("din")
    data = write_tiny_movielens(root / "ml")
    sets = [f"data.movielens.root={data}", "data.batch_size=32", "data.eval_batch_size=64", "train.epochs=2",
            "train.progress=false", "logging.plot=false", "logging.tensorboard=false"]  # fmt: skip
    return root, *train_run(root, "movielens_seq", sets)


def test_din_export_scores_as_trained(din):
    root, trainer, metrics = din
    check_export_scores_as_trained(trainer, metrics, root, int8_atol=0.05)
    histories = torch.cat([b.sparse.feature("history")[1] for b in trainer.source.eval_batches(256)])
    assert histories.min() > 1
    # the held-out ratings all have a history; users' first ratings have none
    src = trainer.source
    first = src.batch(torch.from_numpy(np.flatnonzero(src.history_lengths.numpy() == 0)))
    assert len(first) == 24 and not first.sparse.feature("history")[1].any()
    for name, atol in (("fp32", 0.0), ("checked_int8", 0.05)):
        exported = logits_of(load_export(root / f"{name}.nrx").model, [first])
        torch.testing.assert_close(exported, logits_of(trainer.model.eval(), [first]), rtol=0, atol=atol)


def test_din_predict_reads_the_histories_of_its_own_data(din, capsys):
    root, trainer, metrics = din
    out = root / "pred.txt"
    assert cli_main(["predict", str(root / "fp32.nrx"), "--out", str(out)]) == 0
    probs = torch.tensor([float(x) for x in out.read_text().splitlines()], dtype=torch.float64)
    expected = torch.sigmoid(logits_of(trainer.model.eval(), trainer.source.eval_batches(256)))
    torch.testing.assert_close(probs, expected.double(), rtol=1e-8, atol=0)
    assert "auc" in capsys.readouterr().out


def test_din_without_its_history_feature_is_refused_naming_it(din):
    root, trainer, _ = din
    batch = next(iter(trainer.source.eval_batches(16)))
    bare = Batch(
        batch.dense, batch.sparse.select([k for k in batch.sparse.keys if k != "history"]), batch.labels
    )
    with pytest.raises(NeorecError, match="sequence feature 'history'.*which this batch does not have"):
        load_export(root / "fp32.nrx").model(bare)


def test_exported_sequence_rows_are_scaled_by_their_ids_weights():
    from neorec.embedding.tables import TableConfig
    from neorec.serving.embeddings import InferenceEmbeddings
    from neorec.sparse import SparseBatch

    table = TableConfig(name="h", rows=10, dim=4, features=["hist"], pooling="none")
    w = torch.randn(10, 4)
    ids, lengths, weights = torch.tensor([1, 2, 3]), torch.tensor([2, 1]), torch.tensor([0.5, 2.0, 1.0])
    _, sequences = InferenceEmbeddings([table], {"h": w}).embed(SparseBatch(["hist"], ids, lengths, weights))
    assert torch.equal(sequences["hist"].values, w[[1, 2, 3]] * torch.tensor([[0.5], [2.0], [1.0]]))


# ---- managed collision ----------------------------------------------------------------------------------
MANAGED = [
    "embedding.tables.C2={managed_collision: {eviction: lru, buckets: 2}, rows: 64, pooling: mean}",
    "embedding.tables.C4={managed_collision: {eviction: lfu}, rows: 100}",
    "checkpoint.every_steps=8",
]


@pytest.fixture(scope="module")
def managed(tmp_path_factory):
    root = tmp_path_factory.mktemp("managed")
    return root, *train_run(root, None, [*SYNTHETIC, *MANAGED])


def test_managed_collision_export_maps_raw_ids_as_training_evaluates(managed):
    """Held-out ids the maps do not hold are left out of their bags, as evaluation does in training."""
    root, trainer, metrics = managed
    check_export_scores_as_trained(trainer, metrics, root, int8_atol=0.05)
    model = load_export(root / "fp32.nrx").model
    trained_maps = {m.name: m.id_map.keys.tensor for m in trainer.model.embeddings.mapped}
    assert model.embeddings.id_maps().keys() == trained_maps.keys() == {"C2", "C4"}
    for name, keys in model.embeddings.id_maps().items():
        assert torch.equal(keys, trained_maps[name])
    logits_of(model, trainer.source.eval_batches(256))
    stats = {m.name: dict(m.id_map.stats) for m in model.embeddings.mapped}
    assert all(s["eval_misses"] > 0 and s["eval_hits"] > 0 for s in stats.values()), stats  # scoring's, apart
    assert all(s["inserts"] == 0 for s in stats.values()), stats


def test_managed_collision_export_from_a_checkpoint_equals_model_pt(managed):
    root, trainer, _ = managed
    export_model(root / "run" / "checkpoints", root / "ckpt.nrx", measure=False)
    a, b = (load_export(root / f"{n}.nrx").model for n in ("fp32", "ckpt"))
    assert torch.equal(
        logits_of(a, trainer.source.eval_batches(256)), logits_of(b, trainer.source.eval_batches(256))
    )


def test_managed_collision_pt2_is_refused_naming_the_tables(managed):
    root = managed[0]
    with pytest.raises(
        ExportError, match=r"tables \['C2', 'C4'\] have managed collision, which --format pt2"
    ):
        export_model(root / "run", root / "pt2", format="pt2")


CRITEO = Path(__file__).parents[2] / "shared" / "data" / "criteo_sample.tsv"


@pytest.mark.skipif(not CRITEO.is_file(), reason=f"shared Criteo sample not found at {CRITEO}")
def test_managed_collision_predict_maps_raw_criteo_lines(tmp_path):
    """Raw TSV lines give the managed-collision table its raw hash values, as training read them."""
    sets = ["data.source=criteo_tsv", f"data.criteo={{train_paths: [{CRITEO}], table_rows: 1000, hashing: hash}}",
            "embedding.tables.C3={managed_collision: {eviction: lru}, rows: 64}", "data.batch_size=32",
            "train.max_steps=5", "train.progress=false", "logging.plot=false", "logging.tensorboard=false"]  # fmt: skip
    Trainer(load_config("default", sets), tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "m.nrx", measure=False)
    held_out = tmp_path / "held_out.tsv"
    held_out.write_text(
        "".join(x for i, x in enumerate(CRITEO.read_text().splitlines(True), 1) if i % 10 == 0)
    )
    a = predict_file(tmp_path / "m.nrx", tmp_path / "a.txt", data=held_out)
    predict_file(tmp_path / "m.nrx", tmp_path / "b.txt")
    assert a.num_samples == 20 and (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text()


@pytest.mark.distributed
def test_managed_collision_export_of_a_two_process_run_from_its_checkpoint(tmp_path):
    """Each rank keeps the map of its buckets; the checkpoint read into one process gives the same
    file, id maps included, as the model.pt the ranks gathered."""
    from dist_helpers import fit_rank, spawn

    # `neorec train` reads neorec/configs/default.yaml, whose preset (criteo_kaggle) has its own 26 tables
    synthetic = [s for s in SYNTHETIC if not s.startswith("data.synthetic.num_sparse=")]
    sets = [*synthetic, "embedding.tables.C2={managed_collision: {eviction: lru, buckets: 2}, rows: 64}",
            "checkpoint.every_steps=8", "distributed.sharding={C2: {kind: rw, ranks: [0, 1]}}"]  # fmt: skip
    spawn(2, fit_rank, (sets, str(tmp_path / "run")), tmp_path=tmp_path / "pg")  # the workers' Trainer
    export_model(tmp_path / "run", tmp_path / "a.nrx", measure=False)
    export_model(tmp_path / "run" / "checkpoints", tmp_path / "b.nrx", measure=False)
    _, a = read_export(tmp_path / "a.nrx")
    _, b = read_export(tmp_path / "b.nrx")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert bool((a["tables/C2/mc_keys"] != -1).all())  # both ranks' buckets filled
