"""A plain-PyTorch DLRM written the facebookresearch/dlrm way: the baseline neorec is measured against.

One nn.EmbeddingBag(sparse=True) per table, a bottom MLP, pairwise dot interaction, a top MLP; sparse
embedding gradients go to a torch.optim optimizer that accepts them (SGD, Adagrad). No neorec code.
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


class PlainDLRM(nn.Module):
    def __init__(self, num_dense: int, rows: list[int], dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.emb = nn.ModuleList()
        for n in rows:
            bag = nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
            bound = math.sqrt(1 / n)
            bag.weight.data = torch.empty(n, dim).uniform_(-bound, bound)
            self.emb.append(bag)
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
