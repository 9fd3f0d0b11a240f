"""The indexing pass of Criteo TSV preprocessing (neorec/data/tsv_index.py): scans of byte ranges added
up equal one scan of the file, and both equal the lines counted one by one, whatever the block size."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from neorec.data.tsv_blocks import line_blocks
from neorec.data.tsv_index import combine_scans, index_file, scan_range
from neorec.errors import DataError

TEXTS = [
    b"",
    b"a\tb\n",
    b"a\tb",
    b"1\t2\n\n3\t4\n5\n6\t\t\n\n \t\n",
    b"l1\nl2\r\nl3\t\t\t\t\t\t\n\t\n\n",
    b"x" * 23 + b"\n" + b"y\t" * 9 + b"\t\t\t\t\n \n",
    b"\n\n\nonly\tthe\tfourth\n",
]


def expected(text: bytes, shard_lines: int) -> tuple[int, list[int], int]:
    """(lines up to the last non-blank one, offsets of lines 1, 1 + shard_lines, ..., where the last
    non-blank line ends, its newline included), counted line by line."""
    filled = text.rstrip()
    num_lines = filled.count(b"\n") + 1 if filled else 0
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == ord("\n")]
    newline = text.find(b"\n", len(filled))
    end = (newline + 1 if newline >= 0 else len(text)) if filled else 0
    return num_lines, [starts[k] for k in range(0, num_lines, shard_lines)], end


@pytest.mark.parametrize("text", TEXTS)
def test_scans_of_ranges_equal_the_lines_counted_one_by_one(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "day.tsv"
    path.write_bytes(text)
    (tmp_path / "day.tsv.gz").write_bytes(gzip.compress(text))
    for block_bytes in (1, 2, 3, 5, 8, 64):
        for shard_lines in (1, 2, 3, 100):
            whole = index_file(path, shard_lines, block_bytes)
            assert (whole.num_lines, whole.shard_offsets, whole.end) == expected(text, shard_lines)
            line_starts = [0] + [i + 1 for i, c in enumerate(text) if c == ord("\n")]
            for line, offset in whole.piece_starts:
                assert line_starts[line - 1] == offset and line <= whole.num_lines
            num_blocks = -(-len(text) // block_bytes)
            for cut in range(1, num_blocks):  # two ranges, as two workers scan them
                scans = scan_range(path, 0, cut * block_bytes, block_bytes)
                scans += scan_range(path, cut * block_bytes, None, block_bytes)
                assert combine_scans(path, shard_lines, scans) == whole
            gz = index_file(tmp_path / "day.tsv.gz", shard_lines, block_bytes)
            assert (gz.num_lines, gz.shard_offsets, gz.piece_starts, gz.end) == (
                whole.num_lines, whole.shard_offsets, [], -1,
            )  # fmt: skip


def test_a_piece_counted_by_the_index_is_one_block_and_a_changed_file_is_an_error(tmp_path: Path) -> None:
    text = b"".join(b"%d\tx\n" % i for i in range(40))
    blocks = list(
        line_blocks(io.BytesIO(text), 100, first=1, num_lines=40, num_bytes=len(text), block_bytes=160)
    )
    assert [(b.first, b.num_lines, b.data) for b in blocks] == [(1, 40, text)]  # over the block by < 1/4
    from neorec.data.manifest import ShardPlan
    from neorec.data.tsv_pieces import Piece, PieceParse, parse_pieces

    path = tmp_path / "day.tsv"
    path.write_bytes(text)
    shard = ShardPlan(0, str(path), "split", 1, 41, 0)  # one line more than the file holds
    with pytest.raises(DataError, match="changed since it was indexed"):
        list(parse_pieces([Piece(shard, 1, 41, 0, len(text))], 10, "skip", 1000, PieceParse()))
