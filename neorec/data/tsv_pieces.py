"""How preprocessing cuts Criteo TSV files into pieces that workers parse in parallel, and the parse of a
piece: its lines split into held-out and training lines, bad lines by the policy (torch-free).

A shard is lines [k * shard_lines + 1, ...] of a file (neorec/data/preprocess.py). A piece is a run of
whole lines of one shard: the indexing pass (neorec/data/tsv_index.py) notes where a line starts near
every INDEX_BLOCK bytes of a plain file (and its number), so that pieces are byte ranges that start on a line, and several workers
share one big file, and one shard, whatever its size. A .gz file cannot seek: its shards are its
pieces, read in order by one job.

Bad lines are reported as the line-by-line preprocessing reported them: it parsed each shard in chunks
of CHUNK_LINES lines, the held-out lines of a chunk before its training lines, and stopped at the first
bad line of the first of those groups that had one. `error_key` orders bad lines so: a piece stops at the
end of the chunk that holds its first bad line, and of all pieces that stopped, the one with the least
key names the line (neorec/data/tsv_shards.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neorec.data.criteo_lines import FAIL_HINT, BadLine, Parsed, parse_lines, select
from neorec.data.manifest import ShardPlan
from neorec.data.tsv_blocks import LineBlock, line_blocks, parse_fast
from neorec.data.tsv_index import READ_ERRORS, FileIndex, open_input, read_error
from neorec.errors import DataError

CHUNK_LINES = 16384  # lines per chunk of the line-by-line preprocessing, whose bad-line order is kept

PathLike = str | Path


@dataclass
class Piece:
    """Lines [first, first + count) of shard `shard`, at byte `offset` of a plain file (-1: read from
    the start of a .gz file), `num_bytes` long (-1: as many as the lines take)."""

    shard: ShardPlan
    first: int
    count: int
    offset: int = -1
    num_bytes: int = -1


def plan_pieces(shards: list[ShardPlan], index: FileIndex) -> list[Piece]:
    """The pieces of some shards of one file, in order; every shard has at least one."""
    if index.end < 0:  # .gz: the shard is the piece
        return [Piece(s, s.first, s.count) for s in shards]
    offset = dict(index.piece_starts)
    offset |= {k * index.shard_lines + 1: off for k, off in enumerate(index.shard_offsets)}
    offset[index.num_lines + 1] = index.end
    pieces: list[Piece] = []
    for shard in shards:
        if offset.get(shard.first) != shard.offset:
            raise DataError(
                f"{index.path}: changed since it was indexed (line {shard.first} moved); preprocess it again"
            )
        end = shard.first + shard.count  # the line after the shard: a shard's start, or past the file
        lines = [shard.first, *(n for n, _ in index.piece_starts if shard.first < n < end), end]
        if end not in offset:
            raise DataError(
                f"{index.path}: changed since it was indexed (no line {end}); preprocess it again"
            )
        for a, b in zip(lines, lines[1:], strict=False):
            pieces.append(Piece(shard, a, b - a, offset[a], offset[b] - offset[a]))
    return pieces


def error_key(shard: ShardPlan, number: int, held_out: bool) -> tuple[int, int, int, int]:
    """The order in which the line-by-line preprocessing met bad lines (see the module's docstring)."""
    return shard.index, (number - shard.first) // CHUNK_LINES, 0 if held_out else 1, number


@dataclass
class PieceParse:
    """The outcome of parsing pieces: lines skipped per shard and reason, and under bad_lines="fail"
    the first bad line by error_key (key, message), if any."""

    skipped: dict[int, Counter] = field(default_factory=dict)
    error: tuple[tuple[int, int, int, int], str] | None = None


def parse_pieces(
    pieces: list[Piece], eval_every: int | None, bad_lines: str, max_line_bytes: int, outcome: PieceParse
) -> Iterator[tuple[Piece, str, Parsed]]:
    """(piece, split, parsed lines of that split) per block of the pieces (all of one file, in order,
    one read of a .gz file from its start); stops at the end of the chunk of the first bad line under
    bad_lines="fail", with `outcome.error` set."""
    path = Path(pieces[0].shard.file)
    with open_input(path) as f:
        stream = LineStream(line_blocks(f, max_line_bytes))  # a .gz file: read once, in order
        for piece in pieces:
            outcome.skipped.setdefault(piece.shard.index, Counter())
            try:
                if piece.offset >= 0:
                    f.seek(piece.offset)
                    blocks = line_blocks(
                        f, max_line_bytes, first=piece.first, num_lines=piece.count, num_bytes=piece.num_bytes
                    )
                else:
                    for _ in stream.take(piece.first - stream.next_line):  # lines of shards done before
                        pass
                    blocks = stream.take(piece.count)
                for block in blocks:
                    yield from _parse_block(
                        path, piece, block, eval_every, bad_lines, max_line_bytes, outcome
                    )
                    if outcome.error is not None and _past_error(piece, block, outcome):
                        return
            except READ_ERRORS as e:  # a failing disk, a truncated or damaged .gz file
                raise read_error(path, f"near line {piece.first}", e) from e


class LineStream:
    """The blocks of one pass over a file, taken a number of lines at a time (a block that goes past
    the lines taken is split, its rest kept for the next take)."""

    def __init__(self, blocks: Iterator[LineBlock]) -> None:
        self.blocks = blocks
        self.next_line = 1
        self._rest: LineBlock | None = None

    def take(self, count: int) -> Iterator[LineBlock]:
        while count > 0:
            block, self._rest = self._rest, None
            if block is None:
                block = next(self.blocks, None)
                if block is None:
                    return
            if block.num_lines > count:
                ends = np.flatnonzero(np.frombuffer(block.data, np.uint8) == ord("\n"))
                cut = int(ends[count - 1]) + 1
                self._rest = LineBlock(block.first + count, block.data[cut:], block.num_lines - count)
                block = LineBlock(block.first, block.data[:cut], count)
            count -= block.num_lines
            self.next_line = block.first + block.num_lines
            yield block


def _past_error(piece: Piece, block: LineBlock, outcome: PieceParse) -> bool:
    """Whether the lines read are past the chunk of the first bad line."""
    assert outcome.error is not None
    last = block.first + block.num_lines - 1
    return (
        error_key(piece.shard, last, True)[:2] > outcome.error[0][:2] or last >= piece.first + piece.count - 1
    )


def _parse_block(
    path: Path, piece: Piece, block: LineBlock, eval_every: int | None, bad_lines: str, max_line_bytes: int,
    outcome: PieceParse,
) -> Iterator[tuple[Piece, str, Parsed]]:  # fmt: skip
    role = piece.shard.role
    held_out = block.numbers() % eval_every == 0 if role == "split" else None
    parsed = parse_fast(block.data, block.num_lines, max_line_bytes) if block.long_line is None else None
    if parsed is not None:
        if held_out is None:
            yield piece, role, parsed
        else:
            yield piece, "eval", select(parsed, held_out)
            yield piece, "train", select(parsed, ~held_out)
        return
    lines = block.lines(max_line_bytes)
    if len(lines) != block.num_lines:  # the lines counted by the indexing pass are no longer there
        raise DataError(f"{path}: changed since it was indexed (lines {block.first}..); preprocess it again")
    numbered = list(zip(block.numbers().tolist(), lines, strict=True))
    chunk = (block.numbers() - piece.shard.first) // CHUNK_LINES
    for c in np.unique(chunk):
        groups = (
            [(role, chunk == c)]
            if held_out is None
            else [("eval", (chunk == c) & held_out), ("train", (chunk == c) & ~held_out)]
        )
        for split, rows in groups:
            lines = [numbered[i] for i in np.flatnonzero(rows)]
            if not lines:
                continue
            parsed, bad = parse_lines(path, lines)
            _count_bad(piece, split == "eval", bad, bad_lines, outcome)
            yield piece, split, parsed


def _count_bad(piece: Piece, held_out: bool, bad: list[BadLine], bad_lines: str, outcome: PieceParse) -> None:
    if not bad:
        return
    if bad_lines == "skip":
        outcome.skipped[piece.shard.index].update(reason for _, reason, _ in bad)
        return
    number, _, message = min(bad)
    key = error_key(piece.shard, number, held_out and piece.shard.role == "split")
    if outcome.error is None or key < outcome.error[0]:
        outcome.error = (key, message + FAIL_HINT)
