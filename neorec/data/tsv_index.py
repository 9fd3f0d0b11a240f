"""The indexing pass of Criteo TSV preprocessing: the lines of a file, where its shards start and where
pieces start (torch-free: preprocessing workers import it).

The file is read in blocks of `INDEX_BLOCK` bytes at offsets k * INDEX_BLOCK. Each block is scanned on
its own (`scan_block`: its newlines, its first newline, where its last non-blank byte is), so that
workers scan byte ranges of one plain file in parallel (`scan_range`), and `combine_scans` adds up the
scans in file order: the line count (up to the last non-blank line), a piece start per block (the line
after the block's first newline) and the offsets of the shards' first lines, found by reading again the
block that holds each (one per shard). A .gz file cannot seek: it is scanned in one pass, the shard
offsets (positions in the decompressed stream) taken as its blocks go by.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from neorec.errors import DataError

INDEX_BLOCK = 8 << 20  # bytes read at a time by the indexing pass; a piece starts in each

PathLike = str | Path


@dataclass
class FileIndex:
    """What the indexing pass learns of a file: its lines (up to the last non-blank one), the byte
    offsets of lines 1, 1 + shard_lines, ... and of the lines that start pieces (plain files only),
    and where its last non-blank line ends."""

    path: str
    num_lines: int
    shard_lines: int
    shard_offsets: list[int]
    piece_starts: list[tuple[int, int]] = field(default_factory=list)  # (line, byte offset)
    end: int = -1


@dataclass
class BlockScan:
    """One block of a file: at byte `pos`, `size` bytes, `newlines` of them newlines, the first at
    `first_newline` (-1: none). `filled`: its length without trailing whitespace; when not 0, the
    newlines from its last non-blank byte on (`newlines_after`) and where that byte's line ends
    (`line_end`, a file offset). `shard_offsets`: those in this block, when the scan knew the lines
    before it (a .gz file's single pass)."""

    pos: int
    size: int
    newlines: int
    first_newline: int
    filled: int
    newlines_after: int = 0
    line_end: int = 0
    shard_offsets: list[int] | None = None


def open_input(path: str | Path) -> IO[bytes]:
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


# what a read of a TSV input raises: a failing disk or permission (OSError), a truncated .gz file
# (EOFError) or damaged compressed data (zlib.error, gzip.BadGzipFile)
READ_ERRORS = (OSError, EOFError, zlib.error)


def read_error(path: PathLike, where: str, error: BaseException) -> DataError:
    """The one-line error of a read of `path` that failed `where` ("after line 12"); raise it from
    `error`, so that a failing disk (EIO) is reported as one (exit 1)."""
    if isinstance(error, EOFError | zlib.error | gzip.BadGzipFile):
        reason = f"damaged or truncated gzip data ({error})"
    else:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return DataError(f"{path}: cannot read {where}: {reason}")


def _filled(block: bytes) -> int:
    """The length of `block` without its trailing whitespace (bytes.rstrip), copying it only when it
    ends with whitespace."""
    if block and block[-1] not in b" \t\n\r\x0b\x0c":
        return len(block)
    return len(block.rstrip())


def scan_block(block: bytes, pos: int, lines_before: int | None = None, shard_lines: int = 0) -> BlockScan:
    """The scan of the block at byte `pos`; with `lines_before` (the newlines before it), also the
    offsets of the shard starts in it."""
    count = int(np.count_nonzero(np.frombuffer(block, np.uint8) == 10))  # 3x bytes.count's speed
    scan = BlockScan(pos, len(block), count, block.find(b"\n"), _filled(block))
    if scan.filled:
        scan.newlines_after = block.count(b"\n", scan.filled - 1)
        newline = block.find(b"\n", scan.filled - 1)
        scan.line_end = pos + (newline + 1 if newline >= 0 else len(block))
    if lines_before is not None:
        shard_start = (lines_before // shard_lines + 1) * shard_lines <= lines_before + count
        newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) if shard_start else np.empty(0, np.intp)
        scan.shard_offsets = _offsets_in(newlines, pos, lines_before, shard_lines)
    return scan


def _offsets_in(newlines: np.ndarray, pos: int, lines_before: int, shard_lines: int) -> list[int]:
    """Offsets of the lines after newline number j * shard_lines that are in the block at byte `pos`
    whose newlines are at `newlines` (positions in the block)."""
    first_target = (lines_before // shard_lines + 1) * shard_lines
    targets = range(first_target, lines_before + len(newlines) + 1, shard_lines)
    return [pos + int(newlines[t - lines_before - 1]) + 1 for t in targets]


def scan_range(path: PathLike, start: int, stop: int | None, block_bytes: int) -> list[BlockScan]:
    """Scans of the blocks of a plain file from byte `start` (a multiple of `block_bytes`) up to `stop`
    (None: the end)."""
    scans = []
    pos = start
    try:
        with open(path, "rb") as f:
            f.seek(start)
            while stop is None or pos < stop:
                block = f.read(block_bytes)
                if not block:
                    break
                scans.append(scan_block(block, pos))
                pos += len(block)
    except OSError as e:
        raise DataError(f"{path}: cannot read after byte {pos} of its content: {e}") from e
    return scans


def scan_stream(path: PathLike, shard_lines: int, block_bytes: int) -> list[BlockScan]:
    """Scans of every block of a file read once from its start, shard offsets included (a .gz file)."""
    scans = []
    pos, lines_before = 0, 0
    with open_input(path) as f:
        try:
            while block := f.read(block_bytes):
                scans.append(scan_block(block, pos, lines_before, shard_lines))
                lines_before += scans[-1].newlines
                pos += len(block)
        except READ_ERRORS as e:
            raise read_error(path, f"after line {lines_before} (byte {pos} of its content)", e) from e
    return scans


# finds the shard offsets in blocks read again: (path, shard_lines, [(block, newlines before it)]) ->
# the offsets, in order
FindOffsets = Callable[[PathLike, int, list[tuple[BlockScan, int]]], list[int]]


def combine_scans(
    path: PathLike, shard_lines: int, scans: list[BlockScan], find_offsets: FindOffsets | None = None
) -> FileIndex:
    """The index of a file from the scans of all its blocks, in order (see the module's docstring). The
    last non-blank line ends at its newline, or at the end of the file, whatever blocks it spans. The
    blocks that hold shard starts are read again by `find_offsets` (default: `reread_offsets`, here)."""
    gz = str(path).endswith(".gz")
    num_newlines, last_line, end = 0, 0, 0
    open_line = False  # whether the last non-blank line so far goes on past `end` (blanks, a newline)
    offsets, starts = [0], [(1, 0)]
    reread: list[tuple[BlockScan, int]] = []  # (block, newlines before it) of plain files' shard starts
    for scan in scans:
        if scan.pos and scan.first_newline >= 0 and not gz:
            starts.append((num_newlines + 2, scan.pos + scan.first_newline + 1))
        if scan.filled:  # the last non-blank line so far ends in this block
            last_line = num_newlines + scan.newlines - scan.newlines_after + 1
            end = scan.line_end
            open_line = scan.newlines_after == 0
        elif open_line:  # its trailing blanks go on in this block
            end = scan.pos + (scan.first_newline + 1 if scan.first_newline >= 0 else scan.size)
            open_line = scan.first_newline < 0
        if scan.shard_offsets is not None:
            offsets += scan.shard_offsets
        elif (num_newlines // shard_lines + 1) * shard_lines <= num_newlines + scan.newlines:
            reread.append((scan, num_newlines))
        num_newlines += scan.newlines
    # a block is read again only for a shard that starts at a line of the file (not past its last one)
    reread = [
        (scan, before) for scan, before in reread if (before // shard_lines + 1) * shard_lines < last_line
    ]
    if reread:
        offsets += (find_offsets or reread_offsets)(path, shard_lines, reread)
    offsets = [o for i, o in enumerate(offsets) if i * shard_lines < last_line]
    starts = [(line, off) for line, off in starts if line <= last_line]
    return FileIndex(str(path), last_line, shard_lines, offsets, [] if gz else starts, -1 if gz else end)


def reread_offsets(path: PathLike, shard_lines: int, reread: list[tuple[BlockScan, int]]) -> list[int]:
    """The offsets of the shard starts in these blocks of a plain file, each given with the newlines
    before it, read again; a block that is not as its scan found it is an error."""
    offsets: list[int] = []
    scan = reread[0][0]
    try:
        with open(path, "rb") as f:
            for scan, lines_before in reread:
                f.seek(scan.pos)
                block = f.read(scan.size)
                newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                if len(block) != scan.size or len(newlines) != scan.newlines:
                    raise DataError(
                        f"{path}: changed while it was indexed (near byte {scan.pos}); preprocess it again"
                    )
                offsets += _offsets_in(newlines, scan.pos, lines_before, shard_lines)
    except OSError as e:
        raise read_error(path, f"at byte {scan.pos} of its content, indexing it", e) from e
    return offsets


def index_file(path: PathLike, shard_lines: int, block_bytes: int | None = None) -> FileIndex:
    """Count the lines of a file and note the offsets of shard starts and of a piece start in every
    block of `block_bytes` (the line after the block's first newline), in this process."""
    block_bytes = block_bytes or INDEX_BLOCK
    if str(path).endswith(".gz"):
        return combine_scans(path, shard_lines, scan_stream(path, shard_lines, block_bytes))
    return combine_scans(path, shard_lines, scan_range(path, 0, None, block_bytes))
