"""A DataSource over Parquet files (`data.source: parquet`): one rank's share, streamed by row group,
exact resume.

Files: each entry of `paths` / `eval_paths` is a file or a folder (local, or a URI that pyarrow's
filesystems open, such as s3://...), listed by pyarrow.dataset; a folder's files are taken in sorted
order (names starting with "." or "_" are skipped). Every file's footer is read when the source is
built, and its schema checked against the config (neorec/data/parquet_columns.py): a missing column, a
column of the wrong type or a file that is not Parquet is a DataError naming the file and column.

The unit of reading is a row group. The samples of one epoch, for one rank, are a pure function of
(seed, epoch, rank, world_size, shuffle) and the files, as in the preprocessed-shard reader
(neorec/data/sharded_reader.py):
1. Row-group order: the split's row groups, in file order, or permuted by a generator seeded with
   (seed, epoch) when shuffling training data; laid end to end they give N samples.
2. Rank share: rank r takes samples [r n, (r + 1) n) of that order, n = N // world_size, so every rank
   yields the same number of batches, known from the footers alone; a rank reads only the row groups
   that overlap its range (a row group on the boundary of two ranks is read by both, each keeping its
   rows). The N % world_size samples at the end are left out of that epoch.
3. Within a row group, rows are permuted by a generator seeded with (seed, epoch, row group) when
   shuffling: an order that depends only on the position, which makes resuming exact.
4. Batches: consecutive `batch_size` samples of that stream, across row groups (the last may be
   smaller). One background thread reads and converts row groups, another cuts batches, so memory
   holds a few row groups and batches whatever the size of the files.

Held-out set: the files of `eval_paths`, or the rows of `paths` whose `eval_column` is true (then the
flag column is read for every row group when the source is built, to count the samples of each split).
Evaluation reads the whole held-out set in file order; under W ranks each scores its rows of every
batch (`eval_slices`, as the sharded reader).

Resume: `state()` tells how many samples of which epoch this reader has handed out; after
`load_state(state)`, the next `train_batches(batch_size, state["epoch"])` starts right after them,
reading from the row group that holds the next sample.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from neorec.config.schema import ParquetConfig
from neorec.data.batch import Batch
from neorec.data.checks import checked_mode
from neorec.data.columns import Columns, cut_batches
from neorec.data.file_roles import FileRoles
from neorec.data.packed import PackedColumns
from neorec.data.parquet_columns import ColumnMap, held_out
from neorec.data.parquet_output import check_finished
from neorec.data.prefetch import prefetch
from neorec.data.reader_position import checked_position
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.data.vocab import load_vocabs, vocabs_crc32
from neorec.errors import ConfigError, DataError

SPLITS = ("train", "eval")
_OPEN_FILES = 32
_LAYOUT_KEYS = ("seed", "rank", "world_size", "shuffle")


@dataclass
class RowGroup:
    """Row group `group` of file `file` (an index into the source's files) and its samples per split."""

    file: int
    group: int
    samples: dict[str, int]


def list_files(path: str) -> tuple[pafs.FileSystem, list[str]]:
    """(filesystem, sorted files) of a file or folder, local or a URI; DataError when there is none, or
    when it is part of an unfinished preprocessing's Parquet copy (neorec/data/parquet_output.py)."""
    check_finished(path)
    try:
        dataset = ds.dataset(path, format="parquet", schema=pa.schema([]))  # lists only: files are opened later
    except FileNotFoundError:
        raise DataError(f"{path}: no such file or folder") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: cannot list Parquet files ({e})") from None
    files = sorted(dataset.files)
    if not files:
        raise DataError(f"{path}: holds no Parquet files")
    return dataset.filesystem, files


def listed_files(config: ParquetConfig) -> list[tuple[str, pafs.FileSystem, str]]:
    """(key, filesystem, file) of every file of data.parquet.paths, then of eval_paths ("paths" or
    "eval_paths" as key), listed without being opened; a file named twice, or both for training and
    as held out (a held-out file inside a training folder), is refused (neorec/data/file_roles.py)."""
    once, out = FileRoles(), []
    for key, paths in (("paths", config.paths), ("eval_paths", config.eval_paths or [])):
        for path in paths:
            fs, files = list_files(path)
            for name in files:
                role = "train" if key == "paths" else "eval"
                once.add(file_uri(fs, name), role, f"data.parquet.{key}: {path}")
                out.append((key, fs, name))
    return out


def open_parquet(fs: pafs.FileSystem, path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(fs.open_input_file(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def column_map(
    config: ParquetConfig, with_vocabs: bool = True, bounds_check: str = "error", labeled: bool = True
) -> ColumnMap:
    """The config's columns, with every feature's settings and vocabulary (hashing vocab) resolved
    (`with_vocabs=False`: vocabularies not loaded, for checking files before they are counted;
    `labeled=False`: files without the label column, whose rows are scored only)."""
    features = config.feature_configs()
    names = [f.name for f in features if f.hashing == "vocab"]
    loaded = dict(zip(names, load_vocabs(Path(config.vocab_dir), names), strict=True)) if names and with_vocabs else {}
    vocabs = [loaded.get(f.name) for f in features]
    label = config.label if labeled else None
    dense, eval_column = list(config.dense), config.eval_column
    return ColumnMap(label, dense, config.dense_log1p, features, vocabs, eval_column, bounds_check)


def file_uri(fs: pafs.FileSystem, path: str) -> str:
    """A string that `open_uri` opens again (in another process): the path, or a URI off this machine."""
    return path if fs.type_name == "local" else f"{fs.type_name}://{path}"


def open_uri(uri: str) -> pq.ParquetFile:
    if "://" not in uri:
        return open_parquet(pafs.LocalFileSystem(), uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return open_parquet(fs, path)


class ParquetSource:
    """DataSource over Parquet files; this rank's share only (see the module docstring)."""

    def __init__(
        self,
        config: ParquetConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        bounds_check: str = "error",
        labeled: bool = True,
    ) -> None:
        """`bounds_check` (embedding.bounds_check): what ids outside their tables (hashing none) do when a
        row group is read: "error" stops naming file, row group, row and column, "warn" logs them and
        passes them on for the embedding engine to drop, "off" reads no id. `labeled=False`: files
        without the label column, to be scored (their labels read as 0)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        self.config = config
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, config.shuffle
        self.map = column_map(config, bounds_check=checked_mode(bounds_check), labeled=labeled)
        features, vocabs = self.map.features, self.map.vocabs
        self.files: list[tuple[pafs.FileSystem, str]] = []
        self.groups: dict[str, list[RowGroup]] = {split: [] for split in SPLITS}
        multi_hot: list[bool] | None = None
        for role, fs, name in listed_files(config):
            pf = open_parquet(fs, name)
            by_column = role == "paths" and config.eval_column is not None
            hot = self.map.check_schema(name, pf.schema_arrow, with_eval_column=by_column)
            if multi_hot is not None and hot != multi_hot:
                f = int(np.flatnonzero(np.array(hot) != np.array(multi_hot))[0])
                raise DataError(
                    f"{name}: column {features[f].column!r} is {'a list' if hot[f] else 'not a list'} "
                    f"here but {'a list' if multi_hot[f] else 'not a list'} in {self.files[0][1]}"
                )
            multi_hot = hot
            self.files.append((fs, name))
            for g in range(pf.num_row_groups):
                self._add_group(pf, len(self.files) - 1, g, role, by_column)
        assert multi_hot is not None
        if self.num_samples("train") == 0:
            raise DataError(
                f"data.parquet.paths {list(config.paths)}: no training rows for {world_size} rank(s)"
                + (f" (every row's {config.eval_column!r} is true)" if config.eval_column else "")
            )
        self.features = [
            FeatureSpec(f.name, f.rows if v is None else v.size + 1, hot, f.weights is not None)
            for f, v, hot in zip(features, vocabs, multi_hot, strict=True)
        ]
        self.keys = [f.name for f in self.features]
        notes = {"dense": list(config.dense), "files": len(self.files)}
        self.info = SourceInfo(len(config.dense), self.features, self.num_samples("train"), notes)
        self._open: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._lock = threading.Lock()
        self._epoch, self._position = 0, 0  # what this reader has handed out
        self._resume: tuple[int, int] | None = None
        # the training files as read (their order and names, row groups, rows; not the folders, whose
        # paths the run's data settings compare): files added to a training folder, or written again,
        # would move the saved position to other samples, which a resume refuses
        train = self.groups["train"]
        groups = [(g.file, Path(self.files[g.file][1]).name, g.group, g.samples["train"]) for g in train]
        self.files_crc32 = zlib.crc32(json.dumps(groups).encode())
        # and the vocabularies the ids are mapped with (hashing vocab), which may be counted again in place
        self.vocab_crc32 = vocabs_crc32([f.name for f in features], vocabs)

    def _add_group(self, pf: pq.ParquetFile, file: int, g: int, role: str, by_column: bool) -> None:
        rows = pf.metadata.row_group(g).num_rows
        if rows == 0:
            return
        if by_column:
            column = self.map.eval_column
            try:
                flags = pf.read_row_group(g, columns=[column]).column(0)
            except (pa.ArrowInvalid, OSError) as e:
                raise DataError(f"{self.files[file][1]}, row group {g}: cannot read column {column!r} ({e})") from None
            held = int(held_out(flags, f"{self.files[file][1]}, row group {g}", column).sum())
            samples = {"train": rows - held, "eval": held}
            for split in SPLITS:
                if samples[split]:
                    self.groups[split].append(RowGroup(file, g, samples))
        else:
            split = "train" if role == "paths" else "eval"
            self.groups[split].append(RowGroup(file, g, {split: rows}))

    # ---- sizes ---------------------------------------------------------------------------------------
    def num_samples(self, split: str = "train") -> int:
        """Samples every rank reads per epoch of training (the whole held-out set for eval)."""
        total = sum(g.samples[split] for g in self.groups[split])
        return total // self.world_size if split == "train" else total

    def left_out(self) -> int:
        """Training samples of an epoch that no rank reads: the last N % world_size of its order."""
        return sum(g.samples["train"] for g in self.groups["train"]) % self.world_size

    # ---- DataSource ----------------------------------------------------------------------------------
    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
            self._resume = None
        n = self.num_samples("train")
        return self._batches("train", batch_size, epoch, self.rank * n + start, (self.rank + 1) * n)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """The whole held-out set, in file order, on every rank."""
        return self._batches("eval", batch_size, None, 0, self.num_samples("eval"))

    def eval_slices(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        """(this rank's rows of a held-out batch, n) for every batch of `batch_size` of the held-out set
        (what one process's `eval_batches` yields): rows [r b, (r + 1) b) of the batch's n samples,
        b = ceil(n / world_size), rows past n being copies of its last sample."""
        from neorec.data.ranks import take

        for batch in self.eval_batches(batch_size):
            n = len(batch)
            b = -(-n // self.world_size)
            if (self.rank + 1) * b <= n:
                yield batch.slice(self.rank * b, (self.rank + 1) * b), n
            else:
                yield take(batch, torch.arange(self.rank * b, (self.rank + 1) * b).clamp_(max=n - 1)), n

    def check_share(self) -> None:
        """Read this rank's training samples of epoch 0 through once, every value checked as training
        reads it (a damaged row group is a DataError naming it), without handing any out."""
        n = self.num_samples("train")
        for _ in self._windows("train", 0, self.rank * n, (self.rank + 1) * n):
            pass

    # ---- resume --------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Position after the latest training batch handed out (plus the layout it is valid for)."""
        return {"epoch": self._epoch, "samples": self._position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle,
                "files_crc32": self.files_crc32,
                **({"vocab_crc32": self.vocab_crc32} if self.vocab_crc32 is not None else {})}  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        """Make the next `train_batches(.., state["epoch"])` continue after `state["samples"]` samples."""
        epoch, samples = checked_position(self, state, _LAYOUT_KEYS)
        self._resume = (epoch, samples)
        self._epoch, self._position = epoch, samples

    # ---- reading -------------------------------------------------------------------------------------
    def _pieces(self, split: str, epoch: int | None, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(row group index in the split, start, end) covering samples [lo, hi) of the epoch's order."""
        groups = self.groups[split]
        order = range(len(groups))
        if epoch is not None and self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(groups)).tolist()
        pieces, pos = [], 0
        for i in order:
            size = groups[i].samples[split]
            a, b = max(lo, pos), min(hi, pos + size)
            if a < b:
                pieces.append((i, a - pos, b - pos))
            pos += size
            if pos >= hi:
                break
        return pieces

    def _read(self, split: str, i: int) -> Columns:
        """The samples of `split` in the split's row group i."""
        group = self.groups[split][i]
        fs, name = self.files[group.file]
        by_column = self.map.eval_column is not None and len(group.samples) == 2
        where = f"{name}, row group {group.group}"
        try:
            with self._lock:  # a file's reader is shared by the training and evaluation threads
                table = self._file(group.file).read_row_group(
                    group.group, columns=self.map.columns(by_column), use_threads=False
                )
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{where}: cannot read ({e})") from None
        cols = self.map.to_columns(table, where)  # all rows, so that errors name the file's row numbers
        if by_column:
            mask = held_out(table.column(self.map.eval_column), where, self.map.eval_column)
            cols = cols.take(np.flatnonzero(mask if split == "eval" else ~mask))
        return cols

    def _windows(
        self, split: str, epoch: int | None, lo: int, hi: int
    ) -> Iterator[tuple[PackedColumns, np.ndarray]]:
        """(row group's samples, packed (neorec/data/packed.py), order of the ones to take) for samples
        [lo, hi) of the epoch."""
        shuffled = epoch is not None and self.shuffle
        for i, a, b in self._pieces(split, epoch, lo, hi):
            cols = self._read(split, i)
            order = np.arange(len(cols))
            if shuffled:
                order = np.random.default_rng([self.seed, epoch, i]).permutation(len(cols))
            yield PackedColumns.pack([cols]), order[a:b]

    def _batches(self, split: str, batch_size: int, epoch: int | None, lo: int, hi: int) -> Iterator[Batch]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        depth = self.config.prefetch
        windows = prefetch(self._windows(split, epoch, lo, hi), 1 if depth else 0)
        batches = (cols.to_batch(self.keys) for cols in cut_batches(windows, batch_size))
        position = lo - self.rank * self.num_samples("train") if epoch is not None else 0
        for batch in prefetch(batches, depth):
            position += len(batch)
            if epoch is not None:
                self._epoch, self._position = epoch, position
            yield batch

    def _file(self, file: int) -> pq.ParquetFile:
        """The open file (kept open for the next row groups); call with the lock held."""
        pf = self._open.get(file)
        if pf is None:
            pf = open_parquet(*self.files[file])
            self._open[file] = pf
            if len(self._open) > _OPEN_FILES:
                self._open.popitem(last=False)
        self._open.move_to_end(file)
        return pf
