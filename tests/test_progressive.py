"""Progressive metrics in bounded memory (neorec/metrics/progressive.py) against the exact metrics of
neorec/metrics/evaluation.py on the same scores, and the sliding window against a recount."""

from __future__ import annotations

import json

import pytest
import torch

from neorec.metrics.evaluation import binary_metrics
from neorec.metrics.progressive import LOGIT_RANGE, ScoreHistogram, SlidingWindow


def batches(num: int, size: int = 500, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        logits = torch.randn(size, generator=g) * 2
        labels = (torch.rand(size, generator=g) < torch.sigmoid(logits * 0.8 + 0.3)).float()
        out.append((logits, labels))
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 40.0])  # narrow, ordinary, and beyond the bins' range
def test_histogram_metrics_match_the_exact_ones(scale):
    data = [(x * scale, y) for x, y in batches(6)]
    h = ScoreHistogram()
    for x, y in data:
        h.add(x, y)
    logits, labels = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    exact = binary_metrics(logits, labels)
    got = h.metrics()
    assert got["num_samples"] == exact["num_samples"] == 3000
    ends = binary_metrics(logits.clamp(-LOGIT_RANGE, LOGIT_RANGE), labels)  # the end bins tie
    assert abs(got["auc"] - ends["auc"]) < 1e-3
    assert got["log_loss"] == pytest.approx(exact["log_loss"], rel=1e-9)
    assert got["ne"] == pytest.approx(exact["ne"], rel=1e-9)
    assert got["calibration"] == pytest.approx(exact["calibration"], rel=1e-9)
    assert got["ctr"] == pytest.approx(exact["ctr"], rel=1e-12)


def test_merged_histograms_and_their_saved_state_give_the_same_metrics():
    data = batches(4)
    whole, a, b = ScoreHistogram(), ScoreHistogram(), ScoreHistogram()
    for i, (x, y) in enumerate(data):
        whole.add(x, y)
        (a if i % 2 else b).add(x, y)
    a.merge(b)
    assert torch.equal(a.counts, whole.counts)
    restored = ScoreHistogram.from_state(json.loads(json.dumps(whole.state())))
    assert restored.metrics() == whole.metrics()
    assert len(whole.state()["bins"]) <= 2000  # one per sample at most
    assert all(v != v for k, v in ScoreHistogram().metrics().items() if k != "num_samples")  # nan when empty
    with pytest.raises(ValueError, match="outside"):
        ScoreHistogram.from_state({"bins": [1 << 20], "counts": [1], "sums": [1, 0, 0, 0]})


def test_the_window_holds_exactly_its_last_batches():
    data = batches(7)
    window = SlidingWindow(3)
    for x, y in data:
        window.add(x, y)
    recount = ScoreHistogram()
    for x, y in data[-3:]:
        recount.add(x, y)
    assert torch.equal(window.total.counts, recount.counts)
    got, want = window.total.metrics(), recount.metrics()
    assert got["auc"] == want["auc"] and got["num_samples"] == 1500
    assert got["log_loss"] == pytest.approx(want["log_loss"], rel=1e-12)


def test_a_restored_window_goes_on_bitwise_as_the_saved_one():
    """A window saved mid-stream and restored (through JSON, as a checkpoint keeps it) gives the same
    counts and float sums as the one never saved, batch after batch; restored into a smaller window,
    it holds the newest batches."""
    data = batches(9, size=50)
    window = SlidingWindow(3)
    for x, y in data[:5]:
        window.add(x, y)
    restored = SlidingWindow.from_state(3, json.loads(json.dumps(window.state())))
    for x, y in data[5:]:
        window.add(x, y)
        restored.add(x, y)
        assert torch.equal(restored.total.counts, window.total.counts)
        assert torch.equal(restored.total.sums, window.total.sums)
    smaller = SlidingWindow.from_state(2, window.state())
    recount = ScoreHistogram()
    for x, y in data[-2:]:
        recount.add(x, y)
    assert torch.equal(smaller.total.counts, recount.counts)
    assert smaller.total.metrics()["num_samples"] == 100
