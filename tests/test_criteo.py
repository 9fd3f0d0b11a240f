"""The raw Criteo TSV reader: real rows, dlrm preprocessing, bad-line policies, and the train/eval split."""

from __future__ import annotations

import gzip
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data.criteo import (
    CATEGORICAL_NAMES,
    CriteoTSVReader,
    CriteoTSVSource,
    parse_dense,
    parse_hex,
    splitmix64,
)
from neorec.errors import ConfigError, DataError

SAMPLE = Path(__file__).parents[2] / "shared" / "data" / "criteo_sample.tsv"
FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
needs_sample = pytest.mark.skipif(not SAMPLE.is_file(), reason=f"shared Criteo sample not found at {SAMPLE}")


def read_all(paths, batch_size=64, **kw):
    """(labels, dense, ids [B, 26]) of every line, concatenated over batches."""
    kw.setdefault("table_rows", 1 << 20)
    reader = CriteoTSVReader(paths, **kw)
    batches = list(reader.batches(batch_size))
    labels = torch.cat([b.labels for b in batches])
    dense = torch.cat([b.dense for b in batches])
    ids = torch.cat([b.sparse.values.view(len(CATEGORICAL_NAMES), -1).t() for b in batches])
    return labels, dense, ids, reader


def corrupt(src: Path, dst: Path, line: int, field: int, value: str) -> Path:
    """Copy src to dst with field `field` (0-based) of 1-based line `line` set to `value`."""
    lines = src.read_text().split("\n")
    fields = lines[line - 1].split("\t")
    fields[field] = value
    lines[line - 1] = "\t".join(fields)
    dst.write_text("\n".join(lines))
    return dst


@needs_sample
def test_reads_all_200_rows_and_49_clicks():
    labels, dense, ids, reader = read_all([SAMPLE], batch_size=64)
    assert labels.shape == (200,) and dense.shape == (200, 13) and ids.shape == (200, 26)
    assert int(labels.sum()) == 49
    assert labels.dtype == torch.float32 and dense.dtype == torch.float32
    assert reader.num_skipped == 0


def test_fixture_values_match_hand_computation():
    """Line 2 of the fixture, preprocessed by hand from its raw text."""
    raw = FIXTURE.read_text().split("\n")[1].split("\t")
    assert raw[2] == "-1"  # a negative dense value on this line: clamped to 0
    labels, dense, ids, _ = read_all([FIXTURE], batch_size=7, table_rows=1000)
    assert len(labels) == 20 and int(labels.sum()) == 3
    assert labels[1] == float(raw[0])
    for j in range(13):
        x = max(int(raw[1 + j]), 0) if raw[1 + j] else 0
        assert dense[1, j].item() == pytest.approx(math.log1p(x), rel=1e-6)
    for j in range(26):
        h = int(raw[14 + j], 16) if raw[14 + j] else 0
        assert ids[1, j].item() == h % 1000
    assert raw[39] == "" and ids[1, 25] == 0  # missing categorical reads as 0 -> id 0 under modulo


def test_gz_matches_plain(tmp_path):
    gz = tmp_path / "sample.tsv.gz"
    with gzip.open(gz, "wb") as f:
        f.write(FIXTURE.read_bytes())
    a = read_all([FIXTURE], batch_size=6)
    b = read_all([gz], batch_size=6)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)


def test_batches_span_files_and_keep_the_last_partial_one():
    reader = CriteoTSVReader([FIXTURE, FIXTURE], table_rows=100, chunk_lines=3)
    sizes = [len(b) for b in reader.batches(16)]
    assert sizes == [16, 16, 8]


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        (0, "2", "label '2' is not 0 or 1"),
        (0, "10", "label '10' is not 0 or 1"),  # wider than a label: not read as its first byte
        (0, "01", "label '01' is not 0 or 1"),
        (1, "+000000000000000000012", "dense feature I1 = '+000000000000000000012' is not an integer"),
        (1, "-1234567890123456789", "dense feature I1 = '-1234567890123456789' is not an integer"),
        (5, "12a", "dense feature I5 = '12a' is not an integer"),
        (3, "1.5", "dense feature I3 = '1.5'"),
        (20, "05db916g", "categorical feature C7 = '05db916g' is not a hex hash"),
        (14, "105db9164", "categorical feature C1 = '105db9164'"),
    ],
)
def test_bad_value_fails_with_file_and_line(tmp_path, field, value, expect):
    path = corrupt(FIXTURE, tmp_path / "bad.tsv", line=13, field=field, value=value)
    with pytest.raises(DataError, match=re.escape(f"{path}:13: ")) as err:
        read_all([path], batch_size=4, chunk_lines=5)
    assert expect in str(err.value)


def test_wrong_field_count_fails_with_file_and_line(tmp_path):
    lines = FIXTURE.read_text().split("\n")
    lines[6] = lines[6] + "\textra"  # line 7 gets 41 fields
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines))
    with pytest.raises(
        DataError, match=re.escape(f"{path}:7: expected 40 tab-separated fields") + ".* got 41"
    ):
        read_all([path])


def test_first_bad_line_is_reported(tmp_path):
    path = corrupt(FIXTURE, tmp_path / "a.tsv", line=9, field=0, value="x")
    path = corrupt(path, tmp_path / "b.tsv", line=4, field=20, value="zz")
    lines = path.read_text().split("\n")
    lines[11] = "only\ttwo"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=re.escape(f"{path}:4: ")):
        read_all([path], chunk_lines=100)


def test_skip_counts_bad_lines(tmp_path):
    path = corrupt(FIXTURE, tmp_path / "a.tsv", line=3, field=0, value="yes")
    path = corrupt(path, tmp_path / "b.tsv", line=8, field=2, value="abc")
    path = corrupt(path, tmp_path / "c.tsv", line=15, field=30, value="nothex!")
    path = corrupt(path, tmp_path / "d.tsv", line=16, field=30, value="ffff")  # short hex is fine
    lines = path.read_text().split("\n")
    lines[18] = lines[18].rsplit("\t", 2)[0]  # line 19: 38 fields
    path.write_text("\n".join(lines) + "\n\n")  # blank lines at EOF are not errors
    labels, _, ids, reader = read_all([path], batch_size=5, bad_lines="skip", chunk_lines=4)
    assert len(labels) == 16
    assert reader.num_skipped == 4
    assert reader.skipped == {"label": 1, "dense": 1, "categorical": 1, "field_count": 1}
    kept = [n for n in range(1, 21) if n not in (3, 8, 15, 19)]
    assert ids[kept.index(16), 16].item() == 0xFFFF  # C17 of line 16


def test_blank_line_inside_the_file_is_an_error(tmp_path):
    lines = FIXTURE.read_text().split("\n")
    path = tmp_path / "blank.tsv"
    path.write_text("\n".join(lines[:5] + [""] + lines[5:]))
    with pytest.raises(DataError, match=re.escape(f"{path}:6: expected 40")):
        read_all([path])


@pytest.mark.parametrize("hashing", ["modulo", "hash"])
def test_ids_stay_in_range(hashing):
    rows = [7, 1, 2, 1000, 3] + [13] * 21
    labels, _, ids, _ = read_all([FIXTURE], table_rows=rows, hashing=hashing)
    assert (ids >= 0).all() and (ids < torch.tensor(rows)).all()
    assert (ids[:, 1] == 0).all()  # a table of one row


def test_hash_is_fixed_and_differs_from_modulo():
    x = np.array([0, 1, 0x05DB9164], dtype=np.uint64)
    # The first output of the SplitMix64 generator seeded with 0 (Vigna's reference implementation).
    assert int(splitmix64(x)[0]) == 0xE220A8397B1DCDAF
    assert len(set(splitmix64(x).tolist())) == 3
    a = read_all([FIXTURE], table_rows=97, hashing="modulo")[2]
    b = read_all([FIXTURE], table_rows=97, hashing="hash")[2]
    assert not torch.equal(a, b)


def test_parse_helpers():
    values, ok = parse_hex(np.array([b"05db9164", b"ABC", b"", b"123456789", b"g"]))
    assert values.tolist()[:3] == [0x05DB9164, 0xABC, 0] and ok.tolist() == [True, True, True, False, False]
    values, ok = parse_dense(np.array([b"12", b"-3", b"", b"1e3", b"-", b"0"]))
    assert values.tolist()[:3] == [12, -3, 0] and ok.tolist() == [True, True, True, False, False, True]


def test_source_split_is_disjoint_and_covers_every_line():
    src = CriteoTSVSource([FIXTURE], table_rows=1 << 30, eval_every=4)
    assert src.info.num_dense == 13 and src.info.feature_names == CATEGORICAL_NAMES
    all_ids = read_all([FIXTURE], table_rows=1 << 30)[2]
    train = torch.cat([b.sparse.values.view(26, -1).t() for b in src.train_batches(3, epoch=1)])
    held = torch.cat([b.sparse.values.view(26, -1).t() for b in src.eval_batches(3)])
    assert len(train) == 15 and len(held) == 5
    assert torch.equal(held, all_ids[3::4])  # lines 4, 8, 12, 16, 20
    keep = [i for i in range(20) if (i + 1) % 4 != 0]
    assert torch.equal(train, all_ids[keep])


def test_source_with_eval_paths_and_skip_counts(tmp_path):
    bad = corrupt(FIXTURE, tmp_path / "eval.tsv", line=2, field=1, value="?")
    src = CriteoTSVSource(FIXTURE, bad, table_rows=100, bad_lines="skip")
    assert sum(len(b) for b in src.train_batches(8)) == 20
    assert sum(len(b) for b in src.eval_batches(8)) == 19
    assert src.skipped["eval"] == {"dense": 1} and src.num_skipped == 1
    for b in src.eval_batches(8):
        b.sparse.validate({f.name: f.num_ids for f in src.info.features})


@needs_sample
def test_source_on_the_sample_holds_out_every_10th_line():
    src = CriteoTSVSource([SAMPLE], table_rows=[1000] * 26)
    assert sum(len(b) for b in src.train_batches(50)) == 180
    assert sum(len(b) for b in src.eval_batches(50)) == 20


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="26"):
        CriteoTSVSource(FIXTURE, table_rows=[10, 10])
    with pytest.raises(ConfigError, match="hashing"):
        CriteoTSVSource(FIXTURE, table_rows=10, hashing="md5")
    with pytest.raises(ConfigError, match="bad_lines"):
        CriteoTSVSource(FIXTURE, table_rows=10, bad_lines="ignore")
    with pytest.raises(DataError, match="no such file"):
        CriteoTSVSource(tmp_path / "missing.tsv", table_rows=10)
