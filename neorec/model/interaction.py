"""Feature interactions: DLRM's pairwise dot products and DCNv2's cross network."""

from __future__ import annotations

import torch
from torch import nn


class DotInteractionFn(torch.autograd.Function):
    """[x[:, 0], dots] with dots[b, k] = <x[b, i_k], x[b, j_k]> for the pairs flat = i * F + j.

    Forward is one batched Gram product and a gather of the pairs. Backward returns S @ x (one
    batched product), where S is the symmetric matrix holding each pair's incoming gradient at both
    (i, j) and (j, i): S is gathered straight from the incoming gradient (`sym`: for each of the
    F * F positions, the column it reads) in one pass, and the gradient of the x[:, 0] prefix is
    added to row 0 of the product. Autograd through bmm(x, x^T), an advanced index and a concat would
    take two products, a scatter, zero-filled buffers for the prefix and the sum of the operand
    gradients. A pair on the diagonal (self-interaction) reads a doubled copy of its gradient, since
    d<x_i, x_i>/dx_i = 2 x_i.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, flat: torch.Tensor, sym: torch.Tensor, diag: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        # Under autocast the products run in its dtype; backward (where autocast is off) uses the
        # same dtype explicitly and hands back a gradient of x's own dtype.
        xc = x.to(autocast_dtype(x))
        ctx.save_for_backward(xc, sym, diag)
        ctx.input_dtype = x.dtype
        b, f, _ = x.shape
        dots = torch.bmm(xc, xc.transpose(1, 2)).view(b, f * f).index_select(1, flat)
        return torch.cat([x[:, 0], dots.to(x.dtype)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        xc, sym, diag = ctx.saved_tensors
        b, f, d = xc.shape
        pairs = grad[:, d:]
        # the column each diagonal position reads: zeros, or the doubled self-interaction gradients
        extra = pairs.index_select(1, diag) * 2 if diag.numel() else pairs.new_zeros(b, 1)
        s = torch.cat([pairs, extra], dim=1).to(xc.dtype).index_select(1, sym).view(b, f, f)
        dx = torch.bmm(s, xc).to(ctx.input_dtype)
        dx[:, 0] += grad[:, :d]
        return dx, None, None, None


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
        n = num_vectors
        rows, cols = torch.tril_indices(n, n, offset=0 if self_interaction else -1)
        self.register_buffer("flat", rows * n + cols, persistent=False)
        # backward's gather: position (i, j) of the symmetric gradient reads pair (max, min); the
        # diagonal reads the column after the pairs (zeros), or with self-interaction column
        # num_pairs + i (its pair's gradient, doubled), whose pairs `diag` lists
        pair = torch.full((n, n), -1, dtype=torch.long)
        pair[rows, cols] = torch.arange(rows.numel())
        pair = torch.maximum(pair, pair.T)
        diagonal = torch.arange(n)
        if self_interaction:
            diag = pair[diagonal, diagonal].clone()
            pair[diagonal, diagonal] = rows.numel() + diagonal
        else:
            diag = torch.zeros(0, dtype=torch.long)
            pair[diagonal, diagonal] = rows.numel()
        self.register_buffer("sym", pair.reshape(-1), persistent=False)
        self.register_buffer("diag", diag, persistent=False)

    @property
    def num_pairs(self) -> int:
        return self.flat.numel()

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        """vectors [B, (1 + F) * d]: the bottom-MLP output, then the F pooled embeddings (as
        EmbeddingCollection.pooled_after gives them) -> [B, d + num_pairs]."""
        b = vectors.shape[0]
        d = vectors.shape[1] // self.num_vectors
        return DotInteractionFn.apply(vectors.view(b, self.num_vectors, d), self.flat, self.sym, self.diag)


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
