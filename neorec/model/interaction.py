"""Feature interactions: DLRM's pairwise dot products and DCNv2's cross network."""

from __future__ import annotations

import torch
from torch import nn


class PairwiseDots(torch.autograd.Function):
    """dots[b, k] = <x[b, i_k], x[b, j_k]> for the (i_k, j_k) pairs given by flat = i * F + j.

    Forward is one batched Gram product and a gather. Backward forms one symmetric matrix
    S = G + G^T, where G holds each pair's incoming gradient at (i, j), and returns S @ x: one
    batched product, where autograd through bmm(x, x^T) and the advanced index would take two
    products, a scatter and a sum of the two operand gradients (about 3x slower on CPU at
    B=2048, F=27, D=64). A pair on the diagonal (self-interaction) gets 2 * g * x_i, as it must.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Under autocast both products run in its dtype; backward (where autocast is off) uses the
        # same dtype explicitly and hands back a gradient of x's own dtype.
        xc = x.to(autocast_dtype(x))
        ctx.save_for_backward(xc, flat)
        ctx.input_dtype = x.dtype
        b, f, _ = x.shape
        return torch.bmm(xc, xc.transpose(1, 2)).view(b, f * f).index_select(1, flat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        xc, flat = ctx.saved_tensors
        b, f, _ = xc.shape
        sym = xc.new_zeros(b, f * f).index_copy_(1, flat, grad.to(xc.dtype).contiguous()).view(b, f, f)
        sym = sym + sym.transpose(1, 2)
        return torch.bmm(sym, xc).to(ctx.input_dtype), None


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would compute a product of x in: its own dtype when autocast is off."""
    kind = x.device.type
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        enabled, dtype = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    elif kind == "cpu":
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    else:
        enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return dtype if enabled and x.is_floating_point() else x.dtype


class DotInteraction(nn.Module):
    """Pairwise dot products between the bottom-MLP output and every pooled embedding (DLRM).

    Output: [dense_out, dot(i, j) for i > j] (strict lower triangle; with self_interaction the
    diagonal too), as in facebookresearch/dlrm's `interact_features` with arch-interaction-op=dot.
    """

    def __init__(self, num_vectors: int, self_interaction: bool = False) -> None:
        super().__init__()
        self.num_vectors = num_vectors
        offset = 0 if self_interaction else -1
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=offset)
        self.register_buffer("flat", rows * num_vectors + cols, persistent=False)

    @property
    def num_pairs(self) -> int:
        return self.flat.numel()

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        """vectors [B, (1 + F) * d]: the bottom-MLP output, then the F pooled embeddings (as
        EmbeddingCollection.pooled_after gives them) -> [B, d + num_pairs]."""
        b = vectors.shape[0]
        d = vectors.shape[1] // self.num_vectors
        dots = PairwiseDots.apply(vectors.view(b, self.num_vectors, d), self.flat)
        return torch.cat([vectors[:, :d], dots], dim=1)


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
