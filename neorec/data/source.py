"""The contract between a data source and the trainer.

A source knows its features (and the number of distinct ids each can take, which sizes the tables),
its dense width, and yields `Batch`es for training and for held-out evaluation. Sources: the
synthetic Criteo-like generator, raw Criteo TSV files, MovieLens, preprocessed shards, Parquet files.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from neorec.data.batch import Batch


@dataclass
class FeatureSpec:
    name: str
    num_ids: int  # ids lie in [0, num_ids): the rows the feature's table needs
    multi_hot: bool = False  # True when a sample can carry several ids (or none) for this feature
    weighted: bool = False  # True when the ids come with per-id weights


@dataclass
class SourceInfo:
    num_dense: int
    features: list[FeatureSpec]
    num_train_samples: int | None = None  # samples per training epoch, when known up front
    notes: dict[str, object] = field(default_factory=dict)  # e.g. the teacher's AUC ceiling

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]


class DataSource(Protocol):
    info: SourceInfo

    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        """Training batches of one epoch (a stream source may be endless; the trainer counts steps)."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """The held-out set, the same samples on every call."""
        ...


# Optional, used by neorec/data/ranks.py when a source has them:
#   train_slices(batch_size, epoch, rank, world_size) -> Iterator[Batch]: only rank's slice of every
#       training batch (synthetic, shards)
#   rank, world_size (attributes) and eval_slices(batch_size): a reader of one rank's part of the data
#       (the sharded reader)
#   state() -> dict and load_state(state): the settings a saved position depends on, and a restart
#       after state["samples"] samples of epoch state["epoch"] without reading them
