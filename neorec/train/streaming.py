"""What a run does at the seams of a followed stream (data.follow): a partition starts (managed-collision
ids not seen for `expire_after_partitions` partitions are freed), every few steps ids not seen for
`expire_after_steps` steps are freed, a held-out batch is scored, a partition ends (its progressive
metrics and id-map counts are logged), and a snapshot is published.

`StreamHandling` is part of Trainer (neorec/train/trainer.py), whose step loop calls it; its methods use
the trainer's attributes listed in the class. Every method is called by every rank after the same batch.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

from neorec.checkpoint.files import CheckpointError
from neorec.checkpoint.save import checkpoint_name
from neorec.config.schema import RunConfig
from neorec.data.source import DataSource
from neorec.distributed.comms import Comms
from neorec.distributed.topology import Topology
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.remap import MappedTable, expire_ids
from neorec.train.progressive import ProgressiveValidation
from neorec.train.snapshots import PeriodicSnapshots

log = logging.getLogger(__name__)

_COUNTED = ("inserts", "evictions", "dropped")  # id-map counters reported per partition


def mapped_tables(embeddings: EmbeddingCollection) -> tuple[list[MappedTable], object | None]:
    """(the managed-collision tables of this rank's engine, that engine), for fused, reference and
    sharded collections alike."""
    engine = getattr(
        embeddings, "local", embeddings
    )  # a sharded collection's tables live in its local engine
    return list(getattr(engine, "mapped", [])), engine


def steps_between_sweeps(expire_after_steps: int) -> int:
    """How often ids are checked for expiry by steps: an id leaves within N + N // 8 steps of its
    last batch, and the check (a pass over the maps' rows) costs at most one in eight steps."""
    return max(1, expire_after_steps // 8)


def map_clock(engine) -> int:
    """The step the engine's id maps stamp on the next training batch."""
    return int(getattr(engine, "num_updates", getattr(engine, "map_step", 0))) + 1


class StreamHandling:
    """Trainer's partition starts and ends, held-out scoring and snapshots."""

    # the trainer's, set by Trainer.__init__
    cfg: RunConfig
    comms: Comms | None
    is_main: bool
    topo: Topology
    device: torch.device
    model: nn.Module
    embeddings: EmbeddingCollection
    source: DataSource
    progressive: ProgressiveValidation | None
    snapshots: PeriodicSnapshots
    out_dir: Path
    partition_clocks: list[int]  # map clocks at the starts of the latest partitions (checkpointed)
    _map_counts: dict[str, float]  # id-map counters at the start of the partition being read

    def _stream_state(self) -> dict:
        """What a checkpoint keeps of the stream (collective): every rank's progressive histograms and window,
        its id-map counts so far and ids expired at its start, and the map clocks of partition starts."""
        assert self.progressive is not None
        now = self._summed_map_counts()
        before = getattr(self, "_map_counts", {})
        counts = {k: v - before.get(k, 0) for k, v in now.items()}
        return {
            "progressive": self.progressive.state(),
            "partition_clocks": list(self.partition_clocks),
            "partition_id_map": {**counts, "expired": getattr(self, "_expired", 0)},
        }

    def _load_stream_state(self, position: dict) -> None:
        """Continue the partition's records from a checkpoint's `_stream_state` (a restarted process's
        id-map counters start at zero: the counts so far become a negative baseline)."""
        assert self.progressive is not None
        try:
            self.progressive.load_state(position.get("progressive"), self.topo.rank, self.topo.world_size)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint resumed from: its progressive metrics state is malformed ({e})"
            ) from None
        self.partition_clocks = list(position.get("partition_clocks") or [])
        saved = dict(position.get("partition_id_map") or {})
        self._expired = int(saved.pop("expired", 0))
        self._map_counts = {k: -float(v) for k, v in saved.items()}

    def _start_partition(self, name: str) -> None:
        """A partition's first batch is next: free the ids not seen in the last N partitions."""
        tables, engine = mapped_tables(self.embeddings)
        follow = self.cfg.data.follow
        assert follow is not None
        self._map_counts = self._summed_map_counts()
        self._expired = 0
        if not self._has_maps() or follow.expire_after_partitions is None:
            return
        self.partition_clocks.append(map_clock(engine))
        keep = follow.expire_after_partitions + 1
        del self.partition_clocks[:-keep]
        if len(self.partition_clocks) == keep:  # ids last seen before the oldest of the last N partitions
            freed = expire_ids(tables, self.partition_clocks[0])  # a rank may hold none of the maps
            self._expired = int(self._sum_over_ranks(torch.tensor([float(sum(freed.values()))]))[0])

    def _expire_by_steps(self, step: int) -> None:
        """Before the training batch after `step` steps: every max(1, N // 8) steps, free the ids not
        seen in the last N training steps (expire_after_steps N), counted with the partition's expired
        ids. Keyed on the step, so a resumed run sweeps where an uninterrupted one does."""
        follow = self.cfg.data.follow
        assert follow is not None
        n = follow.expire_after_steps
        if n is None or step == 0 or step % steps_between_sweeps(n) or not self._has_maps():
            return
        tables, engine = mapped_tables(self.embeddings)
        freed = expire_ids(tables, map_clock(engine) - n)  # ids of the last n batches keep their rows
        self._expired += int(self._sum_over_ranks(torch.tensor([float(sum(freed.values()))]))[0])

    @torch.no_grad()
    def _score_held_out(self, local) -> None:
        """Score a held-out batch (evaluation mode: the id maps do not learn it) and count it apart."""
        if self.device.type != "cpu":
            local = local.to(self.device, non_blocking=True)
        self.model.eval()
        try:
            with self._counted_as_eval():  # its exchanges are no training step's
                outputs = self.model(local)
        finally:
            self.model.train()
        assert self.progressive is not None
        self.progressive.add(outputs, local.labels, held_out=True)

    def _end_partition(self, logger, step: int, name: str, result) -> None:
        """Log the partition's progressive metrics and its id-map counts (all ranks summed)."""
        assert self.progressive is not None
        metrics = self.progressive.end_partition()
        counts = self._summed_map_counts()
        before = getattr(self, "_map_counts", {})
        for key in _COUNTED:
            if key in counts:
                metrics[f"id_map_{key}"] = counts[key] - before.get(key, 0)
        if counts:
            metrics["id_map_expired"] = getattr(self, "_expired", 0)
        result.partitions.append({"partition": name, "step": step, **metrics})
        logger.log("partition", step, {"partition": name, **metrics})
        if self.is_main:
            extra = f", {metrics['id_map_evictions']:.0f} evicted" if "id_map_evictions" in metrics else ""
            extra += f", {metrics['id_map_expired']:.0f} expired" if metrics.get("id_map_expired") else ""
            log.info(f"partition {name}: progressive AUC {metrics['auc']:.4f}, NE {metrics['ne']:.4f}, "
                     f"calibration {metrics['calibration']:.3f} over {metrics['num_samples']:,} samples{extra}")  # fmt: skip

    def _summed_map_counts(self) -> dict[str, float]:
        """The id-map counters of every managed-collision table, summed over tables and ranks."""
        if not self._has_maps():
            return {}
        tables, _ = mapped_tables(self.embeddings)  # this rank's shards of them (maybe none)
        mine = torch.tensor(
            [float(sum(t.id_map.stats[k] for t in tables)) for k in _COUNTED], dtype=torch.float64
        )
        return dict(zip(_COUNTED, self._sum_over_ranks(mine).tolist(), strict=True))

    def _has_maps(self) -> bool:
        """Whether the model has managed-collision tables (on some rank: the same answer on all)."""
        return any(o.managed_collision is not None for o in self.cfg.embedding.tables.values())

    def _counted_as_eval(self) -> AbstractContextManager:
        """A block whose exchanges count as an evaluation's, apart from the training steps' bytes."""
        return self.comms.stats.counted_as("eval") if self.comms is not None else nullcontext()

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if self.comms is None:
            return values
        return self.comms.sum_over_ranks(values.to(torch.float64), "eval")

    def _publish_snapshot(self, step: int) -> None:
        """Publish the snapshot of `step` from its checkpoint (rank 0; the checkpoint exists)."""
        checkpoint = self.checkpoints.root / checkpoint_name(step)  # type: ignore[attr-defined]
        self.snapshots.publish(step, checkpoint, self.out_dir / "config.yaml", self.source)
