import math

import numpy as np
import torch

from neorec.metrics.auc import auc
from neorec.metrics.evaluation import binary_metrics, probability_metrics


def brute_auc(s, y):
    pos = [a for a, b in zip(s, y, strict=True) if b == 1]
    neg = [a for a, b in zip(s, y, strict=True) if b == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = rng.integers(2, 60)
        s = rng.integers(0, 5, n).astype(float)  # many ties
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        assert math.isclose(auc(torch.tensor(s), torch.tensor(y)), brute_auc(s, y), rel_tol=1e-12)


def test_auc_one_class_is_nan():
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_binary_metrics_values():
    p = torch.tensor([0.9, 0.2, 0.6, 0.4], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 0.0, 1.0])
    m = binary_metrics(torch.logit(p), y)
    assert probability_metrics(p, y) == m
    ll = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.4)) / 4
    assert math.isclose(m["log_loss"], ll, rel_tol=1e-9)
    assert math.isclose(m["ne"], ll / math.log(2), rel_tol=1e-9)  # base rate 0.5 -> entropy log 2
    assert m["accuracy"] == 0.5
    assert math.isclose(m["calibration"], 0.525 / 0.5, rel_tol=1e-9)
    assert m["auc"] == 0.75


def exact_log_loss(z, y):
    """Mean binary cross-entropy of logits, by hand in float64: -log sigmoid(z) = log(1 + e^-z)."""
    pairs = zip(z, y, strict=True)
    losses = [math.log1p(math.exp(-a)) if b else a + math.log1p(math.exp(-a)) for a, b in pairs]
    return sum(losses) / len(z)


def test_confident_logits_keep_their_order_and_log_loss():
    """Logits beyond +-17 round to probability 0 or 1 in float32: the metrics of the logits keep
    their order (no ties) and their exact log loss."""
    z = [-30.0, -25.0, -20.0, -19.0, 18.0, 20.0, 25.0, 30.0]
    y = [0, 1, 0, 1, 0, 1, 0, 1]
    m = binary_metrics(torch.tensor(z), torch.tensor(y, dtype=torch.float32))
    assert m["auc"] == brute_auc(z, y) == 0.625
    assert math.isclose(m["log_loss"], exact_log_loss(z, y), rel_tol=1e-12)
    assert m["accuracy"] == 0.5


def test_a_nan_score_makes_the_metrics_nan_in_any_order():
    for y in ([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]):
        z = torch.tensor([float("nan"), 0.3, -0.2, 1.0])
        m = binary_metrics(z, torch.tensor(y))
        assert all(math.isnan(m[k]) for k in ("auc", "log_loss", "ne", "accuracy", "calibration"))
        assert m["num_samples"] == 4 and m["ctr"] == 0.5
        assert math.isnan(auc(z, torch.tensor(y)))


def test_labels_that_are_not_one_0_or_1_per_score_are_refused():
    """-1/+1 or 0/2 labels gave another AUC (0.28 or 0.92 for 0.71) and a negative ctr, more labels
    than scores an AUC of the first ones: refused, as the readers refuse them."""
    import pytest

    from neorec.errors import DataError

    scores, labels = torch.tensor([0.1, 0.9, 0.4, 0.7]), torch.tensor([0.0, 1.0, 1.0, 0.0])
    for bad in (2 * labels - 1, 2 * labels, torch.tensor([0.0, 1.0, float("nan"), 0.0])):
        for metrics in (auc, binary_metrics, probability_metrics):
            with pytest.raises(DataError, match=r"label \d is .*; labels are 0 or 1"):
                metrics(scores, bad)
    with pytest.raises(DataError, match="5 labels for 4 scores: one label each"):
        auc(scores, torch.cat([labels, labels[:1]]))
    with pytest.raises(DataError, match="3 labels for 4 logits"):
        binary_metrics(scores, labels[:3])
    assert auc(scores, labels.bool()) == auc(scores, labels) == 0.75


def test_accuracy_counts_a_probability_of_one_half_as_a_click():
    m = binary_metrics(torch.tensor([0.0, -1.0]), torch.tensor([1.0, 0.0]))  # logit 0: p = 0.5
    assert m["accuracy"] == 1.0


def test_probabilities_of_exactly_0_or_1_are_clamped_for_the_log_loss():
    """A predictions file may hold 0 and 1: the log loss stays finite, as of probabilities 1e-7 away."""
    m = probability_metrics(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    assert math.isfinite(m["log_loss"]) and math.isclose(m["log_loss"], -math.log(1e-7), rel_tol=1e-6)
