"""The two ranking models: DLRM (dot interaction) and DCNv2 (cross network).

Both read dense features through a bottom MLP, pooled embeddings through an EmbeddingCollection
(any engine: reference, fused, sharded), combine them, and end in a top MLP producing one logit
(`num_outputs` logits for multi-task heads: neorec/model/multitask.py).

`precision="bf16"` runs the MLPs and the interaction under bf16 autocast (mixed precision: weights,
gradients and the dense optimizer stay fp32; matrix products take bf16 inputs and accumulate in
fp32). On GPUs and on CPUs with bf16 matrix instructions (AMX on Intel Sapphire Rapids and later,
AVX512-BF16 on AMD Zen 4) those products are several times faster. The embedding lookup stays outside autocast (fp32 pooling), and so does the last
layer, so that logits keep fp32 resolution: bf16's 8-bit mantissa would tie many scores and blunt
the AUC.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.collection import EmbeddingCollection
from neorec.errors import ConfigError
from neorec.model.interaction import CrossNetwork, DotInteraction
from neorec.model.mlp import build_mlp


def dense_autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The autocast context for the dense math of a model (a no-op for fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def check_pooled_only(embeddings: EmbeddingCollection, arch: str) -> None:
    """The ranking models read pooled vectors only: a table with pooling none would be looked up for nothing."""
    if embeddings.sequence_names:
        tables = [t.name for t in embeddings.tables if t.pooling == "none"]
        raise ConfigError(
            f"model.arch={arch} reads pooled embeddings only, but table(s) {tables} have pooling none "
            "(sequence features); set embedding.tables.<name>.pooling to sum or mean, or use a sequential model"
        )


def last_layer(top: nn.Sequential, hidden: torch.Tensor) -> torch.Tensor:
    """The top MLP's final layer in fp32, outside any autocast: logits [B] (one output unit) or [B, T]."""
    with torch.autocast(hidden.device.type, enabled=False):
        out = top[-1](hidden.float())
    return out.squeeze(1) if out.shape[1] == 1 else out


class DLRM(nn.Module):
    """Bottom MLP -> pairwise dot interaction with the pooled embeddings -> top MLP -> logit."""

    def __init__(
        self,
        num_dense: int,
        embeddings: EmbeddingCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        self_interaction: bool = False,
        precision: str = "fp32",
        num_outputs: int = 1,
    ) -> None:
        super().__init__()
        self.precision = precision
        check_pooled_only(embeddings, "dlrm")
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
        self.top = build_mlp(dim + self.interaction.num_pairs, top_mlp + [num_outputs], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B] ([B, num_outputs] for several outputs)."""
        finish = self.embeddings.start_pooled(batch.sparse)  # an exchange travels during the bottom MLP
        vectors = finish(self.bottom_stage(batch.dense))  # [dense_out | pooled]
        return self.top_stage(vectors)

    def bottom_stage(self, dense: torch.Tensor) -> torch.Tensor:
        """The bottom MLP: dense features [B, num_dense] -> [B, d]."""
        with dense_autocast(dense.device, self.precision):
            return self.bottom(dense)

    def top_stage(self, vectors: torch.Tensor) -> torch.Tensor:
        """Interaction and top MLP: [dense_out | pooled] -> logits [B] ([B, num_outputs])."""
        with dense_autocast(vectors.device, self.precision):
            hidden = self.top[:-1](self.interaction(vectors))
        return last_layer(self.top, hidden)


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
        precision: str = "fp32",
        num_outputs: int = 1,
    ) -> None:
        super().__init__()
        self.precision = precision
        check_pooled_only(embeddings, "dcnv2")
        self.embeddings = embeddings
        self.bottom = build_mlp(num_dense, bottom_mlp)
        width = bottom_mlp[-1] + embeddings.output_dim
        self.cross = CrossNetwork(width, cross_layers, low_rank)
        self.top = build_mlp(width, top_mlp + [num_outputs], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B] ([B, num_outputs] for several outputs)."""
        finish = self.embeddings.start_pooled(batch.sparse)  # an exchange travels during the bottom MLP
        x0 = finish(self.bottom_stage(batch.dense))  # [dense_out | pooled]
        return self.top_stage(x0)

    def bottom_stage(self, dense: torch.Tensor) -> torch.Tensor:
        """The bottom MLP: dense features [B, num_dense] -> [B, bottom_mlp[-1]] in fp32."""
        with dense_autocast(dense.device, self.precision):
            return self.bottom(dense).float()

    def top_stage(self, x0: torch.Tensor) -> torch.Tensor:
        """Cross network and deep MLP: [dense_out | pooled] -> logits [B] ([B, num_outputs])."""
        with dense_autocast(x0.device, self.precision):
            hidden = self.top[:-1](self.cross(x0))
        return last_layer(self.top, hidden)
