"""Where a run's step loop stands: the step, the epoch and the batches read of it, the logged loss,
the current log window, and the run's logs and results so far.

Trainer's step loop (neorec/train/trainer.py) keeps one `RunState` for a run and hands it to what it
calls: a log step reads and resets the window, a checkpoint records the position, a stop saves it.
`RunResult` is what the run has done so far, and what Trainer.fit returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neorec.train.logger import MetricsLogger, NoLogger

STARTUP_STEPS = 10  # steps whose ends a run's start-up records


@dataclass
class RunResult:
    steps: int
    samples: int
    train_seconds: float
    losses: list[float] = field(default_factory=list)  # every step's loss, for determinism checks
    eval: dict[str, float] = field(default_factory=dict)
    eval_digest: str | None = None  # of the held-out samples the final evaluation scored (sample_digest.py)
    teacher_auc: float | None = None
    skipped_lines: int = 0  # malformed input lines skipped under the reader's `skip` policy
    out_dir: Path | None = None
    comm_bytes_per_step: dict[str, float] = field(default_factory=dict)  # rank 0's sends, by exchange
    dropped_ids: dict[str, int] = field(default_factory=dict)  # bounds_check warn: per feature, all ranks
    id_map: dict[str, dict[str, float]] = field(default_factory=dict)  # managed-collision tables, at the end
    partitions: list[dict] = field(default_factory=list)  # data.follow: each partition's progressive metrics
    # seconds from the start of training to the first batch in hand and to the end of each of the first
    # STARTUP_STEPS steps on the host (a GPU's work is queued, not waited for): where start-up goes
    first_batch_seconds: float | None = None
    step_ends: list[float] = field(default_factory=list)
    # resumed: the checkpoint's step, and the samples trained before it (None: a checkpoint that does
    # not record them); `samples`, `train_seconds` and the throughput are this process's, since then
    resumed_at: int | None = None
    samples_before: int | None = 0

    @property
    def total_samples(self) -> int | None:
        """Samples trained over the whole run (None: resumed from a checkpoint without the count)."""
        return None if self.samples_before is None else self.samples_before + self.samples

    @property
    def startup(self) -> dict:
        if self.first_batch_seconds is None:
            return {}
        ends = [round(t, 4) for t in self.step_ends]
        return {"first_batch_s": round(self.first_batch_seconds, 4), "step_ends_s": ends}

    @property
    def steps_trained_here(self) -> int:
        """Steps this process trained: since the resume, for a resumed run."""
        return self.steps - (self.resumed_at or 0)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")


@dataclass
class LogWindow:
    """The steps since the last log step (after a resume: since the resume): steps and samples trained,
    when the window began, time waited for data."""

    steps: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)
    data_wait: float = 0.0

    def restart(self, now: float) -> None:
        self.steps, self.samples, self.start, self.data_wait = 0, 0, now, 0.0


@dataclass
class RunState:
    step: int  # steps trained so far, over the whole run (a resumed run starts at its checkpoint's)
    epoch: int
    logger: MetricsLogger | NoLogger
    result: RunResult
    total: int  # steps the run will train (0: unknown, a stream of unknown length)
    position: dict | None = None  # the checkpoint's data position a resumed run continues from
    in_epoch: int = 0  # batches of `epoch` read: trained, or scored as a followed stream's held-out ones
    # the losses read back since the last log step (over all ranks: the global batch's): their sum and
    # number; a log step logs their mean
    loss_sum: float = 0.0
    loss_steps: int = 0
    unread: list[torch.Tensor] = field(default_factory=list)  # losses not yet read back to the host
    window: LogWindow = field(default_factory=LogWindow)
    bar: object | None = None  # the progress bar, rank 0 with train.progress
    start: float = field(default_factory=time.perf_counter)  # when training began, in this process
    done: bool = False  # train.max_steps reached
    # the id maps' counters (hits, misses, ...) of this rank when the checkpoint resumed from was saved:
    # the log's id_map lines count from the start of the run
    id_map_earlier: dict[str, dict[str, float]] = field(default_factory=dict)
    eval_every: int | None = None  # steps between mid-run evaluations (None: after each epoch but the last)
    eval_batches: int | None = None  # batches of a mid-run evaluation (None: all)

    def take_loss(self) -> float:
        """The mean loss of the steps since the last log step; the next one starts from none."""
        loss = self.loss_sum / self.loss_steps if self.loss_steps else float("nan")
        self.loss_sum, self.loss_steps = 0.0, 0
        return loss

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
