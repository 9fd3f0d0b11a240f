import json
import math
import subprocess

import pytest
import torch
from forked import run_neorec

from neorec.config.load import load_config
from neorec.config.schema import ScheduleConfig
from neorec.train.schedule import lr_multiplier
from neorec.train.trainer import Trainer

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=6000", "data.synthetic.eval_samples=3000", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=5",
]  # fmt: skip


def run(tmp_path, extra=(), name="run"):
    cfg = load_config("default", TINY + list(extra))
    return Trainer(cfg, tmp_path / name).fit()


@pytest.mark.parametrize("engine", ["reference", "fused"])
def test_same_seed_gives_bitwise_identical_losses(tmp_path, engine):
    a = run(tmp_path, [f"embedding.engine={engine}"], "a")
    b = run(tmp_path, [f"embedding.engine={engine}"], "b")
    assert len(a.losses) == 24 and a.losses == b.losses
    c = run(tmp_path, [f"embedding.engine={engine}", "seed=1"], "c")
    assert c.losses != a.losses


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_training_learns(tmp_path, arch):
    extra = ["data.synthetic.train_samples=30000", f"model.arch={arch}"]
    extra += ["model.low_rank=4"] if arch == "dcnv2" else []  # low-rank cross weights: dcnv2 only
    r = run(tmp_path, extra)
    assert r.eval["auc"] > 0.65, r.eval
    assert r.losses[-1] < r.losses[0]
    records = [json.loads(x) for x in (r.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert {x["split"] for x in records} == {"train", "eval"}


def test_multi_hot_weighted_mean_pooling_trains(tmp_path):
    extra = ["data.synthetic.multi_hot=[1, 3, 0, 5]", "data.synthetic.variable_bags=true",
             "data.synthetic.weighted=true", "embedding.pooling=mean", "train.max_steps=5"]  # fmt: skip
    r = run(tmp_path, extra)
    assert r.steps == 5 and all(torch.isfinite(torch.tensor(r.losses)))


def test_schedule():
    s = ScheduleConfig(warmup_steps=4, decay="linear", decay_start=4, min_ratio=0.1)
    assert lr_multiplier(s, 0, 10) == 0.25 and lr_multiplier(s, 3, 10) == 1.0
    assert lr_multiplier(s, 4, 10) == 1.0 and abs(lr_multiplier(s, 10, 10) - 0.1) < 1e-12
    c = ScheduleConfig(decay="cosine")
    assert lr_multiplier(c, 5, 10) == pytest.approx(0.5)


def test_total_steps_is_what_the_data_allows_when_max_steps_is_larger(tmp_path):
    """6000 samples / 256 = 24 steps an epoch: max_steps beyond two epochs ends with the data, and the
    decay schedule (and the auto evaluation spacing) runs over the 48 steps actually trained."""
    extra = ["train.epochs=2", "train.max_steps=1000", "train.schedule.decay=linear", "train.schedule.min_ratio=0.1"]
    trainer = Trainer(load_config("default", TINY + extra), tmp_path / "r")
    assert trainer.total_steps() == 48
    result = trainer.fit()
    assert result.steps == 48
    last = 1 - 0.9 * 47 / 48  # the multiplier of the last step, 47 of 48: near the floor, not 1 - 0.9 * 47/1000
    assert trainer.dense_opt.param_groups[0]["lr"] == pytest.approx(last * trainer._base_lrs[0][0])
    capped = Trainer(load_config("default", TINY + ["train.epochs=2", "train.max_steps=30"]), tmp_path / "c")
    assert capped.total_steps() == 30


def neorec(*args, cwd):
    """`python -m neorec *args` in a fresh process (forked from one that has imported neorec)."""
    return run_neorec(list(args), cwd=cwd, timeout=300)


def test_cli_train_eval_and_outputs(tmp_path):
    sets = [x for kv in TINY if not kv.startswith("logging") for x in ("--set", kv)]
    p = neorec("train", *sets, "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "eval AUC" in p.stdout and "teacher AUC (ceiling)" in p.stdout and "throughput" in p.stdout
    for f in ["metrics.jsonl", "summary.json", "model.pt", "config.yaml", "curves.png"]:
        assert (tmp_path / "out" / f).is_file(), f
    assert list((tmp_path / "out" / "tensorboard").glob("events.*"))
    e = neorec("eval", str(tmp_path / "out"), cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    ends = summary["startup"]["step_ends_s"]  # where start-up went: first batch, then each first step ends
    assert len(ends) == min(10, summary["steps"]) and 0 < summary["startup"]["first_batch_s"] <= ends[0]
    assert ends == sorted(ends) and ends[-1] <= summary["train_seconds"] and "first batch after" in p.stdout
    auc_line = next(line for line in e.stdout.splitlines() if line.startswith("auc"))
    assert float(auc_line.split("|")[1]) == pytest.approx(summary["eval_auc"], abs=1e-6)


def test_cli_rejects_bad_config_before_work(tmp_path):
    p = neorec("train", "--set", "train.dense_optimizer.lr=-1", "--set", "model.arch=wide", cwd=tmp_path)
    assert p.returncode == 2
    assert "train.dense_optimizer.lr" in p.stderr and "model.arch" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_criteo_bad_lines_fail_then_skip(tmp_path):
    from pathlib import Path

    lines = (Path(__file__).parent / "fixtures" / "criteo_20.tsv").read_text().splitlines()
    lines[4] = "1\t2\tnot-enough-fields"
    lines[11] = lines[11].replace("\t", "\tzz", 1)  # a non-numeric dense value
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    base = ["train", "--set", "data.source=criteo_tsv", "--set", "data.batch_size=4", "--set", "train.progress=false",
            "--set", "logging.plot=false", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    p = neorec(*base, "--set", f"data.criteo={{train_paths: [{bad}], table_rows: 100}}", cwd=tmp_path)
    assert p.returncode == 2 and f"{bad}:5:" in p.stderr
    p = neorec(*base, "--set", f"data.criteo={{train_paths: [{bad}], table_rows: 100, bad_lines: skip}}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "malformed lines skipped         | 2" in p.stdout


def test_console_script_and_data_commands(tmp_path):
    import shutil

    exe = shutil.which("neorec")
    assert exe is not None, "the neorec console script is not installed (pip install -e .)"
    assert subprocess.run([exe, "--help"], capture_output=True, text=True).returncode == 0
    sets = [x for kv in TINY for x in ("--set", kv)]
    g = neorec("data", "generate", *sets, "--out", str(tmp_path / "shards"), cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert (tmp_path / "shards" / "meta.json").is_file()
    i = neorec("data", "inspect", *sets, "--batches", "2", cwd=tmp_path)
    assert i.returncode == 0 and "teacher AUC" in i.stdout and "C4" in i.stdout
    run_sets = [x for kv in TINY if not kv.startswith("data.synthetic.") for x in ("--set", kv)]
    t = neorec("train", *run_sets, "--set", "data.source=shards",
               "--set", f"data.shards_dir={tmp_path / 'shards'}",
               "--set", "train.max_steps=3", "--output-dir", str(tmp_path / "out"), cwd=tmp_path)  # fmt: skip
    assert t.returncode == 0, t.stderr


def test_cosine_decay_between_its_ends():
    """At a fifth of the decay, cosine's 0.5 (1 + cos(pi / 5)), not linear's 0.8."""
    c = ScheduleConfig(decay="cosine")
    assert lr_multiplier(c, 2, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
