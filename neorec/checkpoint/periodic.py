"""Checkpoints during training: when to save, where, and what to keep after a divergence."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from neorec.checkpoint.load import checkpoint_folder, latest_checkpoint
from neorec.checkpoint.save import checkpoint_name, prune, save_checkpoint
from neorec.config.schema import CheckpointConfig
from neorec.distributed.topology import Topology


def is_due(
    step: int, every_steps: int | None, every_minutes: float | None, elapsed_seconds: float, topo: Topology
) -> bool:
    """A periodic action (checkpoint, snapshot) after `step`: every `every_steps` steps and/or once
    `every_minutes` have passed since the last one. With every_minutes over several processes, rank 0's
    clock decides (one tiny broadcast per step) so that all ranks act together."""
    due = every_steps is not None and step % every_steps == 0
    if every_minutes is not None:
        late = elapsed_seconds >= 60.0 * every_minutes
        if topo.world_size > 1:
            import torch.distributed as dist

            flag = torch.tensor([int(late)])
            dist.broadcast(flag, 0)
            late = bool(flag.item())
        due = due or late
    return due


class PeriodicCheckpoints:
    """The trainer's checkpoint settings: every N steps and/or every M minutes, keep the last K."""

    def __init__(self, cfg: CheckpointConfig, root: Path, topo: Topology) -> None:
        self.cfg, self.root, self.topo = cfg, root, topo
        self.last_step: int | None = None  # step of the newest checkpoint saved or loaded by this run
        self._last_time = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def due(self, step: int) -> bool:
        """Whether to save after `step` (see `is_due`)."""
        c = self.cfg
        return is_due(step, c.every_steps, c.every_minutes, time.monotonic() - self._last_time, self.topo)

    def save(self, step: int, embeddings, model, optimizers: dict, state: dict) -> Path:
        path = save_checkpoint(self.root, step, embeddings, model, optimizers, state, keep=self.cfg.keep)
        self.last_step, self._last_time = step, time.monotonic()
        return path

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def to_resume(self, resume: bool | str | Path) -> Path | None:
        """`--resume`: the newest complete checkpoint (None when there is none); `--resume PATH`:
        that checkpoint folder (CheckpointError when it is not one; the newer ones go once it is
        loaded, `resumed_at`)."""
        return self.latest() if resume is True else checkpoint_folder(resume)

    def resumed_at(self, step: int) -> list[Path]:
        """Rank 0, a run resumed at `step` (`--resume PATH` may name an older checkpoint): this run's
        checkpoints of later steps belong to the run it replaces and are removed now, not at its first
        save, so that a stop before that save leaves no newer checkpoint for a plain `--resume` to
        continue. Returns those removed (none on other ranks)."""
        if self.topo.rank != 0 or not self.root.is_dir():
            return []
        return prune(self.root, step, None)

    def set_aside_diverged(self, step: int) -> Path | None:
        """After a non-finite loss at step `step` + 1: a checkpoint of step `step` holds the weights
        that gave it, so it is renamed diverged-step-... (resume skips it). Returns the newest
        checkpoint left (rank 0 renames; every rank returns the same answer)."""
        newest = self.latest()
        if newest is not None and newest.name == checkpoint_name(step):
            if self.topo.rank == 0:
                os.replace(newest, newest.with_name("diverged-" + newest.name))
            return self._previous(step)
        return newest

    def _previous(self, step: int) -> Path | None:
        from neorec.checkpoint.save import list_checkpoints

        older = [p for p in list_checkpoints(self.root) if int(p.name[5:]) < step]
        return older[-1] if older else None
