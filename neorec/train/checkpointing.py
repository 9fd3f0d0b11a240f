"""A run's checkpoints: saving one during training, resuming from one, stopping on a signal with one,
and naming the last good one when the loss diverges.

`CheckpointHandling` is part of Trainer (neorec/train/trainer.py), whose step loop calls it; its
methods use the trainer's attributes listed in the class. When to save and what to keep is
PeriodicCheckpoints' business (neorec/checkpoint/periodic.py); the signals themselves are handled in
neorec/train/signals.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import yaml
from torch import nn

from neorec.checkpoint import load_checkpoint
from neorec.checkpoint.files import CheckpointError
from neorec.checkpoint.load import read_manifest
from neorec.checkpoint.periodic import PeriodicCheckpoints
from neorec.checkpoint.save import checkpoint_name
from neorec.config.load import config_changes
from neorec.config.schema import RunConfig
from neorec.data.ranks import RankData
from neorec.data.reader_position import (
    check_data_settings,
    check_resume,
    check_training_files,
    data_settings,
    training_file_state,
)
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.remap import counters, with_earlier_counts
from neorec.errors import ConfigError, NeorecError
from neorec.train.run_folder import RESULTS, check_steps_left
from neorec.train.run_state import RunState
from neorec.train.signals import TrainingStopped
from neorec.utils.files import fsync_dir

log = logging.getLogger(__name__)
# settings a resume changes on purpose, not named among the changed ones: how far to train, the bar
_HOW_LONG = {"train.max_steps", "train.progress"}


class TrainingDiverged(NeorecError, FloatingPointError):
    """The loss became NaN or infinite; the message names the last good checkpoint."""


class CheckpointHandling:
    """Trainer's checkpoints: save, resume, stop, divergence."""

    # the trainer's, set by Trainer.__init__
    cfg: RunConfig
    resume: bool | str | Path
    is_main: bool
    data: RankData
    embeddings: EmbeddingCollection
    model: nn.Module
    dense_opt: torch.optim.Optimizer
    emb_opt: torch.optim.Optimizer
    checkpoints: PeriodicCheckpoints
    eval_pending: dict | None

    def _stop(self, signum: int, run: RunState) -> None:
        """A stop was requested: save step `run.step` (unless just saved), close the logs, raise."""
        if hasattr(self.embeddings, "clear_prefetched"):
            self.embeddings.clear_prefetched()
        if self.checkpoints.last_step != run.step:
            self._save_checkpoint(run)
        run.close_bar()
        run.logger.close()
        raise TrainingStopped(signum, run.step, self.checkpoints.root / checkpoint_name(run.step))

    def _save_checkpoint(self, run: RunState, snapshot_due: bool = False) -> None:
        """Collective: tables (sharded), dense model, both optimizers, RNG and the data position:
        `run.in_epoch` batches of epoch `run.epoch` are trained (the schedule position is the step),
        with the reader's position where it has one. Rank 0's state is the one written.
        snapshot_due: a snapshot of this step is published next (a run resumed here publishes it
        when LATEST does not name it: the job stopped in between)."""
        state = self.data.position(run.epoch, run.in_epoch)
        if snapshot_due:
            state.update(snapshot_due=True)
        state.update(batch_size=self.cfg.data.batch_size, seed=self.cfg.seed)  # must match on resume
        state.update(data_settings=data_settings(self.cfg.data))  # and so must the data
        state.update(training_file_state(self.source))  # and the files a TSV or MovieLens source re-reads
        state.update(dense_optimizer=self.cfg.train.dense_optimizer.name)  # and the kind of its state
        # metrics.jsonl goes on seamlessly
        state.update(metrics_lines=run.logger.num_lines, loss_window=[run.loss_sum, run.loss_steps])
        total = run.result.total_samples
        if total is not None:  # the run's samples so far, for its summary once resumed
            state.update(samples_trained=total)
        if maps := self._id_map_totals():  # type: ignore[attr-defined]  # all ranks (collective), for its log
            state.update(id_map_counts=counters(with_earlier_counts(maps, run.id_map_earlier)))
        if self.eval_pending is not None:  # stopped during a mid-run evaluation
            state.update(eval_pending=self.eval_pending)
        if getattr(self, "progressive", None) is not None:  # a followed stream: its partition so far (collective)
            state.update(self._stream_state())  # type: ignore[attr-defined]
        optimizers = {"dense": self.dense_opt, "embedding": self.emb_opt}
        self.checkpoints.save(run.step, self.embeddings, self.model, optimizers, state)

    def _say_changed_settings(self, step: int) -> None:
        """Rank 0, resumed at `step`, before the run's config.yaml is replaced: the settings that differ
        from the ones it names (a flag left out of the resuming command changes a setting silently
        otherwise; what may change applies from the resumed step, docs/checkpoints.md)."""
        previous = self.out_dir / "config.yaml"
        try:
            saved = yaml.safe_load(previous.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):  # none, or not readable: nothing to compare
            return
        if not isinstance(saved, dict):
            return
        changes = config_changes(saved, self.cfg, ignore=_HOW_LONG | {"output_dir"})  # the folder: no setting
        if changes:
            more = f"; and {len(changes) - 10} more" if len(changes) > 10 else ""
            log.warning(
                f"resumed at step {step} with settings other than {previous}'s, from this step on: "
                + "; ".join(changes[:10]) + more
            )

    def _withdraw_results(self, step: int) -> None:
        """Rank 0, resumed at `step`: model.pt and summary.json in the run folder are the results of
        the run this one continues (or replaces, from an older checkpoint). They are removed, so that
        `neorec eval` and `export` read the newest checkpoint until this run writes its own at its end
        (a stop or failure before then leaves none, never an older run's under the new config.yaml).
        The checkpoints of steps after `step` go too, for the same reason: resumed from an older one,
        they are of the run this one replaces, and a plain `--resume` would continue them."""
        later = self.checkpoints.resumed_at(step)
        if later:
            log.warning(
                f"{self.checkpoints.root}: removed {', '.join(p.name for p in later)}, of steps after step "
                f"{step}, which this resumed run trains again"
            )
        gone = [name for name in RESULTS if (self.out_dir / name).is_file()]
        for name in gone:
            (self.out_dir / name).unlink()
        if gone:
            fsync_dir(self.out_dir)
            log.warning(
                f"{self.out_dir}: removed {' and '.join(gone)}, of the run before this one resumed at step "
                f"{step}; it writes them again when it ends (until then, export reads its newest "
                "checkpoint, and eval waits for the end)"
            )

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint `resume` names (None: none yet, start from step 0), once its data position is
        known to fit this run's reader (same batch size, processes and shuffle settings): an
        incompatible resume is refused before anything is said, loaded or written."""
        path = self.checkpoints.to_resume(self.resume)
        if path is None:
            if self.is_main:
                log.info(f"no checkpoint in {self.checkpoints.root}; starting from step 0")
            return None
        manifest = read_manifest(path)
        state = manifest.get("state")
        check_steps_left(self.cfg.train.max_steps, manifest.get("step"), path)
        check_resume(self.data, state, path)
        check_data_settings(self.cfg.data, state, path)
        check_training_files(self.source, state, path)
        saved, now = (state or {}).get("dense_optimizer"), self.cfg.train.dense_optimizer.name
        if saved is not None and saved != now:
            raise ConfigError(
                f"checkpoint {path} was trained with train.dense_optimizer.name {saved}, this run has {now}: "
                f"its state does not fit; continue with {saved}, or start a new run (--overwrite)"
            )
        return path

    def _resume(self, path: Path) -> tuple[int, int, dict | None]:
        """(step, epoch, data position: see RankData.position) of checkpoint `path`, loaded."""
        optimizers = {"dense": self.dense_opt, "embedding": self.emb_opt}
        manifest = load_checkpoint(path, self.embeddings, self.model, optimizers)
        state = manifest["state"]
        for key, now in (("batch_size", self.cfg.data.batch_size), ("seed", self.cfg.seed)):
            if state.get(key) != now:
                raise CheckpointError(
                    f"checkpoint {path} was trained with {key} {state.get(key)}, this run has {now}: resuming exactly "
                    f"needs the same {'data.batch_size' if key == 'batch_size' else 'seed'}"
                )
        self.checkpoints.last_step = manifest["step"]
        if self.is_main:
            log.info(f"resumed from {path} (step {manifest['step']})")
        return manifest["step"], state["epoch"], state

    def _diverged(self, loss: float, step: int) -> TrainingDiverged:
        msg = f"loss became {loss} at step {step + 1} (the weights after step {step} gave it); "
        msg += "lower the learning rates"
        if self.checkpoints.enabled:
            kept = self.checkpoints.set_aside_diverged(step)
            msg += (
                f". The last good checkpoint is {kept}; `neorec train --resume` continues from it"
                if kept is not None
                else ". No checkpoint was saved before it"
            )
        return TrainingDiverged(msg)
