"""The block parser (pyarrow, tsv_blocks.parse_fast) against the line parser (criteo_lines.parse_lines)
on random blocks of Criteo lines, valid and not: wherever the block parser takes a block, it gives the
line parser's values bit for bit, and it takes no block in which the line parser finds a bad line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neorec.data.criteo_lines import DEFAULT_MAX_LINE_BYTES, NUM_CATEGORICAL, NUM_DENSE, parse_lines
from neorec.data.tsv_blocks import parse_fast

# odd values: some valid for the line parser alone, most valid for neither
ODD_LABELS = ["", "2", "-0", " 1", "01", "1\r", "١"]
ODD_DENSE = ["9999999999999999999", "+5", "-", "--1", "1-", "1e3", " 7", "7 ", "٣", "0x10", "1.5", "-999999999999999999"]
ODD_HEX = ["abc", "deadbeef0", "ghijklmn", "0000000g", " 1234567", "1234567 ", "12345678\r", "é2345678", "-1234567"]

dense = st.one_of(
    st.just(""), st.integers(0, 2**16).map(str), st.integers(-(10**17) + 1, 10**18 - 1).map(str), st.just("00012")
)
hexes = st.one_of(
    st.just(""),
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:08X}"),
)


@st.composite
def lines(draw) -> bytes:
    """A line of 40 valid fields; one in four with an odd value in one field, one in thirty with a field
    too many or too few."""
    fields = [draw(st.sampled_from(["0", "1"])), *(draw(dense) for _ in range(NUM_DENSE))]
    fields += [draw(hexes) for _ in range(NUM_CATEGORICAL)]
    if draw(st.integers(0, 3)) == 0:
        k = draw(st.integers(0, len(fields) - 1))
        odd = ODD_LABELS if k == 0 else ODD_DENSE if k <= NUM_DENSE else ODD_HEX
        fields[k] = draw(st.sampled_from(odd))
    if draw(st.integers(0, 29)) == 0:
        fields = fields[:-1] if draw(st.booleans()) else [*fields, "0"]
    return "\t".join(fields).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(st.lists(lines(), min_size=1, max_size=6), st.sampled_from([b"\n", b"\r\n"]))
def test_block_parser_agrees_with_the_line_parser(block_lines, newline):
    data = newline.join(block_lines) + newline
    fast = parse_fast(data, len(block_lines), DEFAULT_MAX_LINE_BYTES)
    chunk = [(i + 1, line + newline[:-1]) for i, line in enumerate(block_lines)]  # as read_lines gives them
    (labels_, dense_, raw), bad = parse_lines(Path("fuzz.tsv"), chunk)
    if fast is None:
        return
    assert not bad, bad[0]
    fast_labels, fast_dense, fast_raw = fast
    np.testing.assert_array_equal(fast_labels, labels_)
    np.testing.assert_array_equal(fast_dense.view(np.uint32), dense_.view(np.uint32))  # bit for bit
    np.testing.assert_array_equal(fast_raw, raw)


def test_the_block_parser_takes_plain_valid_blocks():
    """Not a vacuous comparison: valid lines of the common forms go through the block parser."""
    line = "\t".join(["1", *["123"] * NUM_DENSE, *["deadbeef"] * NUM_CATEGORICAL]).encode()
    assert parse_fast(line + b"\n" + line + b"\n", 2, DEFAULT_MAX_LINE_BYTES) is not None
