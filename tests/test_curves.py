"""curves.png and what feeds it: evaluations through the run (train.eval_every auto), learning rates."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from neorec.config.load import load_config  # noqa: E402
from neorec.errors import ConfigError  # noqa: E402
from neorec.metrics.plot import curves_figure, plot_curves  # noqa: E402
from neorec.train import evaluation  # noqa: E402
from neorec.train.schedule import lr_multiplier  # noqa: E402
from neorec.train.trainer import Trainer  # noqa: E402

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=6000", "data.synthetic.eval_samples=3000", "data.batch_size=256",
    "data.eval_batch_size=512", "train.progress=false", "logging.tensorboard=false", "train.log_every=5",
]  # fmt: skip


def records_of(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_auto_evaluates_five_times_mid_run_ones_on_a_bounded_sample(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluation, "AUTO_EVAL_SAMPLES", 1024)  # 2 batches of 512
    cfg = load_config("default", TINY + ["train.schedule.warmup_steps=20"])
    assert cfg.train.eval_every == "auto"
    result = Trainer(cfg, tmp_path / "run").fit()  # 24 steps
    records = records_of(tmp_path / "run")
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [5, 10, 15, 20, 24]
    assert [r["num_samples"] for r in evals] == [1024] * 4 + [3000]  # the final one: the whole held-out set
    assert result.eval["num_samples"] == 3000
    train = [r for r in records if r["split"] == "train"]
    for r in train:  # the rates of the step just taken, warming up
        assert r["lr_dense"] == pytest.approx(0.002 * lr_multiplier(cfg.train.schedule, r["step"] - 1, 24))
        assert r["lr_embedding"] == pytest.approx(0.1 * lr_multiplier(cfg.train.schedule, r["step"] - 1, 24))
    assert train[0]["lr_dense"] < train[-1]["lr_dense"]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_explicit_and_epoch_evaluations_and_epoch_boundaries(tmp_path):
    extra = ["train.epochs=2", "data.synthetic.train_samples=2560", "logging.plot=false"]  # 10 steps an epoch
    Trainer(load_config("default", TINY + extra + ["train.eval_every=null"]), tmp_path / "a").fit()
    records = records_of(tmp_path / "a")
    assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20]
    assert [(r["step"], r["epoch"]) for r in records if r["split"] == "epoch_end"] == [(10, 0)]
    Trainer(load_config("default", TINY + extra + ["train.eval_every=7"]), tmp_path / "b").fit()
    assert [r["step"] for r in records_of(tmp_path / "b") if r["split"] == "eval"] == [7, 14, 20]


@pytest.mark.parametrize("value", [0, -3, "often", True])
def test_eval_every_rejects_what_is_not_steps_or_auto(value):
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config("default", [f"train.eval_every={value}"])


def run_records(steps=100, epochs=1, auc=0.7):
    per_epoch = steps // epochs
    out = [{"split": "train", "step": s, "loss": 1.0 / s, "epoch": (s - 1) // per_epoch}
           for s in range(5, steps + 1, 5)]  # fmt: skip
    out += [{"split": "eval", "step": s, "log_loss": 0.5, "auc": auc, "teacher_auc": 0.8}
            for s in (20, 40, steps)]  # fmt: skip
    out += [{"split": "epoch_end", "step": e * per_epoch, "epoch": e - 1} for e in range(1, epochs)]
    return out


def test_curves_step_axis_epochs_and_title(tmp_path):
    fig = curves_figure(run_records(steps=100, epochs=2), "my-run")
    try:
        assert fig._suptitle.get_text() == "my-run"
        loss, auc = fig.axes
        assert loss.get_ylabel() == "log loss" and auc.get_ylabel() == "AUC"
        for ax in (loss, auc):
            lo, hi = ax.get_xlim()
            assert -3 < lo <= 0 and 100 <= hi < 103  # the run's steps, not the last evaluation's surroundings
            assert all(float(t).is_integer() for t in ax.get_xticks())
            boundaries = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
            assert [line.get_xdata()[0] for line in boundaries] == [50]
        assert [t.get_text() for t in fig.texts] == ["my-run"]  # the title, no note
    finally:
        plt.close(fig)
    path = plot_curves(run_records(), tmp_path / "curves.png", "r")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_no_panel_for_a_metric_that_is_never_finite():
    fig = curves_figure(run_records(auc=None), "r")  # metrics.jsonl writes a NaN AUC as null
    try:
        assert [ax.get_ylabel() for ax in fig.axes] == ["log loss"]
    finally:
        plt.close(fig)


def test_a_run_too_short_for_a_curve_says_so():
    records = [{"split": "eval", "step": 3, "log_loss": 0.6, "auc": 0.55}]
    fig = curves_figure(records, "short")
    try:
        assert any("too short for a curve" in t.get_text() for t in fig.texts)
        lo, hi = fig.axes[0].get_xlim()
        assert -1 < lo <= 0 and 3 <= hi < 4
    finally:
        plt.close(fig)
    fig = curves_figure([], "empty")
    try:
        assert len(fig.axes) == 1 and any("no finite" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)


def labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def line_of(ax, label: str):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def multitask_records(love_auc=0.63):
    weights = {"like": 1.0, "love": 0.5, "ok": 0.5}
    # the training loss: sum_t w_t BCE_t
    out = [{"split": "train", "step": s, "loss": 1.3 - 0.005 * s} for s in range(10, 41, 10)]
    for step, d in ((20, 0.0), (40, 0.02)):
        # (AUC, log loss) of each task
        per_task = {"like": (0.70 + d, 0.64 - d), "love": (love_auc, 0.50 - d), "ok": (0.57, 0.50)}
        r = {"split": "eval", "step": step, "auc": per_task["like"][0], "log_loss": per_task["like"][1]}
        for task, (auc, log_loss) in per_task.items():
            r.update({f"{task}/auc": auc, f"{task}/log_loss": log_loss, f"{task}/ne": 0.9})
        r["weighted_log_loss"] = sum(w * per_task[t][1] for t, w in weights.items())
        out.append(r)
    return out


def test_multitask_curves_compare_the_weighted_loss_and_name_each_task():
    records = multitask_records()
    fig = curves_figure(records, "mt")
    try:
        loss, auc, per_task = fig.axes
        assert "weighted log loss" in loss.get_ylabel()
        validation = line_of(loss, "validation weighted log loss")
        evals = [r for r in records if r["split"] == "eval"]
        assert list(validation.get_ydata()) == [r["weighted_log_loss"] for r in evals]  # not the first task's
        assert labels(auc) == ["validation AUC: like", "validation AUC: love", "validation AUC: ok"]
        assert list(line_of(auc, "validation AUC: love").get_ydata()) == [0.63, 0.63]
        assert labels(per_task) == [f"validation log loss: {t}" for t in ("like", "love", "ok")]
    finally:
        plt.close(fig)


def test_multitask_curves_of_a_real_run(tmp_path):
    tasks = ["model.arch=multitask", "model.tasks=[{name: click}, {name: conversion, weight: 0.5}]"]
    extra = ["logging.plot=false", "train.eval_every=10"]
    Trainer(load_config("default", TINY + tasks + extra), tmp_path).fit()
    records = records_of(tmp_path)
    fig = curves_figure(records, "mt")
    try:
        loss, auc, _ = fig.axes
        evals = [r for r in records if r["split"] == "eval"]
        validation = line_of(loss, "validation weighted log loss")
        assert list(validation.get_ydata()) == [r["weighted_log_loss"] for r in evals]
        # synthetic data: the teacher's AUC is of the click label, the first task
        assert labels(auc)[:2] == ["validation AUC: click", "validation AUC: conversion"]
        assert labels(auc)[2].startswith("teacher ceiling of click")
    finally:
        plt.close(fig)


def test_two_tower_curves_name_the_softmax_loss_and_draw_recall():
    records = [{"split": "train", "step": s, "loss": 8.0 - 0.03 * s} for s in range(10, 41, 10)]
    records += [{"split": "eval", "step": s, "recall@10": 0.04, "recall@100": 0.2, "num_queries": 9}
                for s in (20, 40)]  # fmt: skip
    for arch in (None, "two_tower"):
        fig = curves_figure(records, "tt", arch)
        try:
            loss, recall = fig.axes
            assert "softmax" in loss.get_ylabel() and "log loss" not in loss.get_ylabel()
            assert labels(loss) == ["train loss (mean over each log interval)"]
            assert recall.get_ylabel() == "recall@K"
            assert labels(recall) == ["validation recall@10", "validation recall@100"]
        finally:
            plt.close(fig)
    fig = curves_figure(records[:4], "tt", "two_tower")  # no evaluation yet: the records cannot tell
    try:
        assert "softmax" in fig.axes[0].get_ylabel()
    finally:
        plt.close(fig)


def follow_records():
    out = [{"split": "train", "step": s, "loss": 0.8 - 0.01 * s} for s in range(5, 25, 5)]
    out += [{"split": "progressive", "step": s, "auc": 0.52 + 0.002 * s, "ne": 1.1, "log_loss": 0.7,
             "calibration": 1.5, "num_samples": 2560 * s} for s in range(5, 25, 5)]  # fmt: skip
    for step, day, auc in ((8, "day-000", 0.54), (16, "day-001", 0.59), (24, "day-002", 0.67)):
        out.append({"split": "partition", "step": step, "partition": day, "auc": auc, "ne": 0.99,
                    "log_loss": 0.6, "calibration": 1.2, "num_samples": 4000})  # fmt: skip
    return out


def test_follow_curves_draw_progressive_metrics_and_partition_ends():
    fig = curves_figure(follow_records(), "follow")
    try:
        loss, auc, ne = fig.axes
        assert "progressive log loss per partition" in labels(loss)
        assert "progressive log loss (sliding window)" in labels(loss)
        assert list(line_of(auc, "progressive AUC per partition").get_xdata()) == [8, 16, 24]
        assert list(line_of(auc, "progressive AUC per partition").get_ydata()) == [0.54, 0.59, 0.67]
        assert "progressive AUC (sliding window)" in labels(auc)
        calibration = "calibration per partition (predicted / observed)"
        assert labels(ne) == ["progressive NE per partition", calibration, "partition end"]
        for ax in fig.axes:
            ends = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "-."]
            assert ends == [8, 16, 24]
        assert [t.get_text() for t in loss.texts] == ["day-000", "day-001", "day-002"]
    finally:
        plt.close(fig)


def test_a_loss_spanning_more_than_100x_gets_a_log_scale():
    exploding = [{"split": "train", "step": s, "loss": 0.83 * 1.6e6 ** ((s - 5) / 95)}
                 for s in range(5, 101, 5)]  # fmt: skip (from 0.83 to 1.6e6)
    fig = curves_figure(exploding, "boom")
    try:
        assert fig.axes[0].get_yscale() == "log"
    finally:
        plt.close(fig)
    fig = curves_figure(run_records(), "calm")
    try:
        assert [ax.get_yscale() for ax in fig.axes] == ["linear", "linear"]
    finally:
        plt.close(fig)


def test_the_step_of_a_non_finite_loss_is_marked():
    records = run_records(steps=60) + [{"split": "diverged", "step": 57, "loss": None}]
    fig = curves_figure(records, "nan")
    try:
        for ax in fig.axes:
            marks = [line for line in ax.get_lines() if line.get_label() == "loss not finite at step 57"]
            assert len(marks) == 1 and list(marks[0].get_xdata()) == [57, 57]
        assert any("not finite at step 57" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)
    records = [{"split": "train", "step": 5, "loss": 0.7}, {"split": "diverged", "step": 7, "loss": None}]
    fig = curves_figure(records)
    try:  # too short for a curve, but what ended it is said, not "train longer"
        texts = " ".join(t.get_text() for t in fig.texts)
        assert "not finite at step 7" in texts and "too short" not in texts
        assert fig.axes[0].get_xlim()[1] >= 7
    finally:
        plt.close(fig)


def test_a_metric_left_out_for_never_being_finite_is_named():
    fig = curves_figure(run_records(auc=None), "one class")
    try:
        assert any("Not drawn, never finite: validation AUC" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)
    fig = curves_figure(multitask_records(love_auc=None), "one class task")
    try:
        assert "validation AUC: love" not in labels(fig.axes[1])
        assert any("validation AUC: love" in t.get_text() for t in fig.texts)
    finally:
        plt.close(fig)


def test_cache_benchmark_plot_title_ticks_and_clamped_hit_rates():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.cache import plot, plot_title, recorded_results

    rows, title = recorded_results("cache_dram.png")
    assert "tier dram" in title and "LRU" in title and "after 10 warm-up steps" in title
    assert "tier ssd" in recorded_results("cache_lfu_steady.png")[1]
    fig = plot(rows, title, None)
    try:
        _, hits = fig.axes
        for ax in fig.axes:
            assert [t.get_text() for t in ax.get_xticklabels()] == ["1%", "5%", "20%", "100%"]
            assert len(ax.get_xticks(minor=True)) == 0
        joined = next(line for line in hits.get_lines() if line.get_linestyle() == "-")
        measured = [r["hit_rate"] for r in rows if r["fraction"] is not None and r["hit_rate"] >= 0]
        assert [h for h in joined.get_ydata() if h == h] == measured  # NaN where clamped: the line breaks
        hollow = [line for line in hits.get_lines() if line.get_linestyle() == "None"]
        assert [list(line.get_ydata()) for line in hollow] == [[0.0]]  # 1%: recorded -0.432
    finally:
        plt.close(fig)
    assert "GPU memory" in plot_title("ssd", "lfu", 300, "adagrad", "cuda")
