"""Snapshots for serving during training (`snapshot:`): when one is due, and exporting it.

A snapshot of step S is exported from the checkpoint of step S (the trainer saves one first when the
checkpoint schedule has not), by rank 0 alone, with neorec's own export (neorec/serving/export.py:
fp32 or quantized tables, nrx or pt2), then published into the snapshots folder behind LATEST
(neorec/serving/snapshots.py). Reading the checkpoint makes a snapshot of a sharded run whole in one
process, and leaves training untouched: the export runs with the global RNG states put back after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from neorec.checkpoint.periodic import is_due
from neorec.config.continuous import SnapshotConfig
from neorec.data.source import DataSource
from neorec.distributed.topology import Topology
from neorec.serving.snapshots import (
    SnapshotError,
    latest_snapshot,
    publish,
    snapshot_name,
    withdraw_after,
)

log = logging.getLogger(__name__)


class PeriodicSnapshots:
    """The trainer's snapshot settings: every N steps and/or every M minutes, keep the last K."""

    def __init__(
        self, cfg: SnapshotConfig, root: Path, topo: Topology, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """clock: seconds from a fixed origin, read for every_minutes (a test gives its own)."""
        self.cfg, self.root, self.topo, self.clock = cfg, root, topo, clock
        self.last_step: int | None = None
        self._last_time = clock()

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def due(self, step: int) -> bool:
        """Whether to publish after `step` (collective with every_minutes: rank 0's clock decides)."""
        c = self.cfg
        return is_due(step, c.every_steps, c.every_minutes, self.clock() - self._last_time, self.topo)

    def missing(self, step: int, due: bool | None) -> bool:
        """A run resumed at `step`: whether the snapshot of its checkpoint's step was due but is not the
        one LATEST names (the job stopped between the checkpoint and the publish, or between the
        snapshot's folder and LATEST). due: the checkpoint's `snapshot_due`; a checkpoint that does not
        say (older, or saved when none was due) counts as due when its step is one of every_steps."""
        c = self.cfg
        if not self.enabled or step == 0:
            return False
        if not due and (c.every_steps is None or step % c.every_steps):
            return False
        try:
            return latest_snapshot(self.root, verify=False).name != snapshot_name(step)
        except SnapshotError:  # none published, or LATEST unreadable (the publish rewrites it)
            return True

    def resumed_at(self, step: int) -> None:
        """Rank 0, a run resumed at `step`: the snapshots of later steps, of the run this one replaces,
        are withdrawn (serving.snapshots.withdraw_after), whether or not this run publishes any."""
        if self.topo.rank != 0:
            return
        gone = withdraw_after(self.root, step)
        if gone:
            try:
                now = f"LATEST names {latest_snapshot(self.root, verify=False).name}"
            except SnapshotError:
                now = "none is published"
            log.warning(
                f"{self.root}: removed {', '.join(p.name for p in gone)}, of steps after step {step}, which "
                f"this resumed run trains again; {now}"
            )

    def publish(self, step: int, checkpoint: Path, config: Path, source: DataSource) -> Path | None:
        """Rank 0: export checkpoint `checkpoint` (of `step`; `config` the run's config.yaml) and publish
        it. Returns the snapshot folder (None on other ranks)."""
        self.last_step, self._last_time = step, self.clock()
        if self.topo.rank != 0:
            return None
        from neorec.serving.export import export_model

        c = self.cfg
        name = "model.nrx" if c.format == "nrx" else "pt2"

        def write(folder: Path) -> dict:
            with torch.random.fork_rng(devices=[]):  # building the export's model draws from the global RNG
                report = export_model(
                    checkpoint, folder / name, measure=False, config=config, format=c.format, quantize=c.quantize,
                    source=source, run_snapshot=True,
                )  # fmt: skip
            return {
                "format": c.format,
                "quantize": c.quantize,
                "checkpoint": checkpoint.name,
                "bytes": report.num_bytes,
            }

        def verify(folder: Path) -> None:
            if c.format == "nrx":
                from neorec.serving.file_format import read_export

                read_export(folder / name)  # every checksum of the file
            else:
                from neorec.serving.pt2_file import read_pt2

                read_pt2(folder / name)

        start = time.perf_counter()
        folder = publish(self.root, step, write, verify, c.keep)
        log.info(f"snapshot {folder} published (step {step}, {time.perf_counter() - start:.1f} s)")
        return folder
