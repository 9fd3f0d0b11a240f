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
    out = [{"split": "train", "step": s, "loss": 1.0 / s, "epoch": (s - 1) // per_epoch} for s in range(5, steps + 1, 5)]
    out += [{"split": "eval", "step": s, "log_loss": 0.5, "auc": auc, "teacher_auc": 0.8} for s in (20, 40, steps)]
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
            assert -3 < lo <= 0 and 100 <= hi < 103  # the run's steps, not the last evaluation's neighbourhood
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
