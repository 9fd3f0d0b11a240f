"""What a run's metrics.jsonl says about its training steps: every step's loss reaches a record (the
last, partial log interval and the steps before a divergence too), and samples/s counts training
time only."""

from __future__ import annotations

import json
import time

import pytest

from neorec.config.load import load_config
from neorec.train import trainer as trainer_module
from neorec.train.checkpointing import TrainingDiverged
from neorec.train.trainer import Trainer

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=6000", "data.synthetic.eval_samples=1024", "data.batch_size=256",
    "data.eval_batch_size=512", "train.progress=false", "logging.tensorboard=false", "train.log_every=5",
]  # fmt: skip


def train_records(out_dir) -> list[dict]:
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == "train"]


def test_the_steps_after_the_last_log_step_are_logged(tmp_path):
    """13 steps, a log line every 5: steps 11-13 were trained and never logged (nor drawn)."""
    cfg = load_config("default", TINY + ["train.max_steps=13", "train.eval_every=null", "logging.plot=false"])
    result = Trainer(cfg, tmp_path / "run").fit()
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records] == [5, 10, 13]
    assert records[-1]["loss"] == pytest.approx(sum(result.losses[10:]) / 3, rel=1e-12)
    assert records[-1]["samples_per_s"] > 0


@pytest.mark.parametrize(
    "settings, steps",
    [
        (["train.max_steps=20", "train.eval_every=7"], [5, 10, 15, 20]),
        # after each epoch (10 steps), and the last steps' record after the final checkpoint
        (["train.epochs=2", "data.synthetic.train_samples=2560", "train.eval_every=null"], [5, 10, 15, 20]),
        (["train.max_steps=13", "train.eval_every=null"], [5, 10, 13]),
    ],
)
def test_samples_per_s_leaves_out_evaluations_and_checkpoints(settings, steps, tmp_path, monkeypatch):
    """An evaluation or a checkpoint between two log steps was counted as training time: the log line
    after it read a fraction of the speed. Here a clock that jumps 1000 s in each shows it."""
    jump = [0.0]

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return time.perf_counter() + jump[0]

    monkeypatch.setattr(trainer_module, "time", Clock)
    def slow(original):
        def run(self, *args, **kwargs):
            jump[0] += 1000.0
            return original(self, *args, **kwargs)

        return run

    monkeypatch.setattr(Trainer, "_eval", slow(Trainer._eval))
    monkeypatch.setattr(Trainer, "_save_checkpoint", slow(Trainer._save_checkpoint))
    cfg = load_config("default", TINY + settings + ["checkpoint.every_steps=4", "logging.plot=false"])
    Trainer(cfg, tmp_path / "run").fit()
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records] == steps
    # 5 steps of 256 samples: over 1000 s that would be 1.28 samples/s
    assert all(r["samples_per_s"] > 50 for r in records), [r["samples_per_s"] for r in records]


def test_a_diverged_run_logs_the_losses_before_it_and_draws_its_curves(tmp_path, monkeypatch):
    """A loss that became NaN at step 13 stopped the run without a record of steps 11-12 or of the
    divergence, and without curves.png."""
    step = Trainer.train_step
    calls = [0]

    def nan_at_13(self, *args, **kwargs):
        calls[0] += 1
        out = step(self, *args, **kwargs)
        return out * float("nan") if calls[0] == 13 else out

    monkeypatch.setattr(Trainer, "train_step", nan_at_13)
    cfg = load_config("default", TINY + ["train.max_steps=20", "train.eval_every=null"])
    with pytest.raises(TrainingDiverged, match="loss became nan at step 13"):
        Trainer(cfg, tmp_path / "run").fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want = [("train", 5), ("train", 10), ("train", 12), ("diverged", 13)]
    assert [(r["split"], r["step"]) for r in lines] == want
    assert lines[2]["loss"] > 0 and lines[3]["loss"] is None  # NaN is written as null
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_the_summary_says_why_an_auc_is_not_a_number():
    """A held-out set of one class has no AUC: the summary printed "eval AUC | nan" and a gap to the
    ceiling of nan."""
    from neorec.train.reporting import summary_table
    from neorec.train.run_state import RunResult

    result = RunResult(10, 100, 1.0, eval={"auc": float("nan"), "log_loss": 0.1, "love/auc": float("nan")},
                       teacher_auc=float("nan"))  # fmt: skip
    rows = dict(line.split(" | ") for line in summary_table(result).splitlines() if " | " in line)
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["eval AUC"] == rows["eval love/auc"] == "n/a (the held-out data has one class)"
    assert rows["teacher AUC (ceiling)"] == "n/a (the held-out data has one class)"
    assert rows["eval log loss"] == "0.1000" and "gap to ceiling" not in rows
