"""Samples held as numpy columns, gathered into batches: the sharded reader's working form.

The reader's background threads do all their work here in numpy (which releases the GIL and runs on
the calling thread) rather than in torch ops, which would compete with the training step for torch's
intra-op thread pool; tensors are made at the end with `torch.from_numpy` (no copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.sparse import SparseBatch


@dataclass
class Columns:
    """n samples: dense [n, d] f32, labels [n] f32; per feature integer ids (of any integer dtype; int64 in a
    batch), lengths (None: exactly one id per sample) and weights (None: unweighted)."""

    dense: np.ndarray
    labels: np.ndarray
    values: list[np.ndarray]
    lengths: list[np.ndarray | None]
    weights: list[np.ndarray | None]
    # per feature bounds every id is known to lie within (lows, highs), as SparseBatch.id_limits holds
    # them: a reader that checked its file's ids gives them, so that no batch is scanned again for them
    id_limits: tuple[list[int], list[int]] | None = None
    _offsets: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # per multi-hot feature, cached

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def cat(parts: list[Columns]) -> Columns:
        """Concatenate, copying into owned arrays of the working dtypes (also when there is one part).
        Ids keep their integer dtype (the int32 of preprocessed shards) until `to_batch` widens them:
        a batch's gather from a shuffle window then reads half the bytes. A feature whose values are
        None (packed elsewhere: neorec/data/packed.py) stays None."""
        first = parts[0]
        return Columns(
            join([p.dense for p in parts], np.float32),
            join([p.labels for p in parts], np.float32),
            [None if v is None else join([p.values[f] for p in parts]) for f, v in enumerate(first.values)],
            [
                None if ln is None else join([p.lengths[f] for p in parts], np.int64)
                for f, ln in enumerate(first.lengths)
            ],
            [
                None if w is None else join([p.weights[f] for p in parts], np.float32)
                for f, w in enumerate(first.weights)
            ],
            joined_limits([p.id_limits for p in parts]),
        )

    def take(self, idx: np.ndarray) -> Columns:
        """Samples `idx`, in that order.

        A batch's samples are scattered over a shuffle window far larger than the caches, one column
        after the other: read in the order of `idx`, nearly every value is a cache miss. The dense
        values, the labels and the one-hot ids are therefore read in address order (`idx` sorted, a
        pass the hardware prefetches), then put in the order of `idx` within the batch, which the
        caches hold: about a third less time per batch of 16,384 samples. The way back is the
        inverse of the sorting permutation (a scatter), not a binary search per sample."""
        perm = np.argsort(idx)
        ordered = idx[perm]
        back = np.empty_like(perm)
        back[perm] = np.arange(len(idx))  # ordered[back[i]] == idx[i], repeated samples included

        def gather(column: np.ndarray) -> np.ndarray:
            return column.take(ordered, axis=0).take(back, axis=0)

        values, lengths, weights = take_features(self, idx, gather)
        return Columns(gather(self.dense), gather(self.labels), values, lengths, weights, self.id_limits)

    def to_batch(self, keys: list[str]) -> Batch:
        n = len(self)
        lengths = np.empty(sum(n if ln is None else len(ln) for ln in self.lengths), np.int64)
        pos = 0
        for ln in self.lengths:  # one array, written once (a one-hot feature's lengths are all 1)
            size = n if ln is None else len(ln)
            lengths[pos : pos + size] = 1 if ln is None else ln
            pos += size
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
            torch.from_numpy(lengths),
            weights,
            [len(v) for v in self.values],
            self.id_limits,
        )
        return Batch(torch.from_numpy(self.dense), sparse, torch.from_numpy(self.labels))


def join(arrays: list[np.ndarray], dtype=None) -> np.ndarray:
    """`arrays` concatenated into an owned array of `dtype` (None: ids, of `ids_dtype`)."""
    return np.concatenate(arrays, dtype=ids_dtype(arrays) if dtype is None else dtype)


def ids_dtype(arrays: list[np.ndarray]) -> np.dtype:
    """The dtype that holds the ids of all `arrays`: the widest of their integer dtypes (int64 where
    signed and unsigned 64-bit ids mix, which numpy would widen to floats)."""
    if not arrays:
        return np.dtype(np.int32)
    dtype = np.result_type(*(a.dtype for a in arrays))
    return dtype if dtype.kind in "iu" else np.dtype(np.int64)


def take_features(
    columns: Columns, idx: np.ndarray, gather: Callable[[np.ndarray], np.ndarray]
) -> tuple[list, list[np.ndarray | None], list[np.ndarray | None]]:
    """(values, lengths, weights) of samples `idx` of every feature of `columns`: a one-hot feature's
    ids and weights by `gather`, a multi-hot feature's each chosen sample's run of ids; a feature whose
    values are None (packed elsewhere, neorec/data/packed.py) stays None."""
    values: list = []
    lengths: list[np.ndarray | None] = []
    weights: list[np.ndarray | None] = []
    for f, (v, ln, w) in enumerate(zip(columns.values, columns.lengths, columns.weights, strict=True)):
        if v is None or ln is None:
            values.append(None if v is None else gather(v))
            lengths.append(None)
            weights.append(None if w is None else gather(w))
            continue
        if f not in columns._offsets:
            columns._offsets[f] = np.concatenate([[0], np.cumsum(ln, dtype=np.int64)])
        offsets = columns._offsets[f]
        new_len = ln[idx]
        run_start = np.cumsum(new_len) - new_len  # where each chosen run starts in the output
        sel = np.repeat(offsets[idx] - run_start, new_len) + np.arange(int(new_len.sum()))
        values.append(v[sel])
        lengths.append(new_len)
        weights.append(None if w is None else w[sel])
    return values, lengths, weights


def joined_limits(limits: list[tuple[list[int], list[int]] | None]) -> tuple[list[int], list[int]] | None:
    """The id limits of concatenated columns: known when every part's are."""
    if any(x is None for x in limits):
        return None
    lows = [min(col) for col in zip(*(x[0] for x in limits), strict=True)]
    highs = [max(col) for col in zip(*(x[1] for x in limits), strict=True)]
    return lows, highs


def batch_pieces(
    windows: Iterator[tuple[Columns, np.ndarray]], batch_size: int
) -> Iterator[list[tuple[Columns, np.ndarray]]]:
    """What each batch of `batch_size` samples (the last may be smaller) is made of, from (window, order
    of its samples) pairs: consecutive entries of the orders, across window boundaries, as
    (window, samples of it) pieces. Cutting is cheap; `assemble` does the gathering."""
    pending: list[tuple[Columns, np.ndarray]] = []
    count = 0
    for window, order in windows:
        pos = 0
        while pos < len(order):
            idx = order[pos : pos + batch_size - count]
            pending.append((window, idx))
            count, pos = count + len(idx), pos + len(idx)
            if count == batch_size:
                yield pending
                pending, count = [], 0
    if count:
        yield pending


def assemble(pieces: list[tuple[Columns, np.ndarray]]) -> Columns:
    """The samples of `pieces` (see `batch_pieces`), in order, of the windows' kind (Columns, or the
    PackedColumns of neorec/data/packed.py)."""
    parts = [window.take(idx) for window, idx in pieces]
    return parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)


def cut_batches(windows: Iterator[tuple[Columns, np.ndarray]], batch_size: int) -> Iterator[Columns]:
    """Batches of `batch_size` samples (the last may be smaller) from (window, order of its samples)
    pairs: consecutive entries of the orders, across window boundaries."""
    return (assemble(pieces) for pieces in batch_pieces(windows, batch_size))
