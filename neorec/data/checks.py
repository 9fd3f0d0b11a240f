"""Value checks shared by the readers: labels, dense values, id weights and id ranges, with one wording
for all.

A reader runs them when it opens a file (a preprocessed shard's part, a generated .npz file, a Parquet
row group), before any of its samples are handed out, so that a bad value stops the run with the file,
the row (the sample's index in that file), the column and the value, instead of training on it or
surfacing much later as a NaN loss that names nothing.

The checks are vectorised numpy over pieces of about `CHUNK` elements: a memory-mapped column of
several GB is read piece by piece and never held whole, and no Python loop runs over rows. They run
on the readers' background threads (numpy releases the GIL).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from neorec.errors import ConfigError, DataError
from neorec.sparse import BOUNDS_MODES

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # elements per piece of a scanned column
QUOTE = 40  # characters of a bad value an error message quotes at most
WARN_HINT = "or set embedding.bounds_check: warn to drop such ids"


def quote(value: object) -> str:
    """A bad value as an error message shows it: numbers as numpy prints them (7, 0.5, nan, inf),
    anything else as its repr; at most QUOTE characters, so a huge field never floods the message."""
    if isinstance(value, np.generic):
        text = str(value)
    elif isinstance(value, float | int) and not isinstance(value, bool):
        text = repr(value)
    elif isinstance(value, str):
        text = repr(value[: QUOTE + 1])
    else:
        text = repr(value)
    return text if len(text) <= QUOTE else text[:QUOTE] + "..."


def checked_mode(bounds_check: str) -> str:
    """`bounds_check` itself, once it is known to be a mode."""
    if bounds_check not in BOUNDS_MODES:
        raise ConfigError(f"embedding.bounds_check must be one of {list(BOUNDS_MODES)}, got {bounds_check!r}")
    return bounds_check


def _pieces(num_rows: int, width: int) -> Iterator[tuple[int, int]]:
    """[start, end) row ranges of about CHUNK elements each."""
    step = max(1, CHUNK // max(width, 1))
    for start in range(0, num_rows, step):
        yield start, min(start + step, num_rows)


def _first_not(values: np.ndarray, ok: Callable[[np.ndarray], np.ndarray]) -> tuple[int, int] | None:
    """(row, column) of the first element of `values` ([n] or [n, ...], viewed as [n, width]) for
    which `ok` is False, or None; `ok` maps a piece to a bool array of its shape."""
    if values.size == 0:
        return None
    width = values.size // len(values)
    for start, end in _pieces(len(values), width):
        good = ok(np.asarray(values[start:end]).reshape(end - start, width))
        if not good.all():
            row, column = divmod(int(np.argmin(good)), width)
            return start + row, column
    return None


def _at(values: np.ndarray, row: int, column: int) -> object:
    return values.reshape(len(values), -1)[row, column]


# ---- labels and dense values -------------------------------------------------------------------------
def first_bad_label(labels: np.ndarray) -> tuple[int, int] | None:
    """(row, task) of the first label that is not exactly 0 or 1 (NaN included), or None."""
    return _first_not(labels, lambda x: (x == 0) | (x == 1))


def check_labels(labels: np.ndarray, where: str, name: str = "label") -> None:
    """DataError naming `where` (the file, and row group), the row, `name` and the value when a label is
    not exactly 0 or 1: a 7 or a 0.5 would otherwise train silently as a strange target."""
    bad = first_bad_label(labels)
    if bad is not None:
        row, task = bad
        named = name if labels.ndim == 1 else f"{name} {task}"
        raise DataError(
            f"{where}, row {row}: {named} = {quote(_at(labels, row, task))} is not 0 or 1; labels must be "
            "exactly 0 or 1: fix the data"
        )


def first_nonfinite(values: np.ndarray) -> tuple[int, int] | None:
    """(row, column) of the first NaN or infinite value, or None."""
    return _first_not(values, np.isfinite)


def dense_error(where: str, row: int, column: str, value: object) -> DataError:
    """The error for a dense value that is not finite (`column`: its name or number, as the file has it)."""
    return DataError(
        f"{where}, row {row}: dense column {column} = {quote(value)} is not finite as float32; dense "
        "features must be finite numbers (no NaN or inf, magnitude below 3.4e38): fix the data"
    )


def check_dense(dense: np.ndarray, where: str, names: Sequence[str] | None = None) -> None:
    """DataError naming `where`, the row, the column and the value when a dense value is NaN or
    infinite: it would reach the loss only steps later, as a NaN that names no file."""
    bad = first_nonfinite(dense)
    if bad is not None:
        row, column = bad
        label = f"{column} ({names[column]})" if names and column < len(names) else str(column)
        raise dense_error(where, row, label, _at(dense, row, column))


def check_weights(weights: np.ndarray, where: str, feature: str, lengths: np.ndarray | None = None) -> None:
    """DataError naming `where`, the row (the sample; `lengths`: the bag sizes of a multi-hot column),
    the feature and the value when an id's weight is NaN or infinite (a float64 beyond float32's range
    included): it scales the id's row in the pooled sum, so it would reach the loss as a NaN that names
    no file. Any finite weight is a weight (zero and negative ones included)."""
    with np.errstate(over="ignore"):
        bad = _first_not(weights, lambda x: np.isfinite(x.astype(np.float32, copy=False)))
    if bad is not None:
        position = bad[0]
        row = position if lengths is None else _sample_of(position, lengths)
        raise DataError(
            f"{where}, row {row}: weight {quote(weights[position])} of an id of feature {feature!r} is not "
            "finite as float32; id weights must be finite numbers (no NaN or inf, magnitude below 3.4e38): "
            "fix the data"
        )


# ---- ids against their table -------------------------------------------------------------------------
def _sample_of(position: int, lengths: np.ndarray) -> int:
    """The sample that holds value `position` of a multi-hot column with these bag sizes (scanned in
    pieces, so a memory-mapped lengths column is never held whole)."""
    total = 0
    for start, end in _pieces(len(lengths), 1):
        ends = np.cumsum(lengths[start:end], dtype=np.int64) + total
        if ends[-1] > position:
            return start + int(np.searchsorted(ends, position, side="right"))
        total = int(ends[-1])
    return len(lengths)


def _scan_ids(ids: np.ndarray, limit: int, stop_at_first: bool) -> tuple[int, int]:
    """(how many ids, seen as unsigned, are >= limit; the position of the first, or -1)."""
    unsigned = np.dtype(f"u{ids.dtype.itemsize}")
    count, first = 0, -1
    for start, end in _pieces(len(ids), 1):
        piece = np.asarray(ids[start:end]).view(unsigned)
        if piece.max() >= limit:  # a reduction without temporaries decides the common, clean case
            bad = piece >= limit
            if first < 0:
                first = start + int(np.argmax(bad))
            count += int(np.count_nonzero(bad))
            if stop_at_first:
                break
    return count, first


def check_ids(
    ids: np.ndarray,
    where: str,
    feature: str,
    num_ids: int,
    *,
    lengths: np.ndarray | None = None,
    raw: bool = False,
    mode: str = "error",
) -> int:
    """Check one feature's ids against its table's `num_ids` rows, as `mode` says; returns how many
    lie outside (0 with mode "off", which reads nothing).

    `lengths`: the bag sizes of a multi-hot column, to name the sample of a bad id. `raw`: the column
    holds raw ids of a managed-collision table (mapped to rows later), which need only be >= 0.
    error: DataError naming `where`, the row, the feature, the id and the table's rows. warn: one
    warning with the count and the first bad id's row; the ids are passed on unchanged, for the
    embedding engine to drop and count. An id outside its table must never read another table's rows.
    Ids stored in the other byte order than this machine's (a big-endian '>i4' column) are a DataError
    whatever the mode: the reader hands the column's bytes on as they are.
    """
    if not ids.dtype.isnative:
        order = "big-endian" if ids.dtype.byteorder == ">" else "little-endian"
        native = ids.dtype.newbyteorder("=").str
        raise DataError(
            f"{where}: ids of feature {feature} have dtype {ids.dtype.str} ({order}); the reader takes "
            f"integers in this machine's byte order ({native}): write the column in that byte order"
        )
    if mode == "off" or len(ids) == 0:
        return 0
    if ids.dtype.kind not in "iu":
        raise DataError(f"{where}: ids of feature {feature} have dtype {ids.dtype}; ids must be integers")
    bits = 8 * ids.dtype.itemsize
    # Seen as unsigned, a negative id is at least 2^(bits-1): one comparison finds both kinds of bad id.
    limit = (1 << bits) if ids.dtype.kind == "u" else (1 << (bits - 1))
    if not raw:
        limit = min(limit, num_ids)
    if limit >= 1 << bits:
        return 0
    count, first = _scan_ids(ids, limit, stop_at_first=mode == "error")
    if not count:
        return 0
    row = first if lengths is None else _sample_of(first, lengths)
    value = quote(ids[first])
    if raw:
        outside = "negative (raw ids of its managed-collision table must be >= 0)"
    else:
        outside = f"outside its table of {num_ids} rows (ids must lie in [0, {num_ids}))"
    if mode == "error":
        kind = "raw id" if raw else "id"
        raise DataError(
            f"{where}, row {row}: feature {feature} has {kind} {value}, {outside}; fix the data, {WARN_HINT}"
        )
    log.warning(
        "%s: %d ids of feature %s %s, the first at row %d: %s; passed on for the embedding engine to drop "
        "(embedding.bounds_check: warn)", where, count, feature, outside, row, value,
    )  # fmt: skip
    return count
