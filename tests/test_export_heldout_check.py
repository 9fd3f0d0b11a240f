"""`neorec export` measures, and `neorec predict` without --data scores, the held-out data the run
scored (neorec/serving/held_out.py), as `neorec eval` does: a held-out file rewritten since the run
gave an export AUC on other samples and predictions of them, with exit status 0. And the export
report: a quantized export without held-out metrics says the AUC change was not measured and how to
measure it; a multi-task one gives each task's change. Predictions under a .gz name are gzip; an
empty Parquet file given to predict is named as the --data it is."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml

from neorec.cli import main
from neorec.config.load import load_config
from neorec.errors import DataError
from neorec.serving import export_model, predict_file
from neorec.serving.export import report_text
from neorec.serving.file_format import read_export, read_header, write_export
from neorec.serving.predict import result_text
from neorec.train.trainer import Trainer
from tests.test_export_models import SYNTHETIC
from tests.test_predict_failures import exports, write_parquet  # noqa: F401 (a fixture)
from tests.tiny_cli import TINY, criteo_lines, sets

CRITEO = [
    "data.source=criteo_tsv", "data.criteo.train_paths=[train.tsv]", "data.criteo.eval_paths=[eval.tsv]",
    "data.batch_size=16", "data.eval_batch_size=16", "data.criteo.table_rows=1000", "train.max_steps=5",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip


def run_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def row(text: str, key: str) -> str:
    """The value of a report's row `key` ("" when it has none)."""
    found = [line.split(" | ", 1) for line in text.splitlines() if " | " in line]
    return next((v for k, v in found if k.strip() == key), "")


def test_export_and_predict_refuse_held_out_data_changed_since_the_run(tmp_path, capsys, monkeypatch):
    """The run's held-out file cut to its first 20 lines: export refused (its AUC would be of 20 other
    samples) as neorec eval refuses, and predict without --data too, neither writing a file; --data
    (the user's own data) and --no-eval still work. Read from another folder, the relative paths name
    other files: refused naming the folder to run from."""
    monkeypatch.chdir(tmp_path)
    lines = criteo_lines(200)
    Path("train.tsv").write_text("".join(lines[:150]))
    Path("eval.tsv").write_text("".join(lines[-50:]))
    assert main(["train", *sets(CRITEO), "--output-dir", "run"]) == 0
    recorded = json.loads(Path("run/summary.json").read_text())["eval_data"]["samples_digest"]
    code, out, err = run_cli(capsys, "export", "run", "--out", "c.nrx")
    assert code == 0 and row(out, "held-out data").startswith(f"the run's (samples digest {recorded}"), err
    assert read_header("c.nrx")["eval_data"]["samples_digest"] == recorded
    code, out, err = run_cli(capsys, "predict", "c.nrx", "--out", "p.txt")
    assert code == 0 and len(Path("p.txt").read_text().splitlines()) == 50, err
    assert row(out, "held-out data").startswith(f"the run's (samples digest {recorded}"), out

    Path("eval.tsv").write_text("".join(lines[-50:-30]))  # another held-out set under the run's name
    code, out, err = run_cli(capsys, "export", "run", "--out", "m.nrx")
    assert code == 2 and "the held-out samples its config names now differ from those the run" in err, err
    assert "--no-eval" in err and not Path("m.nrx").exists()
    code, out, err = run_cli(capsys, "predict", "c.nrx", "--out", "p2.txt")
    assert code == 2 and "the held-out samples its config names here differ from those its run" in err, err
    assert "--data" in err and not Path("p2.txt").exists() and not Path("p2.txt.tmp").exists()
    code, out, err = run_cli(capsys, "predict", "c.nrx", "--out", "p3.txt", "--data", "eval.tsv")
    assert code == 0 and len(Path("p3.txt").read_text().splitlines()) == 20 and "held-out data" not in out
    assert run_cli(capsys, "export", "run", "--out", "m.nrx", "--no-eval")[0] == 0

    Path("eval.tsv").write_text("".join(lines[-50:]))
    Path("other").mkdir()
    for name in ("train.tsv", "eval.tsv"):  # the run's files read from another folder: other files
        Path("other", name).write_text("".join(reversed(Path(name).read_text().splitlines(keepends=True))))
    monkeypatch.chdir(tmp_path / "other")
    code, out, err = run_cli(capsys, "export", "../run", "--out", "m.nrx")
    assert code == 2 and f"Run `neorec export` from {tmp_path}" in err, err
    code, out, err = run_cli(capsys, "predict", "../c.nrx", "--out", "p.txt")
    assert code == 2 and f"Run `neorec predict` from {tmp_path}" in err and not Path("p.txt").exists(), err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished synthetic run (its summary.json records its held-out data)."""
    root = tmp_path_factory.mktemp("heldout_tiny")
    assert main(["train", *sets(TINY), "--output-dir", str(root / "run")]) == 0
    return root / "run"


def test_a_run_without_a_record_is_exported_with_a_note(tiny_run, tmp_path):
    """A run whose summary.json records no held-out data (an earlier neorec's, or one stopped before its
    final evaluation) is measured with a note; the header keeps the digest of what was measured, which
    predict checks. An export without that header field (an earlier neorec's) is scored with a note."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    summary = json.loads((run / "summary.json").read_text())
    recorded = summary.pop("eval_data")["samples_digest"]
    (run / "summary.json").write_text(json.dumps(summary))
    report = export_model(run, tmp_path / "m.nrx")
    assert report.held_out.startswith("not checked against the run's") and "records none" in report.held_out
    assert "held-out data" in report_text(report) and "not checked" in report_text(report)
    assert read_header(tmp_path / "m.nrx")["eval_data"]["samples_digest"] == recorded  # the same samples
    result = predict_file(tmp_path / "m.nrx", tmp_path / "p.txt")
    assert result.held_out.startswith("those the export measured") and result.num_samples == 500

    header, tensors = read_export(tmp_path / "m.nrx")
    old = {k: v for k, v in header.items() if k not in ("eval_data", "tensors", "data_bytes", "data_crc32")}
    write_export(tmp_path / "old.nrx", old, tensors)
    result = predict_file(tmp_path / "old.nrx", tmp_path / "q.txt")
    assert result.held_out.startswith("not checked") and "not checked" in result_text(result)
    assert (tmp_path / "q.txt").read_text() == (tmp_path / "p.txt").read_text()
    (run / "summary.json").unlink()
    assert "records none" in export_model(run, tmp_path / "n.nrx").held_out


def test_a_config_choosing_other_held_out_data_is_measured_on_it_on_purpose(tiny_run, tmp_path):
    """--config with other held-out samples (as `neorec eval --set` may): measured on them, and said so;
    the export's header records what it measured, which predict then scores."""
    cfg = yaml.safe_load((tiny_run / "config.yaml").read_text())
    cfg["data"]["synthetic"]["eval_samples"] = 300
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(cfg))
    r = export_model(tiny_run, tmp_path / "m.nrx", config=tmp_path / "other.yaml")
    assert r.eval["fp32"]["num_samples"] == 300 and r.held_out.startswith("of --config"), r.held_out
    assert "data.synthetic.eval_samples" in r.held_out
    result = predict_file(tmp_path / "m.nrx", tmp_path / "p.txt")
    assert result.num_samples == 300 and result.held_out.startswith("those the export measured")


def test_predict_writes_gzip_under_a_gz_name(tiny_run, tmp_path, capsys):
    """--out pred.txt.gz: the predictions gzip-compressed (written atomically), which a later predict
    to the same name replaces as earlier predictions."""
    model = export_model(tiny_run, tmp_path / "m.nrx", measure=False).out
    for out in ("p.txt", "p.txt.gz", "p.txt.gz"):
        code, _, err = run_cli(capsys, "predict", model, "--out", tmp_path / out, "--with-labels")
        assert code == 0, err
    plain = (tmp_path / "p.txt").read_bytes()
    assert plain.startswith(b"probability,label\n")
    assert gzip.decompress((tmp_path / "p.txt.gz").read_bytes()) == plain
    assert not (tmp_path / "p.txt.gz.tmp").exists()


def test_an_empty_parquet_file_is_named_as_the_data(exports, tmp_path):  # noqa: F811 (the fixture)
    empty = write_parquet(tmp_path / "empty.parquet", 0, 3)
    with pytest.raises(DataError, match=r"--data .*empty\.parquet: its Parquet files hold no rows") as e:
        predict_file(exports / "fp32.nrx", tmp_path / "p.txt", data=empty)
    assert "data.parquet.paths" not in str(e.value) and "training rows" not in str(e.value)


def test_a_quantized_export_without_held_out_metrics_says_the_change_was_not_measured(tmp_path, capsys):
    """A followed stream has no held-out set: the report says the int2 tables' AUC change was not
    measured, why, and how to measure it; --no-eval says so too."""
    stream, run = tmp_path / "daily", tmp_path / "stream"
    assert main(["data", "stream", "--out", str(stream), "--days", "2", "--rows", "600"]) == 0
    quick = ["train.max_steps=3", "train.progress=false", "logging.plot=false", "logging.tensorboard=false"]
    follow = ["--config", "continuous", "--follow", stream, "--until", "day-000", "--output-dir", run]
    assert run_cli(capsys, "train", *follow, *sets(quick))[0] == 0
    code, out, err = run_cli(capsys, "export", run, "--out", tmp_path / "s.nrx", "--quantize", "int2")
    change = row(out, "AUC change int2 - fp32")
    assert code == 0 and change.startswith("not measured: the run followed a stream"), out + err
    assert f"neorec predict {tmp_path / 's.nrx'} --out q.txt --data FILE --with-labels" in change
    report = export_model(run, tmp_path / "t.nrx", quantize="int8", measure=False)
    assert row(report_text(report), "AUC change int8 - fp32").startswith("not measured: --no-eval")


def test_a_multitask_quantized_export_reports_each_tasks_auc_change(tmp_path):
    tasks = "model.tasks=[{name: click}, {name: conversion, weight: 0.5}]"
    cfg = load_config(None, [*SYNTHETIC, "model.arch=multitask", tasks, "train.max_steps=4"])
    Trainer(cfg, tmp_path / "run").fit()
    r = export_model(tmp_path / "run", tmp_path / "m.nrx", int8=True)
    text = report_text(r)
    for task in ("click", "conversion"):
        change = r.eval["int8"][f"{task}/auc"] - r.eval["fp32"][f"{task}/auc"]
        assert row(text, f"AUC change {task}/auc int8 - fp32") == f"{change:+.2e}", text
