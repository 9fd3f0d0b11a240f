"""Held-out metrics for click prediction: AUC, normalized entropy, log loss, accuracy, calibration."""

from __future__ import annotations

import math

import torch

from neorec.metrics.auc import auc


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """All metrics of one evaluation pass, from predicted click probabilities and 0/1 labels.

    - auc: exact ROC AUC.
    - log_loss: mean binary cross-entropy.
    - ne: normalized entropy = log_loss / entropy of the observed click rate (He et al. 2014);
      below 1 means better than always predicting the base rate.
    - accuracy: at threshold 0.5.
    - calibration: mean predicted CTR / observed CTR (1 is perfect).
    """
    p = probs.detach().reshape(-1).to(torch.float64).clamp(1e-7, 1 - 1e-7)
    y = labels.detach().reshape(-1).to(torch.float64)
    n = y.numel()
    ctr = float(y.mean()) if n else float("nan")
    log_loss = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean()) if n else float("nan")
    if 0 < ctr < 1:
        base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
        ne = log_loss / base
    else:
        ne = float("nan")
    return {
        "auc": auc(p, y),
        "ne": ne,
        "log_loss": log_loss,
        "accuracy": float(((p >= 0.5).to(torch.float64) == y).to(torch.float64).mean()) if n else float("nan"),
        "calibration": float(p.mean()) / ctr if ctr > 0 else float("nan"),
        "ctr": ctr,
        "num_samples": n,
    }
