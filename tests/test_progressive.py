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


def test_held_out_batches_stay_out_of_the_window():
    """Held-out batches are scored, not trained: the partition's held-out metrics count them, the
    sliding window of trained batches does not."""
    from neorec.train.progressive import ProgressiveValidation

    pv = ProgressiveValidation(5, None, torch.device("cpu"))
    pv.add(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([1.0, 0.0, 0.0]), held_out=True)
    pv.add(torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0]))
    assert pv.window_metrics()["num_samples"] == 2


def test_each_rank_resumes_with_its_own_saved_counts():
    """Rank r takes the histograms and window rank r saved (summed over ranks when metrics are made);
    a state of one process without per-rank parts goes to rank 0 alone, so nothing is counted twice."""
    from neorec.train.progressive import ProgressiveValidation

    states = []
    for n in (2, 3):
        pv = ProgressiveValidation(3, None, torch.device("cpu"))
        pv.add(torch.zeros(n), torch.ones(n))
        states.append(pv.state()["ranks"][0])
    pv = ProgressiveValidation(3, None, torch.device("cpu"))
    pv.load_state({"ranks": states}, rank=1, world_size=2)
    assert pv.partition.num_samples == 3 and pv.window.total.num_samples == 3
    h = ScoreHistogram()
    h.add(torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0]))
    unsplit = {"partition": h.state(), "held_out": ScoreHistogram().state()}
    for rank, expected in ((0, 2), (1, 0)):
        pv = ProgressiveValidation(3, None, torch.device("cpu"))
        pv.load_state(unsplit, rank=rank, world_size=2)
        assert pv.partition.num_samples == expected
