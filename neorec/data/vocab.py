"""Categorical vocabularies: count raw values, keep the frequent ones, map raw values to dense ids.

As facebookresearch/dlrm (`--data-sub-sample-rate`, `days` counts) and the MLPerf DLRM reference do: a
first pass counts how often every raw value of a feature occurs in the training lines; values seen at
least `threshold` times get ids 1..V in increasing raw-value order, and everything else (rare values,
values first seen in evaluation data) shares id 0. A feature's table therefore needs V + 1 rows.

Counts are merged with `np.unique`, whose result does not depend on the order of the parts, so the
vocabulary is the same whatever the number of worker processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from neorec.errors import DataError

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


def save_vocabs(folder: Path, names: list[str], vocabs: list[np.ndarray], settings: dict) -> None:
    """Write `<name>.npy` per feature and the `settings` they were counted under into `folder`
    (created under a temporary name, then renamed)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():  # left by an interrupted run
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, vocab in zip(names, vocabs, strict=True):
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(vocab, dtype=np.uint64))
    (tmp / "settings.json").write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.replace(folder)


def saved_settings(folder: Path) -> dict | None:
    """The settings a saved vocabulary was counted under, or None when there is none."""
    path = folder / "settings.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_vocabs(folder: Path, names: list[str]) -> list[np.ndarray]:
    vocabs = []
    for name in names:
        path = folder / f"{name}.npy"
        if not path.is_file():
            raise DataError(
                f"{path}: vocabulary file missing; rerun `neorec data preprocess` into a new folder"
            )
        vocabs.append(np.load(path))
    return vocabs
