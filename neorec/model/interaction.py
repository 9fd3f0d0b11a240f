"""Feature interactions: DLRM's pairwise dot products and DCNv2's cross network."""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """Pairwise dot products between the bottom-MLP output and every pooled embedding (DLRM).

    Output: [dense_out, dot(i, j) for i > j] (strict lower triangle; with self_interaction the
    diagonal too), as in facebookresearch/dlrm's `interact_features` with arch-interaction-op=dot.
    """

    def __init__(self, num_vectors: int, self_interaction: bool = False) -> None:
        super().__init__()
        offset = 0 if self_interaction else -1
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=offset)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    @property
    def num_pairs(self) -> int:
        return self.rows.numel()

    def forward(self, dense_out: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """dense_out [B, d], embeddings [B, F * d] -> [B, d + num_pairs]."""
        b, d = dense_out.shape
        vectors = torch.cat([dense_out, embeddings], dim=1).view(b, -1, d)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense_out, gram[:, self.rows, self.cols]], dim=1)


class CrossNetwork(nn.Module):
    """DCNv2 cross layers: x_{l+1} = x0 * (W_l x_l + b_l) + x_l, with optional low-rank W = U V^T."""

    def __init__(self, dim: int, num_layers: int, low_rank: int | None = None) -> None:
        super().__init__()
        self.low_rank = low_rank
        if low_rank is None:
            self.w = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))
        else:
            self.v = nn.ModuleList(nn.Linear(dim, low_rank, bias=False) for _ in range(num_layers))
            self.w = nn.ModuleList(nn.Linear(low_rank, dim) for _ in range(num_layers))
        for lin in self.w:
            nn.init.xavier_normal_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for i, w in enumerate(self.w):
            h = w(x) if self.low_rank is None else w(self.v[i](x))
            x = x0 * h + x
        return x
