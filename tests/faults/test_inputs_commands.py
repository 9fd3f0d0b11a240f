"""Inputs that commands once reported with a traceback, a misleading message or not at all, through the
real command line in this process: a model.pt that does not fit its run's config (export), an export
file whose dense layers do not fit its header (predict), damaged .gz inputs, files that cannot be read
(a TSV, model.pt: PermissionError and EIO raised by a patched `open`, since the tests run as root),
`--config`/`--set` where they mean nothing, numeric flags out of bounds and a config of 60,000 unknown
keys. Each is one `neorec: error:` line naming the file, flag or key, exit 2 for bad input and 1 for a
failing disk, never a traceback; nothing is written."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from tiny_cli import TINY, sets

from neorec.cli import main
from neorec.config.load import load_config
from neorec.errors import NeorecError
from neorec.serving import export_model
from neorec.serving.file_format import read_export, write_export
from neorec.train.trainer import Trainer

FIXTURE_TSV = Path(__file__).parents[1] / "fixtures" / "criteo_20.tsv"
TINY_RUN = [kv for kv in TINY if not kv.startswith("data.synthetic.")]  # for a run on other data
CRITEO_RUN = [
    "data.source=criteo_tsv", f"data.criteo={{train_paths: [{FIXTURE_TSV}], table_rows: 1000, hashing: hash}}",
    "data.batch_size=8", "train.max_steps=1", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip


def one_line(capsys, code: int, want: int, *words: str, absent: tuple[str, ...] = ()) -> str:
    """Exit `want`, exactly one error line holding every word and none of `absent`, no traceback."""
    err = capsys.readouterr().err
    assert code == want, err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert len(err) < 1200, err
    for w in words:
        assert w in err, err
    for w in absent:
        assert w not in err, err
    return err


def run_main(argv: list[str]) -> int:
    """`neorec argv`; argparse's mistakes exit through SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished tiny synthetic run."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", *sets(TINY), "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def criteo_model(tmp_path_factory) -> Path:
    """The export of a run on hashed Criteo TSV, which `neorec predict --data` scores TSV files with."""
    root = tmp_path_factory.mktemp("criteo")
    # the data its config names, which predict reads by default
    day = shutil.copy(FIXTURE_TSV, root / "day.tsv")
    # trained skipping bad lines, which predict skips none of
    sets = [*CRITEO_RUN, f"data.criteo.train_paths=[{day}]", "data.criteo.bad_lines=skip"]
    Trainer(load_config("default", sets), root / "run").fit()
    export_model(root / "run", root / "m.nrx", measure=False)
    return root / "m.nrx"


def unreadable(monkeypatch, path: Path, code: int = errno.EACCES) -> None:
    """Opening `path` fails with `code` (EACCES: as for a file of mode 000 and a user who is not root)."""
    target = os.path.abspath(path)

    def patched(real):
        def open_(file, *args, **kwargs):
            if isinstance(file, str | Path) and os.path.abspath(file) == target:
                raise OSError(code, os.strerror(code), str(file))
            return real(file, *args, **kwargs)

        return open_

    monkeypatch.setattr(builtins, "open", patched(builtins.open))
    monkeypatch.setattr(io, "open", patched(io.open))  # zipfile's


def fake_gz(path: Path) -> Path:
    """A gzip header, then bytes that are no deflate stream."""
    path.write_bytes(b"\x1f\x8b\x08" + bytes((i * 151 + 7) % 256 for i in range(1000)))
    return path


# ---- export and predict never write over what they read --------------------------------------------------
@pytest.mark.parametrize("target", ["model.pt", "config.yaml"])
@pytest.mark.parametrize("format", ["nrx", "aoti"])
def test_export_does_not_write_over_a_file_that_is_not_an_earlier_export(
    run, tmp_path, capsys, target, format
):
    """`--out RUN/model.pt` replaced the trained model with the export; an export file replaces only an
    earlier export of its format."""
    root = Path(shutil.copytree(run, tmp_path / "run"))
    out = root / target if format == "nrx" else (root / target).with_suffix(".pt2")
    if format == "aoti":
        shutil.copy(root / target, out)  # the same bytes under the package's suffix
    before = out.read_bytes()
    code = run_main(["export", str(root), "--out", str(out), "--format", format, "--no-eval"])
    one_line(capsys, code, 2, f"--out {out}: is a file that is not", "give a new path")
    assert out.read_bytes() == before
    export = tmp_path / "m.nrx"
    for _ in range(2):  # an earlier export is replaced
        assert run_main(["export", str(root), "--out", str(export), "--no-eval"]) == 0
    capsys.readouterr()


def test_predict_does_not_write_over_its_model_its_data_or_any_model(criteo_model, run, tmp_path, capsys):
    model = Path(shutil.copy(criteo_model, tmp_path / "m.nrx"))
    data = Path(shutil.copy(FIXTURE_TSV, tmp_path / "day.tsv"))
    for out, data_flag, words in [
        (model, [], ["is the model this command reads"]),
        (data, ["--data", str(data)], ["is the data this command reads"]),
        (run / "model.pt", [], ["is a model file; predictions never replace one"]),
        (criteo_model.parent / "day.tsv", [], ["is the model's data (", "data.source criteo_tsv"]),
    ]:
        before = out.read_bytes()
        code = run_main(["predict", str(model), *data_flag, "--out", str(out)])
        one_line(capsys, code, 2, f"--out {out}: {words[0]}", *words[1:])
        assert out.read_bytes() == before
    for _ in range(2):  # earlier predictions are replaced
        assert run_main(["predict", str(model), "--data", str(data), "--out", str(tmp_path / "p.txt")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "settings",
    [
        {"source": "shards", "shards_dir": "{d}"},
        {"source": "preprocessed", "preprocessed": {"path": "{d}"}},
        {"source": "movielens", "movielens": {"root": "{d}"}},
        {"source": "parquet", "parquet": {"paths": ["{d}/sub"], "eval_paths": ["{d}"], "features": ["a"]}},
    ],
)
def test_predictions_never_replace_a_file_in_the_models_data_folders(tmp_path, settings):
    """Without --data, predict scores the data its model's config names; --out inside one of its folders
    is refused (a file of a MovieLens, shards or Parquet folder was replaced by the predictions)."""
    from neorec.config.data import DataConfig
    from neorec.serving.predict import _check_not_in_data

    data = DataConfig.model_validate(yaml.safe_load(str(settings).replace("{d}", str(tmp_path))))
    (tmp_path / "sub").mkdir()
    for inside in (tmp_path / "sub" / "ratings.csv", tmp_path / "ratings.csv"):
        inside.write_text("userId,movieId,rating,timestamp\n")
        with pytest.raises(NeorecError, match=f"--out {inside}: is in the model's data"):
            _check_not_in_data(inside, data)
    _check_not_in_data(tmp_path.parent / "elsewhere.txt", data)  # a path outside them is fine


def test_plan_does_not_write_over_a_runs_files(run, tmp_path, capsys):
    """`neorec plan --output-dir RUN` replaced the run's summary.json (its final metrics) and plan.json;
    a folder an earlier plan wrote is written again."""
    root = Path(shutil.copytree(run, tmp_path / "run"))
    before = (root / "summary.json").read_bytes()
    code = run_main(["plan", *sets(TINY), "--batches", "1", "--output-dir", str(root)])
    one_line(capsys, code, 2, f"--output-dir {root}: holds a run (config.yaml", "give another folder")
    assert (root / "summary.json").read_bytes() == before and not (root / "report.txt").exists()
    for _ in range(2):
        assert run_main(["plan", *sets(TINY), "--batches", "1", "--output-dir", str(tmp_path / "plan")]) == 0
    assert (tmp_path / "plan" / "report.txt").is_file()
    capsys.readouterr()


def test_a_calibration_replaces_only_an_earlier_one(run, tmp_path, capsys):
    """`neorec plan --calibrate --calibration RUN/model.pt` replaced the trained model with the speeds
    of this machine; refused before anything is measured, naming --calibration."""
    from neorec.planner.calibrate import check_calibration_target

    root = Path(shutil.copytree(run, tmp_path / "run"))
    for target, words in [(root / "model.pt", "is a file that is not a calibration"),
                          (root / "summary.json", "is a file that is not a calibration"),
                          (root, "is a folder")]:  # fmt: skip
        before = target.read_bytes() if target.is_file() else None
        code = run_main(["plan", "--calibrate", "--nproc", "2", "--calibration", str(target)])
        one_line(capsys, code, 2, f"--calibration {target}: {words}")
        assert before is None or target.read_bytes() == before
    for damaged in (b"[1, 2]", b'{"lookup_bandwidth": NaN}', b"\xff\xfe not text"):  # an earlier one, damaged
        (tmp_path / "calibration.json").write_bytes(damaged)
        check_calibration_target(tmp_path / "calibration.json")
    check_calibration_target(tmp_path / "new.json")


# ---- export and predict: dense layers that do not fit the config ---------------------------------------
@pytest.mark.parametrize(
    "change, words",
    [
        ({"model.top_mlp": [32]}, ["top."]),
        ({"model.arch": "dcnv2"}, ["cross"]),
        (
            {"data.synthetic.num_sparse": 3, "data.synthetic.rows": [50, 300, 7]},
            ["top.0.weight", "[128, 26] in the file, [128, 22] in the model"],
        ),
    ],
)
@pytest.mark.parametrize("format", ["nrx", "pt2"])
def test_export_of_a_model_pt_that_does_not_fit_its_config(run, tmp_path, capsys, change, words, format):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    cfg = yaml.safe_load((bad / "config.yaml").read_text())
    for key, value in change.items():
        *sections, name = key.split(".")
        node = cfg
        for section in sections:
            node = node[section]
        node[name] = value
    (bad / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = tmp_path / ("w.nrx" if format == "nrx" else "w")
    code = main(["export", str(bad), "--out", str(out), "--no-eval", "--format", format])
    one_line(capsys, code, 2, "model.pt", "do not fit", "--config", *words, absent=("checkpoint",))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_predict_with_an_export_whose_dense_layers_do_not_fit_its_header(run, tmp_path, capsys):
    export_model(run, tmp_path / "good.nrx", measure=False)
    header, tensors = read_export(tmp_path / "good.nrx")
    cfg = yaml.safe_load(header["config"])
    cfg["model"]["top_mlp"] = [32]
    write_export(tmp_path / "bad.nrx", {**header, "config": yaml.safe_dump(cfg)}, tensors)
    code = main(["predict", str(tmp_path / "bad.nrx"), "--out", str(tmp_path / "p.txt")])
    one_line(
        capsys,
        code,
        2,
        "export file",
        "bad.nrx",
        "do not fit",
        "export the run again",
        absent=("checkpoint",),
    )
    assert not (tmp_path / "p.txt").exists()


# ---- damaged .gz inputs ----------------------------------------------------------------------------------
def test_a_damaged_gz_file_as_input_of_every_command_that_reads_tsv(criteo_model, tmp_path, capsys):
    fake = fake_gz(tmp_path / "fake.gz")
    out = tmp_path / "out"
    code = main(["predict", str(criteo_model), "--data", str(fake), "--out", str(out / "p.txt")])
    one_line(capsys, code, 2, "fake.gz", "cannot read after line 0", "damaged or truncated gzip")
    code = main(["data", "preprocess", str(fake), "--out", str(out / "pre"), "--no-progress"])
    one_line(capsys, code, 2, "fake.gz", "cannot read after line 0", "damaged or truncated gzip")
    criteo = ["data.source=criteo_tsv", f"data.criteo.train_paths=[{fake}]", "data.criteo.table_rows=100"]
    code = main(["train", *sets([*TINY_RUN, *criteo]), "--output-dir", str(out / "run")])
    one_line(capsys, code, 2, "fake.gz", "line", "damaged or truncated gzip")
    assert not (out / "p.txt").exists() and not (out / "pre" / "manifest.json").exists()


def test_predict_scores_every_line_whatever_the_model_skipped_in_training(criteo_model, tmp_path, capsys):
    """A model trained with data.criteo.bad_lines skip skipped a bad line of --data too, so the
    predictions' lines no longer matched the data's, and the error of one trained with fail named
    options predict does not have. A bad line is an error naming it, and nothing is written."""
    lines = FIXTURE_TSV.read_text().splitlines(keepends=True)
    data = tmp_path / "day.tsv"
    data.write_text("".join(lines[:3]) + lines[3].rstrip("\n") + "\textra\n" + "".join(lines[4:]))
    code = main(["predict", str(criteo_model), "--data", str(data), "--out", str(tmp_path / "p.txt")])
    words = (f"{data}:4", "scored line by line, one prediction a line")
    one_line(capsys, code, 2, *words, absent=("--bad-lines",))
    assert not (tmp_path / "p.txt").exists()


# ---- files that cannot be read ---------------------------------------------------------------------------
def test_predict_names_the_data_file_it_cannot_read(criteo_model, tmp_path, capsys, monkeypatch):
    data = shutil.copy(FIXTURE_TSV, tmp_path / "secret.tsv")
    unreadable(monkeypatch, data)
    code = main(["predict", str(criteo_model), "--data", str(data), "--out", str(tmp_path / "p.txt")])
    one_line(capsys, code, 2, "secret.tsv", "Permission denied", absent=("write", "p.txt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.tsv"]


def test_train_on_an_unreadable_tsv_is_refused_before_the_run_folder_is_written(
    tmp_path, capsys, monkeypatch
):
    data = shutil.copy(FIXTURE_TSV, tmp_path / "secret.tsv")
    unreadable(monkeypatch, data)
    criteo = ["data.source=criteo_tsv", f"data.criteo.train_paths=[{data}]", "data.criteo.table_rows=100"]
    code = main(["train", *sets([*TINY_RUN, *criteo]), "--output-dir", str(tmp_path / "run")])
    one_line(capsys, code, 2, "secret.tsv", "cannot be read", "Permission denied")
    assert (
        not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    )


@pytest.mark.parametrize(
    "code, exit_code, words",
    [(errno.EACCES, 2, "Permission denied; check its permissions"), (errno.EIO, 1, "Input/output error")],
)
@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_model_pt_that_cannot_be_read_is_not_called_damaged(
    run, tmp_path, capsys, monkeypatch, code, exit_code, words, command
):
    unreadable(monkeypatch, run / "model.pt", code)
    argv = ["eval", str(run)] if command == "eval" else ["export", str(run), "--out", str(tmp_path / "m.nrx")]
    one_line(capsys, main(argv), exit_code, "cannot read model file", "model.pt", words, absent=("damaged",))


# ---- options where they mean nothing, flags out of bounds ---------------------------------------------
@pytest.mark.parametrize(
    "options, words",
    [
        (["--config", "/nonexistent.yaml"], "--config describes"),
        (["--set", "bogus.key=1"], "--set describes"),
        (["--set", "data.batch_size=8", "--config", "default"], "--config describes"),
    ],
)
def test_preprocessing_tsv_refuses_config_options(tmp_path, capsys, options, words):
    code = main(
        ["data", "preprocess", str(FIXTURE_TSV), "--out", str(tmp_path / "pre"), "--no-progress", *options]
    )
    one_line(capsys, code, 2, words, "--synthetic or --parquet")
    assert not (tmp_path / "pre").exists()


@pytest.mark.parametrize(
    "mode, options, words",
    [
        ("--synthetic", ["--table-rows", "5"], "--table-rows describes Criteo TSV preprocessing; --synthetic"),
        ("--parquet", ["--hashing", "hash", "--bad-lines", "skip"], "--hashing, --bad-lines describe"),
        ("--synthetic", ["--eval-paths", "x.tsv"], "--eval-paths"),
        ("--synthetic", ["--shard-lines", "5"], "--shard-lines applies to Criteo TSV and Parquet input"),
    ],
)
def test_synthetic_and_parquet_preprocessing_refuse_tsv_flags(tmp_path, capsys, mode, options, words):
    """Flags that only Criteo TSV preprocessing reads are refused by the others, not ignored."""
    code = main(["data", "preprocess", mode, "--out", str(tmp_path / "pre"), "--no-progress", *options])
    one_line(capsys, code, 2, words)
    assert not (tmp_path / "pre").exists()


@pytest.mark.parametrize(
    "options, words",
    [
        (["--eval-paths", "EVAL", "--eval-every", "5"], "--eval-every holds out lines of the training files"),
        (["--vocab-threshold", "2", "--hashing", "hash"], "--hashing hash values into tables; --vocab"),
        (["--vocab-threshold", "2", "--table-rows", "50"], "--table-rows hash values into tables"),
    ],
)
def test_tsv_flags_another_flag_switches_off_are_refused(tmp_path, capsys, options, words):
    evals = tmp_path / "eval.tsv"
    evals.write_bytes(FIXTURE_TSV.read_bytes())
    options = [str(evals) if o == "EVAL" else o for o in options]
    argv = ["data", "preprocess", str(FIXTURE_TSV), "--out", str(tmp_path / "pre"), "--no-progress"]
    one_line(capsys, main([*argv, *options]), 2, words)
    assert not (tmp_path / "pre").exists()


def test_stream_partitions_stop_where_their_names_stop_sorting_in_day_order(tmp_path, capsys):
    """day-1000 would sort before day-999 (and train before it under data.follow.order: name)."""
    code = run_main(["data", "stream", "--out", str(tmp_path / "d"), "--first-day", "999", "--days", "2"])
    one_line(capsys, code, 2, "partitions are named day-000 .. day-999", "at most 999")
    assert not (tmp_path / "d" / "day-999").exists()


HUGE = "1" + "0" * 20
FLAGS = [  # (argv, words of the error)
    (["plan", "--nproc", "1000000000", "--cluster", "a100-node"], "--nproc: expected a whole number >= 1 and at most 4096"),
    (["plan", "--ranks-per-node", HUGE], "--ranks-per-node"),
    (["plan", "--calibrate", "--threads", "1000000000"], "--threads: expected a whole number >= 1 and at most"),
    (["plan", "--calibrate", "--nproc", "4096"], "calibration starts that many processes"),
    (["plan", "--batches", HUGE], "--batches"),
    (["plan", "--time-budget", "nan"], "--time-budget"),
    (["plan", "--time-budget", "1e300"], "at most 86400"),
    (["train", "--nproc", "1000000"], "--nproc"),
    (["predict", "m.nrx", "--out", "p", "--batch-size", HUGE], "--batch-size"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--table-rows", HUGE], "--table-rows"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--table-rows", "9" * 5000], "(5000 characters)"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--eval-every", HUGE], "--eval-every"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--shard-lines", HUGE], "--shard-lines"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--vocab-threshold", "-3"], "--vocab-threshold"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--max-line-bytes", HUGE], "--max-line-bytes"),
    (["data", "preprocess", "x.tsv", "--out", "o", "--workers", "1000000"], "--workers"),
    (["data", "stream", "--out", "s", "--rows", HUGE], "--rows"),
    (["data", "stream", "--out", "s", "--first-day", HUGE], "--first-day"),
    (["data", "stream", "--out", "s", "--seed", HUGE], "--seed"),
    (["data", "inspect", "--batches", HUGE], "--batches"),
    (["checkpoint", "export-dcp", "r", "--out", "d", "--row-state-columns", "C1=0,-5"], "--row-state-columns"),
    (["train", "--nproc", "x" * 100_000], "(100000 characters)"),
    (["train", "--unknown-flag", "y" * 100_000], "unrecognized arguments"),
]  # fmt: skip


def test_numeric_flags_are_bounded(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, words in FLAGS:
        one_line(capsys, run_main(argv), 2, words)
    assert list(tmp_path.iterdir()) == []


# ---- error lines are bounded ---------------------------------------------------------------------------------
def test_a_config_of_60000_unknown_keys_is_one_short_line(tmp_path, capsys):
    path = tmp_path / "keys.yaml"
    path.write_text("train:\n" + "".join(f"  k{i}: 1\n" for i in range(60_000)))
    err = one_line(
        capsys, main(["config", "show", "--config", str(path)]), 2, "60000 problems", "and 59995 more"
    )
    assert "unknown key 'train.k0'" in err


def test_no_error_line_is_longer_than_4000_characters(capsys, monkeypatch):
    def quoting_a_megabyte(args) -> int:
        raise NeorecError("start " + "x" * 1_000_000 + " end")

    monkeypatch.setattr("neorec.cli.cmd_config_keys", quoting_a_megabyte)
    assert main(["config", "keys"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: start") and err.endswith(" end\n") and err.count("\n") == 1
    assert len(err) < 4100 and "(1000010 characters in all)" in err


def test_generated_shards_replace_only_earlier_ones(run, tmp_path, capsys):
    """`neorec data generate --out RUN` wrote its .npz files and meta.json among a run's files; a folder
    holding other files is refused, and an earlier, larger set is replaced whole."""
    root = Path(shutil.copytree(run, tmp_path / "run"))
    before = sorted(p.name for p in root.iterdir())
    code = run_main(["data", "generate", *sets(TINY), "--out", str(root)])
    one_line(capsys, code, 2, f"--out {root}: holds files that `neorec data generate` does not write (config")
    assert sorted(p.name for p in root.iterdir()) == before
    out = tmp_path / "shards"
    for samples in (3000, 1000):  # the second set is smaller: the first's extra files go
        assert run_main(["data", "generate", *sets([*TINY, f"data.synthetic.train_samples={samples}"]),
                         "--out", str(out)]) == 0  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted([*meta["files"], "meta.json"])
    capsys.readouterr()


def test_a_complete_stream_partition_is_never_written_again(tmp_path, capsys):
    """`neorec data stream` wrote over day-000 of an earlier stream, which a follower may have trained
    on as it was; an unfinished partition (no _SUCCESS) is written again, and the next days continue
    the stream of the seed and size it was written with (OUT/_stream.json)."""
    out = tmp_path / "daily"
    assert run_main(["data", "stream", "--out", str(out), "--days", "2", "--rows", "500"]) == 0
    before = (out / "day-001" / "part-0.parquet").read_bytes()
    (out / "day-000" / "_SUCCESS").unlink()  # a stream stopped while writing day-000
    code = run_main(["data", "stream", "--out", str(out), "--days", "2", "--rows", "500", "--seed", "7"])
    one_line(capsys, code, 2, f"--out {out}: partition day-001 is complete already", "--first-day")
    assert (out / "day-001" / "part-0.parquet").read_bytes() == before
    stream = ["data", "stream", "--out", str(out), "--days", "1", "--rows", "500"]
    assert run_main(stream) == 0 and run_main([*stream, "--first-day", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["_stream.json", "day-000", "day-001", "day-002"]
    capsys.readouterr()
    # the next days of another stream (another seed or size) would join this one without a word
    for other in (["--seed", "7"], ["--rows", "400"]):
        code = run_main([*stream, "--first-day", "3", *other])
        one_line(capsys, code, 2, f"its partitions were written with {other[0]} ", "need the same")
    assert not (out / "day-003").exists()


def test_a_stream_is_not_written_among_other_files(run, tmp_path, capsys):
    """`neorec data stream --out RUN` wrote its day folders among a run's files (and a follower of the
    folder then trained them); a folder holding files a stream does not write is refused, untouched."""
    root = Path(shutil.copytree(run, tmp_path / "run"))
    before = sorted(p.name for p in root.iterdir())
    code = run_main(["data", "stream", "--out", str(root), "--days", "1", "--rows", "200"])
    one_line(capsys, code, 2, f"--out {root}: holds files that `neorec data stream` does not write (config")
    assert sorted(p.name for p in root.iterdir()) == before
    out = tmp_path / "daily"
    out.mkdir()
    (out / ".hidden").write_text("")  # hidden names are skipped by followers, and allowed
    assert run_main(["data", "stream", "--out", str(out), "--days", "1", "--rows", "200"]) == 0
    capsys.readouterr()
