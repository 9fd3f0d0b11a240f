"""Held-out metrics for click prediction: AUC, normalized entropy, log loss, accuracy, calibration."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from neorec.metrics.auc import auc, checked_labels

# probabilities (not logits) are kept this far from 0 and 1 in the log loss: a float32 probability is
# exactly 0 or 1 beyond about +-17 in logit, where the log loss of the logit is still finite
PROBABILITY_EPS = 1e-7

MetricsOf = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]  # (scores, labels) -> metrics


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """All metrics of one evaluation pass, from the model's logits and 0/1 labels, in float64.

    - auc: exact ROC AUC of the logits (the same as of the probabilities, without float32's rounding
      of large logits to a probability of exactly 1, which would tie them).
    - log_loss: mean binary cross-entropy, exact for any logit.
    - ne: normalized entropy = log_loss / entropy of the observed click rate (He et al. 2014);
      below 1 means better than always predicting the base rate.
    - accuracy: at probability 0.5 (logit 0).
    - calibration: mean predicted CTR / observed CTR (1 is perfect).
    A NaN logit makes every metric of the pass NaN but ctr and num_samples.
    """
    z = logits.detach().reshape(-1).to(torch.float64)
    y = checked_labels(labels, z.numel(), "logits")
    n = y.numel()
    ctr = float(y.mean()) if n else float("nan")
    if not n or bool(torch.isnan(z).any()):
        nan = float("nan")
        return {"auc": nan, "ne": nan, "log_loss": nan, "accuracy": nan, "calibration": nan, "ctr": ctr,
                "num_samples": n}  # fmt: skip
    # -log p = softplus(-z), -log(1 - p) = softplus(z): no rounding of p near 0 or 1
    log_loss = float((y * F.softplus(-z) + (1 - y) * F.softplus(z)).mean())
    if 0 < ctr < 1:
        base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
        ne = log_loss / base
    else:
        ne = float("nan")
    return {
        "auc": auc(z, y),
        "ne": ne,
        "log_loss": log_loss,
        "accuracy": float(((z >= 0).to(torch.float64) == y).to(torch.float64).mean()),
        "calibration": float(torch.sigmoid(z).mean()) / ctr if ctr > 0 else float("nan"),
        "ctr": ctr,
        "num_samples": n,
    }


def probability_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """binary_metrics of predicted probabilities (a predictions file's), kept PROBABILITY_EPS from 0
    and 1: a probability of exactly 0 or 1 has lost its logit, and counts as that far from it."""
    p = probs.detach().reshape(-1).to(torch.float64).clamp(PROBABILITY_EPS, 1 - PROBABILITY_EPS)
    return binary_metrics(torch.logit(p), labels)
