"""Progressive validation: metrics of scores a model gave to samples before it trained on them, kept in
bounded memory over a stream of any length.

`ScoreHistogram` counts logits per class in BINS fixed bins over [-LOGIT_RANGE, LOGIT_RANGE] (outside:
the end bins) and keeps exact float64 sums. From them:
- auc: the ROC AUC of the binned scores: scores closer than a bin's width (2 LOGIT_RANGE / BINS, 0.0005
  in logit), and scores beyond the same end of the range, count as ties (1/2 a pair), so it differs
  from the exact AUC only by such pairs: below 1e-3 unless nearly all scores fall within a few
  hundredths of a logit of each other, or many beyond +-LOGIT_RANGE;
- log_loss, ne (normalized entropy: log loss / entropy of the observed rate), calibration (mean
  predicted rate / observed rate), ctr, num_samples: exact, as neorec/metrics/evaluation.py computes
  them on the same scores (up to the order of float64 additions).
Histograms add (`merge`), so ranks sum theirs, and a histogram is a few kilobytes of state in a
checkpoint (`state`, `from_state`: the non-zero bins only) whatever the number of samples (in memory,
2 x BINS int64: 1 MiB). Counting stays on the scores' device: nothing is read back until metrics are
asked for.

`SlidingWindow` keeps the histogram of the last `num_batches` batches: each batch's bin indices are
kept (4 bytes a sample) so that the batch leaving the window is subtracted exactly. Its `state` holds
those indices (base64, about 5.3 bytes a sample) and the float sums as they stand, so a window
restored from it goes on bitwise as the one saved.
"""

from __future__ import annotations

import base64
import math
from collections import deque

import numpy as np
import torch
import torch.nn.functional as F

BINS = 1 << 16
LOGIT_RANGE = 16.0
_SUMS = ("num_samples", "positives", "sum_probability", "sum_log_loss")


def bin_index(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """label * BINS + bin of each logit (int64): the flat index into a [2, BINS] count table."""
    x = logits.detach().reshape(-1).to(torch.float32)
    b = ((x.clamp(-LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) * (BINS / (2 * LOGIT_RANGE))).to(torch.int64)
    return b.clamp_(0, BINS - 1) + labels.detach().reshape(-1).to(torch.int64) * BINS


def batch_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[samples, positives, sum of probabilities, sum of log losses] (float64) of one batch."""
    x = logits.detach().reshape(-1).to(torch.float64)
    y = labels.detach().reshape(-1).to(torch.float64)
    loss = F.binary_cross_entropy_with_logits(x, y, reduction="sum")
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), y.sum(),
                        torch.sigmoid(x).sum(), loss])  # fmt: skip


class ScoreHistogram:
    """Counts of logits per class and bin, and exact sums (module docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.counts = torch.zeros(2 * BINS, dtype=torch.int64, device=device)
        self.sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch: `logits` [B] (or [B, 1]) and 0/1 `labels` [B]."""
        self.add_binned(bin_index(logits, labels), batch_sums(logits, labels))

    def add_binned(self, index: torch.Tensor, sums: torch.Tensor, sign: int = 1) -> None:
        self.counts.index_add_(0, index, torch.full_like(index, sign))
        self.sums.add_(sums, alpha=sign)

    def merge(self, other: ScoreHistogram) -> None:
        self.counts += other.counts.to(self.counts.device)
        self.sums += other.sums.to(self.sums.device)

    def clear(self) -> None:
        self.counts.zero_()
        self.sums.zero_()

    @property
    def num_samples(self) -> int:
        return int(self.sums[0])

    def metrics(self) -> dict[str, float]:
        """auc, ne, log_loss, calibration, ctr, num_samples (nan where undefined: no sample, one class)."""
        neg, pos = self.counts.cpu().to(torch.float64).view(2, BINS)
        n, positives, sum_p, sum_loss = self.sums.tolist()
        num_pos, num_neg = float(pos.sum()), float(neg.sum())
        nan = float("nan")
        if num_pos and num_neg:
            below = torch.cumsum(neg, 0) - neg  # negatives in lower bins
            auc = float((pos * (below + 0.5 * neg)).sum()) / (num_pos * num_neg)
        else:
            auc = nan
        ctr = positives / n if n else nan
        log_loss = sum_loss / n if n else nan
        ne = nan
        if 0 < ctr < 1:
            ne = log_loss / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
        calibration = (sum_p / n) / ctr if n and ctr > 0 else nan
        return {
            "auc": auc,
            "ne": ne,
            "log_loss": log_loss,
            "calibration": calibration,
            "ctr": ctr,
            "num_samples": int(n),
        }

    # ---- checkpoint state ------------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-ready: the non-zero bins and their counts, and the sums."""
        counts = self.counts.cpu()
        nonzero = torch.nonzero(counts).view(-1)
        return {
            "bins": nonzero.tolist(),
            "counts": counts[nonzero].tolist(),
            "sums": self.sums.cpu().tolist(),
        }

    @classmethod
    def from_state(cls, state: dict, device: torch.device | str = "cpu") -> ScoreHistogram:
        h = cls(device)
        bins = torch.tensor(state["bins"], dtype=torch.int64)
        if bins.numel() and not bool(((bins >= 0) & (bins < 2 * BINS)).all()):
            raise ValueError(f"histogram bins outside [0, {2 * BINS})")
        h.counts[bins.to(h.counts.device)] = torch.tensor(
            state["counts"], dtype=torch.int64, device=h.counts.device
        )
        h.sums = torch.tensor(state["sums"], dtype=torch.float64, device=h.sums.device)
        if h.sums.numel() != len(_SUMS):
            raise ValueError(f"histogram sums: {h.sums.numel()} values, expected {len(_SUMS)}")
        return h


class SlidingWindow:
    """The histogram of the last `num_batches` batches added."""

    def __init__(self, num_batches: int, device: torch.device | str = "cpu") -> None:
        self.num_batches = num_batches
        self.total = ScoreHistogram(device)
        self._batches: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        index, sums = bin_index(logits, labels), batch_sums(logits, labels)
        self.total.add_binned(index, sums)
        self._batches.append((index.to(torch.int32), sums))
        if len(self._batches) > self.num_batches:
            old_index, old_sums = self._batches.popleft()
            self.total.add_binned(old_index.to(torch.int64), old_sums, sign=-1)

    # ---- checkpoint state ------------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-ready: each batch's bin indices (base64 of little-endian int32) and sums, oldest first,
        and the window's sums as they stand (a recount would add them in another order)."""
        batches = [
            [base64.b64encode(index.cpu().numpy().astype("<i4").tobytes()).decode(), sums.cpu().tolist()]
            for index, sums in self._batches
        ]
        return {"batches": batches, "sums": self.total.sums.cpu().tolist()}

    @classmethod
    def from_state(cls, num_batches: int, state: dict, device: torch.device | str = "cpu") -> SlidingWindow:
        """The window `state` describes; with fewer batches than it holds (window_batches lowered), its
        newest `num_batches`, their sums recounted."""
        w = cls(num_batches, device)
        saved = state["batches"]
        for text, sums in saved[-num_batches:]:
            index = torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<i4").astype(np.int32))
            if index.numel() and not bool(((index >= 0) & (index < 2 * BINS)).all()):
                raise ValueError(f"window bins outside [0, {2 * BINS})")
            batch_sums = torch.tensor(sums, dtype=torch.float64, device=w.total.sums.device)
            if batch_sums.numel() != len(_SUMS):
                raise ValueError(f"window batch sums: {batch_sums.numel()} values, expected {len(_SUMS)}")
            index = index.to(w.total.counts.device)
            w.total.add_binned(index.to(torch.int64), batch_sums)
            w._batches.append((index, batch_sums))
        if len(saved) <= num_batches:
            w.total.sums = torch.tensor(state["sums"], dtype=torch.float64, device=w.total.sums.device)
            if w.total.sums.numel() != len(_SUMS):
                raise ValueError(f"window sums: {w.total.sums.numel()} values, expected {len(_SUMS)}")
        return w
