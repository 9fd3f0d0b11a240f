"""The trainer's progressive validation of a followed stream (data.follow): every batch is scored before
the model trains on it, and the scores are counted per partition and over a sliding window
(neorec/metrics/progressive.py).

The scores of a trained batch are the outputs of its own training forward, computed with the weights
before its update: nothing is run twice. The first `held_out_batches` batches of each partition are
scored by a forward in evaluation mode (id maps unchanged) and not trained on; they are counted apart.

Over several processes each rank counts its own samples; the histograms are summed over the ranks
when metrics are read (collective: at a partition's end and at log steps, which every rank reaches
after the same batch). A checkpoint holds every rank's histograms and window as they stand (gathered
to rank 0, which writes them); a resumed rank takes its own back, so the sums go on in the order they
would have without the restart, and every metrics line after it is the uninterrupted run's.
"""

from __future__ import annotations

import json

import torch

from neorec.distributed.comms import Comms
from neorec.metrics.progressive import ScoreHistogram, SlidingWindow


class ProgressiveValidation:
    """Histograms of the partition being read (trained batches, held-out batches) and the window."""

    def __init__(self, window_batches: int, comms: Comms | None, device: torch.device) -> None:
        self.comms, self.device = comms, device
        self.partition = ScoreHistogram(device)
        self.held_out = ScoreHistogram(device)
        self.window = SlidingWindow(window_batches, device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor, held_out: bool = False) -> None:
        """Count one batch's scores (this rank's samples)."""
        if held_out:
            self.held_out.add(logits, labels)
        else:
            self.partition.add(logits, labels)
            self.window.add(logits, labels)

    def end_partition(self) -> dict[str, float]:
        """The metrics of the partition just finished, over all ranks (collective), and a fresh start:
        auc, ne, log_loss, calibration, ctr, num_samples, and held_out_* for its held-out batches."""
        out = self._summed(self.partition).metrics()
        held = self._summed(self.held_out)
        if held.num_samples:
            out.update({f"held_out_{k}": v for k, v in held.metrics().items()})
        self.partition.clear()
        self.held_out.clear()
        return out

    def window_metrics(self) -> dict[str, float]:
        """The metrics of the last window_batches batches, over all ranks (collective)."""
        return self._summed(self.window.total).metrics()

    def state(self) -> dict:
        """Every rank's partition and held-out histograms and window (collective), for a checkpoint:
        {"ranks": [rank 0's, rank 1's, ...]}."""
        mine = {
            "partition": self.partition.state(),
            "held_out": self.held_out.state(),
            "window": self.window.state(),
        }
        if self.comms is None:
            return {"ranks": [mine]}
        payload = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
        every = self.comms.all_gather_bytes(payload, "eval").wait()
        return {"ranks": [json.loads(p.cpu().numpy().tobytes()) for p in every]}

    def load_state(self, state: dict | None, rank: int, world_size: int) -> None:
        """Continue this rank's counts and window from a checkpoint's `state`. A checkpoint that holds
        the partition's sums only (no "ranks"): rank 0 takes them, the other ranks start from zero, so
        that the sum over the ranks is the saved one, and the window starts empty."""
        if not state:
            return
        if "ranks" not in state:
            if rank == 0:
                self.partition = ScoreHistogram.from_state(state["partition"], self.device)
                self.held_out = ScoreHistogram.from_state(state["held_out"], self.device)
            return
        if len(state["ranks"]) != world_size:
            raise ValueError(f"progressive state of {len(state['ranks'])} ranks, this run has {world_size}")
        mine = state["ranks"][rank]
        self.partition = ScoreHistogram.from_state(mine["partition"], self.device)
        self.held_out = ScoreHistogram.from_state(mine["held_out"], self.device)
        self.window = SlidingWindow.from_state(self.window.num_batches, mine["window"], self.device)

    def _summed(self, h: ScoreHistogram) -> ScoreHistogram:
        if self.comms is None:
            return h
        out = ScoreHistogram("cpu")
        out.counts = self.comms.sum_over_ranks(h.counts.cpu(), "eval")
        out.sums = self.comms.sum_over_ranks(h.sums.cpu(), "eval")
        return out
