"""Exact ROC AUC (ties get half credit), computed by sorting: O(n log n), no binning."""

from __future__ import annotations

import torch

from neorec.errors import DataError


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count 1/2).

    Returns nan when only one class is present, or when a score is NaN (it has no rank).
    """
    scores = scores.detach().reshape(-1).to(torch.float64)
    labels = checked_labels(labels, scores.numel(), "scores")
    n_pos = float(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0 or bool(torch.isnan(scores).any()):
        return float("nan")
    order = torch.argsort(scores, stable=True)
    s, y = scores[order], labels[order]
    # average 1-based rank of each group of tied scores (Mann-Whitney U with midranks)
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    mid_rank = ends - (counts.to(torch.float64) - 1) / 2
    rank_sum_pos = float((mid_rank[inverse] * y).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def checked_labels(labels: torch.Tensor, count: int, of: str) -> torch.Tensor:
    """`labels` flat in float64, one for each of `count` `of` (scores, logits); a DataError unless
    there are as many and each is exactly 0 or 1 (a -1/+1 or 0/2 label would give another AUC)."""
    y = labels.detach().reshape(-1).to(torch.float64)
    if y.numel() != count:
        raise DataError(f"{y.numel()} labels for {count} {of}: one label each")
    bad = (y != 0) & (y != 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise DataError(f"label {i} is {float(y[i])!r}; labels are 0 or 1")
    return y
