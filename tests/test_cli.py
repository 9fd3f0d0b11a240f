"""The `neorec` command line: a user's mistake is one line `neorec: error: ...` (exit 2) before any work,
never a traceback; runs never overwrite each other silently; config show/keys; --version; strict JSON."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import neorec
from neorec.cli import main
from neorec.config.load import load_config
from neorec.serving import export_model
from neorec.train.run_folder import check_output_dir
from neorec.train.trainer import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"  # the held-out lines 10 and 20 are both label 0
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=1000", "data.synthetic.eval_samples=500", "data.batch_size=250",
    "train.max_steps=2", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip
CRITEO = ["data.source=criteo_tsv", "data.batch_size=4", "train.progress=false", "logging.plot=false",
          "logging.tensorboard=false"]  # fmt: skip


def sets(items: list[str]) -> list[str]:
    return [x for kv in items for x in ("--set", kv)]


def fails(capsys, argv: list[str], *words: str) -> str:
    """Run `neorec argv` in this process: exit 2 with one error line that holds `words`."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


# ---- flags and configs ------------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"neorec {neorec.__version__}"


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_nproc_below_one_is_refused(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["train", "--nproc", value])
    assert e.value.code == 2 and "--nproc: expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "--nproc", "0"], "--nproc: expected a whole number >= 1"),
        (["plan", "--time-budget", "-1"], "--time-budget: expected a number of seconds >= 0"),
        (["data", "inspect", "--batches", "-1"], "--batches: expected a whole number >= 0"),
        (["data", "preprocess", "x.tsv", "--out", "o", "--workers", "0"], "--workers: expected a whole number >= 1"),
        (["predict", "m.nrx", "--out", "p", "--batch-size", "0"], "--batch-size: expected a whole number >= 1"),
    ],
)
def test_counts_out_of_range_are_refused(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_what_every_process_would_fail_on_is_checked_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("not json")
    train = ["train", "--nproc", "2", *sets(TINY)]
    fails(capsys, [*train, "--set", "data.batch_size=251"], "data.batch_size 251", "must divide over 2 processes")
    fails(capsys, [*train, "--set", "distributed.plan=plan.json"], "sharding plan plan.json")
    fails(capsys, [*train, "--set", "embedding.tables={C9: {dim: 16}}"], "embedding.tables names ['C9']")
    fails(capsys, [*train, "--set", "distributed.sharding={C3: {kind: tw, ranks: [5]}}"], "rank(s) [5] do not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # nothing started


def test_config_mistakes_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    (tmp_path / "binary.yaml").write_bytes(b"\x00\xff\xfe\x80")
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "folder.yaml").mkdir()
    fails(capsys, ["train", "--set", "train.max_steps="], "train.max_steps", "empty value", "=null")
    fails(capsys, ["train", "--config", "empty.yaml"], "empty.yaml: empty config")
    fails(capsys, ["train", "--config", "binary.yaml"], "binary.yaml: not a YAML config")
    fails(capsys, ["train", "--config", "list.yaml"], "list.yaml: the top level must be a mapping")
    fails(capsys, ["train", "--config", "folder.yaml"], "folder.yaml: is a folder")
    fails(capsys, ["train", "--set", "train.epochs=true"], "train.epochs", "not a boolean")
    fails(capsys, ["train", *sets(TINY), "--set", "distributed.sharding={C99: {kind: tw, ranks: [0]}}"],
          "distributed.sharding names ['C99']", "tables: ['C1', 'C2', 'C3', 'C4']")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.yaml", "empty.yaml", "folder.yaml", "list.yaml"]


def test_config_show_prints_the_resolved_config_with_descriptions(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("base: movielens\nembedding: {dim: 32}\nmodel: {bottom_mlp: [32, 32]}\n")
    assert main(["config", "show", "--config", str(tmp_path / "mine.yaml"), "--set", "train.max_steps=9"]) == 0
    text = capsys.readouterr().out
    assert "  max_steps: 9  # stop after this many steps" in text
    assert "  source: movielens  # where batches come from" in text and "  dim: 32  # default embedding" in text
    (tmp_path / "shown.yaml").write_text(text)  # what it prints is a config that reads back the same
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(str(tmp_path / "mine.yaml"), ["train.max_steps=9"])


def test_config_keys_lists_type_default_and_allowed_values(capsys):
    assert main(["config", "keys"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "int (> 0), default 1: passes over the training data" in lines["train.epochs"]
    assert "(synthetic, criteo_tsv, movielens, shards, preprocessed, parquet), default synthetic" in lines["data.source"]
    assert "default [64, 16] (schema: [512, 256, 64, 16])" in lines["model.bottom_mlp"]
    assert "embedding.tables.<table>.dim" in lines and "data.criteo.train_paths" in lines


# ---- run folders -----------------------------------------------------------------------------------
def test_train_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["train", *sets(TINY), "--output-dir", str(run)]
    assert main(base) == 0
    capsys.readouterr()
    model = (run / "model.pt").read_bytes()
    fails(capsys, base, "holds a run already (summary.json, model.pt)", "--overwrite", "--output-dir")
    assert (run / "model.pt").read_bytes() == model
    fails(capsys, [*base, "--resume"], "no checkpoint", "--overwrite")
    fails(capsys, [*base, "--resume", "--overwrite"], "give one of them")
    stale = run / "checkpoints" / "step-00000099"
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text("{}")
    fails(capsys, base, "checkpoints in", "--resume to continue it", "--overwrite")
    assert main([*base, "--overwrite"]) == 0  # replaced: the other run's checkpoints are gone
    assert not stale.exists() and (run / "summary.json").is_file()
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    fails(capsys, ["train", "--output-dir", str(tmp_path / "file")], "is a file")
    ssd = ["embedding.tier=ssd", f"embedding.cache.directory={tmp_path / 'file'}"]
    fails(capsys, ["train", *sets(TINY + ssd), "--output-dir", str(tmp_path / "ssd")], "cache.directory", "is a file")


def test_output_paths_of_the_wrong_kind_are_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    fails(capsys, ["plan", "--output-dir", str(tmp_path / "file")], "--output-dir", "is a file")
    fails(capsys, ["data", "generate", "--out", str(tmp_path / "file")], "--out", "is a file")
    fails(capsys, ["data", "preprocess", str(FIXTURE), "--out", str(tmp_path / "file"), "--no-progress"], "is a file")
    fails(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "folder")], "--out", "is a folder")
    fails(capsys, ["predict", str(tmp_path / "m.nrx"), "--out", str(tmp_path / "folder")], "--out", "is a folder")
    # a file where a folder of the path must be
    fails(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "file" / "m.nrx")], "--out", "file is not a folder")


# ---- data ------------------------------------------------------------------------------------------
def test_empty_missing_or_folder_tsv_inputs_are_errors(tmp_path, capsys):
    empty, folder, empty_gz = tmp_path / "empty.tsv", tmp_path / "folder", tmp_path / "empty.tsv.gz"
    empty.write_text("")
    folder.mkdir()
    with gzip.open(empty_gz, "wb"):
        pass
    train = ["train", *sets(CRITEO), "--output-dir", str(tmp_path / "run")]
    fails(capsys, [*train, "--set", f"data.criteo.train_paths=[{empty}]"], f"{empty}: empty file")
    fails(capsys, [*train, "--set", f"data.criteo.train_paths=[{folder}]"], f"{folder}: is a folder")
    fails(capsys, [*train, "--set", f"data.criteo.train_paths=[{empty_gz}]"], f"{empty_gz}: empty file")
    assert not (tmp_path / "run" / "summary.json").exists()
    pre = ["data", "preprocess", "--no-progress", "--out"]
    fails(capsys, [*pre, str(tmp_path / "p1"), str(empty)], "empty file")
    fails(capsys, [*pre, str(tmp_path / "p2"), str(empty_gz)], "no lines")
    fails(capsys, [*pre, str(tmp_path / "p3"), str(folder)], "is a folder")
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\tnot-a-criteo-line\n" * 3)
    fails(capsys, [*pre, str(tmp_path / "p4"), str(bad), "--bad-lines", "skip"], "no training samples", "malformed")


def test_summary_json_is_strict_when_a_metric_is_nan(tmp_path, capsys):
    """Both held-out lines of the fixture are label 0: AUC is undefined (NaN), written as null."""
    assert main(["train", *sets([*CRITEO, f"data.criteo={{train_paths: [{FIXTURE}], table_rows: 100}}"]),
                 "--output-dir", str(tmp_path / "run")]) == 0  # fmt: skip

    def refuse(name: str):
        raise ValueError(f"summary.json holds {name}, which is not JSON")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=refuse)
    assert summary["eval_auc"] is None and summary["steps"] == 5


def test_predict_data_refuses_a_model_not_trained_on_hashed_criteo(tmp_path, capsys):
    cfg = load_config("default", [*TINY, "data.synthetic.num_sparse=26", "data.synthetic.rows=30"])
    Trainer(cfg, tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "m.nrx", measure=False)
    capsys.readouterr()
    fails(capsys, ["predict", str(tmp_path / "m.nrx"), "--out", str(tmp_path / "p.txt"), "--data", str(FIXTURE)],
          "trained on synthetic data (data.source: synthetic)", "not on hashed Criteo TSV", "leave out --data")  # fmt: skip
    assert not (tmp_path / "p.txt").exists()


def test_eval_of_a_followed_stream_says_it_has_no_held_out_set(tmp_path, capsys):
    """A followed stream's run has no held-out set (its batches were scored before they trained): eval
    says so and what to do, rather than wait for the stream's partitions or fail on no metrics."""
    from neorec.config.reference import show_config

    run = tmp_path / "stream"
    run.mkdir()
    cfg = load_config("continuous", [f"data.follow.dir={tmp_path / 'gone'}"])
    (run / "config.yaml").write_text(show_config(cfg))
    (run / "model.pt").write_bytes(b"")
    fails(capsys, ["eval", str(run)], "followed a stream (data.follow)", "no held-out set", "metrics.jsonl",
          "neorec predict")  # fmt: skip


def test_checkpoint_inspect_of_a_run_folder_reads_its_checkpoints(tmp_path, capsys):
    """A run folder stands for its checkpoint folder; one that saved none is said to, naming the settings."""
    run, bare = tmp_path / "run", tmp_path / "bare"
    Trainer(load_config("default", [*TINY, "checkpoint.every_steps=1"]), run).fit()
    Trainer(load_config("default", TINY), bare).fit()
    assert main(["checkpoint", "inspect", str(run)]) == 0
    assert f"checkpoint  {run / 'checkpoints' / 'step-00000002'}" in capsys.readouterr().out
    fails(capsys, ["checkpoint", "inspect", str(bare)], f"{bare}: a run folder whose checkpoints",
          "hold no complete checkpoint", "checkpoint.every_steps")  # fmt: skip


@pytest.mark.parametrize("flag", ["--config", "-c", "--output-dir"])
def test_an_empty_path_is_refused_not_taken_as_the_default(tmp_path, capsys, flag):
    """`-c "$CFG"` with CFG unset trained the default config, `--output-dir ""` wrote into the config's
    output_dir: an empty path is a mistake."""
    with pytest.raises(SystemExit) as stopped:  # argparse's mistakes (neorec.cli_args.Parser)
        main(["train", flag, "", "--set", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("neorec: error: argument --") and "expected a path, got an empty one" in err, err


def test_until_without_a_stream_says_so(capsys):
    """--until alone was refused as a missing key data.follow.dir, which names no flag."""
    fails(capsys, ["train", "--until", "day-001"], "--until NAME ends a followed stream", "add --follow DIR")


def test_outputs_never_take_a_place_a_run_folder_keeps(tmp_path, capsys):
    """export, export-dcp and predict refuse --out named as a run's own file or folder inside the run
    folder, even one not there yet (an export named checkpoints would block the run's resume), or
    anywhere inside one of them (a checkpoint's manifest; an export in a step folder would be pruned),
    a run's lock file (replaced, a second run could train there at once), anything inside another
    folder a run locks, and an existing file that is not earlier predictions (a config)."""
    run, m = tmp_path / "run", tmp_path / "m.nrx"
    Trainer(load_config("default", [*TINY, "checkpoint.every_steps=1"]), run).fit()
    export_model(run, m, measure=False)
    capsys.readouterr()
    for argv, name in (
        (["export", str(run), "--out", str(run / "curves.png")], "curves.png"),
        (["export", str(run), "--out", str(run / "snapshots"), "--format", "pt2"], "snapshots"),
        (["checkpoint", "export-dcp", str(run), "--out", str(run / "snapshots")], "snapshots"),
        (["predict", str(m), "--out", str(run / "tensorboard")], "tensorboard"),
    ):
        fails(capsys, argv, f"is where the run in {run} keeps its {name}")
        assert not (run / name).exists()
    step = run / "checkpoints" / "step-00000002"
    before = (step / "manifest.json").read_bytes()
    pt2 = ["export", str(run), "--out", str(step.with_name("step-00000099")), "--format", "pt2"]
    for argv in (["predict", str(m), "--out", str(step / "p.txt")], pt2,
                 ["predict", str(m), "--out", str(step / "manifest.json")]):  # fmt: skip
        fails(capsys, argv, f"is inside where the run in {run} keeps its checkpoints")
    not_predictions = "is a file that is not earlier predictions"
    assert (step / "manifest.json").read_bytes() == before and not step.with_name("step-00000099").exists()
    for folder in (run, tmp_path / "elsewhere"):  # a run's lock file; a folder a run locks (checkpoint.dir)
        folder.mkdir(exist_ok=True)
        (folder / "neorec.lock").write_text("held\n")
    fails(capsys, ["predict", str(m), "--out", str(run / "neorec.lock")], "is the lock file of the run in")
    elsewhere = tmp_path / "elsewhere" / "p.txt"
    fails(capsys, ["predict", str(m), "--out", str(elsewhere)], "a folder a run writes")
    (tmp_path / "my.yaml").write_text("data:\n  batch_size: 4\n")
    fails(capsys, ["predict", str(m), "--out", str(tmp_path / "my.yaml")], not_predictions)
    assert (run / "neorec.lock").read_text() == "held\n"
    assert (tmp_path / "my.yaml").read_text().startswith("data")
    assert main(["export", str(run), "--out", str(run / "m.nrx")]) == 0  # a name of its own is fine
    # a project folder holding a config.yaml of the user's own is no run: its snapshots/ is theirs
    project = tmp_path / "project"
    (project / "snapshots").mkdir(parents=True)
    (project / "config.yaml").write_text("base: default\n")
    assert main(["export", str(run), "--out", str(project / "snapshots" / "m.nrx")]) == 0
    check_output_dir(project / "checkpoints" / "exp1", load_config("default", TINY))
    for _ in range(2):  # earlier predictions (one probability a line) are replaced
        assert main(["predict", str(m), "--out", str(run / "p.txt")]) == 0
    (run / "p.txt").write_text("click,conversion\n0.5,0.25\n")  # a multi-task model's, with a header
    assert main(["predict", str(m), "--out", str(run / "p.txt"), "--with-labels"]) == 0


# ---- from a shell ----------------------------------------------------------------------------------
def test_console_script_prints_errors_without_traceback(tmp_path):
    exe = shutil.which("neorec") or pytest.skip("the neorec console script is not installed")
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "out").mkdir()
    for argv in (
        ["train", "--set", "train.max_steps="],
        ["train", "--nproc", "0"],
        ["train", "--set", "data.source=criteo_tsv", "--set", "data.criteo.train_paths=[empty.tsv]"],
        ["predict", "missing.nrx", "--out", "out"],
    ):
        p = subprocess.run([exe, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (argv, p.stderr)
        assert p.stderr.strip().splitlines()[-1].startswith("neorec"), (argv, p.stderr)
    v = subprocess.run([sys.executable, "-m", "neorec", "--version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and v.stdout.strip() == f"neorec {neorec.__version__}"


def test_a_config_mistake_is_told_before_torch_is_imported():
    """`neorec train` validates the config first: a mistake costs the user no wait for torch's import
    (seconds on a small machine), and the error report does not import it either."""
    code = (
        "import sys; from neorec.cli import main; "
        "code = main(['train', '--set', 'train.max_steps=']); print(code, 'torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["2", "False"], (p.stdout, p.stderr[-2000:])
    assert "train.max_steps" in p.stderr
