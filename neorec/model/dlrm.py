"""The two ranking models: DLRM (dot interaction) and DCNv2 (cross network).

Both read dense features through a bottom MLP, pooled embeddings through an EmbeddingCollection
(any engine: reference, fused, sharded), combine them, and end in a top MLP producing one logit.
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.collection import EmbeddingCollection
from neorec.errors import ConfigError
from neorec.model.interaction import CrossNetwork, DotInteraction
from neorec.model.mlp import build_mlp


class DLRM(nn.Module):
    """Bottom MLP -> pairwise dot interaction with the pooled embeddings -> top MLP -> logit."""

    def __init__(
        self,
        num_dense: int,
        embeddings: EmbeddingCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        self_interaction: bool = False,
    ) -> None:
        super().__init__()
        dims = set(embeddings.feature_dims)
        if len(dims) != 1:
            raise ConfigError(f"model.arch=dlrm needs one embedding dim for all tables, got {sorted(dims)}")
        dim = dims.pop()
        if bottom_mlp[-1] != dim:
            raise ConfigError(
                f"model.bottom_mlp must end in the embedding dim {dim} for dot interaction, got {bottom_mlp}"
            )
        self.embeddings = embeddings
        self.bottom = build_mlp(num_dense, bottom_mlp)
        self.interaction = DotInteraction(1 + len(embeddings.feature_names), self_interaction)
        self.top = build_mlp(dim + self.interaction.num_pairs, top_mlp + [1], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B]."""
        dense_out = self.bottom(batch.dense)
        pooled = self.embeddings(batch.sparse)
        return self.top(self.interaction(dense_out, pooled)).squeeze(1)


class DCNv2(nn.Module):
    """[bottom MLP(dense), pooled embeddings] -> cross network -> deep MLP -> logit (stacked DCNv2)."""

    def __init__(
        self,
        num_dense: int,
        embeddings: EmbeddingCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        cross_layers: int = 3,
        low_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.bottom = build_mlp(num_dense, bottom_mlp)
        width = bottom_mlp[-1] + embeddings.output_dim
        self.cross = CrossNetwork(width, cross_layers, low_rank)
        self.top = build_mlp(width, top_mlp + [1], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        x0 = torch.cat([self.bottom(batch.dense), self.embeddings(batch.sparse)], dim=1)
        return self.top(self.cross(x0)).squeeze(1)
