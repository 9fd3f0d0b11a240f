"""Rerunning `neorec data preprocess` on a folder it wrote: every shard written before is checked against
the sizes and crc32s recorded of its files, and a missing or damaged one is written again (byte-identical
to the first time), with a warning naming the file; for Criteo TSV and Parquet input, after a finished
run and after an interrupted one. And a folder of the format before checksums, read as it is."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_parquet import FIXTURE, criteo_config, tsv_to_parquet
from test_preprocess import tree_digest

from neorec.cli import main
from neorec.data.manifest import load_manifest
from neorec.data.preprocess import preprocess_criteo
from neorec.data.preprocess_parquet import preprocess_parquet
from neorec.data.sharded_reader import PreprocessedSource
from neorec.errors import DataError

CRITEO = {"table_rows": 1000, "shard_lines": 5, "progress": False}  # 20 lines: 4 shards


def flip_last_byte(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))


def damage(out: Path) -> None:
    """Shard 2 removed, shard 1's labels cut short, a value of shard 3's ids changed (same size)."""
    shutil.rmtree(out / "shards" / "00002")
    labels = out / "shards" / "00001" / "train" / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-10])
    flip_last_byte(out / "shards" / "00003" / "train" / "ids_C7.npy")


def test_rerun_of_a_finished_folder_writes_missing_and_damaged_shards_again(tmp_path, neorec_warnings):
    out = tmp_path / "out"
    assert preprocess_criteo([FIXTURE], out, **CRITEO).written == 4
    want = tree_digest(out)
    damage(out)
    again = preprocess_criteo([FIXTURE], out, **CRITEO)
    assert (again.written, again.complete, again.num_samples) == (3, True, {"train": 18, "eval": 2})
    assert tree_digest(out) == want
    text = neorec_warnings.text
    assert re.search(r"shard 00001 is written again: \S*00001/train/labels\.npy: has \d+ bytes but", text)
    assert re.search(r"shard 00002 is written again: \S*00002: missing", text)
    assert re.search(r"shard 00003 is written again: \S*00003/train/ids_C7\.npy: checksum mismatch", text)
    assert "writing again 3 shard(s) found missing or damaged" in text
    neorec_warnings.clear()
    assert preprocess_criteo([FIXTURE], out, **CRITEO).written == 0 and not neorec_warnings.text


def test_rerun_of_an_interrupted_folder_checks_the_shards_it_has(tmp_path, neorec_warnings):
    out = tmp_path / "out"
    preprocess_criteo([FIXTURE], tmp_path / "full", **CRITEO)
    assert not preprocess_criteo([FIXTURE], out, max_shards=2, **CRITEO).complete
    flip_last_byte(out / "shards" / "00000" / "train" / "dense.npy")
    meta = out / "shards" / "00001" / "meta.json"  # its file checksums, without a checksum of its own
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "crc32"}))
    again = preprocess_criteo([FIXTURE], out, **CRITEO)
    assert (again.written, again.complete) == (4, True)
    assert tree_digest(out) == tree_digest(tmp_path / "full")
    text = neorec_warnings.text
    assert re.search(r"shard 00000 is written again: \S*00000/train/dense\.npy: checksum mismatch", text)
    assert re.search(r"shard 00001 is written again: .*00001/meta\.json has no checksum", text)


def test_cli_rerun_says_how_many_shards_it_wrote_again(tmp_path, capsys):
    args = ["data", "preprocess", str(FIXTURE), "--out", str(tmp_path / "o"), "--shard-lines", "5",
            "--table-rows", "1000", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    damage(tmp_path / "o")
    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "4 shards (3 written now)" in out
    assert "neorec: warning: " in err and "writing again 3 shard(s) found missing or damaged" in err


def test_parquet_rerun_writes_damaged_shards_again(tmp_path, neorec_warnings):
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 3)
    cfg = criteo_config([path])
    out = tmp_path / "out"
    assert preprocess_parquet(cfg, out, shard_rows=7, progress=False).written == 3
    want = tree_digest(out)
    (out / "shards" / "00001" / "train" / "ids_C2.npy").unlink()
    again = preprocess_parquet(cfg, out, shard_rows=7, progress=False)
    assert (again.written, again.complete) == (1, True) and tree_digest(out) == want
    why = r"shard 00001 is written again: \S*00001/train/ids_C2\.npy: cannot read"
    assert re.search(why, neorec_warnings.text)


def pre_checksum(out: Path) -> None:
    """The folder as written before checksums were recorded: no crc32 in the manifest, no file records."""
    manifest = load_manifest(out)
    for entry in manifest["shards"]:
        entry.pop("files")
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_big_endian_ids_are_refused_naming_the_file_and_dtype(tmp_path):
    """A folder without file checksums whose ids column was saved big-endian: the ids are not read as
    the bytes of this machine's integers (482 would be 3,791,716,352), nor passed on."""
    out = tmp_path / "out"
    preprocess_criteo([FIXTURE], out, **CRITEO)
    pre_checksum(out)
    source = PreprocessedSource(out, shuffle=False)
    assert sum(len(b) for b in source.train_batches(4)) == 18  # the old format reads
    ids = out / "shards" / "00000" / "train" / "ids_C3.npy"
    np.save(ids, np.load(ids).astype(">i4"))
    error = r"00000/train/ids_C3\.npy: ids of feature C3 have dtype >i4 \(big-endian\); the reader takes"
    with pytest.raises(DataError, match=error + r" integers in this machine's byte order \(<i4\)"):
        list(PreprocessedSource(out, shuffle=False).train_batches(4))
