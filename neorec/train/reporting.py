"""What a run reports: the records of a log step (metrics.jsonl and TensorBoard through the run's
logger, neorec/train/logger.py, and the console line), and at the end its outputs: model.pt,
summary.json, curves.png, and the summary table `neorec train` prints.

`RunReporting` is part of Trainer (neorec/train/trainer.py), whose step loop calls it; its methods
use the trainer's attributes listed in the class.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from neorec.checkpoint.stream import save_model_state
from neorec.config.schema import RunConfig
from neorec.distributed.comms import Comms
from neorec.distributed.launch import report_finished
from neorec.distributed.topology import Topology
from neorec.embedding.cache.stats import log_values
from neorec.embedding.collection import EmbeddingCollection, dropped_ids
from neorec.embedding.id_map import STAT_FIELDS
from neorec.embedding.remap import map_log_values, with_earlier_counts
from neorec.train.logger import read_metrics
from neorec.train.run_state import RunResult, RunState
from neorec.utils.files import write_text
from neorec.utils.json_values import strict_dumps

log = logging.getLogger(__name__)

class RunReporting:
    """Trainer's log steps and end-of-run outputs."""

    # the trainer's, set by Trainer.__init__
    cfg: RunConfig
    topo: Topology
    comms: Comms | None
    is_main: bool
    device: torch.device
    tables: Sequence
    embeddings: EmbeddingCollection
    model: nn.Module
    dense_opt: torch.optim.Optimizer
    emb_opt: torch.optim.Optimizer
    timings: dict[str, float]
    out_dir: Path

    def _learning_rates(self) -> dict[str, float]:
        """The learning rates in use (the first parameter group of each optimizer)."""
        return {"lr_dense": self.dense_opt.param_groups[0]["lr"], "lr_embedding": self.emb_opt.param_groups[0]["lr"]}

    def _log_train_step(self, run: RunState, loss: float, sps: float, wait_ms: float) -> None:
        """The records of a log step: the loss (mean since the last log step), speed, data wait and
        learning rates, the caches' and id maps' counters, the ids dropped so far; the console line
        on rank 0."""
        logger, step, bar = run.logger, run.step, run.bar
        lrs = self._learning_rates()
        logger.log("train", step, {"loss": loss, "samples_per_s": sps, "epoch": run.epoch,
                                   "data_wait_ms": wait_ms, **lrs})  # fmt: skip
        cache = None
        if getattr(self.embeddings, "cache_stats", None) and (cache := self.embeddings.cache_stats()):
            cache = log_values(cache)
            logger.log("cache", step, cache)  # hit rate, MiB per tier, per table
        if maps := self._id_map_totals():  # collective
            maps = with_earlier_counts(maps, run.id_map_earlier)  # counted from the run's start
            logger.log("id_map", step, map_log_values(maps))  # inserts, evictions, per table
        if self.cfg.embedding.bounds_check == "warn" and (dropped := self._dropped_ids()):
            logger.log("dropped_ids", step, {"total": sum(dropped.values()), **dropped})
        if self.is_main:
            log.info(train_line(step, run.total, loss, sps, lrs, cache))
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{sps:,.0f}")

    def _id_map_totals(self) -> dict[str, dict[str, float]]:
        """Per managed-collision table: its id maps' counters, occupied rows and capacity, summed over
        the ranks that hold its shards (collective under several processes: every rank calls it at
        the same step)."""
        mine = self.embeddings.id_map_stats() if hasattr(self.embeddings, "id_map_stats") else {}
        if self.comms is None:
            return mine
        names = sorted(n for n, o in self.cfg.embedding.tables.items() if o.managed_collision is not None)
        if not names:
            return {}
        fields = (*STAT_FIELDS, "occupied", "capacity")
        counts = torch.tensor([mine.get(n, {}).get(k, 0) for n in names for k in fields], dtype=torch.float64)
        total = iter(self.comms.sum_over_ranks(counts, "eval").tolist())
        return {n: {k: int(next(total)) for k in fields} for n in names}

    def _dropped_ids(self) -> dict[str, int]:
        """Ids dropped so far per feature for lying outside their table (bounds_check warn), summed
        over the ranks (collective under several processes: every rank calls it at the same step)."""
        mine = dropped_ids(self.model)
        if self.comms is None:
            return mine
        names = [f for t in self.tables for f in t.features]
        counts = torch.tensor([mine.get(f, 0) for f in names], dtype=torch.float64)
        total = self.comms.sum_over_ranks(counts, "eval").tolist()
        return {f: int(n) for f, n in zip(names, total, strict=True) if n}

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
        wait_ms = 1000 * self.timings["data_wait"] / max(result.steps_trained_here, 1)  # this process's steps
        summary = {
            "steps": result.steps,
            "samples": result.total_samples,
            **({"resumed_at_step": result.resumed_at, "samples_since_resume": result.samples}
               if result.resumed_at is not None else {}),  # fmt: skip
            "train_seconds": round(result.train_seconds, 3),
            "samples_per_s": round(result.samples_per_second, 1) if result.steps_trained_here else None,
            "data_wait_ms_per_step": round(wait_ms, 3),
            **({"startup": result.startup} if result.startup else {}),
            "skipped_lines": result.skipped_lines,
            **({"dropped_ids": result.dropped_ids} if result.dropped_ids else {}),
            **({"id_map": result.id_map} if result.id_map else {}),
            "processes": self.topo.world_size,
            "comm_bytes_per_step": {k: round(v) for k, v in result.comm_bytes_per_step.items()},
            **({"device_peak_mib_per_rank": peaks} if peaks else {}),
            **({"planned_device_mib_per_rank": planned} if planned else {}),
            **{f"eval_{k}": v for k, v in result.eval.items()},
            **({"eval_data": self._eval_data(result.eval_digest)} if result.eval_digest else {}),
            **({"partitions": result.partitions} if result.partitions else {}),
        }
        write_text(self.out_dir / "summary.json", strict_dumps(summary, indent=2), "run summary")  # NaN/inf: null
        self._plot_curves()
        report_finished(self.out_dir)  # under `--nproc N`: a signal from now on stops nothing

    def _eval_data(self, digest: str) -> dict:
        """What `neorec eval` compares its held-out data with: the digest of the samples the final
        evaluation scored, and the settings and working folder they were read with; checksummed, as
        it is read back (the rest of summary.json is not)."""
        from neorec.data.reader_position import data_settings
        from neorec.utils.files import CHECKSUM_KEY, json_crc32

        record = {"samples_digest": digest, "seed": self.cfg.seed, "settings": data_settings(self.cfg.data)}
        return {**record, CHECKSUM_KEY: json_crc32(record)}

    def _plot_curves(self) -> None:
        """curves.png of the run's metrics.jsonl so far (logging.plot)."""
        if self.cfg.logging.plot:
            from neorec.metrics.plot import plot_curves

            records = read_metrics(self.out_dir / "metrics.jsonl")
            plot_curves(records, self.out_dir / "curves.png", self.out_dir.name, arch=self.cfg.model.arch)


def train_line(
    step: int, total: int, loss: float, samples_per_s: float, lrs: dict[str, float], cache: dict | None
) -> str:
    """The console line of a log step: loss, speed (none for steps trained before a resume at the
    end of them), learning rates, the caches' hit rate and traffic (`cache`: cache.stats.log_values,
    cumulative)."""
    parts = [f"step {step:,}/{total:,}" if total else f"step {step:,}", f"loss {loss:.4f}"]
    if math.isfinite(samples_per_s):
        parts.append(f"{samples_per_s:,.0f} samples/s")
    parts.append("lr " + " ".join(f"{k.removeprefix('lr_')} {v:.3g}" for k, v in lrs.items()))
    if cache:
        hit = cache.get("hit_rate")
        moved = sum(v for k, v in cache.items() if "/" not in k and k.startswith("mib_"))
        rate = "n/a" if hit is None or hit != hit else f"{hit:.3f}"
        parts.append(f"cache hit rate {rate}, {moved:,.1f} MiB moved (since the start)")
    return " | ".join(parts)


def startup_text(startup: dict) -> str:
    """The start-up of a run in words: when its first batch came and its first step ended, and the
    pace of the next steps (host time: on a GPU, until its queue of work is full)."""
    ends = startup.get("step_ends_s") or []
    if not ends:
        return ""
    text = f"first batch after {startup['first_batch_s']:.2f} s, step 1 done at {ends[0]:.2f} s"
    if len(ends) > 1:
        text += f", steps 2-{len(ends)} {1000 * (ends[-1] - ends[0]) / (len(ends) - 1):.1f} ms each"
    return text


def _metric_text(value: float, key: str) -> str:
    """A metric of the summary; one that is not a number says why."""
    if math.isfinite(value):
        return f"{value:.4f}"
    return "n/a (the held-out data has one class)" if key.endswith("auc") else "n/a (not finite)"


def summary_table(result: RunResult) -> str:
    """The final human-readable summary."""
    rows = [
        ("steps", f"{result.steps:,}"),
        ("samples", "unknown" if result.total_samples is None else f"{result.total_samples:,}"),
        *([("resumed at", f"step {result.resumed_at:,}: {result.samples:,} samples since, timed below")]
          if result.resumed_at is not None else []),  # fmt: skip
        ("train time", f"{result.train_seconds:.1f} s"),
        ("throughput", f"{result.samples_per_second:,.0f} samples/s" if result.steps_trained_here
         else "n/a (no step trained since the resume)"),
    ]
    if startup := startup_text(result.startup):
        rows.append(("start-up", startup))
    e = result.eval
    for key, label in [("auc", "AUC"), ("ne", "normalized entropy"), ("log_loss", "log loss"),
                       ("accuracy", "accuracy"), ("calibration", "calibration (pred/obs CTR)")]:  # fmt: skip
        if key in e and e[key] is not None:
            rows.append((f"eval {label}", _metric_text(e[key], key)))
    for key, value in e.items():  # per task (multi-task heads) and retrieval metrics
        if (key.endswith(("/auc", "/log_loss")) or key.startswith("recall@")) and value is not None:
            rows.append((f"eval {key}", _metric_text(value, key)))
    if result.teacher_auc is not None:
        rows.append(("teacher AUC (ceiling)", _metric_text(result.teacher_auc, "auc")))
        if "auc" in e and math.isfinite(e["auc"]) and math.isfinite(result.teacher_auc):
            rows.append(("gap to ceiling", f"{result.teacher_auc - e['auc']:.4f}"))
    if result.comm_bytes_per_step:
        sent = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in result.comm_bytes_per_step.items())
        rows.append(("MiB sent per step (rank 0)", sent))
    if result.skipped_lines:
        rows.append(("malformed lines skipped", f"{result.skipped_lines:,}"))
    if result.dropped_ids:
        rows.append(("ids dropped (outside tables)", f"{sum(result.dropped_ids.values()):,}"))
    if result.partitions:
        last = result.partitions[-1]
        rows.append(("partitions trained", f"{len(result.partitions):,}"))
        rows.append((f"progressive AUC ({last['partition']})", f"{last['auc']:.4f}"))
    if result.out_dir is not None:
        rows.append(("outputs", str(result.out_dir)))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])
