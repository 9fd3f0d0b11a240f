"""A shuffle window packed for gathering batches out of it: the sharded readers' windows.

A batch is samples drawn at random from a window far larger than the caches. Held as columns (one
array per feature, as the files store them), every feature of every sample is a cache miss of its
own, and a batch costs a few numpy calls per feature. Packed, a sample's one-hot ids lie side by
side in one row of `rows` (26 int32 ids: two cache lines) and its dense values in one row of the
dense matrix, so a batch of Criteo-like samples is gathered by three `take`s and made into the batch's
feature-major ids by one transposing copy, a handful of numpy calls instead of about a hundred.
Each call releases and takes back the GIL: the fewer the reader's threads make, the less often a
training thread bound by host work waits to take it back from them.

Multi-hot and weighted features stay columns, gathered as `Columns.take` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.columns import Columns, ids_dtype, join, take_features
from neorec.sparse import SparseBatch


@dataclass
class PackedColumns:
    """n samples: the ids of the one-hot unweighted features (`packed`, in feature order) as `rows`
    [n, len(packed)], of the ids' integer dtype; everything else in `columns`, whose `values` entry is
    None for a packed feature."""

    columns: Columns
    rows: np.ndarray
    packed: list[int]

    def __len__(self) -> int:
        return len(self.columns)

    @staticmethod
    def pack(parts: list[Columns]) -> PackedColumns:
        """The samples of `parts` (consecutive pieces of files), packed into owned arrays."""
        first = parts[0]
        packed = [
            f
            for f, (ln, w) in enumerate(zip(first.lengths, first.weights, strict=True))
            if ln is None and w is None
        ]
        rows = np.empty(
            (sum(len(p) for p in parts), len(packed)), ids_dtype([p.values[f] for p in parts for f in packed])
        )
        pos = 0
        for part in parts:  # each column into its place in the rows
            for j, f in enumerate(packed):
                rows[pos : pos + len(part), j] = part.values[f]
            pos += len(part)
        rest = [
            replace(p, values=[None if f in packed else v for f, v in enumerate(p.values)]) for p in parts
        ]
        return PackedColumns(Columns.cat(rest), rows, packed)

    def take(self, idx: np.ndarray) -> PackedColumns:
        """Samples `idx`, in that order (repeated samples included)."""
        cols = self.columns
        values, lengths, weights = take_features(cols, idx, lambda column: column.take(idx, axis=0))
        taken = Columns(
            cols.dense.take(idx, axis=0), cols.labels.take(idx), values, lengths, weights, cols.id_limits
        )
        return PackedColumns(taken, self.rows.take(idx, axis=0), self.packed)

    @staticmethod
    def cat(parts: list[PackedColumns]) -> PackedColumns:
        """Concatenate (a batch that spans two windows)."""
        packed = parts[0].packed
        return PackedColumns(Columns.cat([p.columns for p in parts]), join([p.rows for p in parts]), packed)

    def to_batch(self, keys: list[str]) -> Batch:
        cols = self.columns
        n, num_features = len(self), len(cols.values)
        if len(self.packed) < num_features:
            values = list(cols.values)
            for j, f in enumerate(self.packed):
                values[f] = self.rows[:, j]
            return Columns(
                cols.dense, cols.labels, values, cols.lengths, cols.weights, cols.id_limits
            ).to_batch(keys)
        ids = np.empty((num_features, n), np.int64)  # every feature one-hot: the ids are the rows, transposed
        ids[...] = self.rows.T
        lengths = np.ones(num_features * n, np.int64)
        sizes = [n] * num_features
        sparse = SparseBatch(
            keys, torch.from_numpy(ids.reshape(-1)), torch.from_numpy(lengths), None, sizes, cols.id_limits
        )
        return Batch(torch.from_numpy(cols.dense), sparse, torch.from_numpy(cols.labels))
