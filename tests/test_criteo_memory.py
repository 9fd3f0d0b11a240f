"""The Criteo TSV readers' memory is bounded by the block, not by the input's longest line or field.

Lines and fields of 1 KiB, 64 KiB and 1 MiB (and a 1 MiB line with no newline at all) are read under
both bad-line policies by the training reader and by preprocessing: the error names path:line, or the
line is skipped and counted, and the peak of memory (tracemalloc, which numpy and pyarrow's buffers
here are reported to) stays near that of a clean file. The readers parse blocks of whole lines
(neorec/data/tsv_blocks.py, 8 MiB); these tests read blocks of 256 KiB, so that the longer lines do
not fit a block and are read past, as an 8 MiB one would be. Valid files parse exactly as a
line-by-line reference of the dlrm rules does.
"""

from __future__ import annotations

import functools
import gzip
import io
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.cli import build_parser, main
from neorec.config.load import load_config
from neorec.config.schema import CriteoConfig
from neorec.data import criteo_lines, tsv_blocks
from neorec.data.criteo import (
    CATEGORICAL_NAMES,
    DEFAULT_MAX_LINE_BYTES,
    CriteoTSVReader,
    CriteoTSVSource,
    LongLine,
    read_lines,
    splitmix64,
)
from neorec.data.preprocess import load_manifest, preprocess_criteo
from neorec.errors import ConfigError, DataError

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
SAMPLE = Path(__file__).parents[2] / "shared" / "data" / "criteo_sample.tsv"
KiB, MiB = 1 << 10, 1 << 20
SIZES = {"1KiB": KiB, "64KiB": 64 * KiB, "1MiB": MiB}
NUM_LINES, BAD_LINE = 200, 101
# A reader's peak stays within a few of its read blocks (gzip's included) of a clean file's, whatever
# the longest line (it grew by about 40 x the longest field before the cells got a fixed width).
READER_SLACK = 1 * MiB
# Preprocessing first indexes the file in blocks of up to 16 MiB (neorec/data/preprocess.py), so its
# peak also follows the file's size up to that block: 1 MiB more file, up to twice that more memory.
PREPROCESS_SLACK = 4 * MiB
PEAK_LIMIT = 48 * MiB
TEST_BLOCK = 256 * KiB


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(tsv_blocks, "BLOCK_BYTES", TEST_BLOCK)


def valid_lines(n: int, seed: int = 0) -> list[bytes]:
    """Valid Criteo lines with the edge cases of the format: empty fields, negative, signed and 18-digit
    dense values, hex hashes of 1 to 8 digits in either case. A new list each call (callers change
    theirs); the lines of each (n, seed) are drawn once."""
    return list(_valid_lines(n, seed))


@functools.cache
def _valid_lines(n: int, seed: int) -> tuple[bytes, ...]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        fields = [str(rng.integers(0, 2))]
        for _ in range(13):
            r = rng.random()
            if r < 0.15:
                fields.append("")
            elif r < 0.2:
                fields.append(rng.choice(["-1", "-0", "+7", "0", "9" * 18, "-" + "9" * 18, "+" + "1" * 18]))
            else:
                fields.append(str(int(rng.integers(-2, 10 ** int(rng.integers(1, 10))))))
        for _ in range(26):
            r = rng.random()
            digits = f"{int(rng.integers(0, 1 << 32)):08x}"[: int(rng.integers(1, 9)) if r < 0.2 else 8]
            fields.append("" if r < 0.1 else digits.upper() if r > 0.95 else digits)
        lines.append("\t".join(fields).encode())
    return tuple(lines)


def reference(lines: list[bytes], rows: int, hashing: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, dense, ids) of valid lines, one line and one field at a time: the dlrm rules as
    neorec/data/criteo.py states them."""
    fields = [line.rstrip(b"\r").split(b"\t") for line in lines]
    labels = np.array([float(f[0]) for f in fields], np.float32)
    raw_dense = np.array([[max(int(x), 0) if x else 0 for x in f[1:14]] for f in fields], np.float64)
    dense = np.log1p(raw_dense).astype(np.float32)
    raw_ids = np.array([[int(x, 16) if x else 0 for x in f[14:]] for f in fields], np.uint64)
    ids = (raw_ids if hashing == "modulo" else splitmix64(raw_ids)) % np.uint64(rows)
    return labels, dense, ids.astype(np.int64)


def write(path: Path, lines: list[bytes], end: bytes = b"\n") -> Path:
    data = b"\n".join(lines) + end
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def read_arrays(reader: CriteoTSVReader, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    batches = list(reader.batches(batch_size))
    if not batches:
        return np.zeros(0, np.float32), np.zeros((0, 13), np.float32), np.zeros((0, 26), np.int64)
    labels, dense = torch.cat([b.labels for b in batches]), torch.cat([b.dense for b in batches])
    ids = torch.cat([b.sparse.values.view(len(CATEGORICAL_NAMES), -1).t() for b in batches])
    return labels.numpy(), dense.numpy(), ids.numpy()


def peak_memory(fn):
    """(fn's result or the exception it raised, peak bytes allocated while it ran)."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except DataError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---- valid files read as before ----------------------------------------------------------------------
@pytest.mark.parametrize("hashing", ["modulo", "hash"])
@pytest.mark.parametrize("chunk_lines", [1, 7, 16384])
def test_valid_files_parse_as_the_reference(tmp_path, hashing, chunk_lines):
    files = {"fixture": FIXTURE.read_bytes().splitlines()}
    if SAMPLE.is_file():
        files["sample"] = SAMPLE.read_bytes().splitlines()
    if chunk_lines > 1:  # one line per chunk: the small files are enough
        files["generated"] = valid_lines(3000)
    for name, lines in files.items():
        want = reference(lines, 999_983, hashing)
        for suffix, eol in ((".tsv", b"\n"), (".tsv.gz", b"\n"), (".crlf.tsv", b"\r\n")):
            path = tmp_path / f"{name}{suffix}"
            if eol == b"\r\n":
                path.write_bytes(b"\r\n".join(lines) + b"\r\n")
            else:
                write(path, lines)
            reader = CriteoTSVReader([path], 999_983, hashing, chunk_lines=chunk_lines)
            got = read_arrays(reader, batch_size=50)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and np.array_equal(g, w), (name, suffix)
            assert reader.num_skipped == 0


def test_preprocessing_a_generated_file_equals_the_reader(tmp_path):
    path = write(tmp_path / "gen.tsv", valid_lines(3000, seed=1))
    out = tmp_path / "out"
    result = preprocess_criteo([path], out, eval_every=7, table_rows=1000, shard_lines=1000, progress=False)
    assert result.num_samples == {"train": 2572, "eval": 428}
    source = CriteoTSVSource(path, table_rows=1000, eval_every=7)
    train = read_arrays(CriteoTSVReader([path], 1000, keep_line=lambda n: n % 7 != 0))
    manifest = load_manifest(out)
    parts = []
    for entry in manifest["shards"]:
        folder = out / "shards" / f"{entry['index']:05d}" / "train"
        ids = np.stack([np.load(folder / f"ids_{n}.npy") for n in CATEGORICAL_NAMES], 1)
        parts.append((np.load(folder / "labels.npy"), np.load(folder / "dense.npy"), ids))
    for got, want in zip((np.concatenate(p) for p in zip(*parts, strict=True)), train, strict=True):
        np.testing.assert_array_equal(got, want)
    assert sum(len(b) for b in source.train_batches(100)) == 2572
    assert manifest["settings"]["max_line_bytes"] == DEFAULT_MAX_LINE_BYTES


# ---- long lines and fields ---------------------------------------------------------------------------
def long_line(kind: str, size: int) -> bytes:
    """A line holding a field of `size` bytes (kind dense or categorical), or a line of `size` bytes
    of many short fields (kind line)."""
    if kind == "line":
        return (b"0\t" * (size // 2))[:size]
    fields = valid_lines(1, seed=size)[0].split(b"\t")
    fields[5 if kind == "dense" else 20] = (b"1" if kind == "dense" else b"a") * size
    return b"\t".join(fields)


def expected_reason(kind: str, size: int) -> str:
    if size > DEFAULT_MAX_LINE_BYTES:
        return "line_length"
    return {"dense": "dense", "categorical": "categorical", "line": "field_count"}[kind]


def file_with(tmp_path: Path, kind: str, size: int, suffix: str = ".tsv") -> Path:
    lines = valid_lines(NUM_LINES, seed=3)
    lines[BAD_LINE - 1] = long_line(kind, size)
    return write(tmp_path / f"{kind}-{size}{suffix}", lines)


@pytest.fixture(scope="module")
def clean_peaks(tmp_path_factory) -> dict[str, int]:
    """Peak memory of reading and of preprocessing a clean file of as many lines."""
    path = write(tmp_path_factory.mktemp("clean") / "clean.tsv", valid_lines(NUM_LINES, seed=3))
    read = peak_memory(lambda: read_arrays(CriteoTSVReader([path], 1000)))[1]
    out = path.parent / "out"
    pre = peak_memory(lambda: preprocess_criteo([path], out, shard_lines=64, progress=False))[1]
    return {"reader": read, "preprocess": pre}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("kind", ["dense", "categorical", "line"])
@pytest.mark.parametrize("bad_lines", ["fail", "skip"])
def test_training_reader_bounds_memory(tmp_path, clean_peaks, kind, size, bad_lines):
    path = file_with(tmp_path, kind, size, ".tsv.gz" if kind == "line" else ".tsv")
    source = CriteoTSVSource(path, table_rows=1000, bad_lines=bad_lines, eval_every=1000)
    got, peak = peak_memory(lambda: read_arrays(CriteoTSVReader([path], 1000, bad_lines=bad_lines)))
    assert peak < clean_peaks["reader"] + READER_SLACK and peak < PEAK_LIMIT, (peak, clean_peaks)
    reason = expected_reason(kind, size)
    if bad_lines == "fail":
        assert isinstance(got, DataError)
        message = str(got)
        assert message.startswith(f"{path}:{BAD_LINE}: ") and len(message) < 400, message
        if reason == "line_length":
            assert f"line of {len(long_line(kind, size))} bytes" in message
            assert f"max_line_bytes={DEFAULT_MAX_LINE_BYTES}" in message
        elif reason != "field_count":
            assert f"... ({size} bytes)" in message  # a short prefix, never the whole value
        with pytest.raises(DataError, match=re.escape(f"{path}:{BAD_LINE}: ")):
            list(source.train_batches(64))
    else:
        assert len(got[0]) == NUM_LINES - 1
        assert sum(len(b) for b in source.train_batches(64)) == NUM_LINES - 1
        assert source.skipped["train"] == {reason: 1}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("kind", ["dense", "line"])
@pytest.mark.parametrize("bad_lines", ["fail", "skip"])
def test_preprocessing_bounds_memory(tmp_path, clean_peaks, kind, size, bad_lines):
    path = file_with(tmp_path, kind, size)
    out = tmp_path / "out"
    run = lambda: preprocess_criteo([path], out, bad_lines=bad_lines, shard_lines=64, progress=False)  # noqa: E731
    got, peak = peak_memory(run)
    assert peak < clean_peaks["preprocess"] + PREPROCESS_SLACK and peak < PEAK_LIMIT, (peak, clean_peaks)
    if bad_lines == "fail":
        assert isinstance(got, DataError) and str(got).startswith(f"{path}:{BAD_LINE}: "), got
        assert len(str(got)) < 400
    else:
        assert got.skipped == {expected_reason(kind, size): 1}
        assert sum(got.num_samples.values()) == NUM_LINES - 1
        assert [sum(s["skipped"].values()) for s in load_manifest(out)["shards"]] == [0, 1, 0, 0]


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
@pytest.mark.parametrize("bad_lines", ["fail", "skip"])
def test_one_mib_line_without_any_newline(tmp_path, clean_peaks, suffix, bad_lines):
    alone = write(tmp_path / f"alone{suffix}", [b"1\t2\t" * (MiB // 4)], end=b"")
    after = write(tmp_path / f"after{suffix}", [*valid_lines(NUM_LINES - 1, seed=3), b"x" * MiB], end=b"")
    for path, num_valid in ((alone, 0), (after, NUM_LINES - 1)):
        reader = CriteoTSVReader([path], 1000, bad_lines=bad_lines)
        got, peak = peak_memory(lambda reader=reader: read_arrays(reader))
        assert peak < clean_peaks["reader"] + READER_SLACK, (peak, clean_peaks)
        line = 1 if path is alone else NUM_LINES
        if bad_lines == "fail":
            assert isinstance(got, DataError) and str(got).startswith(f"{path}:{line}: line of {MiB} bytes")
        else:
            assert len(got[0]) == num_valid and reader.skipped == {"line_length": 1}
    out = tmp_path / "out"
    got, peak = peak_memory(lambda: preprocess_criteo([alone], out, bad_lines=bad_lines, progress=False))
    assert peak < clean_peaks["preprocess"] + PREPROCESS_SLACK, (peak, clean_peaks)
    want = f"{alone}:1: line of {MiB} bytes"
    if bad_lines == "skip":
        want = "no training samples: every line was skipped as malformed (line_length 1)"
    assert isinstance(got, DataError) and want in str(got)


# ---- the pieces: lines read with a limit, cells cut to a fixed width ---------------------------------
@pytest.mark.parametrize("block", [1, 3, 8, 1 << 18])
def test_read_lines_splits_as_python_and_stands_in_for_long_lines(monkeypatch, block):
    monkeypatch.setattr(criteo_lines, "_READ_BYTES", block)
    rng = np.random.default_rng(block)
    for _ in range(50):
        data = bytes(rng.choice(np.frombuffer(b"ab\t \r\n\n", np.uint8), int(rng.integers(0, 80))))
        limit = int(rng.integers(1, 12))
        want = [line.removesuffix(b"\n") for line in io.BytesIO(data)]
        got = list(read_lines(io.BytesIO(data), limit))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            if len(w) <= limit:
                assert g == w and not isinstance(g, LongLine)
            else:
                assert isinstance(g, LongLine) and g == b"" and g.length == len(w) and g.head == w[:40]
                assert g.blank == (not w.strip())


def test_blank_long_lines_at_the_end_are_ignored_like_short_ones(tmp_path):
    path = write(tmp_path / "blank.tsv", [*valid_lines(5), b" " * 10_000, b"\t" * 5000, b""])
    assert len(read_arrays(CriteoTSVReader([path], 10))[0]) == 5
    path = write(tmp_path / "inside.tsv", [*valid_lines(5), b" " * 10_000, *valid_lines(2)])
    with pytest.raises(DataError, match=re.escape(f"{path}:6: line of 10000 bytes")):
        read_arrays(CriteoTSVReader([path], 10))


@pytest.mark.parametrize(
    ("field", "value", "reason", "quoted"),
    [
        (0, b"0" * 2, "label", "label '00' is not 0 or 1"),  # cut to the label's 1 byte, it would read 0
        (0, b"1" + b"\0" * 3, None, None),  # numpy's bytes type drops trailing NUL bytes, whatever the width
        (0, b"1" + b"\0" * 3 + b"1", "label", "label '1\\x00\\x00\\x001'"),
        (3, b"9" * 19, "dense", "I3 = '9999999999999999999'"),  # fits the width, but 19 digits
        (3, b"-" + b"9" * 19, "dense", "I3 = '-9999999999999999999'"),  # cut to 19 bytes, it would be valid
        (3, b"5" + b"\0" * 30, None, None),
        (3, b"5" + b"\0" * 30 + b"5", "dense", "I3 = '5\\x00"),
        (20, b"a" * 9, "categorical", "C7 = 'aaaaaaaaa'"),
        (20, b"abcdef01" + b"0" * 50, "categorical", f"C7 = 'abcdef01{'0' * 32}'... (58 bytes) is not"),
        (20, b"ab" + b"\0" * 10, None, None),
    ],
)
def test_cells_cut_to_their_width_stay_invalid(tmp_path, field, value, reason, quoted):
    lines = valid_lines(20, seed=4)
    fields = lines[12].split(b"\t")
    fields[field] = value
    lines[12] = b"\t".join(fields)
    path = write(tmp_path / "cut.tsv", lines)
    reader = CriteoTSVReader([path], 1000, bad_lines="skip", chunk_lines=8)
    assert len(read_arrays(reader)[0]) == (20 if reason is None else 19)
    assert reader.skipped == ({} if reason is None else {reason: 1})
    if reason is not None:
        with pytest.raises(DataError, match=re.escape(f"{path}:13: ")) as err:
            read_arrays(CriteoTSVReader([path], 1000))
        assert quoted in str(err.value)


# ---- settings: reader argument, config key, preprocess flag -----------------------------------------
def test_max_line_bytes_is_a_reader_argument_config_key_and_cli_flag(tmp_path, capsys):
    lines = valid_lines(50)
    widest = b"\t".join([b"1", *[b"-" + b"9" * 18] * 13, *[b"abcdef01"] * 26])  # valid, 495 bytes
    lines[8] = widest
    limit = len(widest) - 1  # line 9 is one byte over; the others fit
    assert max(len(line) for line in lines[:8] + lines[9:]) <= limit
    path = write(tmp_path / "x.tsv", lines)
    reader = CriteoTSVReader([path], 100, bad_lines="skip", max_line_bytes=limit)
    assert len(read_arrays(reader)[0]) == 49 and reader.skipped == {"line_length": 1}
    assert len(read_arrays(CriteoTSVReader([path], 100, max_line_bytes=limit + 1))[0]) == 50
    with pytest.raises(ConfigError, match="max_line_bytes must be >= 1"):
        CriteoTSVReader([path], 100, max_line_bytes=0)

    assert CriteoConfig.model_fields["max_line_bytes"].default == DEFAULT_MAX_LINE_BYTES
    sets = ["data.source=criteo_tsv", f"data.criteo={{train_paths: [{path}]}}", "data.criteo.bad_lines=skip"]
    with pytest.raises(ConfigError, match="data.criteo.max_line_bytes"):
        load_config("default", [*sets, "data.criteo.max_line_bytes=0"])
    from neorec.train.build import build_source

    source = build_source(load_config("default", [*sets, f"data.criteo.max_line_bytes={limit}"]))
    assert sum(len(b) for b in source.train_batches(8)) == 44  # 45 training lines, line 9 skipped
    assert source.skipped["train"] == {"line_length": 1}

    args = ["data", "preprocess", str(path), "--out", str(tmp_path / "o"), "--no-progress", "--bad-lines", "skip"]  # fmt: skip
    assert main([*args, "--max-line-bytes", str(limit)]) == 0
    assert "bad lines skipped: line_length 1" in capsys.readouterr().out
    assert load_manifest(tmp_path / "o")["settings"]["max_line_bytes"] == limit
    assert build_parser().parse_args(args).max_line_bytes == DEFAULT_MAX_LINE_BYTES
    with pytest.raises(SystemExit):
        main([*args, "--max-line-bytes", "0"])
    assert "--max-line-bytes" in capsys.readouterr().err
