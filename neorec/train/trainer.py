"""The training loop: fetch batch, forward, loss, backward, step, every step of a run in turn.

`Trainer` owns a run: data, model, both optimizers, the learning-rate schedule, its logs and outputs.
Its step loop is here; what it calls is split by job: evaluation and when it happens
(neorec/train/evaluation.py), checkpoints, resuming and stopping on a signal
(neorec/train/checkpointing.py), the log steps and the outputs at the end (neorec/train/reporting.py).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from neorec.checkpoint.periodic import PeriodicCheckpoints
from neorec.config.load import dump_config
from neorec.config.schema import RunConfig
from neorec.data.device_feed import DeviceFeed
from neorec.data.prefetch import prefetch
from neorec.data.ranks import RankData
from neorec.data.sample_digest import SampleDigest
from neorec.distributed.comms import Comms
from neorec.distributed.dense import DenseGradSync
from neorec.distributed.topology import Topology, choose_backend, init_distributed, rank_device
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.remap import with_earlier_counts
from neorec.errors import ConfigError, DataError
from neorec.model.compile import apply_compile
from neorec.train.build import (
    build_dense_optimizer,
    build_model,
    build_source,
    build_tables,
    dense_parameters,
)
from neorec.train.checkpointing import CheckpointHandling
from neorec.train.embeddings import build_embeddings
from neorec.train.evaluation import EvaluationStopped, eval_schedule, evaluate
from neorec.train.logger import MetricsLogger, NoLogger
from neorec.train.pipeline import pipelined
from neorec.train.progressive import ProgressiveValidation
from neorec.train.reporting import RunReporting
from neorec.train.run_folder import checkpoint_root, snapshot_root
from neorec.train.run_state import STARTUP_STEPS, RunResult, RunState
from neorec.train.same_config import check_same_config
from neorec.train.schedule import lr_multiplier
from neorec.train.signals import StopSignals
from neorec.train.snapshots import PeriodicSnapshots
from neorec.train.streaming import StreamHandling
from neorec.utils.files import write_text
from neorec.utils.host import keep_freed_memory
from neorec.utils.kernel_cache import use_kernel_cache
from neorec.utils.process_state import process_settings
from neorec.utils.progress import progress_bar

log = logging.getLogger(__name__)

def embedding_collection(model: nn.Module) -> EmbeddingCollection:
    return next(m for m in model.modules() if isinstance(m, EmbeddingCollection))


def model_loss(model: nn.Module, outputs: torch.Tensor, batch) -> torch.Tensor:
    """The model's own `loss(outputs, batch)` where it has one (multi-task, two-tower), else BCE of
    one logit per sample."""
    own = getattr(model, "loss", None)
    return own(outputs, batch) if own is not None else F.binary_cross_entropy_with_logits(outputs, batch.labels)


class Trainer(RunReporting, CheckpointHandling, StreamHandling):
    """Owns a run: data, model, both optimizers, schedule, logs and outputs."""

    def __init__(self, cfg: RunConfig, out_dir: Path | None = None, resume: bool | str | Path = False) -> None:
        """resume: True: fit() continues from the newest complete checkpoint in the checkpoint folder;
        a path: from that checkpoint folder (step-XXXXXXXX)."""
        self.cfg = cfg
        self.resume = resume
        with process_settings(cfg.train.threads):  # the caller's threads, dtype and RNG back on return
            if cfg.train.keep_freed_memory:
                # glibc's malloc settings stay changed after the call: glibc cannot report the values
                # they replace, so they cannot be put back; they change how freed memory is reused only
                keep_freed_memory()
            use_kernel_cache(cfg.train.kernel_cache)  # before the first kernel compiles; stays set
            self.device = _training_device(cfg)
            self.topo = init_distributed(self.device, cfg.distributed.backend)
            self.comms = Comms(self.topo, transport=cfg.distributed.transport) if self.topo.world_size > 1 else None
            if self.comms is not None:
                check_same_config(cfg, self.comms)
            self.is_main = self.topo.rank == 0
            if self.comms is not None and cfg.data.batch_size % self.topo.world_size:
                raise ConfigError(
                    f"data.batch_size {cfg.data.batch_size} is the global batch and must divide over "
                    f"{self.topo.world_size} processes"
                )
            self.source = build_source(cfg, self.topo, self.device)  # a per-rank reader where the source has one
            self.data = RankData(self.source, cfg.data.batch_size, self.topo.rank, self.topo.world_size)
            if self.is_main and (untrained := self.data.untrained_warning()):
                log.warning("every epoch: " + untrained)
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
            root = checkpoint_root(cfg, self.out_dir)
            self.checkpoints = PeriodicCheckpoints(cfg.checkpoint, root, self.topo)
            self.snapshots = PeriodicSnapshots(cfg.snapshot, snapshot_root(cfg, self.out_dir), self.topo)
            # a followed stream (data.follow): each batch's partition, and its scores before training
            self.stream = self.source if hasattr(self.source, "batch_record") else None
            self.progressive = None
            if cfg.data.follow is not None:
                self.progressive = ProgressiveValidation(cfg.data.follow.window_batches, self.comms, self.device)
            self.eval_pending: dict | None = None  # a mid-run evaluation a stop cut short (checkpointing.py)
            self.last_outputs: torch.Tensor | None = None  # the latest training forward's, before its update
            self.partition_clocks: list[int] = []  # id-map clocks at the latest partition starts

    def total_steps(self) -> int:
        """Steps the run will train: all epochs, or max_steps where that comes first (0: unknown, a
        stream of unknown length without max_steps)."""
        t = self.cfg.train
        per_epoch = self.data.steps_per_epoch()
        if t.max_steps is not None:
            return min(t.max_steps, t.epochs * per_epoch) if per_epoch else t.max_steps
        return t.epochs * per_epoch if per_epoch else 0

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
        flush_after = None
        if self.stream is not None:  # a partition's last batch trains before the next partition is waited for
            first, stream = (resume_at or {}).get("batches", 0), self.stream
            flush_after = lambda i: stream.batch_record(first + i).last  # noqa: E731
        return feed, (local for _, local in pipelined(feed, _same, self.embeddings, int(t.pipeline), flush_after))

    def train_step(self, batch, is_local: bool = False) -> torch.Tensor:
        """One step on a global batch (or on this rank's slice of one); returns this process's loss."""
        if not is_local:
            batch = self.local_batch(batch)
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True)
        outputs = self.model(batch)
        if self.progressive is not None:  # a followed stream scores each batch before its update
            self.last_outputs = outputs.detach()
        loss = model_loss(self.model, outputs, batch)
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

    def fit(self, *, keep_stop_handlers: bool = False) -> RunResult:
        """Train to the end and evaluate. SIGTERM or SIGINT (in the main thread) stop training at the
        next step boundary, on every rank alike, with a checkpoint of that step, and raise
        TrainingStopped (neorec/train/signals.py); a second signal ends the process at once.

        Training runs with train.threads; when fit returns or raises, the caller's threads, default
        dtype, global RNG states and SIGTERM/SIGINT handlers are back (neorec/utils/process_state.py),
        except, with keep_stop_handlers, the stop handlers after a stop: for a process that exits
        after reporting the stop (`neorec train`), which a signal then does not cut short."""
        with process_settings(self.cfg.train.threads), StopSignals(self.comms, keep_stop_handlers) as stop:
            return self._fit(stop)

    def _fit(self, stop: StopSignals) -> RunResult:
        t = self.cfg.train
        run = self._start_run(stop)
        pending = run.position.get("eval_pending") if run.position is not None else None
        if pending is not None:  # stopped during a mid-run evaluation: the resumed run does it first
            self._evaluate_or_stop(run, stop, pending.get("max_batches"))
        for epoch in range(run.epoch, t.epochs):
            self._train_epoch(run, stop, epoch)
            if run.done:
                break
            if epoch < t.epochs - 1:
                run.logger.log("epoch_end", run.step, {"epoch": epoch})  # curves.png marks the boundary
                if not run.eval_every:
                    # stopped during it, the checkpoint continues at the next epoch's start: its epoch
                    # is over, and its end logged
                    run.epoch, run.in_epoch = epoch + 1, 0
                    self._evaluate_or_stop(run, stop, run.eval_batches)
        return self._end_run(run, stop)

    def _start_run(self, stop: StopSignals) -> RunState:
        """Resume (when asked) and set up the run folder, its logs and the run's state at its first step."""
        cfg = self.cfg
        to_resume = self._checkpoint_to_resume() if self.resume else None
        # loaded before the run's files are written: a checkpoint this run cannot continue is refused
        # with the folder as it was (its config.yaml and plan.json still those of the checkpoint)
        step, first_epoch, position = self._resume(to_resume) if to_resume is not None else (0, 0, None)
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if to_resume is not None:
                self._say_changed_settings(step)
                self._withdraw_results(step)
            write_text(self.out_dir / "config.yaml", dump_config(cfg, self.out_dir), "run config")  # atomic
            plan = getattr(self.embeddings, "plan", None)  # sharded: the plan every rank trains with
            if plan is not None:
                plan.save(self.out_dir / "plan.json")
        if self.progressive is not None and position is not None:
            self._load_stream_state(position)
        if self.stream is not None:  # waiting for a partition ends on a stop signal too
            self.stream.stop_requested = lambda: stop.received != 0
        logger: MetricsLogger | NoLogger = NoLogger()
        if self.is_main:  # resumed: metrics.jsonl keeps its lines up to the checkpoint, drops the later ones
            resumed = {"step": step, "lines": position.get("metrics_lines")} if position is not None else None
            logger = MetricsLogger(self.out_dir, tensorboard=cfg.logging.tensorboard, resume=resumed)
        teacher_auc = self.source.teacher_auc() if hasattr(self.source, "teacher_auc") else None
        result = RunResult(0, 0, 0.0, teacher_auc=teacher_auc, out_dir=self.out_dir)
        if position is not None:
            result.resumed_at, result.samples_before = step, position.get("samples_trained")
        total = self.total_steps()
        run = RunState(step, first_epoch, logger, result, total, position)
        run.eval_every, run.eval_batches = eval_schedule(cfg.train, cfg.data.eval_batch_size, total)
        if position is not None and position.get("loss_window") is not None:  # the log window's losses so far
            run.loss_sum, run.loss_steps = position["loss_window"]
        if position is not None:
            run.id_map_earlier = position.get("id_map_counts") or {}
        run.bar = progress_bar(total, None, cfg.train.progress and self.is_main, unit="step")
        if run.bar is not None and step:
            run.bar.update(step)
        run.done = cfg.train.max_steps is not None and step >= cfg.train.max_steps
        if position is not None:  # resumed: snapshots of later steps are of the run this one replaces
            self.snapshots.resumed_at(step)
        if position is not None and self.snapshots.missing(step, position.get("snapshot_due")):
            # resumed between a checkpoint and the publish of its snapshot
            self._publish_snapshot(step)
        return run

    def _train_epoch(self, run: RunState, stop: StopSignals, epoch: int) -> None:
        """Train on the batches of `epoch` (a resumed run's first: those after its checkpoint's), up
        to train.max_steps."""
        if run.done:
            return
        first = run.position is not None and run.position["epoch"] == epoch
        resume_at = run.position if first else None  # continue after the checkpoint's batches
        run.epoch, run.in_epoch = epoch, resume_at["batches"] if resume_at is not None else 0
        feed, batches = self.training_batches(epoch, resume_at)
        waited = 0.0
        for local in batches:
            if run.result.first_batch_seconds is None:
                run.result.first_batch_seconds = time.perf_counter() - run.start
            self.timings["data_wait"] += feed.wait_seconds - waited
            run.window.data_wait += feed.wait_seconds - waited
            waited = feed.wait_seconds
            run.in_epoch += 1
            record = self.stream.batch_record(run.in_epoch) if self.stream is not None else None
            if record is not None and record.index == 0:
                self._start_partition(record.partition)
            if record is not None and record.index < self.cfg.data.follow.held_out_batches:
                self._score_held_out(local)  # scored, never trained on
                if record.last:
                    self._end_partition(run.logger, run.step, record.partition, run.result)
                continue
            self._train_batch(run, local)
            if record is not None and record.last:
                self._end_partition(run.logger, run.step, record.partition, run.result)
            self._after_step(run, stop)
            if self.cfg.train.max_steps is not None and run.step >= self.cfg.train.max_steps:
                run.done = True
                return

    def _train_batch(self, run: RunState, local) -> None:
        """One training step on this rank's batch, counted; its loss is read back at a log step."""
        if self.progressive is not None:
            self._expire_by_steps(run.step)
        self._set_lr(run.step, run.total)
        run.unread.append(self.train_step(local, is_local=True))
        run.step += 1
        run.window.steps += 1
        if len(run.result.step_ends) < STARTUP_STEPS:
            run.result.step_ends.append(time.perf_counter() - run.start)
        if self.progressive is not None:  # the training forward's scores: before this batch's update
            self.progressive.add(self.last_outputs, local.labels)
        used = len(local) * self.topo.world_size  # every rank trains on as many samples
        run.result.samples += used
        run.window.samples += used
        if run.bar is not None:
            run.bar.update(1)

    def _after_step(self, run: RunState, stop: StopSignals) -> None:
        """What is due after a step: the log step, a mid-run evaluation, a checkpoint, a snapshot,
        and a stop that every rank agreed on."""
        step, t = run.step, self.cfg.train
        if step % t.log_every == 0:
            self._read_losses(run)
            self._log_window(run)
        every = run.eval_every
        if every and step % every == 0 and (not run.total or step < run.total):  # the last: the final one
            self._evaluate_or_stop(run, stop, run.eval_batches)
        aside = time.perf_counter()  # what follows is no training: left out of the next samples/s
        publish = self.snapshots.enabled and self.snapshots.due(step)  # known first: the checkpoint says so
        save = self.checkpoints.enabled and self.checkpoints.due(step)
        if save or (publish and self.checkpoints.last_step != step):  # a snapshot needs its step's checkpoint
            self._read_losses(run)  # no checkpoint after a NaN
            self._save_checkpoint(run, snapshot_due=publish)
        if publish:
            self._publish_snapshot(step)
        run.window.start += time.perf_counter() - aside
        # collective: every rank stops after the same step, once the step's evaluation, checkpoint
        # and snapshot are done (a resumed run starts after them: stopped before, they were lost)
        if signum := stop.agreed():
            self._read_losses(run)  # no checkpoint after a NaN
            self._stop(signum, run)

    def _log_window(self, run: RunState, now: float | None = None) -> None:
        """The log records of the steps since the last log step, up to `now` (collective), and a new
        window."""
        now, window = now or time.perf_counter(), run.window
        # a run resumed at its end trained no step of its window here: its speed is unknown (null)
        sps = window.samples / (now - window.start) if window.steps else math.nan
        wait_ms = 1000 * window.data_wait / window.steps if window.steps else math.nan  # per step
        self._log_train_step(run, run.take_loss(), sps, wait_ms)
        if self.progressive is not None:
            run.logger.log("progressive", run.step, self.progressive.window_metrics())
        window.restart(now)

    def _end_run(self, run: RunState, stop: StopSignals) -> RunResult:
        """After the last step: the final checkpoint and snapshot, the final evaluation, the outputs."""
        cfg, step, result = self.cfg, run.step, run.result
        self._read_losses(run)
        if self.stream is not None and self.stream.ended == "signal":  # stopped while waiting for a partition
            self._stop(stop.received or signal.SIGTERM, run)
        if step == 0 and self.stream is not None:
            raise DataError(f"no training batch: data.follow.dir {cfg.data.follow.dir} gave no trainable partition")
        if step == 0:  # the data had no batch in it: a run without training is a mistake, not a result
            raise DataError(
                f"no training batch: the training data of data.source {cfg.data.source} holds no samples"
                + (f" (data.criteo.train_paths: {cfg.data.criteo.train_paths})" if cfg.data.criteo is not None
                   and cfg.data.source == "criteo_tsv" else "")
                + (f"; {skipped} malformed lines were skipped" if (skipped := getattr(self.source, "num_skipped", 0))
                   else "")
            )  # fmt: skip
        ended = time.perf_counter()
        result.train_seconds = ended - run.start
        result.steps = step
        publish = self.snapshots.enabled and self.snapshots.last_step != step  # the end of training is served
        if (self.checkpoints.enabled or publish) and self.checkpoints.last_step != step:
            self._save_checkpoint(run, snapshot_due=publish)  # and always resumable
        if publish:
            self._publish_snapshot(step)
        # the steps after the last log step, logged after the checkpoint: a resume from it goes on with them
        if run.loss_steps:
            self._log_window(run, ended)
        if hasattr(self.embeddings, "clear_prefetched"):
            self.embeddings.clear_prefetched()
        if self.comms is not None:
            sent = self.comms.stats.take()
            steps = max(result.steps_trained_here, 1)  # sent by this process (resumed at its end: none)
            result.comm_bytes_per_step = {k: v / steps for k, v in sent.items() if k not in ("eval", "loss")}
        run.close_bar()
        result.eval = self._evaluate_or_stop(run, stop, None, final=True)
        result.skipped_lines = int(getattr(self.source, "num_skipped", 0) or 0)
        if cfg.embedding.bounds_check == "warn":
            result.dropped_ids = self._dropped_ids()
        if maps := self._id_map_totals():  # collective; the final evaluation's lookups counted too
            result.id_map = with_earlier_counts(maps, run.id_map_earlier)
        run.logger.close()
        self._finish(result)
        return result

    def _evaluate_or_stop(
        self, run: RunState, stop: StopSignals, max_batches: int | None, final: bool = False
    ) -> dict:
        """An evaluation after step `run.step`; a stop asked for during it stops the run there, its
        checkpoint holding the evaluation still to do (a mid-run one: the resumed run does it first,
        so its metrics are the uninterrupted run's; the final one comes anyway)."""
        progress = final and self.cfg.train.progress
        digest = SampleDigest() if final else None  # what the final one scored: `neorec eval` compares
        started = time.perf_counter()  # no training: left out of the log window's samples/s
        try:
            teacher = run.result.teacher_auc
            metrics = self._eval(run.logger, run.step, max_batches, teacher, progress, stop.agreed, digest)
            run.result.eval_digest = digest.hex(self.comms) if digest is not None and metrics else None
            return metrics
        except EvaluationStopped as e:
            self._read_losses(run)  # no checkpoint after a NaN
            self.eval_pending = None if final else {"max_batches": max_batches}
            self._stop(e.signum, run)  # raises TrainingStopped
            raise
        finally:
            run.window.start += time.perf_counter() - started

    def _read_losses(self, run: RunState) -> None:
        """Read the losses of the steps up to `run.step` back to the host in one transfer (on a GPU the
        steps between log steps never wait for the device), check them, and add them to the log
        window. Over several processes each is the mean over the ranks (collective: every rank reads
        at the same steps): the loss of the global batch, whose shares are equal. A non-finite loss
        stops training on every rank, naming its step."""
        if not run.unread:
            return
        losses = torch.stack(run.unread).to("cpu", torch.float64)
        run.unread.clear()
        if self.comms is not None:  # summed in rank order: the same mean on every rank
            losses = self.comms.sum_over_ranks(losses, "loss") / self.topo.world_size
        values = losses.tolist()
        for i, loss in enumerate(values):
            if not math.isfinite(loss):
                self._log_divergence(run, loss, run.step - len(values) + i)
                raise self._diverged(loss, run.step - len(values) + i)
            run.result.losses.append(loss)
            run.loss_sum += loss
            run.loss_steps += 1

    def _log_divergence(self, run: RunState, loss: float, step: int) -> None:
        """The records of a run whose loss at step `step + 1` is not finite: the finite losses of its
        log window (at `step`), then the divergence; and its curves.png."""
        if run.loss_steps:
            run.logger.log("train", step, {"loss": run.take_loss(), "epoch": run.epoch})
        run.logger.log("diverged", step + 1, {"loss": loss})
        if self.is_main:
            self._plot_curves()

    def _eval(
        self,
        logger: MetricsLogger | NoLogger,
        step: int,
        max_batches: int | None,
        teacher_auc: float | None,
        progress: bool = False,
        stop: Callable[[], int] | None = None,
        digest: SampleDigest | None = None,
    ) -> dict:
        batch_size = self.cfg.data.eval_batch_size
        with self._counted_as_eval():  # its exchanges are no training step's
            metrics = evaluate(
                self.model, self.source, batch_size, max_batches, self.comms, progress and self.is_main, stop,
                digest,
            )
        if not metrics:  # no held-out samples: nothing to log or plot
            return metrics
        if teacher_auc is not None:
            metrics["teacher_auc"] = teacher_auc
        logger.log("eval", step, metrics)
        return metrics


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

