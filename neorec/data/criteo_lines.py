"""The rules of a Criteo TSV line, and the line-by-line parser that applies them exactly (torch-free).

A line is `label \\t I1..I13 \\t C1..C26`: 40 tab-separated fields, no header, an empty field is a
missing value. `parse_lines` takes a chunk of lines, splits them into cells, validates and converts
them with numpy over the whole chunk. It is the reference of the format: the block parser
(neorec/data/tsv_blocks.py) reads most blocks faster and hands every block it cannot vouch for to it.
Memory is bounded by the chunk whatever the input: a line longer than `max_line_bytes` is read past in
blocks, never held whole (`read_lines`, `LongLine`), and cells are held at fixed widths that fit every
valid value (label 1 byte, dense a sign and 18 digits, categorical 8 hex digits).

Preprocessing (as dlrm's `getCriteoAdData` + `--max-ind-range`):
- dense: missing -> 0, negative -> 0, then log(1 + x), float32, in the order I1..I13;
- categorical: the hex hash is read as an unsigned integer; a missing value is read as 0 (the hash
  "00000000", as dlrm does), so it shares an id with that hash; then the integer is reduced into the
  feature's table with `hashing`:
    "modulo": id = value % rows (dlrm's choice; missing -> id 0),
    "hash":   id = splitmix64(value) % rows, which spreads values that share low bits across the table.
  `splitmix64` is the finaliser of Steele et al.'s SplitMix64 on uint64 (constants below), fixed so
  that ids are stable across runs, machines and versions.
  Features of managed-collision tables (`raw_features`) keep the integer itself, a raw id that no
  other value shares; the table's id map gives it a row (neorec/embedding/id_map.py).

Bad lines (longer than `max_line_bytes`, wrong field count, label not 0/1, non-integer dense value,
categorical value with non-hex characters or more than 8 digits) are returned as (line number, reason,
message naming `path:line`); the readers raise the message under `bad_lines="fail"`, or skip and count
them per reason under `bad_lines="skip"`. Messages quote at most the first bytes of a bad value.
"""

from __future__ import annotations

import errno
import gzip
import io
import itertools
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from neorec.data.locations import criteo_hint
from neorec.errors import ConfigError, DataError
from neorec.utils.hashing import splitmix64

NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CATEGORICAL_NAMES = [f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)]
HASHINGS = ("modulo", "hash")
BAD_LINE_POLICIES = ("fail", "skip")
MAX_DENSE_DIGITS = 18  # keeps every accepted dense value inside int64
MAX_HEX_DIGITS = 8
DEFAULT_MAX_LINE_BYTES = 4096  # a valid Criteo line is under 500 bytes
_DENSE_WIDTH = 1 + MAX_DENSE_DIGITS  # bytes of the widest valid dense value: a sign and 18 digits
_DENSE, _HEX = slice(1, 1 + NUM_DENSE), slice(1 + NUM_DENSE, NUM_FIELDS)  # their fields in a line
_QUOTE_BYTES = 40  # messages quote at most this many bytes of a bad value
UNLABELED = b"0\t"  # the label field put in front of a line of a file without labels
_READ_BYTES = 1 << 18  # lines are read in blocks of at most this size

# ASCII byte -> hex digit value, 255 for anything that is not a hex digit.
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _c in b"0123456789abcdef":
    _HEX_LUT[_c] = int(chr(_c), 16)
for _c in b"ABCDEF":
    _HEX_LUT[_c] = int(chr(_c), 16)

PathLike = str | Path


def map_categorical(
    raw: np.ndarray, table_rows: np.ndarray, hashing: str, keep_raw: np.ndarray | None = None
) -> np.ndarray:
    """Raw hash values [B, 26] (uint64) -> int64 ids in [0, table_rows[f]) for each column f; columns
    where `keep_raw` [26] is true keep the raw value (an id for a managed-collision table)."""
    rows = table_rows.astype(np.uint64)
    if hashing == "modulo":
        ids = (raw % rows).astype(np.int64)
    elif hashing == "hash":
        ids = (splitmix64(raw) % rows).astype(np.int64)
    else:
        raise ConfigError(f"hashing must be one of {HASHINGS}, got {hashing!r}")
    if keep_raw is not None and keep_raw.any():
        ids[:, keep_raw] = raw[:, keep_raw].astype(np.int64)  # at most 32 bits: a valid raw id
    return ids


def _byte_matrix(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fixed-width bytes cells [n] -> (bytes [n, width] uint8, lengths [n], in-string mask [n, width])."""
    flat = np.ascontiguousarray(cells).reshape(-1)
    width = flat.dtype.itemsize
    u = flat.view(np.uint8).reshape(-1, width)
    length = np.char.str_len(flat)
    inside = np.arange(width) < length[:, None]
    return u, length, inside


def parse_dense(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer cells (bytes) -> (int64 values, valid mask), same shape; empty -> 0, valid."""
    u, length, inside = _byte_matrix(cells)
    digit = (u >= ord("0")) & (u <= ord("9"))
    sign = (u[:, 0] == ord("-")) | (u[:, 0] == ord("+"))
    char_ok = np.where(inside, digit, True)
    char_ok[:, 0] |= sign
    num_digits = length - sign
    valid = char_ok.all(1) & ((length == 0) | ((num_digits >= 1) & (num_digits <= MAX_DENSE_DIGITS)))
    # Horner's rule over the digits (faster than numpy's bytes -> int cast); invalid cells end as 0
    values = np.zeros(len(u), dtype=np.int64)
    take = digit & inside
    for k in range(min(u.shape[1], MAX_DENSE_DIGITS + 1, int(length.max(initial=0)))):
        values = np.where(take[:, k], values * 10 + (u[:, k] - ord("0")), values)
    values[u[:, 0] == ord("-")] *= -1
    values[~valid] = 0
    return values.reshape(cells.shape), valid.reshape(cells.shape)


def parse_hex(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex cells (bytes, at most 8 digits) -> (uint64 values, valid mask), same shape; empty -> 0."""
    flat = np.ascontiguousarray(cells).reshape(-1)
    length = np.char.str_len(flat)
    if flat.dtype.itemsize != MAX_HEX_DIGITS:
        flat = flat.astype(f"S{MAX_HEX_DIGITS}")  # longer cells are invalid anyway (length check)
    u = flat.view(np.uint8).reshape(-1, MAX_HEX_DIGITS)
    nibble = _HEX_LUT[u]
    inside = np.arange(MAX_HEX_DIGITS) < length[:, None]
    valid = (length <= MAX_HEX_DIGITS) & ((nibble != 255) | ~inside).all(1)
    # The cell as 8 digits left-aligned (2 per byte: a big-endian uint32), then shorter ones shifted back
    nibble[~inside] = 0
    left = ((nibble[:, 0::2] << 4) | nibble[:, 1::2]).view(">u4")[:, 0].astype(np.uint64)
    values = left >> (4 * (MAX_HEX_DIGITS - np.minimum(length, MAX_HEX_DIGITS))).astype(np.uint64)
    return np.where(valid, values, 0).reshape(cells.shape), valid.reshape(cells.shape)


def check_tsv_file(path: PathLike, key: str | None = None) -> None:
    """A Criteo TSV input exists, is a readable file and holds a line that is not blank (0 bytes, an
    empty .gz and blank lines alike are an empty file); DataError naming it if not, and for a missing
    one where Criteo's logs are (`key`: the config key that named it; None: the command line)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a folder; expected a Criteo TSV file (plain or .gz)")
    if not path.is_file():
        raise DataError(f"{path}: no such file; {criteo_hint(key)}")
    try:  # readable: refused before any work, as a missing file is
        with open(path, "rb") as f:
            empty = not _filled(gzip.open(f, "rb") if path.suffix == ".gz" else f)
    except OSError as e:
        hint = "; check its permissions" if e.errno in (errno.EACCES, errno.EPERM) else ""
        raise DataError(f"{path}: cannot be read ({e.strerror or e}){hint}") from e
    if empty:
        unzipped = ", once decompressed" if path.suffix == ".gz" else ""
        raise DataError(
            f"{path}: empty file (no lines, or blank ones only{unzipped}); expected Criteo TSV lines "
            "(label, I1..I13, C1..C26)"
        )


def _filled(f: io.BufferedIOBase) -> bool:
    """Whether a file holds a byte that is not blank (read up to the block that holds the first one). A
    .gz file that cannot be decompressed counts as filled: its reader names where it is damaged."""
    try:
        while block := f.read(_READ_BYTES):
            if block.strip():
                return True
    except (EOFError, zlib.error, gzip.BadGzipFile):
        return True
    return False


def open_tsv(path: Path) -> io.BufferedIOBase:
    """A checked Criteo TSV file, opened for reading its bytes (decompressed for .gz)."""
    check_tsv_file(path)
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


class LongLine(bytes):
    """Stands for a line over the limit, never held whole: empty (one field, so a bad line), it keeps the
    line's `length`, whether it is `blank` (whitespace only), its first bytes (`head`, for messages) and
    the `limit` it is over."""

    def __new__(cls, start: bytes, limit: int) -> LongLine:
        return super().__new__(cls)

    def __init__(self, start: bytes, limit: int) -> None:
        self.length, self.blank, self.head, self.limit = 0, True, b"", limit
        self.add(start)

    def add(self, piece: bytes) -> None:
        self.length += len(piece)
        self.blank = self.blank and (not piece or piece.isspace())
        self.head += piece[: _QUOTE_BYTES - len(self.head)]


def read_lines(f: io.BufferedIOBase, max_line_bytes: int) -> Iterator[bytes]:
    """The lines of a binary file, split at b"\\n" as `for line in f` splits them, without the b"\\n".

    A line longer than `max_line_bytes` comes as a LongLine: it is read past in blocks, so memory stays
    within a block and one line of `max_line_bytes`, even for a file without any newline."""
    head = b""  # the start of a line that goes on in the next block
    while block := f.read1(_READ_BYTES):  # one raw read at most: a corrupt end loses no line before it
        *lines, rest = block.split(b"\n")  # no newline after the rest in this block
        if lines:
            lines[0], head = _extend(head, lines[0], max_line_bytes), b""
            if max(map(len, lines)) > max_line_bytes:  # a LongLine has length 0
                lines = [
                    line if len(line) <= max_line_bytes else LongLine(line, max_line_bytes) for line in lines
                ]
            yield from lines
        head = _extend(head, rest, max_line_bytes)
    if head or isinstance(head, LongLine):
        yield head


def _extend(head: bytes, piece: bytes, max_line_bytes: int) -> bytes:
    """The start of a line and its next piece, as one line or, once too long, as a LongLine."""
    if isinstance(head, LongLine):
        head.add(piece)
        return head
    line = head + piece
    return line if len(line) <= max_line_bytes else LongLine(line, max_line_bytes)


Parsed = tuple[np.ndarray, np.ndarray, np.ndarray]  # labels [n] f32, dense [n, 13] f32, raw hex [26, n] u32
BadLine = tuple[int, str, str]  # (line number, reason, message)
# what skips and counts malformed lines instead: the config key (neorec train, data inspect; the
# readers' Python argument has its name) or the flag of `neorec data preprocess`
FAIL_HINT = "; data.criteo.bad_lines=skip (or --bad-lines skip) skips and counts such lines"


def parse_lines(
    path: Path, chunk: list[tuple[int, bytes]], labeled: bool = True
) -> tuple[Parsed, list[BadLine]]:
    """The valid lines of a chunk of (line number, line without its newline, as read_lines gives it)
    as (labels, dense, raw hex values [26, n]), and the bad lines, with the first problem of each.
    labeled=False: lines of 39 fields without the label (Criteo's test files), read with label 0."""
    if not labeled:
        chunk = [(n, line if isinstance(line, LongLine) else UNLABELED + line) for n, line in chunk]
    lines = [line for _, line in chunk]
    num_tabs = np.fromiter(map(bytes.count, lines, itertools.repeat(b"\t")), np.int64, len(lines))
    bad = [
        _describe_shape(path, *chunk[i], num_tabs[i] + 1, labeled)
        for i in np.flatnonzero(num_tabs != NUM_FIELDS - 1)
    ]
    rows = np.flatnonzero(num_tabs == NUM_FIELDS - 1)  # chunk position of each line parsed below
    ok = np.zeros(0, dtype=bool)
    if len(rows):
        buf, starts, lengths = _split_cells([lines[i] for i in rows] if len(rows) < len(lines) else lines)
        label, label_cut = _cells(buf, starts[:, 0], lengths[:, 0], 1)
        dense_cells, dense_cut = _cells(buf, starts[:, _DENSE], lengths[:, _DENSE], _DENSE_WIDTH)
        hex_cells, hex_cut = _cells(buf, starts[:, _HEX], lengths[:, _HEX], MAX_HEX_DIGITS)
        label_ok = ((label == b"0") | (label == b"1")) & ~label_cut
        dense_raw, dense_ok = parse_dense(dense_cells)
        cat_raw, cat_ok = parse_hex(hex_cells)
        dense_ok &= ~dense_cut
        cat_ok &= ~hex_cut
        ok = label_ok & dense_ok.all(1) & cat_ok.all(1)
        for i in np.flatnonzero(~ok):
            fields = [buf[a : a + n].tobytes() for a, n in zip(starts[i], lengths[i], strict=True)]
            bad.append(_describe(path, chunk[rows[i]][0], fields, label_ok[i], dense_ok[i], cat_ok[i]))
    if not ok.any():
        empty = np.zeros(0, dtype=np.float32)
        return (empty, np.zeros((0, NUM_DENSE), np.float32), np.zeros((NUM_CATEGORICAL, 0), np.uint32)), bad
    labels = (label[ok] == b"1").astype(np.float32)
    dense = np.log1p(np.maximum(dense_raw[ok], 0).astype(np.float64)).astype(np.float32)
    return (labels, dense, cat_raw[ok].T.astype(np.uint32)), bad


def select(parsed: Parsed, rows: np.ndarray) -> Parsed:
    """The rows (a mask or indices) of parsed lines."""
    if rows.dtype == bool:
        rows = np.flatnonzero(rows)
    labels, dense, raw = parsed
    return labels.take(rows), dense.take(rows, axis=0), raw.take(rows, axis=1)  # faster than a mask


def _split_cells(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines of 40 fields -> (their bytes: joined by newlines, then zero padding; starts [n, 40] and
    lengths [n, 40] of their fields). Carriage returns that end a line are not part of its last field."""
    buf = np.frombuffer(b"\n".join(lines) + b"\n" + bytes(_DENSE_WIDTH), np.uint8)
    ends = np.flatnonzero((buf == ord("\t")) | (buf == ord("\n"))).reshape(len(lines), NUM_FIELDS)
    starts = np.concatenate(([0], ends.reshape(-1)[:-1] + 1)).reshape(ends.shape)  # each after a separator
    last, first = ends[:, -1], starts[:, -1]  # views: the last field of each line
    while (cr := (buf[last - 1] == ord("\r")) & (last > first)).any():
        last[cr] -= 1
    return buf, starts, ends - starts


def _cells(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fields of buf cut to `width` bytes (an S<width> array, shaped as starts), and which fields were
    cut: those longer than `width`, trailing NUL bytes not counted (numpy's bytes type drops them, so a
    field that is not cut reads as it would whole)."""
    u = sliding_window_view(buf, width)[starts]  # [..., width]: the bytes from each start
    u *= np.arange(width) < lengths[..., None]  # zero what lies past the field
    cut = lengths > width
    if cut.any():
        for i in np.flatnonzero(cut & (buf[starts + lengths - 1] == 0)):
            a = starts.flat[i]
            cut.flat[i] = len(buf[a : a + lengths.flat[i]].tobytes().rstrip(b"\0")) > width
    return u.view(f"S{width}")[..., 0], cut


def _quote(value: bytes) -> str:
    """A bad value for a message: whole when short, else its first bytes and its length."""
    value = value.rstrip(b"\0")  # as numpy's bytes type, which the parse reads
    if len(value) <= _QUOTE_BYTES:
        return repr(value.decode(errors="replace"))
    return f"{value[:_QUOTE_BYTES].decode(errors='replace')!r}... ({len(value)} bytes)"


def _describe_shape(path: Path, number: int, line: bytes, num_fields: int, labeled: bool = True) -> BadLine:
    """A line that is too long or has not 40 fields (39 unlabeled), as (line number, reason, message)."""
    if isinstance(line, LongLine):
        why = f"line of {line.length} bytes (starting {_quote(line.head)}) is longer than max_line_bytes={line.limit}"
        return number, "line_length", f"{path}:{number}: {why}; a valid Criteo line is under 500 bytes"
    if labeled:
        expected = f"{NUM_FIELDS} tab-separated fields (label, I1..I13, C1..C26)"
    else:  # its label field was added to the line
        expected = f"{NUM_FIELDS - 1} tab-separated fields (I1..I13, C1..C26: no label)"
        num_fields -= 1
    return number, "field_count", f"{path}:{number}: expected {expected}, got {num_fields}"


def with_label(data: bytes) -> bytes:
    """A block of unlabeled lines (39 fields) with the label 0 put in front of each line."""
    if not data:
        return data
    body = data[:-1] if data.endswith(b"\n") else data
    return UNLABELED + body.replace(b"\n", b"\n" + UNLABELED) + data[len(body) :]


def is_unlabeled(path: Path) -> bool:
    """Whether the first line of a Criteo TSV file has the 39 fields of a file without labels."""
    with open_tsv(path) as f:
        first = f.readline(DEFAULT_MAX_LINE_BYTES + 1)
    return first.count(b"\t") == NUM_FIELDS - 2


def _describe(
    path: Path, number: int, fields: list[bytes], label_ok: bool, dense_ok: np.ndarray, cat_ok: np.ndarray
) -> BadLine:
    """The first problem of one line of 40 fields, as (line number, reason, message)."""
    where = f"{path}:{number}"
    if not label_ok:
        return number, "label", f"{where}: label {_quote(fields[0])} is not 0 or 1"
    if not dense_ok.all():
        j = int(np.flatnonzero(~dense_ok)[0])
        value = _quote(fields[1 + j])
        msg = f"{where}: dense feature {DENSE_NAMES[j]} = {value} is not an integer (or empty)"
        return number, "dense", msg
    j = int(np.flatnonzero(~cat_ok)[0])
    value = _quote(fields[1 + NUM_DENSE + j])
    msg = f"{where}: categorical feature {CATEGORICAL_NAMES[j]} = {value} is not a hex hash of at most 8 digits (or empty)"
    return number, "categorical", msg


def resolve_table_rows(table_rows: int | Sequence[int]) -> np.ndarray:
    """One int for all 26 features, or 26 ints -> int64 array [26]; every entry must be >= 1."""
    if isinstance(table_rows, int):
        rows = [table_rows] * NUM_CATEGORICAL
    else:
        rows = [int(r) for r in table_rows]
        if len(rows) != NUM_CATEGORICAL:
            raise ConfigError(
                f"table_rows needs one int or {NUM_CATEGORICAL} ints (C1..C26), got {len(rows)}"
            )
    if min(rows) < 1:
        raise ConfigError(f"table_rows must all be >= 1, got {rows}")
    return np.asarray(rows, dtype=np.int64)


def check_reader_options(hashing: str, bad_lines: str, max_line_bytes: int) -> None:
    """The reader's settings that come from a user, checked before any line is read."""
    if hashing not in HASHINGS:
        raise ConfigError(f"hashing must be one of {HASHINGS}, got {hashing!r}")
    if bad_lines not in BAD_LINE_POLICIES:
        raise ConfigError(f"bad_lines must be one of {BAD_LINE_POLICIES}, got {bad_lines!r}")
    if max_line_bytes < 1:
        raise ConfigError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
