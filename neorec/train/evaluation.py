"""Evaluation on the held-out set: scoring it (`evaluate`) and when a run does so (`eval_schedule`).

A run evaluates at its end on the whole held-out set, and in between every `train.eval_every` steps
(or after each epoch). With `train.eval_every: auto` a run of known length evaluates AUTO_EVALS times,
the mid-run evaluations on a bounded sample of the held-out set so that they cost little.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from neorec.config.schema import TrainConfig
from neorec.data.ranks import RankData
from neorec.data.sample_digest import SampleDigest
from neorec.data.source import DataSource
from neorec.distributed.comms import Comms
from neorec.metrics.evaluation import binary_metrics
from neorec.utils.progress import progress_bar

AUTO_EVALS = 5  # train.eval_every auto: evaluations per run, the final one included
AUTO_EVAL_SAMPLES = 32768  # ... and held-out samples scored by each mid-run one (eval_max_batches unset)


class EvaluationStopped(Exception):  # noqa: N818 - a requested stop, not an error
    """A stop signal came during an evaluation, which ended before its next batch."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"evaluation stopped by signal {signum}")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    source: DataSource,
    batch_size: int,
    max_batches: int | None = None,
    comms: Comms | None = None,
    progress: bool = False,
    stop: Callable[[], int] | None = None,
    digest: SampleDigest | None = None,
) -> dict[str, float]:
    """Metrics of `model` on the source's whole held-out set (its first `max_batches` batches). Over
    W processes (`comms`) each rank scores its rows of every batch (neorec/data/ranks.py) and scores
    and labels are gathered, so every rank computes the metrics of the whole set. progress: a bar on
    rank 0 when the pass takes more than a second. A model may score the set itself (`evaluate_held_out`:
    two-tower retrieval) or turn scores and labels into its own metrics (`held_out_metrics`: per task).
    stop: called before each batch (by every rank: StopSignals.agreed, collective), a signal number
    ends the evaluation with EvaluationStopped, so that a stop asked for during a long evaluation is
    not kept waiting for its end (a scheduler's grace period is short). digest: takes the held-out
    samples scored (each rank its own, padding left out)."""
    was_training = model.training
    model.eval()
    if (own := getattr(model, "evaluate_held_out", None)) is not None:
        metrics = own(source, batch_size, max_batches)
        model.train(was_training)
        return metrics
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # train.device
    logits, labels = [], []
    world = comms.topo.world_size if comms is not None else 1
    rank = comms.topo.rank if comms is not None else 0
    data = RankData(source, batch_size, rank, world)
    bar = progress_bar(max_batches, "evaluation", progress and rank == 0, unit="batch", delay=1.0, leave=False)
    if digest is not None:
        digest.started = True
    for i, (batch, n) in enumerate(data.eval_slices(batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        if stop is not None and (signum := stop()):
            if bar is not None:
                bar.close()
            model.train(was_training)
            raise EvaluationStopped(signum)
        if bar is not None:
            bar.update(1)
        if digest is not None:  # this rank's rows of the batch's n samples are its share's first ones
            digest.add(batch, max(0, min(len(batch), n - rank * -(-n // world))))
        scores = model(batch.to(device) if device.type != "cpu" else batch).float().cpu()  # logits
        if world == 1:
            logits.append(scores)
            labels.append(batch.labels.cpu())
        else:
            logits.append(comms.all_gather(scores, "eval")[:n])
            labels.append(comms.all_gather(batch.labels.cpu(), "eval")[:n])
    if bar is not None:
        bar.close()
    model.train(was_training)
    if not logits:
        return {}
    return getattr(model, "held_out_metrics", binary_metrics)(torch.cat(logits), torch.cat(labels))


def eval_schedule(t: TrainConfig, eval_batch_size: int, total: int) -> tuple[int | None, int | None]:
    """(steps between mid-run evaluations, None: after each epoch; batches each of them scores) of a
    run of `total` steps (0: unknown). train.eval_every auto: AUTO_EVALS evaluations over a run of
    known length, the final one on the whole held-out set, the others on about AUTO_EVAL_SAMPLES
    samples; a run too short for that evaluates at its end only."""
    if t.eval_every != "auto":
        return t.eval_every, t.eval_max_batches
    if not total:  # length unknown (a stream): after each epoch
        return None, t.eval_max_batches
    every = math.ceil(total / AUTO_EVALS) if total >= 2 * AUTO_EVALS else total
    batches = t.eval_max_batches or max(1, AUTO_EVAL_SAMPLES // eval_batch_size)
    return every, batches
