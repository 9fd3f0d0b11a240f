"""Resuming a checkpoint that the run cannot continue exactly: a Parquet (or preprocessed-shard) reader's
position belongs to the number of processes, seed and shuffle settings it was saved under. Another
number of processes is refused before anything is said or done: no process launched, no "resumed from"
line, no table loaded, the run's metrics untouched; one `neorec: error:` line naming the checkpoint and
--nproc. Any other checkpoint the run cannot continue (another model, optimizer, tables or seed) is refused
in one line with the run folder as it was."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from neorec.cli import main

QUIET = [
    "train.progress=false",
    "logging.plot=false",
    "logging.tensorboard=false",
    "data.eval_batch_size=200",
]


def sets(items: list[str]) -> list[str]:
    return [x for kv in items for x in ("--set", kv)]


@pytest.fixture(scope="module")
def parquet_config(tmp_path_factory) -> Path:
    """400 rows in row groups of 100 (every 5th held out), two dense and two id columns, as a config."""
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    n = 400
    table = pa.table({
        "label": rng.integers(0, 2, n), "d0": rng.random(n), "d1": rng.random(n),
        "C1": rng.integers(0, 50, n), "C2": rng.integers(0, 30, n), "is_eval": np.arange(n) % 5 == 0,
    })  # fmt: skip
    pq.write_table(table, root / "data.parquet", row_group_size=100)
    config = {
        "data": {"source": "parquet", "batch_size": 40, "parquet": {
            "paths": [str(root / "data.parquet")], "eval_column": "is_eval", "dense": ["d0", "d1"],
            "features": ["C1", "C2"], "table_rows": 50, "shuffle": True}},
    }  # fmt: skip
    (root / "parquet.yaml").write_text(json.dumps(config))  # JSON is YAML
    return root / "parquet.yaml"


def test_resuming_a_parquet_checkpoint_on_another_number_of_processes(parquet_config, tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    first = [
        "train",
        "--config",
        str(parquet_config),
        *sets([*QUIET, "train.max_steps=3", "checkpoint.every_steps=2"]),
    ]
    assert main([*first, "--output-dir", str(run)]) == 0
    capfd.readouterr()
    metrics = (run / "metrics.jsonl").read_bytes()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    again = ["train", "--config", str(parquet_config), *sets([*QUIET, "train.max_steps=6"]), "--nproc", "2"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torchrun's agent sets it: it must not stay
    environment = dict(os.environ)
    code = main([*again, "--output-dir", str(run), "--resume"])
    out, err = capfd.readouterr()
    # the in-process launch (torchrun's agent) puts back the caller's signal handlers and environment
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert dict(os.environ) == environment
    assert code == 2 and "Traceback" not in err, err
    assert "resumed from" not in out + err and "launching" not in out + err, err  # refused before any launch
    lines = [line for line in err.splitlines() if line.startswith("neorec: error:")]
    assert len(lines) == 1, err
    assert checkpoints[-1] in lines[0] and "number of processes (--nproc) 1, this run has 2" in lines[0], err
    assert (run / "metrics.jsonl").read_bytes() == metrics  # not cut back to the checkpoint's lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints


@pytest.mark.parametrize(
    "change, expected",
    [
        (["model.arch=dcnv2"], "the dense model does not fit: size mismatch for"),
        (["embedding.optimizer.name=adam"], "another embedding optimizer"),
        (["data.synthetic.rows=[60, 300, 7, 100]"], "data.synthetic.rows [50, 300, 7, 100], this"),
        (["seed=5"], "seed 0, this run has 5: resuming exactly needs the same seed"),
        (["data.synthetic.zipf_alpha=1.3"], "data.synthetic.zipf_alpha 1.1, this run has 1.3"),
        (["data.synthetic.generator=device"], "on_device, else host) 'host', this run has 'device'"),
        (["train.dense_optimizer.name=sgd"], "train.dense_optimizer.name adam, this run has sgd: its state"),
        (["embedding.pooling=mean"], "table 'C1' has pooling sum in its manifest.json but mean in the model"),
        (["train.max_steps=1"], "train.max_steps 1 is below step 2 of checkpoint"),
    ],
)
def test_a_refused_resume_leaves_the_run_folder_as_it_was(change, expected, tmp_path, capfd):
    """A checkpoint the changed config cannot continue is refused in one line, and the finished run's
    config.yaml, plan and metrics stay those of its model.pt (`neorec eval` still reads it)."""
    from tests.tiny_cli import TINY

    run = tmp_path / "run"
    base = ["train", "--output-dir", str(run), *sets([*TINY, "checkpoint.every_steps=2"])]
    assert main(base) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "neorec.lock"}
    capfd.readouterr()
    code = main([*base, *sets(["train.max_steps=4", *change]), "--resume"])
    _, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("neorec: error:"), err
    assert expected in lines[0], err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "neorec.lock"} == before
    assert main(["eval", str(run)]) == 0


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_past_max_steps_is_refused_before_any_process_starts(nproc, tmp_path, capfd, monkeypatch):
    """With --nproc 2 the workers started, planned and built their tables (about 28 s) before each
    refused the checkpoint past train.max_steps; the launcher refuses it, as one process does."""
    from tests.tiny_cli import TINY

    run = tmp_path / "run"
    base = ["train", "--output-dir", str(run), *sets([*TINY, "checkpoint.every_steps=2"])]
    assert main(base) == 0
    capfd.readouterr()

    def started(*args, **kwargs):
        raise AssertionError("a process started")

    monkeypatch.setattr("neorec.distributed.launch.launch_torchrun", started)
    monkeypatch.setattr("neorec.cli._fit", started)
    code = main([*base, *sets(["train.max_steps=1"]), "--resume", "--nproc", str(nproc)])
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "train.max_steps 1 is below step" in err, err


def test_the_data_settings_a_resume_compares(tmp_path, monkeypatch):
    """Those that decide the training samples and their order, with paths made absolute; not the
    held-out data's nor the reader's speed."""
    from neorec.config.data import DataConfig
    from neorec.data.reader_position import check_data_settings, data_settings
    from neorec.errors import ConfigError

    def settings(**preprocessed):
        return DataConfig(source="preprocessed", preprocessed={"path": "data/criteo", **preprocessed})

    monkeypatch.chdir(tmp_path)
    saved = {"data_settings": data_settings(settings())}
    check_data_settings(settings(path=str(tmp_path / "data/criteo"), prefetch=9, threads=3), saved, "ck")
    window = "data.preprocessed.shuffle_window 131072, this run has 64"
    for change, words in [({"path": "data/b"}, "data.preprocessed.path"), ({"shuffle_window": 64}, window)]:
        with pytest.raises(ConfigError, match=f"checkpoint ck was trained with {words}"):
            check_data_settings(settings(**change), saved, "ck")
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")  # another node of the job, working in another folder
    check_data_settings(settings(), saved, "ck")  # the path written the same
    check_data_settings(settings(path=str(tmp_path / "data/criteo")), saved, "ck")  # the same place
    with pytest.raises(ConfigError, match="data.preprocessed.path 'data/criteo', this run has '/"):
        check_data_settings(settings(path=str(tmp_path / "b/data/criteo")), saved, "ck")  # another place
    check_data_settings(DataConfig(source="movielens"), {"batches": 3}, "ck")  # saved before they were
    criteo = {"train_paths": ["day.tsv"], "bad_lines": "fail"}  # stopped at a bad line: resumed skipping them
    saved = {"data_settings": data_settings(DataConfig(source="criteo_tsv", criteo=criteo))}
    check_data_settings(DataConfig(source="criteo_tsv", criteo={**criteo, "bad_lines": "skip"}), saved, "ck")
    parquet = {"paths": ["a.parquet"], "eval_paths": ["b.parquet"], "features": ["x"]}
    saved = {"data_settings": data_settings(DataConfig(source="parquet", parquet=parquet))}
    other_eval = DataConfig(source="parquet", parquet={**parquet, "eval_paths": ["c.parquet"]})
    check_data_settings(other_eval, saved, "ck")
    with pytest.raises(ConfigError, match="data.source 'parquet', this run has 'movielens'"):
        check_data_settings(DataConfig(source="movielens"), saved, "ck")


def test_an_optimizers_state_is_loaded_and_this_runs_settings_kept():
    """torch's load_state_dict put the checkpoint's weight decay, eps, momentum and betas back over the
    resumed run's config, without a word; and an Adam state loaded into SGD failed at the first step
    with a KeyError traceback."""
    import torch

    from neorec.checkpoint.files import CheckpointError
    from neorec.checkpoint.load import load_optimizer

    w = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([w], lr=0.1, eps=1e-8, weight_decay=0.0)
    w.grad = torch.full((3,), 0.5)
    adam.step()
    saved = adam.state_dict()
    again = torch.optim.Adam([w], lr=0.2, eps=1e-3, weight_decay=0.5, betas=(0.8, 0.9))
    load_optimizer(again, saved, "here")
    group = again.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"], group["betas"]) == (0.2, 1e-3, 0.5, (0.8, 0.9))
    assert torch.equal(again.state[w]["exp_avg"], adam.state[w]["exp_avg"])
    for other in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.Adagrad([w], lr=0.1)):
        with pytest.raises(CheckpointError, match="here was saved by another kind of optimizer"):
            load_optimizer(other, saved, "here")


def test_a_preprocessed_folder_written_again_under_the_same_path(tmp_path, capfd):
    """The settings compare the path, not what is there: a folder preprocessed again with other
    settings (here another hashing) continued the saved position in other ids. Its manifest's checksum
    is saved with the position; the same folder written again alike resumes."""
    fixture = Path(__file__).parents[1] / "fixtures" / "criteo_20.tsv"
    data, run = tmp_path / "pre", tmp_path / "run"

    def preprocess(*flags: str) -> None:
        shutil.rmtree(data, ignore_errors=True)
        argv = ["data", "preprocess", str(fixture), "--out", str(data), "--table-rows", "100"]
        assert main([*argv, "--no-progress", *flags]) == 0

    settings = ["data.source=preprocessed", f"data.preprocessed.path={data}", "data.batch_size=4"]
    train = ["train", "--output-dir", str(run), *sets([*QUIET, *settings, "checkpoint.every_steps=1"])]
    preprocess()
    assert main([*train, *sets(["train.max_steps=2"])]) == 0
    preprocess("--hashing", "hash")
    capfd.readouterr()
    assert main([*train, *sets(["train.max_steps=4"]), "--resume"]) == 2
    err = capfd.readouterr().err
    assert "was trained with the data set of data.preprocessed.path (its manifest.json's checksum" in err, err
    preprocess()
    assert main([*train, *sets(["train.max_steps=4"]), "--resume"]) == 0


def test_a_parquet_training_folder_that_grew_since_the_checkpoint(tmp_path, capfd):
    """A file added to a training folder changes the epoch's row groups, so the saved position would
    continue in other samples: refused, pointing at data.follow (for a folder that grows)."""
    folder = tmp_path / "train"
    folder.mkdir()
    table = pa.table({"label": [0, 1] * 200, "d0": [0.5] * 400, "a": list(range(400))})
    pq.write_table(table, folder / "part-0.parquet", row_group_size=100)
    pq.write_table(table, tmp_path / "held.parquet")
    files = f"paths: [{folder}], eval_paths: [{tmp_path}/held.parquet]"
    section = f"data.parquet={{{files}, dense: [d0], features: [a]}}"
    base = [*QUIET, "data.source=parquet", section, "data.batch_size=50", "checkpoint.every_steps=1"]
    train = ["train", "--output-dir", str(tmp_path / "run")]
    assert main([*train, *sets([*base, "train.max_steps=2"])]) == 0
    assert main([*train, *sets([*base, "train.max_steps=3"]), "--resume"]) == 0  # the same files
    pq.write_table(table, folder / "part-1.parquet", row_group_size=100)
    capfd.readouterr()
    assert main([*train, *sets([*base, "train.max_steps=4"]), "--resume"]) == 2
    err = capfd.readouterr().err
    assert "was trained with the training files of data.parquet.paths" in err and "data.follow" in err, err


@pytest.mark.parametrize("source", ["criteo_tsv", "movielens"])
def test_files_a_source_reads_again_written_again_since_the_checkpoint(source, tmp_path, capfd):
    """TSV and MovieLens sources keep no position of their own: a resume reads the trained lines
    again. Files written again or grown under the same paths continued in other samples; their sizes
    are saved with the checkpoint, and a resume over other sizes is refused (the same files resume)."""
    fixtures = Path(__file__).parents[1] / "fixtures"
    if source == "criteo_tsv":
        changed = tmp_path / "day_0.tsv"
        shutil.copy(fixtures / "criteo_20.tsv", changed)
        settings = ["data.source=criteo_tsv", f"data.criteo.train_paths=[{changed}]",
                    "data.criteo.table_rows=100", "data.batch_size=4"]  # fmt: skip
    else:
        shared = Path(__file__).parents[3] / "shared" / "data" / "ml-latest-small"
        if not (shared / "ratings.csv").is_file():
            pytest.skip(f"shared MovieLens latest-small not found at {shared}")
        root = tmp_path / "ml"
        shutil.copytree(shared, root)
        changed = root / "ratings.csv"
        settings = ["data.source=movielens", f"data.movielens.root={root}", "data.batch_size=256"]
    run = tmp_path / "run"
    train = ["train", "--output-dir", str(run), *sets([*QUIET, *settings, "checkpoint.every_steps=1"])]
    assert main([*train, *sets(["train.max_steps=2"])]) == 0
    assert main([*train, *sets(["train.max_steps=3"]), "--resume"]) == 0  # the same files
    lines = changed.read_text().splitlines(keepends=True)
    changed.write_text("".join(lines[:1] + lines[2:]))  # a line fewer
    capfd.readouterr()
    assert main([*train, *sets(["train.max_steps=4"]), "--resume"]) == 2
    err = capfd.readouterr().err
    assert "was trained on files of" in err and "written again or grown since" in err, err


def test_a_resume_names_the_settings_that_differ_from_the_runs(tmp_path, capfd):
    """A flag left out of the resuming command changed a setting without a word (the run's config.yaml
    was replaced by the new one): the settings that differ from it are named, how far to train not."""
    base = ["train", "--output-dir", str(tmp_path / "run"),
            *sets([*QUIET, "data.synthetic.train_samples=4096", "data.synthetic.eval_samples=512",
                   "checkpoint.every_steps=1"])]  # fmt: skip
    assert main([*base, *sets(["train.max_steps=1", "embedding.optimizer.lr=0.5"])]) == 0
    capfd.readouterr()
    assert main([*base, *sets(["train.max_steps=2"]), "--resume"]) == 0
    err = capfd.readouterr().err
    assert "resumed at step 1 with settings other than" in err, err
    assert "embedding.optimizer.lr: 0.5 -> 0.1" in err, err
    assert "train.max_steps" not in err
    assert main([*base, *sets(["train.max_steps=3"]), "--resume"]) == 0  # the same settings: nothing said
    assert "settings other than" not in capfd.readouterr().err


def test_a_resumed_run_that_stops_before_its_end_leaves_no_older_results(tmp_path, capfd, monkeypatch):
    """A finished run resumed to train longer: its model.pt and summary.json go when the resume starts.
    Where the resumed run stops before writing its own (here a full disk at its end), eval and export
    read its newest checkpoint: they served the older model.pt under the new config.yaml before."""
    run = tmp_path / "run"
    base = ["train", "--output-dir", str(run),
            *sets([*QUIET, "data.synthetic.train_samples=4096", "data.synthetic.eval_samples=512",
                   "data.batch_size=512", "checkpoint.every_steps=1"])]  # fmt: skip
    assert main([*base, *sets(["train.max_steps=2"])]) == 0
    assert (run / "model.pt").is_file() and (run / "summary.json").is_file()
    capfd.readouterr()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(run / "model.pt"))

    monkeypatch.setattr("neorec.train.reporting.save_model_state", full)
    assert main([*base, *sets(["train.max_steps=4"]), "--resume"]) == 1
    err = capfd.readouterr().err
    assert "removed summary.json and model.pt, of the run before this one resumed at step 2" in err, err
    assert not (run / "model.pt").exists() and not (run / "summary.json").exists()
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").is_file()


def test_a_resumed_runs_summary_counts_the_whole_run(tmp_path):
    """summary.json of a resumed run counted only the samples trained since the resume, beside the
    whole run's steps: "samples" is the whole run's, and what this process trained and timed is said."""
    common = [*QUIET, "data.synthetic.train_samples=4096", "data.synthetic.eval_samples=512",
              "data.batch_size=512", "checkpoint.every_steps=1"]  # fmt: skip
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert main(["train", "--output-dir", str(whole), *sets([*common, "train.max_steps=4"])]) == 0
    assert main(["train", "--output-dir", str(run), *sets([*common, "train.max_steps=2"])]) == 0
    assert main(["train", "--output-dir", str(run), *sets([*common, "train.max_steps=4"]), "--resume"]) == 0
    want, got = (json.loads((r / "summary.json").read_text()) for r in (whole, run))
    assert got["steps"] == want["steps"] == 4 and got["samples"] == want["samples"] == 2048
    assert got["resumed_at_step"] == 2 and got["samples_since_resume"] == 1024
    assert "resumed_at_step" not in want
