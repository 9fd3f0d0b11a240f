"""Categorical vocabularies: count raw values, keep the frequent ones, map raw values to dense ids.

As facebookresearch/dlrm (`--data-sub-sample-rate`, `days` counts) and the MLPerf DLRM reference do: a
first pass counts how often every raw value of a feature occurs in the training lines; values seen at
least `threshold` times get ids 1..V in increasing raw-value order, and everything else (rare values,
values first seen in evaluation data) shares id 0. A feature's table therefore needs V + 1 rows.

Counts are merged with `np.unique`, whose result does not depend on the order of the parts, so the
vocabulary is the same whatever the number of worker processes. Over many files the counts spill to
disk (`SpillingCounts`): memory stays bounded however many distinct values the data holds.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import numpy as np

from neorec.errors import DataError
from neorec.utils.files import (
    check_recorded,
    plain_name,
    read_json_of_files,
    replace_folder,
    size_and_crc32,
    write_atomic,
    write_json,
)

_SETTINGS = "settings.json"
_FILES = "files"  # settings.json's record of each vocabulary file: [size, crc32]
_AGAIN = "rerun `neorec data preprocess` into a new folder"

Counts = tuple[np.ndarray, np.ndarray]  # (sorted distinct raw values uint64, occurrences int64)


def count_values(column: np.ndarray) -> Counts:
    """Distinct values of one column and how often each occurs."""
    values, counts = np.unique(column.astype(np.uint64, copy=False), return_counts=True)
    return values, counts.astype(np.int64)


def merge_counts(parts: list[Counts]) -> Counts:
    """Sum the counts of several (values, counts) parts of one feature."""
    parts = [p for p in parts if p[0].size]
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    if len(parts) == 1:
        return parts[0]
    values, inverse = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
    counts = np.zeros(values.size, np.int64)
    np.add.at(counts, inverse, np.concatenate([p[1] for p in parts]))
    return values, counts


def build_vocab(counts: Counts, threshold: int) -> np.ndarray:
    """Sorted raw values seen at least `threshold` times (they get ids 1..V)."""
    values, n = counts
    return values[n >= threshold]


def apply_vocab(raw: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """Raw values [n] -> int64 ids: 1 + position in `vocab`, or 0 when not in it."""
    raw = raw.astype(np.uint64, copy=False)
    if vocab.size == 0:
        return np.zeros(raw.shape, np.int64)
    pos = np.searchsorted(vocab, raw)
    found = vocab[np.minimum(pos, vocab.size - 1)] == raw
    return np.where(found, pos + 1, 0).astype(np.int64)


def vocabs_crc32(names: list[str], vocabs: list[np.ndarray | None]) -> int | None:
    """A checksum of the vocabularies in use (per feature its name and its values; None where a feature
    has none), or None when no feature has one: a vocabulary counted again under the same folder gives
    another, so a checkpoint or an export trained on the old one is not continued or served on the new
    one, whose ids would mean other values."""
    if all(v is None for v in vocabs):
        return None
    crc = 0
    for name, vocab in zip(names, vocabs, strict=True):
        if vocab is not None:
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(memoryview(np.ascontiguousarray(vocab, dtype=np.uint64)).cast("B"), crc)
    return crc


def save_vocabs(folder: Path, names: list[str], vocabs: list[np.ndarray], settings: dict) -> None:
    """Write `<name>.npy` per feature and settings.json (the `settings` they were counted under, with
    each file's size and crc32, and its own crc32) into a temporary folder that then takes `folder`'s
    place; every file through write_atomic."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():  # left by an interrupted run
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    files = {}
    for name, vocab in zip(names, vocabs, strict=True):
        path = tmp / f"{plain_name(name, f'{folder}: feature', DataError)}.npy"
        array = np.ascontiguousarray(vocab, dtype=np.uint64)
        write_atomic(path, lambda f, a=array: np.save(f, a), "vocabulary file")
        files[path.name] = size_and_crc32(path)
    write_json(tmp / _SETTINGS, {**settings, _FILES: files}, "vocabulary file", sort_keys=True)
    replace_folder(tmp, folder.absolute())


def _read_settings(folder: Path) -> dict | None:
    """settings.json without its "crc32" key, checked against it. One without the key is read as
    written by hand, which records no files: one that records its files' sizes and crc32s but has no
    crc32 of its own was damaged or edited, and is refused."""
    path = folder / _SETTINGS
    if not path.is_file():
        return None
    return read_json_of_files(path, "vocabulary file", _AGAIN, DataError, lambda data: _FILES in data)


def saved_settings(folder: Path) -> dict | None:
    """The settings a saved vocabulary was counted under, or None when there is none."""
    settings = _read_settings(folder)
    return None if settings is None else {k: v for k, v in settings.items() if k != _FILES}


def load_vocabs(folder: Path, names: list[str]) -> list[np.ndarray]:
    """The vocabulary of each feature (sorted raw values, uint64), each file checked against the size
    and crc32 settings.json records (a folder without them, written by hand, is read unchecked)."""
    settings = _read_settings(folder) or {}
    files = settings.get(_FILES) if isinstance(settings.get(_FILES), dict) else {}
    vocabs = []
    for name in names:
        path = folder / f"{plain_name(name, f'{folder}: feature', DataError)}.npy"
        if not path.is_file():
            raise DataError(f"{path}: vocabulary file missing; {_AGAIN}")
        recorded = files.get(path.name)
        if recorded is not None:
            check_recorded(path, recorded, folder / _SETTINGS, _AGAIN, DataError)
        try:
            vocab = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"{path}: not a readable vocabulary ({e}); {_AGAIN}") from None
        if vocab.ndim != 1 or vocab.dtype.kind not in "iu":
            raise DataError(f"{path}: a {vocab.dtype} array of shape {vocab.shape}, expected 1-D integers; {_AGAIN}")
        vocabs.append(_checked_order(vocab, path))
    return vocabs


def _checked_order(vocab: np.ndarray, path: Path) -> np.ndarray:
    """`vocab` as uint64 once it holds distinct raw values >= 0 in increasing order, as ids are looked up
    by binary search: a value out of order would map its raw values, and others', to id 0 unnoticed."""
    if vocab.dtype.kind == "i" and vocab.size and int(vocab.min()) < 0:
        i = int(np.argmax(vocab < 0))
        raise DataError(f"{path}: entry {i} is {vocab[i]}; a vocabulary holds raw values >= 0")
    vocab = vocab.astype(np.uint64, copy=False)
    later = np.flatnonzero(vocab[1:] <= vocab[:-1])
    if later.size:
        i = int(later[0]) + 1
        raise DataError(
            f"{path}: entry {i} ({vocab[i]}) does not follow entry {i - 1} ({vocab[i - 1]}); a vocabulary "
            "lists distinct raw values in increasing order (entry k is id k + 1), as np.unique gives them"
        )
    return vocab


class SpillingCounts:
    """Counts of raw values per feature with bounded memory: parts are merged in memory up to `budget`
    distinct values in all, then spilled to `folder` as sorted runs (one .npy pair per feature and run);
    `vocab` merges a feature's runs one range of values at a time (raw values are below 2^32, 8 hex
    digits), so memory stays within the budget and one range of every run, whatever the data's size."""

    def __init__(self, folder: Path, names: list[str], budget: int = 1 << 23, ranges: int = 64) -> None:
        self.folder, self.names, self.budget, self.ranges = folder, names, budget, ranges
        self.parts: list[list[Counts]] = [[] for _ in names]
        self.runs = 0
        self.remove()  # runs left by an interrupted count

    def add(self, counts: list[Counts]) -> None:
        for f, c in enumerate(counts):
            if c[0].size:
                self.parts[f].append(c)
        if sum(len(p) for p in self.parts) > 64 * len(self.parts):
            self.parts = [[merge_counts(p)] for p in self.parts]
        if sum(p[0].size for parts in self.parts for p in parts) > self.budget:
            self._spill()

    def _spill(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for f, name in enumerate(self.names):
            values, counts = merge_counts(self.parts[f])
            for kind, array in (("values", values), ("counts", counts)):
                path = self.folder / f"{name}.{self.runs}.{kind}.npy"
                write_atomic(path, lambda fh, a=array: np.save(fh, a), "vocabulary counts")
        self.parts = [[] for _ in self.names]
        self.runs += 1

    def vocab(self, f: int, threshold: int) -> np.ndarray:
        """Sorted raw values of feature `f` seen at least `threshold` times in all."""
        runs = [merge_counts(self.parts[f])]
        for r in range(self.runs):
            values, counts = (
                np.load(self.folder / f"{self.names[f]}.{r}.{k}.npy", mmap_mode="r")
                for k in ("values", "counts")
            )
            if values.shape != counts.shape:
                raise DataError(
                    f"{self.folder}: vocabulary counts of {self.names[f]} damaged; preprocess again"
                )
            runs.append((values, counts))
        if len(runs) == 1:
            return build_vocab(runs[0], threshold)
        kept = []
        edges = np.linspace(0, 1 << 32, self.ranges + 1).astype(np.uint64)
        for lo, hi in zip(edges, edges[1:], strict=False):
            parts = []
            for values, counts in runs:
                a, b = np.searchsorted(values, lo), np.searchsorted(values, hi)
                parts.append((np.asarray(values[a:b]), np.asarray(counts[a:b])))
            kept.append(build_vocab(merge_counts(parts), threshold))
        return np.concatenate(kept)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class Vocabularies:
    """The vocabularies of features `names` in `folder` as a value that compares by their contents
    (vocabs_crc32): the same folder named otherwise, or a copy of it, is equal; a folder that cannot
    be read compares by its resolved path."""

    def __init__(self, folder: str | None, names: list[str]) -> None:
        self.folder = folder
        self.where = str(Path(folder).resolve()) if folder is not None else None
        try:
            self.crc = vocabs_crc32(names, load_vocabs(Path(folder), names)) if folder is not None else None
        except (DataError, OSError, ValueError):
            self.crc = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabularies):
            return NotImplemented
        if self.crc is not None and other.crc is not None:
            return self.crc == other.crc
        return self.where == other.where

    __hash__ = None  # type: ignore[assignment]  # compared, never a key

    def __repr__(self) -> str:
        crc = f", vocabularies crc32 {self.crc:08x}" if self.crc is not None else ""
        return f"{self.folder!r} ({self.where}{crc})"

