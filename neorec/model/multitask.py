"""Multi-task heads (`model.arch: multitask`): one trunk, one logit per task, weighted per-task BCE.

The trunk is DLRM or DCNv2 (`model.trunk`) built with one output unit per task: everything up to the
top MLP's last layer is shared, and each task's head is one row of that last linear layer. Labels
come as [B, T], columns in the order of `model.tasks` (the source makes them by name:
neorec/data/movielens.py, neorec/data/synthetic.py).

    loss = sum_t weight_t * mean_b BCE(logit[b, t], label[b, t])

Held-out metrics are binary_metrics per task, named `<task>/<metric>` (like/auc, like/log_loss, ...);
the first task's are also given under the plain names (auc, log_loss, ...), so the curves, the
summary table and tools that read `eval_auc` show the primary task. `weighted_log_loss` is the
held-out value of the training objective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neorec.data.batch import Batch
from neorec.metrics.evaluation import MetricsOf, binary_metrics
from neorec.model.dlrm import DLRM, DCNv2


class TaskHeads:
    """The multi-task part of a trunk with one output per task: its loss and its metrics."""

    task_names: list[str]
    task_weights: list[float]

    def set_tasks(self, names: list[str], weights: list[float]) -> None:
        assert len(names) == len(weights) == self.top[-1].out_features  # type: ignore[attr-defined]
        self.task_names, self.task_weights = list(names), [float(w) for w in weights]

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """sum_t w_t * BCE_t; logits [B] (one task) or [B, T], labels [B, T]."""
        num = len(self.task_names)
        logits, labels = logits.view(-1, num), batch.labels.view(-1, num)
        total = None
        for t, weight in enumerate(self.task_weights):
            term = weight * F.binary_cross_entropy_with_logits(logits[:, t], labels[:, t])
            total = term if total is None else total + term
        return total

    def held_out_metrics(
        self, scores: torch.Tensor, labels: torch.Tensor, metrics_of: MetricsOf = binary_metrics
    ) -> dict[str, float]:
        """Per-task metrics of scores and labels [N, T] (see the module docstring): of logits, or
        with metrics_of=probability_metrics of probabilities."""
        num = len(self.task_names)
        scores, labels = scores.reshape(-1, num), labels.reshape(-1, num)
        out: dict[str, float] = {}
        weighted = 0.0
        for t, (name, weight) in enumerate(zip(self.task_names, self.task_weights, strict=True)):
            metrics = metrics_of(scores[:, t], labels[:, t])
            if t == 0:
                out.update(metrics)
            out.update({f"{name}/{k}": v for k, v in metrics.items() if k != "num_samples"})
            weighted += weight * metrics["log_loss"]
        out["weighted_log_loss"] = weighted
        return out


class MultiTaskDLRM(TaskHeads, DLRM):
    """DLRM trunk, one head per task."""


class MultiTaskDCNv2(TaskHeads, DCNv2):
    """DCNv2 trunk, one head per task."""
