"""The config sections of continuous training: following a folder of partitions (`data.follow`) and
publishing servable snapshots (`snapshot`). Re-exported by neorec.config.schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from neorec.config.base import Strict


class FollowConfig(Strict):
    """Train over the partitions of a folder in order, then on each new one as it lands
    (neorec/data/follow.py; docs/continuous.md)."""

    dir: str = Field(
        min_length=1, description="the folder whose subfolders are the partitions (e.g. one per day)"
    )
    order: Literal["name", "mtime"] = Field(
        "name",
        description="partition order: by folder name, or by the time the partition was completed (its marker)",
    )
    marker: str = Field(
        "_SUCCESS",
        min_length=1,
        description="Parquet partitions are complete when this file is in them (Hive/Spark write _SUCCESS); "
        "preprocessed partitions when their manifest.json says complete",
    )
    poll_seconds: float = Field(5.0, gt=0, description="seconds between looks for a new complete partition")
    idle_timeout: float | None = Field(
        None,
        ge=0,
        description="end the run when no new partition has come for this many seconds (None: wait for ever)",
    )
    until: str | None = Field(
        None, min_length=1, description="end the run after training the partition of this name"
    )
    bad_partitions: Literal["stop", "skip"] = Field(
        "stop",
        description="a partition that cannot be read, is truncated or has another schema: stop the run naming it, "
        "or skip it (logged by name) and go on",
    )
    verify: bool = Field(
        True,
        description="read each partition (this rank's share) through once, checking every value, before training "
        "on it, so that a damaged file stops or skips the whole partition, never half of it",
    )
    held_out_batches: int = Field(
        0,
        ge=0,
        description="the first N batches of each partition are scored (progressive metrics) but not trained on",
    )
    window_batches: int = Field(
        200,
        gt=0,
        description="progressive metrics over a sliding window of this many batches (besides per partition)",
    )
    expire_after_partitions: int | None = Field(
        None,
        gt=0,
        description="managed-collision tables: free the rows of ids not seen in the last N partitions, at the start "
        "of each partition (None: ids leave only when their bucket is full)",
    )
    expire_after_steps: int | None = Field(
        None,
        gt=0,
        description="managed-collision tables: free the rows of ids not seen in the last N training steps, checked "
        "every max(1, N // 8) steps (None: not by steps; with expire_after_partitions too, either frees an id)",
    )


class SnapshotConfig(Strict):
    """Exports published for serving during training (neorec/train/snapshots.py): each a complete,
    verified folder; a `LATEST` file names the newest."""

    dir: str | None = Field(
        None, description="folder of the snapshots and LATEST (default: <output_dir>/snapshots)"
    )
    every_steps: int | None = Field(
        None, gt=0, description="publish every N training steps (None: not by steps)"
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        description="publish when this many minutes passed since the last snapshot (None: not by time)",
    )
    keep: int = Field(
        3, ge=2, description="snapshots kept (the newest K; the one LATEST names is never removed)"
    )
    format: Literal["nrx", "pt2"] = Field(
        "nrx", description="nrx: one neorec file; pt2: a torch.export program"
    )
    quantize: Literal["int8", "int4", "int2"] | None = Field(
        None, description="row-wise quantized tables (None: fp32)"
    )

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_minutes is not None

    @model_validator(mode="after")
    def _something_due(self) -> SnapshotConfig:
        if self.dir is not None and not self.enabled:
            raise ValueError("snapshot.dir is set but neither every_steps nor every_minutes: set one of them")
        return self
