"""Samples held as numpy columns, gathered into batches: the sharded reader's working form.

The reader's background threads do all their work here in numpy (which releases the GIL and runs on
the calling thread) rather than in torch ops, which would compete with the training step for torch's
intra-op thread pool; tensors are made at the end with `torch.from_numpy` (no copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.sparse import SparseBatch


@dataclass
class Columns:
    """n samples: dense [n, d] f32, labels [n] f32; per feature integer ids (int64 in a batch), lengths (None: exactly one
    id per sample) and weights (None: unweighted)."""

    dense: np.ndarray
    labels: np.ndarray
    values: list[np.ndarray]
    lengths: list[np.ndarray | None]
    weights: list[np.ndarray | None]
    _offsets: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # per multi-hot feature, cached

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def cat(parts: list[Columns]) -> Columns:
        """Concatenate, copying into owned arrays of the working dtypes (also when there is one part)."""
        first = parts[0]

        def join(arrays: list, dtype) -> np.ndarray:
            return np.concatenate(arrays, dtype=dtype)

        return Columns(
            join([p.dense for p in parts], np.float32),
            join([p.labels for p in parts], np.float32),
            [join([p.values[f] for p in parts], np.int64) for f in range(len(first.values))],
            [
                None if ln is None else join([p.lengths[f] for p in parts], np.int64)
                for f, ln in enumerate(first.lengths)
            ],
            [
                None if w is None else join([p.weights[f] for p in parts], np.float32)
                for f, w in enumerate(first.weights)
            ],
        )

    def take(self, idx: np.ndarray) -> Columns:
        """Samples `idx`, in that order."""
        values, lengths, weights = [], [], []
        for f, (v, ln, w) in enumerate(zip(self.values, self.lengths, self.weights, strict=True)):
            if ln is None:
                sel = idx
                lengths.append(None)
            else:  # gather each chosen sample's run of ids
                if f not in self._offsets:
                    self._offsets[f] = np.concatenate([[0], np.cumsum(ln, dtype=np.int64)])
                offsets = self._offsets[f]
                new_len = ln[idx]
                run_start = np.cumsum(new_len) - new_len  # where each chosen run starts in the output
                sel = np.repeat(offsets[idx] - run_start, new_len) + np.arange(int(new_len.sum()))
                lengths.append(new_len)
            values.append(v[sel])
            weights.append(None if w is None else w[sel])
        return Columns(self.dense[idx], self.labels[idx], values, lengths, weights)

    def to_batch(self, keys: list[str]) -> Batch:
        n = len(self)
        lengths = [np.ones(n, np.int64) if ln is None else ln for ln in self.lengths]
        weights = None
        if any(w is not None for w in self.weights):
            weights = torch.from_numpy(
                np.concatenate(
                    [
                        np.ones(len(v), np.float32) if w is None else w
                        for v, w in zip(self.values, self.weights, strict=True)
                    ]
                )
            )
        sparse = SparseBatch(
            keys,
            torch.from_numpy(np.concatenate(self.values, dtype=np.int64)),
            torch.from_numpy(np.concatenate(lengths)),
            weights,
        )
        return Batch(torch.from_numpy(self.dense), sparse, torch.from_numpy(self.labels))


def cut_batches(windows: Iterator[tuple[Columns, np.ndarray]], batch_size: int) -> Iterator[Columns]:
    """Batches of `batch_size` samples (the last may be smaller) from (window, order of its samples)
    pairs: consecutive entries of the orders, across window boundaries."""
    pending: Columns | None = None
    for window, order in windows:
        pos = 0
        while pos < len(order):
            need = batch_size - (len(pending) if pending is not None else 0)
            part = window.take(order[pos : pos + need])
            pos += need
            if pending is not None:
                part = Columns.cat([pending, part])
            if len(part) == batch_size:
                yield part
                pending = None
            else:
                pending = part
    if pending is not None and len(pending):
        yield pending
