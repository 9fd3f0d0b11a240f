"""Multi-layer perceptron as in facebookresearch/dlrm: Linear + ReLU, optional sigmoid-free last layer."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_mlp(in_dim: int, sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers of `sizes`, ReLU after each (after the last too unless last_activation=False).

    The ReLUs work in place (a Linear's backward does not need its output, the ReLU's does), which
    spares a pass over a fresh [B, out] buffer per layer in eager mode; compiled (train.compile),
    inductor does the same. Init follows facebookresearch/dlrm: weights N(0, sqrt(2 / (fan_in + fan_out))), bias N(0, sqrt(1 / fan_out)).
    """
    layers: list[nn.Module] = []
    d = in_dim
    for i, out in enumerate(sizes):
        lin = nn.Linear(d, out)
        with torch.no_grad():
            lin.weight.normal_(0.0, math.sqrt(2.0 / (d + out)))
            lin.bias.normal_(0.0, math.sqrt(1.0 / out))
        layers.append(lin)
        if last_activation or i < len(sizes) - 1:
            layers.append(nn.ReLU(inplace=True))  # on the product's own buffer: no second [B, out] tensor
        d = out
    return nn.Sequential(*layers)
