"""The seam between the model and table storage.

Every embedding collection (the per-table reference, the fused table-batched engine, the sharded
collection) takes a SparseBatch and returns pooled vectors [B, sum of feature dims] in
`feature_names` order (`pooled_after` puts the model's dense vector in front). The model never
sees how rows are stored or updated.

Embedding rows have their own optimizer: `build_optimizer()` returns an object with the
torch.optim.Optimizer surface (`step`, `zero_grad`, `param_groups`, `state_dict`,
`load_state_dict`) so the trainer drives the learning-rate schedule the same way for every engine.
A fused engine applies the update inside backward; its optimizer's `step` then only counts steps.
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig, feature_order
from neorec.sparse import SparseBatch


class EmbeddingCollection(nn.Module):
    """Base class: pooled lookups of many features from many tables."""

    def __init__(self, tables: list[TableConfig], optimizer: EmbeddingOptimizerConfig) -> None:
        super().__init__()
        self.tables = list(tables)
        self.optimizer_config = optimizer
        self.feature_names = feature_order(self.tables)
        dims = {f: t.dim for t in self.tables for f in t.features}
        self.feature_dims = [dims[f] for f in self.feature_names]

    @property
    def output_dim(self) -> int:
        return sum(self.feature_dims)

    def forward(self, sparse: SparseBatch) -> torch.Tensor:  # [B, output_dim]
        raise NotImplementedError

    def pooled_after(self, prefix: torch.Tensor, sparse: SparseBatch) -> torch.Tensor:
        """[prefix | pooled]: [B, prefix width + output_dim], the models' input to their interaction
        (the bottom MLP's output first). A collection that assembles its output from pieces anyway
        (the sharded one) writes both in the same pass instead of concatenating afterwards."""
        return torch.cat([prefix, self(sparse)], dim=1)

    def split(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-feature views of a pooled output."""
        return dict(zip(self.feature_names, pooled.split(self.feature_dims, dim=1), strict=True))

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError
