"""Arrow tables of Parquet data -> the reader's numpy Columns: type checks, id mapping, multi-hot lists.

How a column becomes ids (set per feature in `data.parquet`):
- raw value: an integer column gives its value (a negative one read as unsigned of the column's width:
  an int32 -1 is 2^32 - 1, so 32-bit hashes stored as int32 keep their value); a string
  column gives its hex value (`strings: hex`, at most 8 digits, parsed as the Criteo reader does) or its
  FNV-1a 64-bit hash (`strings: fnv1a`, of the UTF-8 bytes); null and "" give 0, as a missing Criteo
  value does;
- row: `modulo` (value % rows), `hash` (splitmix64(value) % rows), `none` (the value itself, which must
  lie in [0, rows)) or `vocab` (1 + the value's place in the feature's vocabulary, 0 when absent), the
  same functions as the Criteo reader and `neorec data preprocess` (neorec/data/criteo.py, vocab.py).
A list column is multi-hot: its list lengths are the bag sizes (a null list is an empty bag); a weights
column holds one float per id, with the same list lengths.

Dense columns are numbers or booleans, null -> 0; with `dense_log1p`, negatives -> 0 then log(1 + x) in
float64 (the Criteo preprocessing); a value that is NaN or infinite (or beyond float32's range without
log1p) is a DataError naming the file, row group, row and column. Labels are exactly 0 or 1 (integers,
floats or booleans) and never null. The held-out flag (`eval_column`) is a boolean or a 0/1 integer
(null: not held out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from neorec.config.schema import ParquetFeatureConfig
from neorec.data.checks import check_ids, check_labels, check_weights, dense_error, first_nonfinite, quote
from neorec.data.columns import Columns
from neorec.data.criteo import MAX_HEX_DIGITS, parse_hex
from neorec.data.vocab import apply_vocab
from neorec.errors import DataError
from neorec.utils.hashing import splitmix64

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@dataclass
class ColumnMap:
    """Which columns hold what, with every feature's settings resolved (ParquetConfig.feature_configs)."""

    label: str | None  # None: rows without labels (scored, not trained or evaluated), labels read as 0
    dense: list[str]
    dense_log1p: bool
    features: list[ParquetFeatureConfig]
    vocabs: list[np.ndarray | None]  # per feature, with hashing vocab
    eval_column: str | None = None
    bounds_check: str = "error"  # hashing none: ids outside their table stop (error), are logged (warn) or not read

    def columns(self, with_eval_column: bool) -> list[str]:
        """The columns a row group is read with."""
        names = ([self.label] if self.label is not None else []) + self.dense
        for f in self.features:
            names += [f.column] + ([f.weights] if f.weights else [])
        if with_eval_column and self.eval_column:
            names.append(self.eval_column)
        return list(dict.fromkeys(names))

    def check_schema(self, path: str, schema: pa.Schema, with_eval_column: bool) -> list[bool]:
        """Raise DataError naming the file and column when a column is missing or of the wrong type;
        returns, per feature, whether it is multi-hot (a list column)."""

        def field(name: str, role: str) -> pa.DataType:
            if schema.get_field_index(name) < 0:
                raise DataError(
                    f"{path}: no column {name!r} ({role}); its columns: {', '.join(schema.names)}"
                )
            return schema.field(name).type

        def expect(ok: bool, name: str, kind: str, what: str) -> None:
            if not ok:
                raise DataError(f"{path}: column {name!r} has type {kind}; {what}")

        if self.label is not None:
            t = field(self.label, "data.parquet.label")
            expect(_is_number(t), self.label, str(t), "the label must be 0/1 integers, floats or booleans")
        for name in self.dense:
            t = field(name, "data.parquet.dense")
            expect(_is_number(t), name, str(t), "dense features must be numbers or booleans")
        if with_eval_column and self.eval_column:
            t = field(self.eval_column, "data.parquet.eval_column")
            expect(pa.types.is_boolean(t) or pa.types.is_integer(t), self.eval_column, str(t),
                   "the held-out flag must be a boolean or 0/1 integer")  # fmt: skip
        multi_hot = []
        for f in self.features:
            t = field(f.column, f"ids of feature {f.name}")
            is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
            item = t.value_type if is_list else t
            expect(_is_id(item), f.column, str(t),
                   f"ids of feature {f.name} must be integers or strings, or lists of them")  # fmt: skip
            if f.hashing == "none":
                expect(pa.types.is_integer(item), f.column, str(t), f"hashing none of feature {f.name} needs integer ids")
            if f.weights:
                w = field(f.weights, f"weights of feature {f.name}")
                w_list = pa.types.is_list(w) or pa.types.is_large_list(w)
                w_item = w.value_type if w_list else w
                expect(w_list == is_list and _is_number(w_item), f.weights, str(w),
                       f"weights of feature {f.name} must be {'lists of floats' if is_list else 'floats'}, like its ids")  # fmt: skip
            multi_hot.append(is_list)
        return multi_hot

    def to_columns(self, table: pa.Table, where: str) -> Columns:
        """A table of the `columns()` of one row group (`where`: its file and row group, for errors)."""
        if self.label is None:
            labels = np.zeros(table.num_rows, np.float32)
        else:
            labels = _numbers(table.column(self.label), where, self.label, nulls="error")
            check_labels(labels, where, f"label column {self.label!r}")
        n = len(labels)
        # log1p in float64 as the Criteo reader computes it; plain values go straight to float32
        dense = np.empty((n, len(self.dense)), np.float64 if self.dense_log1p else np.float32)
        with np.errstate(over="ignore"):  # a finite value beyond float32's range becomes inf: caught below
            for j, name in enumerate(self.dense):
                dense[:, j] = _numbers(table.column(name), where, name, nulls="zero")
            if self.dense_log1p:
                dense = np.log1p(np.maximum(dense, 0))
            dense = dense.astype(np.float32, copy=False)
        bad = first_nonfinite(dense)
        if bad is not None:  # NaN or inf would reach the loss steps later, naming no file
            i, j = bad
            raise dense_error(where, i, repr(self.dense[j]), table.column(self.dense[j])[i].as_py())
        values, lengths, weights, limits = [], [], [], []
        for f, vocab in zip(self.features, self.vocabs, strict=True):
            ids, ln, known = _ids(table.column(f.column).combine_chunks(), where, f, vocab, self.bounds_check)
            values.append(ids)
            lengths.append(ln)
            limits.append(known)
            weights.append(None if not f.weights else _weights(table.column(f.weights), ln, where, f))
        id_limits = None  # each feature's bounds, where all are known: its batches are then not scanned again
        if all(x is not None for x in limits):
            id_limits = ([low for low, _ in limits], [high for _, high in limits])
        return Columns(dense, labels.astype(np.float32), values, lengths, weights, id_limits)


def same_lists(cmap: ColumnMap, path: str, multi_hot: list[bool], first: str, first_hot: list[bool]) -> None:
    """Each feature's column is a list (multi-hot) in file `path` where it is one in file `first`, and
    only there (`multi_hot`: what check_schema returns for each); a DataError naming both files and the
    column otherwise: the shards of a feature would hold bags in one place and single ids in another."""
    for f, here, there in zip(cmap.features, multi_hot, first_hot, strict=True):
        if here != there:
            raise DataError(
                f"{path}: column {f.column!r} is {'a list' if here else 'not a list'} here but "
                f"{'a list' if there else 'not a list'} in {first}"
            )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_id(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or \
        pa.types.is_binary(t) or pa.types.is_large_binary(t)  # fmt: skip


def held_out(column: pa.ChunkedArray, where: str, name: str) -> np.ndarray:
    """The eval_column `name` as a bool mask (null: not held out). An integer flag is 0 or 1: any other
    value is a DataError naming `where` (the file and row group), the row and the value, since a cast
    to bool would read 2 as held out."""
    if pa.types.is_integer(column.type):
        flags = (pc.fill_null(column, 0) if column.null_count else column).to_numpy()
        bad = np.flatnonzero((flags != 0) & (flags != 1))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{where}, row {i}: column {name!r} (data.parquet.eval_column) = {quote(flags[i])}; the "
                "held-out flag must be a boolean or 0/1 integer: fix the data"
            )
        return flags == 1
    return pc.fill_null(column.cast(pa.bool_()), False).to_numpy(zero_copy_only=False)


def _numbers(column: pa.ChunkedArray, where: str, name: str, nulls: str) -> np.ndarray:
    """A numeric column as numpy (bool as 0/1 bytes); nulls -> 0, or an error naming the row."""
    if column.null_count:
        if nulls == "error":
            i = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{where}, row {i}: column {name!r} is null")
        column = pc.fill_null(column, 0)
    values = column.to_numpy()
    return values.view(np.uint8) if values.dtype == np.bool_ else values


def _flatten(arr: pa.Array) -> tuple[pa.Array, np.ndarray | None]:
    """(the values, lengths or None): a list column's flattened values and list lengths (null -> empty)."""
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        return pc.list_flatten(arr), lengths
    return arr, None


def _raw_values(arr: pa.Array, where: str, f: ParquetFeatureConfig, lengths: np.ndarray | None) -> np.ndarray:
    """The uint64 raw values of flattened ids, which hashing modulo, hash and vocab map to rows."""
    if pa.types.is_integer(arr.type):
        raw = (pc.fill_null(arr, 0) if arr.null_count else arr).to_numpy()
        # the value's bits as an unsigned integer of its width: a hash stored as int32 keeps its 32-bit value
        return raw.view(f"u{raw.dtype.itemsize}").astype(np.uint64)
    return _string_values(arr, where, f, lengths)


def raw_ids(column: pa.ChunkedArray, where: str, f: ParquetFeatureConfig) -> np.ndarray:
    """All raw values of one feature's column (the ids of every row, lists flattened): what a vocabulary
    counts."""
    arr, lengths = _flatten(column.combine_chunks())
    return _raw_values(arr, where, f, lengths)


def _ids(arr: pa.Array, where: str, f: ParquetFeatureConfig, vocab: np.ndarray | None, bounds_check: str) -> tuple:
    """(int64 rows, lengths or None, (low, high) bounds of the rows or None) of one feature's column.
    With hashing none the values are the ids, checked against the table as `bounds_check` says (warn:
    logged and passed on, for the embedding engine to drop and count; off: not read, nor bounded);
    the other hashings map every value into the table."""
    arr, lengths = _flatten(arr)
    table = (0, f.rows - 1)
    if f.hashing == "none" and pa.types.is_integer(arr.type):
        raw = (pc.fill_null(arr, 0) if arr.null_count else arr).to_numpy()
        if bounds_check == "off":
            return raw, lengths, None
        if bounds_check == "warn":
            outside = check_ids(raw, f"{where}, column {f.column!r}", f.name, f.rows, lengths=lengths, mode="warn")
            return raw, lengths, None if outside else table
        low, high = pc.min_max(arr).values()
        if raw.size and (low.as_py() < 0 or high.as_py() >= f.rows):
            i = int(np.flatnonzero((raw < 0) | (raw >= f.rows))[0])
            raise DataError(
                f"{where}, row {_row(i, lengths)}: column {f.column!r} holds id {raw[i]}, outside "
                f"[0, {f.rows}) of feature {f.name}'s table (hashing none); set its rows, or hashing modulo/hash"
            )
        return raw, lengths, table  # ids kept in their own integer type: the batch's concatenation widens them
    if f.hashing == "vocab":
        assert vocab is not None
        table = (0, len(vocab))  # 0 for a value it lacks, else 1 + its place
    return _rows(_raw_values(arr, where, f, lengths), f, vocab), lengths, table


def _row(i: int, lengths: np.ndarray | None) -> int:
    """The row of value i of a column (of a list column's flattened values when lengths are given)."""
    return i if lengths is None else int(np.searchsorted(np.cumsum(lengths), i, side="right"))


def _rows(raw: np.ndarray, f: ParquetFeatureConfig, vocab: np.ndarray | None) -> np.ndarray:
    if f.hashing == "vocab":
        assert vocab is not None
        return apply_vocab(raw, vocab)
    if f.hashing == "hash":
        raw = splitmix64(raw)
    return (raw % np.uint64(f.rows)).astype(np.int64)


class _Strings:
    """The bytes of a string (or binary) array: byte j of every string, without copying the strings."""

    def __init__(self, arr: pa.Array) -> None:
        arr = arr.cast(pa.large_binary())
        buffers = arr.buffers()
        self.starts = np.frombuffer(buffers[1], np.int64, count=len(arr) + 1, offset=arr.offset * 8)
        self.lengths = np.diff(self.starts)
        self.starts = self.starts[:-1]
        if arr.null_count:
            self.lengths = np.where(arr.is_null().to_numpy(zero_copy_only=False), 0, self.lengths)
        data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
        self.data = data if data.size else np.zeros(1, np.uint8)  # (every string empty or null)

    @property
    def max_length(self) -> int:
        return int(self.lengths.max(initial=0))

    def byte(self, j: int) -> np.ndarray:
        """Byte j of every string, 0 past its end."""
        at = np.minimum(self.starts + j, self.data.size - 1)
        return np.where(j < self.lengths, self.data[at], 0).astype(np.uint8)


def _string_values(arr: pa.Array, where: str, f: ParquetFeatureConfig, lengths: np.ndarray | None) -> np.ndarray:
    """Raw uint64 values of a string column, as `f.strings` says."""
    strings = _Strings(arr)
    if f.strings == "hex":
        cells = np.stack([strings.byte(j) for j in range(MAX_HEX_DIGITS)], 1)
        values, valid = parse_hex(cells.view(f"S{MAX_HEX_DIGITS}").reshape(-1))
        valid &= strings.lengths <= MAX_HEX_DIGITS
        if not valid.all():
            i = int(np.flatnonzero(~valid)[0])
            raise DataError(
                f"{where}, row {_row(i, lengths)}: column {f.column!r} value {arr[i].as_py()!r} is not a hex "
                f"hash of at most {MAX_HEX_DIGITS} digits; set strings: fnv1a to hash any string"
            )
        return values
    h = np.full(len(arr), _FNV_OFFSET, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(strings.max_length):  # one pass per byte position: memory stays O(rows)
            h = np.where(j < strings.lengths, (h ^ strings.byte(j)) * _FNV_PRIME, h)
    return np.where(strings.lengths > 0, h, 0).astype(np.uint64)


def _weights(column: pa.ChunkedArray, lengths: np.ndarray | None, where: str, f: ParquetFeatureConfig) -> np.ndarray:
    arr = column.combine_chunks()
    if lengths is not None:
        w_lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
        if not np.array_equal(w_lengths, lengths):
            i = int(np.flatnonzero(w_lengths != lengths)[0])
            raise DataError(
                f"{where}, row {i}: weights column {f.weights!r} has {w_lengths[i]} weights for the "
                f"{lengths[i]} ids of column {f.column!r}"
            )
        arr = pc.list_flatten(arr)
    weights = pc.fill_null(arr, 1.0).to_numpy(zero_copy_only=False)
    check_weights(weights, where, f.name, lengths)
    return weights.astype(np.float32)
