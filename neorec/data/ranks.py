"""What one of W processes reads: its local batches, the steps of an epoch, where a resume restarts.

`data.batch_size` is the global batch; each rank trains on a local batch of 1/W of it. How a rank
gets it depends on what the source can do:
- rank parts (`PreprocessedSource` or `ParquetSource` built with this rank and world size): each rank
  reads only its own part of the data, in local batches of batch_size / W. The global batch of a step is the ranks' local
  batches concatenated in rank order: one process trained on those global batches trains the same
  model (tested).
- slices (sources with `train_slices`: synthetic, shards): the source makes only rank r's slice
  [r b, (r + 1) b), b = len // W, of every global batch, never the whole batch (the synthetic
  generator still draws whole blocks; see its docstring).
- global (Criteo TSV, MovieLens): every rank reads every global batch and keeps its slice. A TSV
  stream has no random access (a rank cannot find its lines without parsing all lines before them),
  and MovieLens is small enough to hold whole.
With slices and global reading, W processes train on exactly the batches one process would, but for
a last batch that does not divide over them: each rank trains len // W of its samples, the remainder
is not trained (`untrained_per_epoch` counts it where the size is known, and the trainer warns).

Held-out evaluation covers the whole held-out set in every case (`eval_slices`): each rank scores its
rows of every held-out batch (the last rows padded), and the scores are gathered.

Resume: a source with `load_state` restarts right after the trained samples (the sharded reader
validates its layout: seed, world size, shuffle settings); others re-read and drop the trained batches.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch

from neorec.data.batch import Batch
from neorec.data.source import DataSource
from neorec.sparse import SparseBatch

log = logging.getLogger(__name__)


def untrained_text(last: int, untrained: int, world_size: int) -> str:
    return (
        f"a last batch of {last} samples does not divide over {world_size} processes: each trains "
        f"{last // world_size} of them, leaving {untrained} untrained (one process trains them all); a "
        f"number of training samples that leaves a last batch divisible by {world_size} trains every one"
    )


def left_out_text(total: int, left: int, world_size: int, of: str = "the epoch") -> str:
    """What a per-rank reader (each rank reads N // W samples of an epoch) leaves untrained."""
    return (
        f"the {total:,} training samples do not divide over {world_size} processes: each reads "
        f"{total // world_size:,} of them, leaving the last {left} of {of}'s order untrained (one "
        f"process trains them all); a number of training samples divisible by {world_size} trains every one"
    )


class RankData:
    """This process's view of `source` in a run of `world_size` processes and global `batch_size`."""

    def __init__(self, source: DataSource, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        source_world = getattr(source, "world_size", 1)
        assert source_world in (1, world_size), "a per-rank reader must be built for this world size"
        self.reads_part = world_size > 1 and source_world == world_size
        # batches are counted in what the source yields: local batches of a rank part, else global ones
        self.read_batch_size = batch_size // world_size if self.reads_part else batch_size
        self._said_untrained = rank != 0  # rank 0 warns of samples no rank trains

    def steps_per_epoch(self) -> int | None:
        """Training steps of one epoch (None when the source does not know its size)."""
        n = self.source.info.num_train_samples  # a rank part's own size for a per-rank reader
        if not n:
            return None
        full, rest = divmod(n, self.read_batch_size)
        smallest = 1 if self.world_size == 1 or self.reads_part else self.world_size  # a slice of >= 1 sample
        return full + (rest >= smallest)

    def train_batches(self, epoch: int, resume: dict | None = None) -> Iterator[Batch]:
        """This rank's local batches of `epoch`; with `resume` (a checkpoint's data position, see
        `position`), only those after the `resume["batches"]` already trained."""
        skip = resume["batches"] if resume else 0
        if resume and hasattr(self.source, "position_after"):  # a stream: its position is its own (follow.py)
            self.source.load_state({**resume["reader"], "batches": skip, "rank": self.rank})
            skip = 0
        if skip and hasattr(self.source, "load_state"):  # restart right after them, without reading them
            reader = dict(resume.get("reader") or {})
            if self.reads_part:
                reader["rank"] = self.rank
            self.source.load_state({**reader, "epoch": epoch, "samples": self._samples(skip)})
            skip = 0
        if self.reads_part or self.world_size == 1:
            batches = self.source.train_batches(self.read_batch_size, epoch)
        elif hasattr(self.source, "train_slices"):
            batches = self.source.train_slices(self.batch_size, epoch, self.rank, self.world_size)
        else:
            batches = (self.local_batch(b) for b in self.source.train_batches(self.batch_size, epoch))
            batches = (b for b in batches if len(b))
        return itertools.islice(batches, skip, None) if skip else batches

    def untrained_per_epoch(self) -> int | None:
        """Samples of an epoch no rank trains: the remainder of a last global batch that does not
        divide over the W processes, or for a per-rank reader the N % W samples that no rank's part
        holds (None: the source does not know its size)."""
        if self.world_size == 1:
            return 0
        if self.reads_part:
            return self.source.left_out() if hasattr(self.source, "left_out") else 0
        n = self.source.info.num_train_samples
        return n % self.batch_size % self.world_size if n else None

    def untrained_warning(self) -> str | None:
        """The warning of the samples each epoch leaves untrained (untrained_per_epoch), or None."""
        untrained = self.untrained_per_epoch()
        if not untrained:
            return None
        n = self.source.info.num_train_samples
        if self.reads_part:  # n: this rank's part
            return left_out_text(n * self.world_size + untrained, untrained, self.world_size)
        return untrained_text(n % self.batch_size, untrained, self.world_size)

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's slice of a global batch: samples [r b, (r + 1) b), b = len // W (the remainder
        of a last batch that does not divide is not trained: see untrained_per_epoch)."""
        if self.world_size == 1:
            return batch
        b = len(batch) // self.world_size
        if len(batch) % self.world_size and not self._said_untrained and self.untrained_per_epoch() is None:
            self._said_untrained = True  # a source of unknown size: said when it happens
            log.warning(untrained_text(len(batch), len(batch) % self.world_size, self.world_size))
        return batch.slice(self.rank * b, (self.rank + 1) * b)

    def position(self, epoch: int, batches: int) -> dict:
        """The data position to checkpoint after `batches` steps of `epoch`; for a source with
        `state()`, its settings too (checked when resuming). Every rank of a per-rank reader stands at
        the same place of its own part, so rank 0's position serves all (its rank is left out)."""
        out: dict = {"epoch": epoch, "batches": batches}
        if hasattr(self.source, "position_after"):  # a stream of uneven partitions knows where each batch ends
            reader = self.source.position_after(batches)
            reader.pop("rank", None)
            out["reader"] = reader
        elif hasattr(self.source, "state"):
            reader = {**self.source.state(), "epoch": epoch, "samples": self._samples(batches)}
            reader.pop("rank", None)
            out["reader"] = reader
        return out

    def _samples(self, batches: int) -> int:
        """Samples of the source's stream in the first `batches` batches of an epoch."""
        n = self.source.info.num_train_samples
        done = batches * self.read_batch_size
        return min(done, n) if n else done

    def eval_slices(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        """(this rank's rows of a held-out batch, n) for every held-out batch of `batch_size`, the whole
        set as one process reads it: rows [r b, (r + 1) b) of the batch's n samples, b = ceil(n / W),
        rows past n being copies of its last sample. Gathered in rank order and cut to n, the ranks'
        scores are the batch's scores. One process: (batch, len(batch))."""
        if self.world_size == 1:
            return ((b, len(b)) for b in self.source.eval_batches(batch_size))
        if self.reads_part:  # reads only its rows
            return self.source.eval_slices(batch_size)  # type: ignore[attr-defined]
        return (self._eval_slice(b) for b in self.source.eval_batches(batch_size))

    def _eval_slice(self, batch: Batch) -> tuple[Batch, int]:
        n = len(batch)
        b = -(-n // self.world_size)
        if (self.rank + 1) * b <= n:
            return batch.slice(self.rank * b, (self.rank + 1) * b), n
        return take(batch, padded_share(n, self.rank, self.world_size)), n


def take(batch: Batch, index: torch.Tensor) -> Batch:
    """Samples `index` of `batch`, in that order (repeats allowed)."""
    return Batch(batch.dense[index], take_samples(batch.sparse, index), batch.labels[index])


def take_samples(s: SparseBatch, index: torch.Tensor) -> SparseBatch:
    """Samples `index` of a sparse batch, in that order (repeats allowed)."""
    feats = {}
    for k in s.keys:
        ids, lengths, weights = s.feature(k)
        starts = lengths.cumsum(0) - lengths
        picked = lengths[index]
        shift = (starts[index] - (picked.cumsum(0) - picked)).repeat_interleave(picked)
        pick = torch.arange(int(picked.sum())) + shift
        part = (ids[pick], lengths[index]) if weights is None else (ids[pick], lengths[index], weights[pick])
        feats[k] = part
    return SparseBatch.from_features(feats)


def padded_share(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of n samples spread over the ranks as `eval_slices` spreads a batch: [r b,
    (r + 1) b), b = ceil(n / W), rows past n being the last sample again."""
    b = -(-n // world_size)
    return torch.arange(rank * b, (rank + 1) * b).clamp_(max=n - 1)
