"""The seam between the model and table storage.

Every embedding collection (the per-table reference, the fused table-batched engine, the sharded
collection) takes a SparseBatch and returns pooled vectors [B, sum of feature dims] in
`feature_names` order (`pooled_after` puts the model's dense vector in front). The model never
sees how rows are stored or updated.

Tables with `pooling: none` are not pooled: their features (`sequence_names`, dims
`sequence_dims`) come out as JaggedRows, one row per id. `embed(sparse)` returns both, the pooled
vectors and the sequences, from one lookup (and, sharded, one exchange); `forward(sparse)` is its
pooled part, so `feature_names`, `feature_dims` and `output_dim` speak of pooled features only.

Every engine checks each batch's ids against their tables before it looks anything up
(`self.bounds`, neorec/sparse/bounds.py; `bounds_check` "error", "warn" or "off"): an id outside its
table would otherwise read and train another table's rows. `dropped_ids()` counts what warn dropped.

Embedding rows have their own optimizer: `build_optimizer()` returns an object with the
torch.optim.Optimizer surface (`step`, `zero_grad`, `param_groups`, `state_dict`,
`load_state_dict`) so the trainer drives the learning-rate schedule the same way for every engine.
A fused engine applies the update inside backward; its optimizer's `step` then only counts steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from neorec.embedding.tables import (
    EmbeddingOptimizerConfig,
    TableConfig,
    feature_order,
    pooled_tables,
    sequence_tables,
)
from neorec.sparse import IdBounds, JaggedRows, SparseBatch


class EmbeddingCollection(nn.Module):
    """Base class: pooled lookups (and unpooled sequences) of many features from many tables."""

    def __init__(
        self, tables: list[TableConfig], optimizer: EmbeddingOptimizerConfig, bounds_check: str = "error"
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.optimizer_config = optimizer
        self.bounds = IdBounds.of_tables(self.tables, bounds_check)
        dims = {f: t.dim for t in self.tables for f in t.features}
        self.feature_names = feature_order(pooled_tables(self.tables))
        self.feature_dims = [dims[f] for f in self.feature_names]
        self.sequence_names = feature_order(sequence_tables(self.tables))
        self.sequence_dims = [dims[f] for f in self.sequence_names]

    @property
    def output_dim(self) -> int:
        """Width of the pooled output (sequence features not included)."""
        return sum(self.feature_dims)

    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """(pooled [B, output_dim] in feature_names order, {sequence feature: its rows}) in one pass."""
        raise NotImplementedError

    def forward(self, sparse: SparseBatch) -> torch.Tensor:  # [B, output_dim]
        return self.embed(sparse)[0]

    def pooled_after(self, prefix: torch.Tensor, sparse: SparseBatch) -> torch.Tensor:
        """[prefix | pooled]: [B, prefix width + output_dim], the models' input to their interaction
        (the bottom MLP's output first). A collection that assembles its output from pieces anyway
        (the sharded one) writes both in the same pass instead of concatenating afterwards."""
        return torch.cat([prefix, self(sparse)], dim=1)

    def start_pooled(self, sparse: SparseBatch) -> Callable[[torch.Tensor], torch.Tensor]:
        """pooled_after in two halves: this call starts what can start without the prefix, the
        returned finish(prefix) gives [prefix | pooled]. Models call it before their bottom MLP, so
        that a collection with an exchange to wait for (the sharded one) overlaps it with that MLP;
        here everything happens in finish."""
        return lambda prefix: self.pooled_after(prefix, sparse)

    def dropped_ids(self) -> dict[str, int]:
        """Ids dropped per feature so far because they lay outside their table (bounds_check warn)."""
        return dict(self.bounds.dropped)

    def split(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-feature views of a pooled output."""
        return dict(zip(self.feature_names, pooled.split(self.feature_dims, dim=1), strict=True))

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError


def dropped_ids(model: nn.Module) -> dict[str, int]:
    """Ids dropped per feature by every embedding collection in `model` (bounds_check warn)."""
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, EmbeddingCollection):
            for f, n in m.dropped_ids().items():
                out[f] = out.get(f, 0) + n
    return out
