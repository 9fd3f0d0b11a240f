"""Plain-PyTorch ranking models written the facebookresearch/dlrm way: the baselines neorec is measured against.

One nn.EmbeddingBag(sparse=True) per table and a bottom MLP, then either DLRM's pairwise dot
interaction and a top MLP (PlainDLRM) or DCNv2's low-rank cross network and a deep MLP (PlainDCNv2,
as in the MLPerf DLRM-DCNv2 reference); sparse embedding gradients go to a torch.optim optimizer that
accepts them (SGD, Adagrad). No neorec code.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


def mlp(sizes: list[int], last_sigmoid: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        n, m = sizes[i], sizes[i + 1]
        lin = nn.Linear(n, m)
        lin.weight.data = torch.tensor(np.random.normal(0.0, math.sqrt(2 / (m + n)), (m, n)), dtype=torch.float32)
        lin.bias.data = torch.tensor(np.random.normal(0.0, math.sqrt(1 / m), m), dtype=torch.float32)
        layers.append(lin)
        layers.append(nn.Sigmoid() if (last_sigmoid and i == len(sizes) - 2) else nn.ReLU())
    return nn.Sequential(*layers)


def embedding_bags(rows: list[int], dim: int) -> nn.ModuleList:
    """One sum-pooling EmbeddingBag with sparse gradients per table, dlrm's uniform(+-1/sqrt(n)) init."""
    bags = nn.ModuleList()
    for n in rows:
        bag = nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
        bound = math.sqrt(1 / n)
        bag.weight.data = torch.empty(n, dim).uniform_(-bound, bound)
        bags.append(bag)
    return bags


class PlainDLRM(nn.Module):
    def __init__(self, num_dense: int, rows: list[int], dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.emb = embedding_bags(rows, dim)
        self.bot = mlp([num_dense] + bottom)
        f = len(rows) + 1
        self.li, self.lj = torch.tril_indices(f, f, offset=-1)
        self.top = mlp([dim + f * (f - 1) // 2] + top + [1])
        self.top = self.top[:-1]  # logits out; the loss applies the sigmoid

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bot(dense)
        ly = [bag(i, o) for bag, i, o in zip(self.emb, indices, offsets, strict=True)]
        t = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, x.shape[1])
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


class PlainDCNv2(nn.Module):
    """[bottom MLP(dense), pooled embeddings] -> low-rank cross layers x0 * (W (V x) + b) + x -> deep MLP."""

    def __init__(self, num_dense: int, rows: list[int], dim: int, bottom: list[int], top: list[int],
                 cross_layers: int, low_rank: int | None) -> None:  # fmt: skip
        super().__init__()
        self.emb = embedding_bags(rows, dim)
        self.bot = mlp([num_dense] + bottom)
        width = bottom[-1] + dim * len(rows)
        rank = low_rank or width  # full-rank cross weights: V is the identity
        self.v = nn.ModuleList((nn.Linear(width, rank, bias=False) if low_rank else nn.Identity())
                               for _ in range(cross_layers))  # fmt: skip
        self.w = nn.ModuleList(nn.Linear(rank, width) for _ in range(cross_layers))
        self.top = mlp([width] + top + [1])[:-1]  # logits out; the loss applies the sigmoid

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        ly = [bag(i, o) for bag, i, o in zip(self.emb, indices, offsets, strict=True)]
        x0 = torch.cat([self.bot(dense)] + ly, dim=1)
        x = x0
        for v, w in zip(self.v, self.w, strict=True):
            x = x0 * w(v(x)) + x
        return self.top(x).squeeze(1)


def split_sparse(sparse) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """neorec's feature-major SparseBatch -> dlrm's per-table (indices, offsets) lists (done outside the timing)."""
    b = sparse.batch_size
    bounds = sparse.offset_per_key()
    offsets = sparse.offsets()
    idx, off = [], []
    for f in range(len(sparse.keys)):
        idx.append(sparse.values[bounds[f] : bounds[f + 1]])
        off.append(offsets[f * b : (f + 1) * b] - bounds[f])
    return idx, off
