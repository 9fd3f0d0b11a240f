"""Criteo TSV in blocks of whole lines: read through a bounded buffer, parsed by pyarrow's CSV reader and
numpy at the speed of the parser, and handed to the line-by-line parser (criteo_lines.parse_lines) when a
block holds anything the fast path does not vouch for. Torch-free: preprocessing workers import it.

`line_blocks` cuts a byte stream into blocks of at most `block_bytes` bytes of whole lines, numbered.
A line longer than a block (so longer than `max_line_bytes`) is never held: it is read past and stands
as a LongLine, a bad line of its own. Memory is therefore bounded by the block whatever the input.

`parse_fast` parses a block with pyarrow.csv (tab-separated, no quoting, every column as binary) and
decodes the columns from their offsets and data buffers: the label is one byte 0 or 1; a dense value is
at most 18 bytes of [0-9-] that pyarrow's integer cast accepts (-?[0-9]+; an empty one is 0), then
log(1 + max(x, 0)) as the line parser computes it (a table for values under 2^16); a categorical value
is empty or 8 hex digits, decoded two characters at a time through a 64 Ki table. It returns None,
leaving the block to the line parser, for any block that has a line pyarrow splits otherwise than the
line parser does (a carriage return not followed by a newline, a byte-order mark at its start, a line
without 40 fields) or any value outside those forms (a sign '+', a hex value of fewer digits, 19
digits, a bad value of any kind), and when `max_line_bytes` is under the longest line it accepts, so
that only the line parser decides which lines are too long. Its output equals the line parser's on every
block it accepts; tests/test_ingest_exact.py checks this against digests of the line parser's output.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from neorec.data.criteo_lines import (
    CATEGORICAL_NAMES,
    DENSE_NAMES,
    MAX_HEX_DIGITS,
    NUM_CATEGORICAL,
    NUM_DENSE,
    LongLine,
    Parsed,
    read_lines,
)

BLOCK_BYTES = 8 << 20  # bytes of whole lines parsed at once
_FAST_DENSE_BYTES = 18  # the fast path's widest dense value (the line parser takes a sign more)
FAST_MAX_LINE = (
    1 + NUM_DENSE * _FAST_DENSE_BYTES + NUM_CATEGORICAL * MAX_HEX_DIGITS + NUM_DENSE + NUM_CATEGORICAL
)
_BOM = b"\xef\xbb\xbf"  # pyarrow.csv drops it at the start of its input; the line parser reads it as data

try:  # the cast kernel without pyarrow.compute, whose import (wrappers of every kernel) costs 60 ms
    from pyarrow._compute import CastOptions, call_function

    _CAST_INT64 = CastOptions(pa.int64())

    def _to_int64(values: pa.Array) -> pa.Array:
        return call_function("cast", [values], _CAST_INT64)

except ImportError:  # a pyarrow without that module
    import pyarrow.compute as pc

    def _to_int64(values: pa.Array) -> pa.Array:
        return pc.cast(values, pa.int64())


_COLUMNS = ["label", *DENSE_NAMES, *CATEGORICAL_NAMES]
_READ = pcsv.ReadOptions(column_names=_COLUMNS, block_size=2 << 20, use_threads=False)
_PARSE = pcsv.ParseOptions(
    delimiter="\t", quote_char=False, double_quote=False, escape_char=False, newlines_in_values=False,
    ignore_empty_lines=False,
)  # fmt: skip
_CONVERT = pcsv.ConvertOptions(
    column_types={c: pa.binary() for c in _COLUMNS}, null_values=[], strings_can_be_null=False,
    quoted_strings_can_be_null=False,
)  # fmt: skip


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    nibble = np.full(256, -1, np.int32)
    for c in b"0123456789abcdef":
        nibble[c] = int(chr(c), 16)
    for c in b"ABCDEF":
        nibble[c] = int(chr(c), 16)
    pair = np.arange(1 << 16)
    first, second = nibble[pair & 0xFF], nibble[pair >> 8]  # a uint16 of two bytes is little-endian
    hex_pair = np.where((first >= 0) & (second >= 0), first * 16 + second, 0x100).astype(np.uint16)
    dense_byte = np.zeros(256, bool)
    dense_byte[list(b"0123456789-")] = True
    log1p = np.log1p(np.arange(1 << 16, dtype=np.float64)).astype(np.float32)
    return hex_pair, dense_byte, log1p


# two ASCII bytes -> their hex value 0..255, 0x100 unless both are hex digits; bytes of a dense value;
# log(1 + x) of the small dense values, as the line parser computes it (float64, then float32)
_HEX_PAIR, _DENSE_BYTE, _LOG1P = _tables()


@dataclass
class LineBlock:
    """Lines first .. first + num_lines - 1 of a file: whole lines (each ends with a newline, but for
    the last line of a file that has none), or one LongLine that stands for a line longer than a block."""

    first: int
    data: bytes
    num_lines: int
    long_line: LongLine | None = None

    def lines(self, max_line_bytes: int) -> list[bytes]:
        """The lines without their newlines, as criteo_lines.read_lines gives them."""
        if self.long_line is not None:
            return [self.long_line]
        return list(read_lines(io.BytesIO(self.data), max_line_bytes))

    def numbers(self) -> np.ndarray:
        return np.arange(self.first, self.first + self.num_lines, dtype=np.int64)


def line_blocks(
    f: IO[bytes],
    max_line_bytes: int,
    *,
    first: int = 1,
    num_lines: int | None = None,
    num_bytes: int | None = None,
    block_bytes: int | None = None,
) -> Iterator[LineBlock]:
    """Blocks of the lines of `f` from its position on (line `first`), up to `num_lines` lines and
    `num_bytes` bytes when given, else to the end; blocks of BLOCK_BYTES unless `block_bytes` is given.
    With both limits given, the block that holds the last of those bytes is taken to hold the rest of
    the lines, uncounted (a piece counted by the indexing pass; a parse of other lines sees it)."""
    block_bytes = max(
        block_bytes or BLOCK_BYTES, max_line_bytes + 1
    )  # a line without a newline in a block is too long
    number, left_lines, left_bytes = first, num_lines, num_bytes
    if left_bytes is not None and left_bytes <= block_bytes + block_bytes // 4:
        block_bytes = max(block_bytes, left_bytes)  # a piece a little over a block is read as one
    rest = b""
    while left_lines is None or left_lines > 0:
        piece = f.read(block_bytes if left_bytes is None else min(block_bytes, left_bytes))
        if left_bytes is not None:
            left_bytes -= len(piece)
        data = rest + piece if rest else piece
        end = not piece
        if end:  # the lines left, the last one perhaps without its newline
            if not data:
                return
            if not data.endswith(b"\n"):
                data += b"\n"
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) >= block_bytes:  # no line ends in a whole block: read past the line
            long_line, rest, num_read = _read_past(f, data, max_line_bytes, block_bytes, left_bytes)
            if left_bytes is not None:
                left_bytes -= num_read
            yield LineBlock(number, b"", 1, long_line)
            number += 1
            left_lines = None if left_lines is None else left_lines - 1
            continue
        block, rest = data[:cut], data[cut:]
        if left_bytes == 0 and not rest and left_lines is not None:  # the rest of the lines, counted
            count = left_lines  # by the indexing pass (the parse checks it)
        else:
            count = block.count(b"\n")
        if left_lines is not None and count > left_lines:  # the block goes past the last line wanted
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
            block, count = block[: ends[left_lines - 1] + 1], left_lines
        if count:
            yield LineBlock(number, block, count)
        if end:
            return
        number += count
        left_lines = None if left_lines is None else left_lines - count


def _read_past(
    f: IO[bytes], start: bytes, max_line_bytes: int, block_bytes: int, left_bytes: int | None
) -> tuple[LongLine, bytes, int]:
    """A line that begins with `start` (no newline in it), read to its end (at most `left_bytes` more
    bytes): (its LongLine, the bytes read after its newline, the number of bytes read)."""
    long_line = LongLine(start, max_line_bytes)
    num_read = 0
    while left_bytes is None or num_read < left_bytes:
        piece = f.read(block_bytes if left_bytes is None else min(block_bytes, left_bytes - num_read))
        if not piece:
            break
        num_read += len(piece)
        end = piece.find(b"\n")
        if end >= 0:
            long_line.add(piece[:end])
            return long_line, piece[end + 1 :], num_read
        long_line.add(piece)
    return long_line, b"", num_read


def parse_fast(data: bytes, num_lines: int, max_line_bytes: int) -> Parsed | None:
    """(labels [n] f32, dense [n, 13] f32, raw hex values [26, n] u32) of a block of whole lines, or
    None when the block is to be parsed line by line (see the module's docstring)."""
    if max_line_bytes < FAST_MAX_LINE or data.startswith(_BOM) or not num_lines:
        return None
    if b"\r" in data and data.count(b"\r") != data.count(b"\r\n"):
        return None
    try:
        table = pcsv.read_csv(
            pa.py_buffer(data), read_options=_READ, parse_options=_PARSE, convert_options=_CONVERT
        )
    except pa.ArrowInvalid:  # a line without 40 fields
        return None
    if table.num_rows != num_lines:
        return None
    labels = np.empty(num_lines, np.float32)
    dense = np.empty((num_lines, NUM_DENSE), np.float32)
    raw = np.empty((NUM_CATEGORICAL, num_lines), np.uint32)
    row = 0
    for columns in _row_chunks(table):  # pyarrow's blocks of rows, decoded one at a time
        rows = slice(row, row + len(columns[0]))
        if not _labels(columns[0], labels[rows]):
            return None
        values = _dense(columns[1 : 1 + NUM_DENSE])
        if values is None:
            return None
        dense[rows] = values.T
        for j in range(NUM_CATEGORICAL):
            if not _hex(columns[1 + NUM_DENSE + j], raw[j, rows]):
                return None
        row = rows.stop
    return labels, dense, raw


def _row_chunks(table: pa.Table) -> Iterator[list[pa.Array]]:
    """The columns of a table's chunks of rows (one chunk per block pyarrow parsed; every column is
    chunked alike, else the columns are combined into one chunk)."""
    columns = table.columns
    lengths = [len(c) for c in columns[0].chunks]
    if all([len(c) for c in column.chunks] == lengths for column in columns):
        for k in range(len(lengths)):
            yield [column.chunk(k) for column in columns]
    else:
        yield [column.combine_chunks() for column in columns]


def _buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n + 1] int32, the bytes of the values) of a binary array."""
    buffers = column.buffers()
    offsets = np.frombuffer(buffers[1], np.int32, len(column) + 1, column.offset * 4)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    return offsets, data[offsets[0] : offsets[-1]]


def _labels(column: pa.Array, out: np.ndarray) -> bool:
    """Decode a column of labels "0" or "1" into `out` (float32); False for any other value."""
    offsets, data = _buffers(column)
    if len(data) != len(column):  # not one byte each
        return False
    digit = data - np.uint8(ord("0"))
    if (digit > 1).any():
        return False
    out[:] = digit
    return True


def _dense(columns: list[pa.Array]) -> np.ndarray | None:
    """Decode the dense columns of a chunk into log(1 + max(x, 0)) [13, n] float32, one cast for all
    of them; None for any value the fast path does not take."""
    num_rows = len(columns[0])
    column = pa.concat_arrays(columns)
    offsets, data = _buffers(column)
    lengths = np.diff(offsets)
    dense_bytes = np.take(_DENSE_BYTE, data, mode="clip")  # a uint8 is in the table: no bounds check
    if (len(lengths) and lengths.max() > _FAST_DENSE_BYTES) or not dense_bytes.all():
        return None
    given = lengths > 0
    validity = pa.py_buffer(np.packbits(given, bitorder="little"))
    buffers = column.buffers()
    try:  # empty values are nulls to the cast, which rejects "", "-" and misplaced signs
        ints = _to_int64(
            pa.Array.from_buffers(pa.binary(), len(column), [validity, *buffers[1:]], offset=column.offset)
        )
    except pa.ArrowInvalid:
        return None
    values = np.frombuffer(ints.buffers()[1], np.int64, len(ints), ints.offset)
    small = np.where(given, np.clip(values, 0, len(_LOG1P) - 1), 0)  # a null's slot holds no defined value
    out = np.take(_LOG1P, small, mode="clip")
    large = np.flatnonzero(given & (values >= len(_LOG1P)))
    if len(large):
        out[large] = np.log1p(values[large].astype(np.float64)).astype(np.float32)
    return out.reshape(NUM_DENSE, num_rows)


def _hex(column: pa.Array, out: np.ndarray) -> bool:
    """Decode a column of empty or 8-digit hex values into `out` (uint32); False for any other value."""
    offsets, data = _buffers(column)
    full = None
    if len(data) != MAX_HEX_DIGITS * len(column):  # some are empty (or of another length)
        full = np.diff(offsets) == MAX_HEX_DIGITS
        if MAX_HEX_DIGITS * int(np.count_nonzero(full)) != len(data):
            return False
    pairs = np.take(_HEX_PAIR, data.view(np.uint16), mode="clip")  # every uint16 is in the table
    if len(pairs) and pairs.max() > 0xFF:
        return False
    values = pairs.astype(np.uint8).view(">u4")  # 4 bytes of 2 hex digits each, most significant first
    if full is None:
        out[:] = values
    else:
        out[:] = 0
        out[full] = values
    return True
