"""Batches and unpooled lookups: KeyedJaggedTensor <-> SparseBatch, JaggedTensor <-> JaggedRows.

Both batch types are feature-major keyed jagged layouts (all ids of feature 0 for samples 0..B-1,
then feature 1, ...), so id and weight tensors are shared, not copied. TorchRec takes int32 or int64
ids and lengths; neorec's are int64, so int32 ones are widened (a copy, which keeps every value).

A KJT's weights are read or not by the TorchRec module, not the KJT: an EmbeddingBagCollection made
with is_weighted=True pools with them, an unweighted one (the default) and an EmbeddingCollection
ignore them. A neorec collection pools with whatever weights the SparseBatch carries, so
`sparse_from_kjt` is told which (`weighted`) and keeps or drops the weights to match.

An EmbeddingCollection's lookup (dict[str, JaggedTensor]: per feature, one row [D] per id and the
samples' lengths) is what a neorec collection's `embed` returns for its `pooling: none` tables
(dict[str, JaggedRows]); the row tensors are shared both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from neorec.interop.torchrec.common import TorchRecInteropError, import_torchrec
from neorec.sparse import JaggedRows, SparseBatch

if TYPE_CHECKING:  # pragma: no cover
    from torchrec import JaggedTensor, KeyedJaggedTensor

_ID_DTYPES = (torch.int64, torch.int32)  # what TorchRec's lookups take


def sparse_from_kjt(kjt: KeyedJaggedTensor, weighted: bool | None = None) -> SparseBatch:
    """A SparseBatch over the KJT's own id and weight tensors (no copy of int64 ids).

    `weighted`: whether the TorchRec module that reads the KJT pools with its weights
    (`ebc.is_weighted()`; False for an EmbeddingCollection). False drops the KJT's weights, so that
    neorec pools as TorchRec does; True keeps them (a weighted module needs them); a KJT that carries
    weights needs it said. int32 ids and lengths are widened to int64 (copies; widening keeps every
    value, so an id outside its table stays one and the collection's bounds check reports it). A KJT
    with no features, with ids of another dtype, or whose features have different batch sizes has no
    SparseBatch form."""
    if not kjt.keys():
        raise TorchRecInteropError(
            "the KeyedJaggedTensor has no features (keys []), so there is nothing to look up: a SparseBatch "
            "needs one length per sample for each of one or more features (KeyedJaggedTensor.empty() makes "
            f"such a KJT, with {kjt.values().dtype} values because it holds no ids)"
        )
    if kjt.variable_stride_per_key():
        raise TorchRecInteropError(
            f"KeyedJaggedTensor with a different batch size per feature ({kjt.stride_per_key()}) "
            f"has no SparseBatch form: every feature needs one length per sample"
        )
    values = kjt.values()
    if values.dtype not in _ID_DTYPES:
        what = "not ids" if values.is_floating_point() or values.is_complex() else "of neither id type"
        hint = (
            " (torch.tensor([]) is float32: no ids are torch.empty(0, dtype=torch.int64))"
            if not values.numel()
            else ""
        )
        raise TorchRecInteropError(
            f"KeyedJaggedTensor values of features {kjt.keys()} are {values.dtype}, {what}: neorec reads "
            f"int64 or int32 ids, as TorchRec does{hint}"
        )
    weights = kjt.weights_or_none()
    if weights is not None and weighted is None:
        raise TorchRecInteropError(
            f"the KeyedJaggedTensor of features {kjt.keys()} carries weights, which a TorchRec "
            "EmbeddingBagCollection pools with only when made with is_weighted=True: say which, "
            "sparse_from_kjt(kjt, weighted=ebc.is_weighted())"
        )
    if weights is None and weighted:
        raise TorchRecInteropError(
            f"weighted=True, but the KeyedJaggedTensor of features {kjt.keys()} carries no weights: a "
            "weighted EmbeddingBagCollection reads one per id"
        )
    return SparseBatch(
        kjt.keys(), values.to(torch.int64), kjt.lengths().to(torch.int64), weights if weighted else None
    )


def kjt_from_sparse(sparse: SparseBatch) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor over the SparseBatch's own id, length and weight tensors (no copy)."""
    kjt_type = import_torchrec().KeyedJaggedTensor
    return kjt_type(
        keys=list(sparse.keys),
        values=sparse.values,
        lengths=sparse.lengths,
        weights=sparse.weights,
        stride=sparse.batch_size,
    )


def rows_from_jagged(jagged: JaggedTensor) -> JaggedRows:
    """The JaggedRows of one feature of an EmbeddingCollection's lookup: its rows [N, D] (shared)
    and lengths (widened to int64). JaggedRows holds no weights: a JaggedTensor's weights (the ids,
    from an EmbeddingCollection made with need_indices=True) are left behind."""
    values = jagged.values()
    if values.dim() != 2:
        raise TorchRecInteropError(
            f"a JaggedTensor of {values.dim()}-d values {tuple(values.shape)} is not a lookup's rows [N, D]: "
            "ids are a KeyedJaggedTensor's features (sparse_from_kjt)"
        )
    return JaggedRows(values, jagged.lengths().to(torch.int64))


def jagged_from_rows(rows: JaggedRows) -> JaggedTensor:
    """A JaggedTensor over the rows and lengths of one sequence feature (no copy)."""
    return import_torchrec().JaggedTensor(values=rows.values, lengths=rows.lengths)


def sequences_from_jagged(lookup: Mapping[str, JaggedTensor]) -> dict[str, JaggedRows]:
    """An EmbeddingCollection's output as neorec's sequences (what `embed` returns second)."""
    return {feature: rows_from_jagged(jagged) for feature, jagged in lookup.items()}


def jagged_from_sequences(sequences: Mapping[str, JaggedRows]) -> dict[str, JaggedTensor]:
    """neorec's sequences as an EmbeddingCollection's output: {feature: JaggedTensor}."""
    return {feature: jagged_from_rows(rows) for feature, rows in sequences.items()}
