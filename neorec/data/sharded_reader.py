"""A DataSource over a folder of `neorec data preprocess`: per-rank parts, seeded shuffling, background
prefetch, exact resume.

The samples of one epoch, for one rank, are a pure function of (seed, epoch, rank, world_size,
shuffle_window) and the manifest:
1. Shard order: the shards' parts of the split are permuted with a generator seeded by (seed, epoch)
   (kept in manifest order for eval, or with shuffle off) and laid end to end: N samples.
2. Rank part: every rank takes n = N // world_size samples, rank r the contiguous range
   [r * n, (r + 1) * n). All ranks thus yield the same number of samples, so the same number and sizes
   of batches, known from the manifest alone without any communication: no rank runs out of batches
   while the others wait in a collective at the end of an epoch, whatever the shard sizes. The
   N % world_size samples at the very end of the order (of whichever shard comes last that epoch) are
   left out of that epoch.
3. Shuffle window: the rank's range is cut into windows of `shuffle_window` samples and each window is
   permuted with a generator seeded by (seed, epoch, rank, window): a shuffle buffer whose output
   depends only on the position, which is what makes resuming exact.
4. Batches: consecutive `batch_size` samples of that stream (the last one may be smaller).

Reading: columns are memory-mapped, so a window reads only its slices of (at most a few) shards. One
thread reads the next windows, packs them (neorec/data/packed.py: a sample's one-hot ids in one row)
and permutes them, `threads` others gather ready `Batch`es out of them (neorec.data.prefetch; handed
out in order, so the data is the same whatever their number), so the training step finds batches
waiting.

Resume: `state()` tells how many samples of which epoch this reader has handed out; after
`load_state(state)`, the next `train_batches(batch_size, state["epoch"])` starts right after them (the
batch size may differ). A trainer that prefetches batches itself should save the samples it consumed,
not the reader's count: `{**reader.state(), "samples": consumed}`.

Training under W processes: the trainer gives rank r the reader of rank r and local batches of
batch_size / W, so the global batch of a step is the ranks' local batches concatenated in rank order
(what one process must train on to match a W-process run). Evaluation covers the whole held-out set
instead (`eval_slices`): every rank reads only its rows of each held-out batch, as one process reads
the batches, and the ranks' scores gathered in rank order are that batch's scores.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from neorec.data.batch import Batch
from neorec.data.checks import check_dense, check_ids, check_labels, check_weights, checked_mode
from neorec.data.columns import Columns, assemble, batch_pieces
from neorec.data.manifest import SPLITS, check_part_files, load_manifest, shard_name
from neorec.data.npy_map import map_npy
from neorec.data.packed import PackedColumns
from neorec.data.prefetch import ordered_map, prefetch
from neorec.data.reader_position import checked_position
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.errors import ConfigError, DataError

_OPEN_PARTS = 32  # memory-mapped shard parts kept open (each maps one file per column)
_LAYOUT_KEYS = ("seed", "rank", "world_size", "shuffle", "shuffle_window")


_NUMBERS, _INTEGERS, _FLOATS = "biuf", "iu", "f"  # numpy dtype kinds a column may have
_RAW_HIGH = (1 << 63) - 1  # the largest raw id of a managed-collision table


class _Part:
    """One shard's columns of one split, memory-mapped; each checked to have the dimensions and the kind
    of dtype its column needs (a file of floats where ids belong, or labels of two dimensions, is a
    DataError naming it, not a failure deep in a batch)."""

    def __init__(self, folder: Path, features: list[FeatureSpec], num_dense: int) -> None:
        self.folder = folder
        self.id_limits: tuple[list[int], list[int]] | None = None  # known once `check` found every id in place
        self.dense = self._load("dense", 2, _NUMBERS)
        self.labels = self._load("labels", 1, _NUMBERS)
        self.ids = [self._load(f"ids_{f.name}", 1, _INTEGERS) for f in features]
        self.lengths = [self._load(f"lengths_{f.name}", 1, _INTEGERS) if f.multi_hot else None for f in features]
        self.weights = [self._load(f"weights_{f.name}", 1, _FLOATS) if f.weighted else None for f in features]
        n = len(self.labels)
        if self.dense.shape != (n, num_dense):
            raise DataError(f"{folder}/dense.npy: shape {self.dense.shape}, expected ({n}, {num_dense})")
        for f, ln in zip(features, self.lengths, strict=True):
            if ln is not None and len(ln) != n:
                raise DataError(f"{folder}/lengths_{f.name}.npy: {len(ln)} bag sizes, expected {n}")
            if ln is not None and n and int(ln.min()) < 0:
                raise DataError(f"{folder}/lengths_{f.name}.npy: a negative bag size; preprocess again into a new folder")
        # start of each sample's ids in a multi-hot column (one cumsum per part, when first opened)
        self.offsets = [None if ln is None else np.concatenate([[0], np.cumsum(ln, dtype=np.int64)])
                        for ln in self.lengths]  # fmt: skip
        for f, (ids, off) in enumerate(zip(self.ids, self.offsets, strict=True)):
            expected = n if off is None else int(off[-1])
            if len(ids) != expected:
                raise DataError(f"{folder}/ids_{features[f].name}.npy: {len(ids)} ids, expected {expected}")
            w = self.weights[f]
            if w is not None and len(w) != expected:
                raise DataError(f"{folder}/weights_{features[f].name}.npy: {len(w)} weights, expected {expected}")

    def check(
        self, features: list[FeatureSpec], raw: set[str], bounds_check: str, dense_names: list[str]
    ) -> None:
        """Stop (DataError naming the .npy file, row, column and value) at a label other than 0 or 1, a
        dense value or an id weight that is not finite; check ids against their tables as
        `bounds_check` says (`raw`: features holding raw ids of managed-collision tables, which need
        only be >= 0). When every id was checked and lies in its table, the tables' bounds become the
        part's id limits, which its batches carry (the embedding engines' id check then reads no id of
        theirs again)."""
        check_labels(self.labels, str(self.folder / "labels.npy"))
        check_dense(self.dense, str(self.folder / "dense.npy"), dense_names)
        outside = 0
        for f, ids, ln, w in zip(features, self.ids, self.lengths, self.weights, strict=True):
            if w is not None:
                check_weights(w, str(self.folder / f"weights_{f.name}.npy"), f.name, ln)
            outside += check_ids(ids, str(self.folder / f"ids_{f.name}.npy"), f.name, f.num_ids, lengths=ln,
                                 raw=f.name in raw, mode=bounds_check)  # fmt: skip
        if bounds_check != "off" and not outside:
            highs = [_RAW_HIGH if f.name in raw else f.num_ids - 1 for f in features]
            self.id_limits = ([0] * len(features), highs)

    def _load(self, name: str, ndim: int, kinds: str) -> np.ndarray:
        """Column `name`, memory-mapped, with `ndim` dimensions and a dtype of one of `kinds`."""
        path = self.folder / f"{name}.npy"
        try:
            array = map_npy(path)
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"{path}: cannot read ({e}); preprocess again into a new folder") from None
        if not isinstance(array, np.ndarray) or array.ndim != ndim or array.dtype.kind not in kinds:
            what = {_INTEGERS: "integers", _FLOATS: "floats"}.get(kinds, "numbers")
            got = f"{array.ndim}-D {array.dtype}" if isinstance(array, np.ndarray) else type(array).__name__
            raise DataError(f"{path}: {got}, expected {ndim}-D {what}; preprocess again into a new folder")
        return array

    def read(self, start: int, end: int) -> Columns:
        """Samples [start, end): views of the mapping (Columns.cat copies them out)."""
        values, lengths, weights = [], [], []
        for ids, ln, off, w in zip(self.ids, self.lengths, self.offsets, self.weights, strict=True):
            a, b = (start, end) if off is None else (int(off[start]), int(off[end]))
            values.append(ids[a:b])
            lengths.append(None if ln is None else ln[start:end])
            weights.append(None if w is None else w[a:b])
        return Columns(self.dense[start:end], self.labels[start:end], values, lengths, weights, self.id_limits)


class PreprocessedSource:
    """DataSource over preprocessed shards; this rank's part only (see the module docstring)."""

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_window: int = 1 << 17,
        prefetch: int = 4,
        bounds_check: str = "error",
        threads: int = 1,
    ) -> None:
        """`bounds_check` (embedding.bounds_check): what a shard's ids outside their tables do when the
        shard is opened: "error" stops, "warn" logs them and passes them on, "off" reads no id.
        `threads`: threads that gather training batches out of the windows, in parallel (the batches
        come in the same order whatever their number)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
        if shuffle_window < 1:
            raise ConfigError(f"shuffle_window must be >= 1, got {shuffle_window}")
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.root = Path(root)
        manifest = load_manifest(self.root)
        if not manifest.get("complete"):
            raise DataError(
                f"{self.root / 'manifest.json'}: preprocessing is not finished; rerun the same "
                "`neorec data preprocess` command to complete it"
            )
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.shuffle_window, self.prefetch = shuffle, shuffle_window, prefetch
        self.threads = threads
        self.bounds_check = checked_mode(bounds_check)
        self.num_dense = int(manifest["num_dense"])
        self.features = [FeatureSpec(**f) for f in manifest["features"]]
        self.keys = [f.name for f in self.features]
        # per split: (folder, samples) of every shard holding samples of that split, in manifest order
        self.parts: dict[str, list[tuple[Path, int]]] = {split: [] for split in SPLITS}
        self._files: dict[Path, dict] = {}  # part folder -> its shard's file sizes and crc32s (manifest.py)
        for entry in manifest["shards"]:
            for split, n in entry["samples"].items():
                if n:
                    self.parts[split].append((self.root / "shards" / shard_name(entry["index"]) / split, n))
                    self._files[self.parts[split][-1][0]] = entry.get("files", {})
        notes = dict(manifest.get("notes", {}))
        notes.update(settings=manifest["settings"], skipped=manifest.get("skipped", {}))
        self.info = SourceInfo(self.num_dense, self.features, self.num_samples("train"), notes)
        self._raw = set(manifest["settings"].get("categorical", {}).get("raw_features", ()))
        self._dense_names = [str(n) for n in notes.get("dense", [])]
        # parts already checked (a reopened part is not rescanned) -> the id limits the check found
        self._checked: dict[Path, tuple[list[int], list[int]] | None] = {}
        self._open: OrderedDict[Path, _Part] = OrderedDict()
        self._lock = threading.Lock()
        self._epoch, self._position = 0, 0  # what this reader has handed out
        self._resume: tuple[int, int] | None = None
        # the data set itself (its settings, shards and every file's crc32): a folder written again with
        # other inputs or settings under the same path has another, which a resume refuses
        self.data_crc32 = zlib.crc32(json.dumps(manifest, sort_keys=True).encode())

    @property
    def num_skipped(self) -> int:
        """Bad lines skipped when the data was preprocessed (the trainer reports it)."""
        return sum(self.info.notes["skipped"].values())

    # ---- sizes ---------------------------------------------------------------------------------------
    def num_samples(self, split: str = "train") -> int:
        """Samples every rank reads per epoch: the split's total // world_size."""
        return sum(n for _, n in self.parts[split]) // self.world_size

    def left_out(self) -> int:
        """Training samples of an epoch that no rank reads: the last N % world_size of its order."""
        return sum(n for _, n in self.parts["train"]) % self.world_size

    def num_batches(self, batch_size: int, split: str = "train") -> int:
        return -(-self.num_samples(split) // batch_size)

    # ---- DataSource ----------------------------------------------------------------------------------
    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
            self._resume = None
        return self._batches("train", batch_size, epoch, start)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        return self._batches("eval", batch_size, None, 0)

    def eval_slices(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        """(this rank's rows of a held-out batch, n) for every batch of `batch_size` of the whole held-out
        set in manifest order (what one process's `eval_batches` yields): rows [r b, (r + 1) b) of a
        batch of n samples, b = ceil(n / world_size), rows past n being copies of its last sample. All
        ranks get the same number of slices of equal sizes; nothing is left out."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        return prefetch(self._eval_slices(batch_size), self.prefetch)

    def _eval_slices(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        total = sum(n for _, n in self.parts["eval"])
        for first in range(0, total, batch_size):
            n = min(batch_size, total - first)
            b = -(-n // self.world_size)
            lo, hi = first + min(self.rank * b, n), first + min((self.rank + 1) * b, n)
            cols = [self._part(f, size).read(a, z) for f, size, a, z in self._pieces("eval", None, lo, hi)]
            if hi - lo < b:  # pad with the batch's last sample; its scores are dropped after gathering
                f, size, a, z = self._pieces("eval", None, first + n - 1, first + n)[0]
                cols.append(self._part(f, size).read(a, z).take(np.zeros(b - (hi - lo), np.int64)))
            yield Columns.cat(cols).to_batch(self.keys), n

    def check_share(self) -> None:
        """Check every shard part holding this rank's training samples of epoch 0 (file sizes and
        crc32s, then every value), as reading them would, without handing any sample out."""
        for folder, size, _, _ in self._rank_pieces("train", 0):
            self._part(folder, size)

    # ---- resume --------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Position after the latest training batch handed out (plus the layout it is valid for)."""
        return {"epoch": self._epoch, "samples": self._position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle, "shuffle_window": self.shuffle_window,
                "data_crc32": self.data_crc32}  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        """Make the next `train_batches(.., state["epoch"])` continue after `state["samples"]` samples."""
        epoch, samples = checked_position(self, state, _LAYOUT_KEYS)
        self._resume = (epoch, samples)
        self._epoch, self._position = epoch, samples

    # ---- the epoch's order ---------------------------------------------------------------------------
    def _rank_pieces(self, split: str, epoch: int | None) -> list[tuple[Path, int, int, int]]:
        """(part folder, part samples, start, end) covering this rank's range, in reading order."""
        n = self.num_samples(split)
        return self._pieces(split, epoch, self.rank * n, (self.rank + 1) * n)

    def _pieces(self, split: str, epoch: int | None, lo: int, hi: int) -> list[tuple[Path, int, int, int]]:
        """(part folder, part samples, start, end) covering samples [lo, hi) of the epoch's order."""
        parts = self.parts[split]
        order = list(range(len(parts)))
        if epoch is not None and self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(parts)).tolist()
        pieces, pos = [], 0
        for i in order:
            folder, size = parts[i]
            a, b = max(lo, pos), min(hi, pos + size)
            if a < b:
                pieces.append((folder, size, a - pos, b - pos))
            pos += size
        return pieces

    def _windows(
        self, split: str, epoch: int | None, start: int
    ) -> Iterator[tuple[PackedColumns, np.ndarray]]:
        """(window, order of its samples) for this rank's samples from position `start` on."""
        pieces = self._rank_pieces(split, epoch)
        window = self.shuffle_window
        shuffled = epoch is not None and self.shuffle
        first, pos, w = start // window, 0, 0
        pending: list[Columns] = []
        for i, (folder, size, a, b) in enumerate(pieces):
            last = i == len(pieces) - 1
            while a < b:
                take = min(b - a, (w + 1) * window - pos)
                if w >= first:
                    pending.append(self._part(folder, size).read(a, a + take))
                a, pos = a + take, pos + take
                if pos == (w + 1) * window or (last and a == b):
                    if pending:
                        block = PackedColumns.pack(pending)
                        order = np.arange(len(block))
                        if shuffled:
                            order = np.random.default_rng([self.seed, epoch, self.rank, w]).permutation(
                                len(block)
                            )
                        yield block, order[start - w * window :] if w == first else order
                    pending, w = [], w + 1

    def _batches(self, split: str, batch_size: int, epoch: int | None, start: int) -> Iterator[Batch]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        # one thread reads and orders windows, `threads` gather batches; this one only hands them out
        windows = prefetch(self._windows(split, epoch, start), 1)
        keys = self.keys
        pieces = batch_pieces(windows, batch_size)
        position = start
        for batch in ordered_map(lambda p: assemble(p).to_batch(keys), pieces, self.threads, self.prefetch):
            position += len(batch)
            if epoch is not None:
                self._epoch, self._position = epoch, position
            yield batch

    def _part(self, folder: Path, size: int) -> _Part:
        with self._lock:
            part = self._open.get(folder)
            if part is None:
                if folder not in self._checked:  # its files' sizes and crc32s, before they are mapped
                    check_part_files(folder, self._files[folder])
                part = _Part(folder, self.features, self.num_dense)
                if len(part.labels) != size:
                    raise DataError(
                        f"{folder}/labels.npy: {len(part.labels)} samples, the manifest says {size}"
                    )
                if folder not in self._checked:  # before any of its samples are handed out
                    part.check(self.features, self._raw, self.bounds_check, self._dense_names)
                    self._checked[folder] = part.id_limits
                part.id_limits = self._checked[folder]
                self._open[folder] = part
                if len(self._open) > _OPEN_PARTS:
                    self._open.popitem(last=False)
            self._open.move_to_end(folder)
            return part
