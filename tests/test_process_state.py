"""Training through the library leaves the caller's process-wide settings as they were: torch's thread
count, its default dtype, the global generators and the SIGTERM/SIGINT handlers (neorec/utils/process_state.py,
neorec/train/signals.py), whether the run finishes, stops on a signal or resumes."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch
from test_parquet import FIXTURE, TRAIN

from neorec.config.load import load_config
from neorec.train.signals import TrainingStopped
from neorec.train.trainer import Trainer

STOP = (signal.SIGTERM, signal.SIGINT)
CALLER_THREADS = 3  # the run's train.threads is 1 (TRAIN)
CRITEO = [*TRAIN, "data.source=criteo_tsv", f"data.criteo.train_paths=[{FIXTURE}]", "data.criteo.table_rows=500",
          "data.criteo.hashing=hash"]  # fmt: skip


def _callers_handler(signum, frame) -> None:
    pass


@pytest.fixture
def caller():
    """A caller with settings of its own: CALLER_THREADS threads, its own SIGTERM and SIGINT handlers,
    seeded generators. The process's settings are back after the test."""
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in STOP}
    torch.set_num_threads(CALLER_THREADS)
    for s in STOP:
        signal.signal(s, _callers_handler)
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)
    torch.set_num_threads(threads)


def settings() -> dict:
    return {
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "handlers": [signal.getsignal(s) for s in STOP],
        "torch_rng": torch.get_rng_state().tolist(),
        "numpy_rng": np.random.get_state()[1].tolist(),
        "python_rng": random.getstate(),
    }


def signal_at_step(monkeypatch, at: int, signum: int = signal.SIGTERM) -> list[int]:
    """Trainer.train_step, recording torch's thread count at each step; step `at` sends this process
    `signum` first, as a scheduler would."""
    step, threads = Trainer.train_step, []

    def recording(self, *args, **kwargs):
        threads.append(torch.get_num_threads())
        if len(threads) == at:
            os.kill(os.getpid(), signum)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", recording)
    return threads


def test_construction_and_fit_put_back_threads_dtype_generators_and_handlers(tmp_path, caller, monkeypatch):
    threads = signal_at_step(monkeypatch, at=0)  # no signal
    before = settings()
    trainer = Trainer(load_config(None, CRITEO), tmp_path / "run")  # seeds the model's initialisation
    assert settings() == before
    result = trainer.fit()
    assert result.steps == 10 and threads == [1] * 10  # the run trains on its own threads
    assert settings() == before


def test_a_stopped_run_and_its_resume_put_back_the_handlers_and_generators(tmp_path, caller, monkeypatch):
    threads = signal_at_step(monkeypatch, at=3)
    before = settings()
    with pytest.raises(TrainingStopped) as stopped:
        Trainer(load_config(None, CRITEO), tmp_path / "run").fit()
    assert stopped.value.step == 3 and threads == [1] * 3
    assert settings() == before  # the handlers of the caller, not the run's nor SIG_DFL
    resumed = Trainer(load_config(None, CRITEO), tmp_path / "run", resume=True).fit()  # loads the checkpoint's RNG
    assert resumed.steps == 10
    assert settings() == before


def test_keep_stop_handlers_keeps_them_after_a_stop_for_a_process_on_its_way_out(tmp_path, caller, monkeypatch):
    signal_at_step(monkeypatch, at=2, signum=signal.SIGINT)
    with pytest.raises(TrainingStopped):
        Trainer(load_config(None, CRITEO), tmp_path / "run").fit(keep_stop_handlers=True)
    assert [signal.getsignal(s) for s in STOP] == [signal.SIG_DFL] * 2  # a second signal ends the process
    assert torch.get_num_threads() == CALLER_THREADS


def test_criteo_training_leaves_the_process_on_its_callers_threads(tmp_path, caller):
    """In-process, the leak that made tests/test_parquet.py's criteo run followed by
    tests/test_export_pt2.py::test_programs_load_and_score_without_neorec fail: a run with
    train.threads=1 left the whole process on one thread, so the export test's in-process scores
    differed in their last bits from those of the same program in a fresh process."""
    sets = [*CRITEO, "data.batch_size=16"]
    Trainer(load_config(None, sets), tmp_path / "tsv").fit()
    assert torch.get_num_threads() == CALLER_THREADS
