"""`neorec predict --data` over Parquet files, for a model trained on Parquet: the files are read in
file order with the model's column mapping (raw ids into its managed-collision tables here), so its
own held-out files score as its held-out set does; files without the label column are scored without
labels; what cannot be scored is refused naming it. Vocabularies (hashing vocab) counted again in
their folder are refused by a resume and by predict: the ids would mean other values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.data.drifting import DriftSpec, partition_name, write_day
from neorec.data.vocab import save_vocabs
from neorec.errors import ConfigError, DataError
from neorec.serving import ExportError, export_model, predict_file
from neorec.train.trainer import Trainer

SPEC = DriftSpec(rows=300, vocab=200, shift=50, row_group=128)


@pytest.fixture(scope="module")
def parquet_model(tmp_path_factory) -> tuple[Path, Path]:
    """(a model trained on day 0 of a drifting stream with day 1 held out, the stream's folder)."""
    root = tmp_path_factory.mktemp("parquet_model")
    stream = root / "daily"
    for day in range(3):
        write_day(SPEC, stream, day)
    sets = [
        "data.follow=null", f"data.parquet.paths=[{stream / partition_name(0)}]",
        f"data.parquet.eval_paths=[{stream / partition_name(1)}]", "data.batch_size=100",
        "data.eval_batch_size=64",
        "train.max_steps=3", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
    ]  # fmt: skip
    Trainer(load_config("continuous", sets), root / "run").fit()
    export_model(root / "run", root / "m.nrx", measure=False)
    return root / "m.nrx", stream


def test_its_own_held_out_files_score_as_its_held_out_set(parquet_model, tmp_path):
    model, stream = parquet_model
    own = predict_file(model, tmp_path / "own.csv", with_labels=True)
    given = predict_file(model, tmp_path / "given.csv", data=stream / partition_name(1), with_labels=True)
    assert given.num_samples == own.num_samples == SPEC.rows
    assert (tmp_path / "given.csv").read_text() == (tmp_path / "own.csv").read_text()
    assert given.metrics == own.metrics and 0 < given.metrics["auc"] < 1


def test_files_without_the_label_column_are_scored_without_labels(parquet_model, tmp_path):
    model, stream = parquet_model
    labeled = predict_file(model, tmp_path / "a.txt", data=stream / partition_name(2))
    table = pq.read_table(next((stream / partition_name(2)).glob("*.parquet")))
    (tmp_path / "new").mkdir()
    pq.write_table(table.drop_columns(["label"]), tmp_path / "new" / "part-0.parquet", row_group_size=100)
    unlabeled = predict_file(model, tmp_path / "b.txt", data=tmp_path / "new")
    assert unlabeled.num_samples == labeled.num_samples == SPEC.rows
    assert (tmp_path / "b.txt").read_text() == (tmp_path / "a.txt").read_text()
    assert labeled.metrics and not unlabeled.metrics
    with pytest.raises(
        ConfigError, match=r"--with-labels: .* has no labels \(.*part-0.parquet has no column 'label'"
    ):
        predict_file(model, tmp_path / "c.txt", data=tmp_path / "new", with_labels=True)
    with pytest.raises(ExportError, match="is inside the data folder"):
        predict_file(model, tmp_path / "new" / "p.txt", data=tmp_path / "new")
    # a label column of nulls only (rows not labeled yet) is no label column
    (tmp_path / "nulls").mkdir()
    nulls = table.set_column(table.schema.get_field_index("label"), "label", pa.nulls(len(table), pa.int64()))
    pq.write_table(nulls, tmp_path / "nulls" / "part-0.parquet", row_group_size=100)
    assert not predict_file(model, tmp_path / "d.txt", data=tmp_path / "nulls").metrics
    assert (tmp_path / "d.txt").read_text() == (tmp_path / "a.txt").read_text()
    with pytest.raises(
        ConfigError, match=r"--with-labels: .* \(.*part-0.parquet: its column 'label' holds only"
    ):
        predict_file(model, tmp_path / "e.txt", data=tmp_path / "nulls", with_labels=True)
    assert not (tmp_path / "c.txt").exists() and not (tmp_path / "new" / "p.txt").exists()
    # an unlabeled file listed before a labeled one: all were scored without labels, without a word
    (tmp_path / "mixed").mkdir()
    pq.write_table(table.drop_columns(["label"]), tmp_path / "mixed" / "part-0.parquet", row_group_size=100)
    pq.write_table(table, tmp_path / "mixed" / "part-1.parquet", row_group_size=100)
    words = r"part-0.parquet has no column 'label', but .*part-1.parquet has labels"
    with pytest.raises(DataError, match=words):
        predict_file(model, tmp_path / "f.txt", data=tmp_path / "mixed")
    # a file of no rows (as Spark writes) beside unlabeled ones is neither kind
    pq.write_table(nulls.slice(0, 0), tmp_path / "nulls" / "part-1.parquet")
    assert not predict_file(model, tmp_path / "g.txt", data=tmp_path / "nulls").metrics


def test_vocabularies_counted_again_are_refused_by_a_resume_and_by_predict(tmp_path):
    stream = tmp_path / "daily"
    for day in range(2):
        write_day(SPEC, stream, day)
    table = pq.read_table(next((stream / partition_name(0)).glob("*.parquet")))
    values = np.unique(table.column("c0").to_numpy().astype(np.uint64))
    vocab = tmp_path / "vocab"
    save_vocabs(vocab, ["c0"], [values[::2]], {"counted": "by hand"})
    sets = [
        "data.follow=null", f"data.parquet.paths=[{stream / partition_name(0)}]",
        f"data.parquet.eval_paths=[{stream / partition_name(1)}]", "data.parquet.hashing=modulo",
        "data.parquet.table_rows=4096", f"data.parquet.vocab_dir={vocab}",
        "data.parquet.features=[{name: c0, hashing: vocab}, c1, c2, c3]", "embedding.tables={}",
        "data.batch_size=50", "checkpoint.every_steps=2", "train.progress=false", "logging.plot=false",
        "logging.tensorboard=false",
    ]  # fmt: skip
    Trainer(load_config("continuous", [*sets, "train.max_steps=2"]), tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "m.nrx", measure=False)
    predict_file(tmp_path / "m.nrx", tmp_path / "before.txt")

    save_vocabs(vocab, ["c0"], [values[1::2]], {"counted": "by hand, again"})
    with pytest.raises(
        ConfigError, match=r"trained with the vocabularies of data.parquet.vocab_dir .*counted again"
    ):
        Trainer(load_config("continuous", [*sets, "train.max_steps=4"]), tmp_path / "run", resume=True).fit()
    for data in (None, stream / partition_name(1)):
        with pytest.raises(ExportError, match=r"vocabularies in .* are not the ones it was exported with"):
            predict_file(tmp_path / "m.nrx", tmp_path / "after.txt", data=data)
    assert not (tmp_path / "after.txt").exists()


def test_a_followed_streams_model_exports_without_waiting_and_scores_only_given_data(tmp_path, capsys):
    """A stream's run (no idle timeout: it would wait for partitions for ever) exports from a complete
    partition, never waiting for one: with none there, export and plan say so at once; predict without
    --data says the stream has no held-out set (it wrote an empty file before) and scores --data."""
    stream = tmp_path / "daily"
    write_day(SPEC, stream, 0)
    sets = [f"data.follow.dir={stream}", "data.follow.until=day-000", "data.follow.idle_timeout=null",
            "data.batch_size=100", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false"]  # fmt: skip
    Trainer(load_config("continuous", sets), tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "m.nrx", measure=False)
    with pytest.raises(
        ExportError, match=r"followed stream \(data.follow\), which has no held-out set: give --data"
    ):
        predict_file(tmp_path / "m.nrx", tmp_path / "p.txt")
    assert (
        predict_file(tmp_path / "m.nrx", tmp_path / "p.txt", data=stream / partition_name(0)).num_samples
        == 300
    )

    (stream / partition_name(0)).rename(tmp_path / "elsewhere")
    with pytest.raises(DataError, match=r"data.follow.dir .*: holds no complete partition .*does not wait"):
        export_model(tmp_path / "run", tmp_path / "again.nrx", measure=False)
    assert not (tmp_path / "again.nrx").exists()
    cmd = ["plan", "--config", str(tmp_path / "run" / "config.yaml"), "--output-dir", str(tmp_path / "plan")]
    assert cli_main(cmd) == 2 and "holds no complete partition" in capsys.readouterr().err
