"""A DataSource that follows a folder of partitions (`data.follow`): every complete partition in order,
then each new one as it lands, until `until`, an idle timeout or a stop signal.

The stream is one pass (epoch 0). Each partition is read by the source of its kind, built for this
rank: a ParquetSource over its files or a PreprocessedSource over its shards, so every rank reads its
share of every partition (rank r: samples [r n, (r + 1) n) of its order, n = N // W) and all ranks
yield the same number of batches per partition. Batches never span two partitions (a partition's last
batch may be smaller), so every batch belongs to one partition: the trainer reads which, and where the
stream stands after it, from `batch_record(k)` (the k-th batch of the stream).

Which partition comes next is decided by rank 0 alone (neorec/data/partitions.py lists the complete
ones) and broadcast on a gloo group of the follow source's own, from the reader's thread: ranks that
listed the folder a moment apart could otherwise disagree. While no new partition is complete, rank 0
broadcasts "wait" every `poll_seconds`, so the other ranks never sit in one collective for long.
Nothing after `until` in the stream's order is chosen: by name, a partition named after it never is
(the stream waits for `until` instead, as for any partition not landed yet); by completion time,
`until` comes before every partition completed after it, and the stream ends after `until`.

Before its first batch a partition is opened (its schema checked against the stream's: the features,
their table sizes, list or not, weights, the dense width; for preprocessed shards also the id mapping:
neorec/data/follow_schema.py) and, with `verify`, this rank's share is read through once, every
value checked. The ranks then agree: if any found it bad, all skip it (logged by name) or all stop
(DataError naming it and what is wrong), per `bad_partitions`. A partition is thus trained whole or
not at all.

Position (`state()`, exact resume): the partitions finished (done or skipped, in order), the one being
read and the samples of this rank's share read from it, and the stream's id mapping (a resumed stream
compares its partitions with the mapping it trained with, though the partition it came from is gone).
After `load_state`, the stream continues inside that partition, then takes the complete partitions
not yet finished, in order: one that landed while the job was down is picked up. The position names
the folder followed: resumed over another one (the stream moved, or another stream), its finished
partitions count as finished there too, by name, with a warning naming both folders.

A partition is read once, by name. One completed again after the stream finished it (its marker or
manifest rewritten: a producer that re-ran a day) is not trained again; rank 0 warns, naming it and
both completion times, which the position keeps for every partition finished or being read.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neorec.config.continuous import FollowConfig
from neorec.data.batch import Batch
from neorec.data.follow_schema import checked_mapping, id_mapping, mapping_change, schema_change
from neorec.data.partitions import Partition, completion_file, completion_text, list_partitions
from neorec.data.reader_position import checked_position
from neorec.data.source import DataSource, SourceInfo
from neorec.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_LAYOUT_KEYS = ("seed", "rank", "world_size", "shuffle")
_MESSAGE_BYTES = 1024  # a rank's report on a bad partition, as gathered


@dataclass(frozen=True)
class BatchRecord:
    """What the trainer needs to know of one batch of the stream."""

    partition: str
    index: int  # the batch's place in its partition (0: the partition's first batch)
    last: bool  # the partition's last batch
    position: dict  # the stream's position after it (see FollowSource.state)


class RankAgreement:
    """Rank 0's word, heard by every rank: text broadcast, and every rank's text gathered, on a gloo
    group used by the follow source's thread only (collective at construction)."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.group = None
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(list(range(world_size)), backend="gloo")

    def broadcast(self, text: str) -> str:
        """Rank 0's `text` on every rank."""
        if self.group is None:
            return text
        import torch.distributed as dist

        data = (
            torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
            if text
            else torch.zeros(0, dtype=torch.uint8)
        )
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        buf = data if self.rank == 0 else torch.zeros(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(buf, 0, group=self.group)
        return bytes(buf.tolist()).decode()

    def gather(self, text: str) -> list[str]:
        """Every rank's `text` (cut to _MESSAGE_BYTES), in rank order, on every rank."""
        if self.group is None:
            return [text]
        import torch.distributed as dist

        raw = text.encode()[:_MESSAGE_BYTES]
        mine = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
        mine[0] = len(raw) > 0
        if raw:
            mine[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [bytes(t[1:].tolist()).rstrip(b"\0").decode(errors="replace") if t[0] else "" for t in every]


class FollowSource:
    """DataSource over the partitions of `config.dir`, this rank's share of each (module docstring).
    `open_partition(path, seed)` builds the source of one partition for this rank."""

    def __init__(
        self,
        config: FollowConfig,
        kind: str,
        open_partition: Callable[[Path, int], DataSource],
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        self.config, self.kind, self._open_source = config, kind, open_partition
        self.root = Path(config.dir)
        self._place = str(self.root.resolve())  # the folder followed, as the position names it
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.stop_requested: Callable[[], bool] = lambda: False  # the trainer's stop signals, while it trains
        self.ended: str | None = None  # why the stream ended: "until", "idle" or "signal"
        self._agreement = RankAgreement(rank, world_size)
        self._finished: list[tuple[str, str]] = []  # (partition, "done" | "skipped"), in stream order
        # rank 0: when each partition it chose was completed (its marker's or manifest's modification
        # time), to tell a finished partition completed again under the same name
        self._completed: dict[str, float] = {}
        self._told_rewritten: set[str] = set()
        self._said_left_out = rank != 0  # rank 0 warns once of samples a partition leaves untrained
        self._current: tuple[str, int] | None = (
            None  # (partition, samples of this rank's share read) to continue
        )
        self._batches = 0  # batches of the stream handed out
        self._records: dict[int, BatchRecord] = {}
        self._idle_since: float | None = None
        self._beyond: list[str] = []  # rank 0: complete partitions after `until`, never trained
        # the stream's schema and id mapping: those of its first complete partition (the first after
        # `until` when only such are complete: commands that read a schema and end need one at once)
        first = self._wait_for_partition(set(), upto_until=False)
        if first is None:
            raise DataError(
                f"data.follow.dir {self.root}: no complete partition came ({self._waiting_for()})"
            )
        self.schema = self._open_source(self.root / first, self._partition_seed(first)).info
        # (partition, its id mapping); a resumed stream takes its position's
        self._mapping = (first, id_mapping(self.schema, self.root / first))
        self.info = SourceInfo(
            self.schema.num_dense, self.schema.features, None, {**self.schema.notes, "follow": str(self.root)}
        )

    # ---- DataSource ----------------------------------------------------------------------------------
    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        """Every batch of the stream from its position on, partition by partition (see the module
        docstring); ends at `until`, after `idle_timeout` or on a stop signal (`ended` says which)."""
        if epoch != 0:
            raise ConfigError("a followed stream is one pass: train.epochs must be 1")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        return self._stream(batch_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """None: every batch of the stream is scored before it trains (progressive validation)."""
        return iter(())

    def eval_slices(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        return iter(())

    # ---- position ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The position after the latest batch handed out (see position_after)."""
        return self.position_after(self._batches)

    def position_after(self, batches: int) -> dict[str, Any]:
        """The stream's position after its first `batches` batches: the partitions finished, the one
        being read and the samples read of this rank's share of it (`partition` None between two),
        plus the layout it holds for. Records of earlier batches are dropped."""
        for k in [k for k in self._records if k < batches]:
            del self._records[k]
        record = self._records.get(batches)
        if record is not None:
            position = record.position
        else:  # nothing handed out since the start or the resume
            position = self._position(len(self._finished), self._current)
        return {**position, "batches": batches, "epoch": 0, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle}  # fmt: skip

    def batch_record(self, batch: int) -> BatchRecord:
        """The record of the stream's `batch`-th batch (1-based), handed out already."""
        return self._records[batch]

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue after the position `state` (a `position_after` of an earlier run of the stream)."""
        checked_position(self, state, _LAYOUT_KEYS, "follow position")
        done, skipped = state.get("done"), state.get("skipped")
        partition, batches = state.get("partition"), state.get("batches")
        names_ok = all(isinstance(x, list) and all(isinstance(n, str) for n in x) for x in (done, skipped))
        if (
            not names_ok
            or not (partition is None or isinstance(partition, str))
            or not isinstance(batches, int)
        ):
            raise DataError(
                f"follow position {str(state)[:200]}: malformed (expected done, skipped, partition, batches)"
            )
        completed = state.get("completed") or {}
        if not isinstance(completed, dict) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in completed.values()
        ):
            raise DataError(f"follow position: completed {str(completed)[:200]}: malformed (partition: time)")
        order = state.get("order") or [[n, "done"] for n in done] + [[n, "skipped"] for n in skipped]
        saved = state.get("dir")
        if isinstance(saved, str) and saved != self._place:  # moved, or another stream: say which
            completed = {}  # another folder's completion times
            if self.rank == 0:
                log.warning(
                    f"data.follow.dir {self.root}: the position resumed was saved following {saved}; the "
                    f"{len(order)} partitions it finished count as finished here too, by name"
                )
        if state.get("id_mapping") is not None:  # the mapping the stream trained with (absent: older runs)
            self._mapping = checked_mapping(state["id_mapping"], "follow position")
        self._finished = [(str(n), str(s)) for n, s in order]
        self._completed = {str(n): float(t) for n, t in completed.items()}
        self._current = (partition, int(state["samples"])) if partition is not None else None
        self._batches = batches
        self._records.clear()

    def _position(self, num_finished: int, current: tuple[str, int] | None) -> dict[str, Any]:
        finished = self._finished[:num_finished]
        return {
            "done": [n for n, s in finished if s == "done"],
            "skipped": [n for n, s in finished if s == "skipped"],
            "order": [[n, s] for n, s in finished],
            "completed": {
                n: self._completed[n]
                for n in [n for n, _ in finished] + ([current[0]] if current else [])
                if n in self._completed
            },
            "partition": current[0] if current else None,
            "samples": current[1] if current else 0,
            "dir": self._place,
            "id_mapping": {"partition": self._mapping[0], "settings": self._mapping[1]},
        }

    # ---- the stream ----------------------------------------------------------------------------------
    def _stream(self, batch_size: int) -> Iterator[Batch]:
        current, self._current = self._current, None
        if current is not None:  # resumed inside a partition
            if not (self.root / current[0]).is_dir():
                raise DataError(
                    f"data.follow.dir {self.root}: partition {current[0]} was being trained when the run "
                    "stopped and is gone; put it back, or start a new run (--overwrite)"
                )
            yield from self._partition_batches(current[0], batch_size, current[1])
        while True:
            seen = {n for n, _ in self._finished}
            if self.config.until is not None and self.config.until in seen:
                self.ended = "until"
                return
            name = self._wait_for_partition(seen)
            if name is None:
                return
            yield from self._partition_batches(name, batch_size, 0)

    def _partition_batches(self, name: str, batch_size: int, start: int) -> Iterator[Batch]:
        source = self._open(name)
        if source is None:  # bad, and skipped
            self._finished.append((name, "skipped"))
            return
        total = source.num_samples("train")  # type: ignore[attr-defined]
        if not self._said_left_out and (left := source.left_out()):  # type: ignore[attr-defined]
            from neorec.data.ranks import left_out_text

            self._said_left_out = True
            text = left_out_text(total * self.world_size + left, left, self.world_size, "the partition")
            log.warning(f"partition {name}: {text} (said for the first partition that leaves some)")
        if start:
            source.load_state({**source.state(), "epoch": 0, "samples": start})  # type: ignore[attr-defined]
        position, index = start, start // batch_size
        for batch in source.train_batches(batch_size, 0):
            position += len(batch)
            last = position >= total
            if last:
                self._finished.append((name, "done"))
                where = self._position(len(self._finished), None)
            else:
                where = self._position(len(self._finished), (name, position))
            self._batches += 1
            self._records[self._batches] = BatchRecord(name, index, last, where)
            index += 1
            yield batch
        if position < total:  # a reader that ended early would be a bug: stop rather than skip samples
            raise DataError(f"partition {name}: read {position} of its {total} samples")

    def _open(self, name: str) -> DataSource | None:
        """Partition `name`'s source for this rank once every rank found it good (schema, and its
        share read through with `verify`); None when it is bad and skipped."""
        path = self.root / name
        source, error = None, ""
        try:
            source = self._open_source(path, self._partition_seed(name))
            error = schema_change(source.info, self.schema) or mapping_change(
                id_mapping(source.info, path), self._mapping[1], self._mapping[0]
            )
            if not error and self.config.verify:
                source.check_share()  # type: ignore[attr-defined]
        except (DataError, OSError) as e:
            error = str(e)
        reports = self._agreement.gather(error)
        bad = [(r, m) for r, m in enumerate(reports) if m]
        if not bad:
            return source
        rank, message = bad[0]
        where = f" (found by rank {rank})" if self.world_size > 1 else ""
        text = f"data.follow: partition {name} ({path}) is bad{where}: {message}"
        if self.config.bad_partitions == "stop":
            raise DataError(f"{text}; fix or remove it, or set data.follow.bad_partitions: skip")
        log.warning(f"{text}; skipped (data.follow.bad_partitions: skip)")
        return None

    def _partition_seed(self, name: str) -> int:
        """The shuffling seed of a partition: the run's seed and the partition's name."""
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)

    # ---- what comes next: rank 0 decides -------------------------------------------------------------
    def _wait_for_partition(self, seen: set[str], upto_until: bool = True) -> str | None:
        """The next complete partition not in `seen` (`upto_until`: not after `until`, see
        `_upto_until`), waiting for one; None when the stream ends (idle timeout, stop signal; `ended`
        says which). Collective over the ranks."""
        while True:
            word = self._agreement.broadcast(self._choose(seen, upto_until) if self.rank == 0 else "")
            kind, _, name = word.partition(":")
            if kind == "partition":
                self._idle_since = None
                return name
            if kind == "end":
                self.ended = name
                if name == "idle" and self.config.until is not None:  # a goal not met must not pass unseen
                    last = self._finished[-1][0] if self._finished else "none"
                    log.warning(
                        f"data.follow: no new partition in {self.root} for {self.config.idle_timeout} s; "
                        f"the run ends before --until {self.config.until} (data.follow.until), which never "
                        f"came: the last partition finished is {last}{self._beyond_text()}"
                    )
                elif name == "idle":
                    log.info(
                        f"data.follow: no new partition in {self.root} for {self.config.idle_timeout} s; "
                        "the run ends"
                    )
                return None
            time.sleep(self.config.poll_seconds)

    def _choose(self, seen: set[str], upto_until: bool = True) -> str:
        """Rank 0's word: "partition:NAME", "end:signal", "end:idle" or "wait"."""
        if self.stop_requested():
            return "end:signal"
        partitions = list_partitions(self.root, self.kind, self.config.marker, self.config.order)
        if upto_until:
            partitions = self._upto_until(partitions)
        for p in partitions:
            if p.name not in seen:
                self._completed[p.name] = p.completed
                return f"partition:{p.name}"
            self._tell_if_rewritten(p)
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            what = f" up to --until {self.config.until}" if self._beyond else ""
            text = f"data.follow: waiting for a new partition{what} in {self.root} ({self._waiting_for()})"
            # later partitions there while the run waits with no limit (no idle warning will come): say so
            forever = self._beyond and self.config.idle_timeout is None
            (log.warning if forever else log.info)(text + self._beyond_text())
        if self.config.idle_timeout is not None and now - self._idle_since >= self.config.idle_timeout:
            return "end:idle"
        return "wait"

    def _upto_until(self, partitions: list[Partition]) -> list[Partition]:
        """The complete `partitions` (in stream order) that may be trained before `until`: up to it
        where it is listed; in name order, those whose names sort up to it when it is not (yet). The
        ones after it are kept in `_beyond` for the messages."""
        until = self.config.until
        names = [p.name for p in partitions]
        if until is None:
            keep = len(partitions)
        elif until in names:
            keep = names.index(until) + 1
        elif self.config.order == "name":
            keep = sum(1 for n in names if n <= until)  # listed by name: a prefix
        else:  # by completion: every partition complete now was completed before `until` will be
            keep = len(partitions)
        self._beyond = names[keep:]
        return partitions[:keep]

    def _beyond_text(self) -> str:
        """The partitions after `until` (rank 0), in words ("" when none)."""
        if not self._beyond:
            return ""
        more = len(self._beyond) - 5
        shown = ", ".join(self._beyond[:5]) + (f" and {more} more" if more > 0 else "")
        one = len(self._beyond) == 1
        return (
            f"; {shown} {'comes' if one else 'come'} after --until {self.config.until} in the stream's order "
            f"(data.follow.order: {self.config.order}) and {'is' if one else 'are'} not trained"
        )

    def _tell_if_rewritten(self, partition: Partition) -> None:
        """Warn (once) when a partition the stream finished was completed again since: the stream takes
        each name once, so its new data is not trained, which must not pass unseen."""
        before = self._completed.get(partition.name)
        if before is None or partition.completed == before or partition.name in self._told_rewritten:
            return
        self._told_rewritten.add(partition.name)
        what = dict(self._finished).get(partition.name, "done")
        how = "trained" if what == "done" else "skipped as bad"
        marker = completion_file(partition.path, self.kind, self.config.marker).name
        log.warning(
            f"data.follow: partition {partition.name} was completed again after this run {how} it (its "
            f"{marker} is from {_when(partition.completed)}, was {_when(before)}); a partition is read once, "
            "by name, so its new data is not trained: write it under a new name to train it"
        )

    def _waiting_for(self) -> str:
        what = completion_text(self.kind, self.config.marker)
        limit = (
            f"for up to {self.config.idle_timeout} s"
            if self.config.idle_timeout is not None
            else "with no limit"
        )
        return f"a subfolder with {what}, {limit}"


def _when(timestamp: float) -> str:
    """A modification time as local date and time, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
