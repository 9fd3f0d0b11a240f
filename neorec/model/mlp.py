"""Multi-layer perceptron as in facebookresearch/dlrm: Linear + ReLU, optional sigmoid-free last layer."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_mlp(in_dim: int, sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers of `sizes`, ReLU after each (after the last too unless last_activation=False).

    The ReLUs work in place on their Linear's output (whose backward does not need it): one [B, out]
    buffer per layer instead of two while a step runs; the step takes as long either way
    (benchmarks/dense_step.py). Init follows facebookresearch/dlrm: weights N(0, sqrt(2 / (fan_in + fan_out))), bias N(0, sqrt(1 / fan_out)).
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
