"""The training loop: fetch batch, forward, loss, backward, step, log. Evaluation on the held-out set."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from neorec.checkpoint import load_checkpoint
from neorec.checkpoint.files import CheckpointError
from neorec.checkpoint.load import read_manifest
from neorec.checkpoint.periodic import PeriodicCheckpoints
from neorec.checkpoint.save import checkpoint_name
from neorec.checkpoint.stream import save_model_state
from neorec.config.load import dump_config
from neorec.config.schema import RunConfig
from neorec.data.device_feed import DeviceFeed
from neorec.data.prefetch import prefetch
from neorec.data.ranks import RankData
from neorec.data.reader_position import check_resume
from neorec.data.source import DataSource
from neorec.distributed.comms import Comms
from neorec.distributed.dense import DenseGradSync
from neorec.distributed.topology import Topology, choose_backend, init_distributed, rank_device
from neorec.embedding.cache.stats import log_values
from neorec.embedding.collection import EmbeddingCollection, dropped_ids
from neorec.embedding.remap import map_log_values
from neorec.errors import ConfigError, DataError, NeorecError
from neorec.metrics.evaluation import binary_metrics
from neorec.model.compile import apply_compile
from neorec.train.build import (
    build_dense_optimizer,
    build_model,
    build_source,
    build_tables,
    dense_parameters,
)
from neorec.train.embeddings import build_embeddings
from neorec.train.logger import MetricsLogger, read_metrics
from neorec.train.pipeline import pipelined
from neorec.train.schedule import lr_multiplier
from neorec.train.signals import StopSignals, TrainingStopped
from neorec.utils.files import write_text
from neorec.utils.host import keep_freed_memory
from neorec.utils.json_values import strict_dumps
from neorec.utils.progress import progress_bar

log = logging.getLogger(__name__)

AUTO_EVALS = 5  # train.eval_every auto: evaluations per run, the final one included
AUTO_EVAL_SAMPLES = 32768  # ... and held-out samples scored by each mid-run one (eval_max_batches unset)


@dataclass
class RunResult:
    steps: int
    samples: int
    train_seconds: float
    losses: list[float] = field(default_factory=list)  # every step's loss, for determinism checks
    eval: dict[str, float] = field(default_factory=dict)
    teacher_auc: float | None = None
    skipped_lines: int = 0  # malformed input lines skipped under the reader's `skip` policy
    out_dir: Path | None = None
    comm_bytes_per_step: dict[str, float] = field(default_factory=dict)  # rank 0's sends, by exchange
    dropped_ids: dict[str, int] = field(default_factory=dict)  # bounds_check warn: per feature, all ranks

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")


def embedding_collection(model: nn.Module) -> EmbeddingCollection:
    return next(m for m in model.modules() if isinstance(m, EmbeddingCollection))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    source: DataSource,
    batch_size: int,
    max_batches: int | None = None,
    comms: Comms | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Metrics of `model` on the source's whole held-out set (its first `max_batches` batches). Over
    W processes (`comms`) each rank scores its rows of every batch (neorec/data/ranks.py) and scores
    and labels are gathered, so every rank computes the metrics of the whole set. progress: a bar on
    rank 0 when the pass takes more than a second. A model may score the set itself (`evaluate_held_out`:
    two-tower retrieval) or turn scores and labels into its own metrics (`held_out_metrics`: per task)."""
    was_training = model.training
    model.eval()
    if (own := getattr(model, "evaluate_held_out", None)) is not None:
        metrics = own(source, batch_size, max_batches)
        model.train(was_training)
        return metrics
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # train.device
    probs, labels = [], []
    world = comms.topo.world_size if comms is not None else 1
    rank = comms.topo.rank if comms is not None else 0
    data = RankData(source, batch_size, rank, world)
    bar = progress_bar(max_batches, "evaluation", progress and rank == 0, unit="batch", delay=1.0, leave=False)
    for i, (batch, n) in enumerate(data.eval_slices(batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        if bar is not None:
            bar.update(1)
        scores = torch.sigmoid(model(batch.to(device) if device.type != "cpu" else batch)).cpu()
        if world == 1:
            probs.append(scores)
            labels.append(batch.labels.cpu())
        else:
            probs.append(comms.all_gather(scores, "eval")[:n])
            labels.append(comms.all_gather(batch.labels.cpu(), "eval")[:n])
    if bar is not None:
        bar.close()
    model.train(was_training)
    if not probs:
        return {}
    return getattr(model, "held_out_metrics", binary_metrics)(torch.cat(probs), torch.cat(labels))


def model_loss(model: nn.Module, outputs: torch.Tensor, batch) -> torch.Tensor:
    """The model's own `loss(outputs, batch)` where it has one (multi-task, two-tower), else BCE of
    one logit per sample."""
    own = getattr(model, "loss", None)
    return own(outputs, batch) if own is not None else F.binary_cross_entropy_with_logits(outputs, batch.labels)


class TrainingDiverged(NeorecError, FloatingPointError):
    """The loss became NaN or infinite; the message names the last good checkpoint."""


class _NoLogger:
    """What ranks other than 0 log to."""

    num_lines = 0

    def log(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class Trainer:
    """Owns a run: data, model, both optimizers, schedule, logs and outputs."""

    def __init__(self, cfg: RunConfig, out_dir: Path | None = None, resume: bool | str | Path = False) -> None:
        """resume: True: fit() continues from the newest complete checkpoint in the checkpoint folder;
        a path: from that checkpoint folder (step-XXXXXXXX)."""
        self.cfg = cfg
        self.resume = resume
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.keep_freed_memory:
            keep_freed_memory()
        self.device = _training_device(cfg)
        self.topo = init_distributed(self.device, cfg.distributed.backend)
        self.comms = Comms(self.topo, transport=cfg.distributed.transport) if self.topo.world_size > 1 else None
        self.is_main = self.topo.rank == 0
        if self.comms is not None and cfg.data.batch_size % self.topo.world_size:
            raise ConfigError(
                f"data.batch_size {cfg.data.batch_size} is the global batch and must divide over "
                f"{self.topo.world_size} processes"
            )
        self.source = build_source(cfg, self.topo, self.device)  # a per-rank reader where the source has one
        self.data = RankData(self.source, cfg.data.batch_size, self.topo.rank, self.topo.world_size)
        self.tables = build_tables(cfg, self.source.info)
        self.embeddings = build_embeddings(cfg, self.tables, self.comms, self.device)
        self.model = build_model(cfg, self.source.info, self.embeddings, self.source, self.comms).to(self.device)
        if cfg.train.compile:
            apply_compile(self.model, self.device)
        dense = dense_parameters(self.model)
        self.dense_opt = build_dense_optimizer(cfg.train.dense_optimizer, dense)
        self.dense_sync = None
        if self.comms is not None:
            d = cfg.distributed
            self.dense_sync = DenseGradSync(dense, self.comms, d.dense_precision, d.dense_bucket_mib)
            self.dense_sync.broadcast_parameters()
        self.timings: dict[str, float] = defaultdict(float)  # seconds per stage, summed over steps
        self.emb_opt = self.embeddings.build_optimizer()
        self._base_lrs = [[g["lr"] for g in opt.param_groups] for opt in (self.dense_opt, self.emb_opt)]
        self.out_dir = Path(out_dir or cfg.resolved_output_dir)
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        self.checkpoints = PeriodicCheckpoints(cfg.checkpoint, root, self.topo)

    def total_steps(self) -> int:
        """Steps the run will train: all epochs, or max_steps where that comes first (0: unknown, a
        stream of unknown length without max_steps)."""
        t = self.cfg.train
        per_epoch = self.data.steps_per_epoch()
        if t.max_steps is not None:
            return min(t.max_steps, t.epochs * per_epoch) if per_epoch else t.max_steps
        return t.epochs * per_epoch if per_epoch else 0

    def _eval_schedule(self, total: int) -> tuple[int | None, int | None]:
        """(steps between mid-run evaluations, None: after each epoch; batches each of them scores).
        train.eval_every auto: AUTO_EVALS evaluations over a run of known length, the final one on
        the whole held-out set, the others on about AUTO_EVAL_SAMPLES samples; a run too short for
        that evaluates at its end only."""
        t = self.cfg.train
        if t.eval_every != "auto":
            return t.eval_every, t.eval_max_batches
        if not total:  # length unknown (a stream): after each epoch
            return None, t.eval_max_batches
        every = math.ceil(total / AUTO_EVALS) if total >= 2 * AUTO_EVALS else total
        batches = t.eval_max_batches or max(1, AUTO_EVAL_SAMPLES // self.cfg.data.eval_batch_size)
        return every, batches

    def _learning_rates(self) -> dict[str, float]:
        """The learning rates in use (the first parameter group of each optimizer)."""
        return {"lr_dense": self.dense_opt.param_groups[0]["lr"], "lr_embedding": self.emb_opt.param_groups[0]["lr"]}

    def _set_lr(self, step: int, total: int) -> None:
        m = lr_multiplier(self.cfg.train.schedule, step, total)
        for opt, bases in zip((self.dense_opt, self.emb_opt), self._base_lrs, strict=True):
            for g, base in zip(opt.param_groups, bases, strict=True):
                g["lr"] = base * m

    def local_batch(self, batch):
        """This process's slice of a global batch (the whole batch for one process). A last batch
        that does not divide over the processes loses its remainder."""
        return self.data.local_batch(batch)

    def training_batches(self, epoch: int, resume_at: dict | None = None) -> tuple[DeviceFeed, Iterator]:
        """This rank's batches of an epoch, as fit trains on them (train_step with is_local=True):
        read ahead on a worker thread (train.prefetch), copied to the device two batches ahead
        (DeviceFeed), and, with train.pipeline, the next batch's id exchange started before this one
        trains. resume_at: a checkpoint's position, to continue after its batches. Returns the feed
        too: its wait_seconds is the time the loop has waited for data."""
        t = self.cfg.train
        feed = DeviceFeed(prefetch(self.data.train_batches(epoch, resume_at), t.prefetch), self.device, depth=2)
        return feed, (local for _, local in pipelined(feed, _same, self.embeddings, int(t.pipeline)))

    def train_step(self, batch, is_local: bool = False) -> torch.Tensor:
        """One step on a global batch (or on this rank's slice of one); returns this process's loss."""
        if not is_local:
            batch = self.local_batch(batch)
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True)
        loss = model_loss(self.model, self.model(batch), batch)
        self.dense_opt.zero_grad(set_to_none=True)
        self.emb_opt.zero_grad(set_to_none=True)
        if self.dense_sync is not None:
            self.dense_sync.arm()  # dense gradients start their all-reduce during backward
        loss.backward()  # the fused engine updates embedding rows here
        if self.dense_sync is not None:
            t0 = time.perf_counter()
            self.dense_sync.start().wait()
            self.timings["allreduce"] += time.perf_counter() - t0
        self.dense_opt.step()
        self.emb_opt.step()
        return loss.detach()

    def fit(self) -> RunResult:
        """Train to the end and evaluate. SIGTERM or SIGINT (in the main thread) stop training at the
        next step boundary, on every rank alike, with a checkpoint of that step, and raise
        TrainingStopped (neorec/train/signals.py); a second signal ends the process at once."""
        with StopSignals(self.comms) as stop:
            return self._fit(stop)

    def _fit(self, stop: StopSignals) -> RunResult:
        cfg, t = self.cfg, self.cfg.train
        logger: MetricsLogger | _NoLogger = _NoLogger()
        to_resume = self._checkpoint_to_resume() if self.resume else None  # refused before anything is written
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_text(self.out_dir / "config.yaml", dump_config(cfg), "run config")  # atomic
        step, first_epoch, position = self._resume(to_resume) if to_resume is not None else (0, 0, None)
        if self.is_main:  # resumed: metrics.jsonl keeps its lines up to the checkpoint, drops the later ones
            resumed = {"step": step, "lines": position.get("metrics_lines")} if position is not None else None
            logger = MetricsLogger(self.out_dir, tensorboard=cfg.logging.tensorboard, resume=resumed)
        teacher_auc = self.source.teacher_auc() if hasattr(self.source, "teacher_auc") else None
        total = self.total_steps()
        result = RunResult(0, 0, 0.0, teacher_auc=teacher_auc, out_dir=self.out_dir)
        every, mid_batches = self._eval_schedule(total)
        bar = progress_bar(total, None, t.progress and self.is_main, unit="step")
        if bar is not None and step:
            bar.update(step)
        running = position.get("running_loss") if position is not None else None  # the logged loss average
        window_samples, window_start, window_wait = 0, time.perf_counter(), 0.0
        unread: list[torch.Tensor] = []  # this rank's losses not yet read back to the host
        done = t.max_steps is not None and step >= t.max_steps
        epoch, in_epoch = first_epoch, 0
        start = time.perf_counter()
        for epoch in range(first_epoch, t.epochs):
            if done:
                break
            resume_at = position if epoch == first_epoch else None  # continue after the checkpoint's batches
            in_epoch = resume_at["batches"] if resume_at is not None else 0
            feed, batches = self.training_batches(epoch, resume_at)
            waited = 0.0
            for local in batches:
                self.timings["data_wait"] += feed.wait_seconds - waited
                window_wait += feed.wait_seconds - waited
                waited = feed.wait_seconds
                self._set_lr(step, total)
                unread.append(self.train_step(local, is_local=True))  # read back at log steps only
                step += 1
                in_epoch += 1
                used = len(local) * self.topo.world_size  # every rank trains on as many samples
                result.samples += used
                window_samples += used
                if bar is not None:
                    bar.update(1)
                if step % t.log_every == 0:
                    running = self._read_losses(unread, step, result, running)
                    now = time.perf_counter()
                    sps = window_samples / (now - window_start)
                    wait_ms = 1000 * window_wait / t.log_every  # waited for data, per step
                    lrs = self._learning_rates()
                    logger.log("train", step, {"loss": running, "samples_per_s": sps, "epoch": epoch,
                                               "data_wait_ms": wait_ms, **lrs})  # fmt: skip
                    cache = None
                    if getattr(self.embeddings, "cache_stats", None) and (cache := self.embeddings.cache_stats()):
                        cache = log_values(cache)
                        logger.log("cache", step, cache)  # hit rate, MiB per tier, per table
                    if getattr(self.embeddings, "id_map_stats", None) and (maps := self.embeddings.id_map_stats()):
                        logger.log("id_map", step, map_log_values(maps))  # inserts, evictions, per table
                    if cfg.embedding.bounds_check == "warn" and (dropped := self._dropped_ids()):
                        logger.log("dropped_ids", step, {"total": sum(dropped.values()), **dropped})
                    if self.is_main:
                        log.info(train_line(step, total, running, sps, lrs, cache))
                    if bar is not None:
                        bar.set_postfix(loss=f"{running:.4f}", samples_s=f"{sps:,.0f}")
                    window_samples, window_start, window_wait = 0, now, 0.0
                if signum := stop.agreed():  # collective: every rank stops after the same step
                    running = self._read_losses(unread, step, result, running)  # no checkpoint after a NaN
                    self._stop(signum, step, epoch, in_epoch, logger, running, bar)
                if every and step % every == 0 and (not total or step < total):  # the last step: the final one
                    self._eval(logger, step, mid_batches, teacher_auc)
                if self.checkpoints.enabled and self.checkpoints.due(step):
                    running = self._read_losses(unread, step, result, running)  # no checkpoint after a NaN
                    self._save_checkpoint(step, epoch, in_epoch, logger, running)
                if t.max_steps is not None and step >= t.max_steps:
                    done = True
                    break
            if done:
                break
            if epoch < t.epochs - 1:
                logger.log("epoch_end", step, {"epoch": epoch})  # curves.png marks the boundary
                if not every:
                    self._eval(logger, step, mid_batches, teacher_auc)
        running = self._read_losses(unread, step, result, running)
        if step == 0:  # the data had no batch in it: a run without training is a mistake, not a result
            raise DataError(
                f"no training batch: the training data of data.source {cfg.data.source} holds no samples"
                + (f" (data.criteo.train_paths: {cfg.data.criteo.train_paths})" if cfg.data.criteo is not None
                   and cfg.data.source == "criteo_tsv" else "")
                + (f"; {skipped} malformed lines were skipped" if (skipped := getattr(self.source, "num_skipped", 0))
                   else "")
            )  # fmt: skip
        result.train_seconds = time.perf_counter() - start
        if self.checkpoints.enabled and step and self.checkpoints.last_step != step:
            # the end of training is always resumable
            self._save_checkpoint(step, epoch, in_epoch, logger, running)
        if hasattr(self.embeddings, "clear_prefetched"):
            self.embeddings.clear_prefetched()
        if self.comms is not None and step:
            sent = self.comms.stats.take()
            result.comm_bytes_per_step = {k: v / step for k, v in sent.items() if k != "eval"}  # training's
        if bar is not None:
            bar.close()
        result.steps = step
        result.eval = self._eval(logger, step, None, teacher_auc, progress=t.progress)
        result.skipped_lines = int(getattr(self.source, "num_skipped", 0) or 0)
        if cfg.embedding.bounds_check == "warn":
            result.dropped_ids = self._dropped_ids()
        logger.close()
        self._finish(result)
        return result

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _stop(self, signum: int, step: int, epoch: int, in_epoch: int, logger, running: float | None, bar) -> None:
        """A stop was requested: save step `step` (unless just saved), close the logs, raise."""
        if hasattr(self.embeddings, "clear_prefetched"):
            self.embeddings.clear_prefetched()
        if self.checkpoints.last_step != step:
            self._save_checkpoint(step, epoch, in_epoch, logger, running)
        if bar is not None:
            bar.close()
        logger.close()
        raise TrainingStopped(signum, step, self.checkpoints.root / checkpoint_name(step))

    def _save_checkpoint(self, step: int, epoch: int, in_epoch: int, logger, running: float | None) -> None:
        """Collective: tables (sharded), dense model, both optimizers, RNG and the data position:
        `in_epoch` batches of epoch `epoch` are trained (the schedule position is the step), with the
        reader's position where it has one. Rank 0's state is the one written."""
        state = self.data.position(epoch, in_epoch)
        state.update(batch_size=self.cfg.data.batch_size, seed=self.cfg.seed)  # must match on resume
        state.update(metrics_lines=logger.num_lines, running_loss=running)  # metrics.jsonl goes on seamlessly
        optimizers = {"dense": self.dense_opt, "embedding": self.emb_opt}
        self.checkpoints.save(step, self.embeddings, self.model, optimizers, state)

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint `resume` names (None: none yet, start from step 0), once its data position is
        known to fit this run's reader (same batch size, processes and shuffle settings): an
        incompatible resume is refused before anything is said, loaded or written."""
        path = self.checkpoints.to_resume(self.resume)
        if path is None:
            if self.is_main:
                log.info(f"no checkpoint in {self.checkpoints.root}; starting from step 0")
            return None
        check_resume(self.data, read_manifest(path).get("state"), path)
        return path

    def _resume(self, path: Path) -> tuple[int, int, dict | None]:
        """(step, epoch, data position: see RankData.position) of checkpoint `path`, loaded."""
        optimizers = {"dense": self.dense_opt, "embedding": self.emb_opt}
        manifest = load_checkpoint(path, self.embeddings, self.model, optimizers)
        state = manifest["state"]
        for key, now in (("batch_size", self.cfg.data.batch_size), ("seed", self.cfg.seed)):
            if state.get(key) != now:
                raise CheckpointError(
                    f"checkpoint {path} was trained with {key} {state.get(key)}, this run has {now}: resuming exactly "
                    f"needs the same {'data.batch_size' if key == 'batch_size' else 'seed'}"
                )
        self.checkpoints.last_step = manifest["step"]
        if self.is_main:
            log.info(f"resumed from {path} (step {manifest['step']})")
        return manifest["step"], state["epoch"], state

    def _read_losses(
        self, unread: list[torch.Tensor], step: int, result: RunResult, running: float | None
    ) -> float | None:
        """Read the losses of the steps up to `step` back to the host in one transfer (on a GPU the
        steps between log steps never wait for the device), check them, and return the running
        average. A non-finite loss stops training, naming its step."""
        if not unread:
            return running
        values = torch.stack(unread).tolist()
        unread.clear()
        for i, loss in enumerate(values):
            if not math.isfinite(loss):
                raise self._diverged(loss, step - len(values) + i)
            result.losses.append(loss)
            running = loss if running is None else 0.98 * running + 0.02 * loss
        return running

    def _dropped_ids(self) -> dict[str, int]:
        """Ids dropped so far per feature for lying outside their table (bounds_check warn), summed
        over the ranks (collective under several processes: every rank calls it at the same step)."""
        mine = dropped_ids(self.model)
        if self.comms is None:
            return mine
        names = [f for t in self.tables for f in t.features]
        counts = torch.tensor([[mine.get(f, 0) for f in names]], dtype=torch.float64)
        total = self.comms.all_gather(counts, "eval").sum(0).tolist()
        return {f: int(n) for f, n in zip(names, total, strict=True) if n}

    def _diverged(self, loss: float, step: int) -> TrainingDiverged:
        msg = f"loss became {loss} at step {step}; lower the learning rates"
        if self.checkpoints.enabled:
            kept = self.checkpoints.set_aside_diverged(step)
            msg += (
                f". The last good checkpoint is {kept}; `neorec train --resume` continues from it"
                if kept is not None
                else ". No checkpoint was saved before it"
            )
        return TrainingDiverged(msg)

    def _single_process_state(self) -> dict | None:
        """The model's state_dict as one process would have it (so `neorec eval` loads it anywhere).
        Over several processes the tables are gathered (collective), up to 2 GiB of them; larger
        sharded models need sharded checkpoints."""
        if self.comms is None:
            return self.model.state_dict()
        emb = self.embeddings
        table_bytes = sum(t.rows * t.dim * 4 for t in self.tables)
        if table_bytes > 2 * 2**30:
            return None
        state = {k: v for k, v in self.model.state_dict().items() if not k.startswith("embeddings.")}
        mine = torch.tensor([emb.local.num_updates, emb.replicated.num_updates], dtype=torch.int64)
        updates = self.comms.all_gather(mine, "eval").max()  # sharded, dp: 2 engines; a rank may hold neither
        for name, entries in emb.gather_tables().items():  # type: ignore[operator]
            for key, value in entries.items():
                state[f"embeddings.tables.{name}.{key}"] = value
            state[f"embeddings.tables.{name}.step"] = updates.clone()
        return state

    def _device_peaks(self) -> list[float] | None:
        """On a GPU, every rank's peak allocated device memory in MiB (torch.cuda.max_memory_allocated),
        to check the planner's memory estimate against (collective)."""
        if self.device.type != "cuda":
            return None
        mine = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**20], dtype=torch.float64)
        every = self.comms.all_gather(mine, "eval") if self.comms is not None else mine
        return [round(x, 1) for x in every.tolist()]

    def _eval(
        self,
        logger: MetricsLogger | _NoLogger,
        step: int,
        max_batches: int | None,
        teacher_auc: float | None,
        progress: bool = False,
    ) -> dict:
        batch_size = self.cfg.data.eval_batch_size
        metrics = evaluate(self.model, self.source, batch_size, max_batches, self.comms, progress and self.is_main)
        if not metrics:  # no held-out samples: nothing to log or plot
            return metrics
        if teacher_auc is not None:
            metrics["teacher_auc"] = teacher_auc
        logger.log("eval", step, metrics)
        return metrics

    def _finish(self, result: RunResult) -> None:
        state = self._single_process_state()
        peaks = self._device_peaks()
        if not self.is_main:
            return
        planned = getattr(getattr(self.embeddings, "plan", None), "device_bytes", None)
        planned = [round(b / 2**20, 1) for b in planned] if planned else None
        if peaks and planned:
            over = [r for r, (peak, plan) in enumerate(zip(peaks, planned, strict=True)) if peak > plan]
            if over:
                log.warning(f"rank(s) {over} used more device memory than the sharding planner estimated "
                            f"(peaks {peaks} MiB against {planned} MiB): its plans may not fit this GPU")  # fmt: skip
        if state is not None:
            save_model_state(state, self.out_dir / "model.pt", self.model)  # cached tables: streamed
        summary = {
            "steps": result.steps,
            "samples": result.samples,
            "train_seconds": round(result.train_seconds, 3),
            "samples_per_s": round(result.samples_per_second, 1),
            "data_wait_ms_per_step": round(1000 * self.timings["data_wait"] / max(result.steps, 1), 3),
            "skipped_lines": result.skipped_lines,
            **({"dropped_ids": result.dropped_ids} if result.dropped_ids else {}),
            "processes": self.topo.world_size,
            "comm_bytes_per_step": {k: round(v) for k, v in result.comm_bytes_per_step.items()},
            **({"device_peak_mib_per_rank": peaks} if peaks else {}),
            **({"planned_device_mib_per_rank": planned} if planned else {}),
            **{f"eval_{k}": v for k, v in result.eval.items()},
        }
        write_text(self.out_dir / "summary.json", strict_dumps(summary, indent=2), "run summary")  # NaN/inf: null
        if self.cfg.logging.plot:
            from neorec.metrics.plot import plot_curves

            plot_curves(read_metrics(self.out_dir / "metrics.jsonl"), self.out_dir / "curves.png", self.out_dir.name)


def _training_device(cfg: RunConfig) -> torch.device:
    """train.device for this process, checked before any work: on CUDA the GPU of this rank
    (LOCAL_RANK, shared round-robin where ranks outnumber GPUs), with a backend that can serve the
    ranks per GPU (choose_backend's error names the fix)."""
    if cfg.train.device != "cuda":
        return torch.device("cpu")
    topo = Topology.from_env()
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device("cuda", int(os.environ.get("LOCAL_RANK", "0")), num_gpus)
    if topo.world_size > 1:
        choose_backend(cfg.distributed.backend, "cuda", topo.local_world_size, num_gpus)
    return device


def _same(batch):
    return batch


def train_line(
    step: int, total: int, loss: float, samples_per_s: float, lrs: dict[str, float], cache: dict | None
) -> str:
    """The console line of a log step: loss, speed, learning rates, the caches' hit rate and traffic
    (`cache`: cache.stats.log_values, cumulative)."""
    parts = [f"step {step:,}/{total:,}" if total else f"step {step:,}", f"loss {loss:.4f}", f"{samples_per_s:,.0f} samples/s"]
    parts.append("lr " + " ".join(f"{k.removeprefix('lr_')} {v:.3g}" for k, v in lrs.items()))
    if cache:
        hit = cache.get("hit_rate")
        moved = sum(v for k, v in cache.items() if "/" not in k and k.startswith("mib_"))
        rate = "n/a" if hit is None or hit != hit else f"{hit:.3f}"
        parts.append(f"cache hit rate {rate}, {moved:,.1f} MiB moved (since the start)")
    return " | ".join(parts)


def summary_table(result: RunResult) -> str:
    """The final human-readable summary."""
    rows = [
        ("steps", f"{result.steps:,}"),
        ("samples", f"{result.samples:,}"),
        ("train time", f"{result.train_seconds:.1f} s"),
        ("throughput", f"{result.samples_per_second:,.0f} samples/s"),
    ]
    e = result.eval
    for key, label in [("auc", "AUC"), ("ne", "normalized entropy"), ("log_loss", "log loss"),
                       ("accuracy", "accuracy"), ("calibration", "calibration (pred/obs CTR)")]:  # fmt: skip
        if key in e and e[key] is not None:
            rows.append((f"eval {label}", f"{e[key]:.4f}"))
    for key, value in e.items():  # per task (multi-task heads) and retrieval metrics
        if (key.endswith(("/auc", "/log_loss")) or key.startswith("recall@")) and value is not None:
            rows.append((f"eval {key}", f"{value:.4f}"))
    if result.teacher_auc is not None:
        rows.append(("teacher AUC (ceiling)", f"{result.teacher_auc:.4f}"))
        if "auc" in e:
            rows.append(("gap to ceiling", f"{result.teacher_auc - e['auc']:.4f}"))
    if result.comm_bytes_per_step:
        sent = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in result.comm_bytes_per_step.items())
        rows.append(("MiB sent per step (rank 0)", sent))
    if result.skipped_lines:
        rows.append(("malformed lines skipped", f"{result.skipped_lines:,}"))
    if result.dropped_ids:
        rows.append(("ids dropped (outside tables)", f"{sum(result.dropped_ids.values()):,}"))
    if result.out_dir is not None:
        rows.append(("outputs", str(result.out_dir)))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])
