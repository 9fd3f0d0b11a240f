"""Damaged preprocessed folders: the manifest, a shard's meta.json and its .npy columns, flipped and
truncated, then `neorec data inspect` and training on the folder stop with one `neorec: error:` line
naming the file (exit 2, no traceback). Feature names, which become file names, must be plain names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_files_writer import assert_one_error, damaged, flipped, json_damage, run_cli

from neorec.config.load import load_config
from neorec.data.manifest import complete_manifest, load_manifest, shard_name, start_manifest
from neorec.data.preprocess import preprocess_synthetic
from neorec.data.sharded_reader import PreprocessedSource
from neorec.data.synthetic import spec_from_config
from neorec.errors import DataError
from neorec.utils.files import json_text

DATA = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.multi_hot=[1, 3, 1, 2]", "data.synthetic.weighted=true",
    "data.synthetic.train_samples=1024", "data.synthetic.eval_samples=256",
]  # fmt: skip
SETS = [x for kv in DATA for x in ("--set", kv)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults-data") / "pre"
    from neorec.cli import main

    assert main(["data", "preprocess", "--synthetic", "--out", str(out), "--no-progress", *SETS]) == 0
    return out


def _readers(folder: Path, tmp_path: Path) -> list[list]:
    reads = ["--set", "data.source=preprocessed", "--set", f"data.preprocessed.path={folder}"]
    train = ["data.batch_size=128", "train.max_steps=2", "train.progress=false", "logging.plot=false",
             "logging.tensorboard=false"]  # fmt: skip
    return [  # the data's data.synthetic settings were the preprocessing's: these read the folder alone
        ["data", "inspect", *reads, "--batches", "1"],
        ["train", "--output-dir", tmp_path / "run", "--overwrite", *reads,
         *[x for kv in train for x in ("--set", kv)]],
    ]


def test_the_manifest_records_every_file_and_a_checksum_of_its_own(folder):
    manifest = load_manifest(folder)
    files = manifest["shards"][0]["files"]
    assert {"train/labels.npy", "train/dense.npy", "train/ids_C2.npy", "train/lengths_C2.npy",
            "train/weights_C2.npy"} <= set(files)  # fmt: skip
    assert files["train/labels.npy"][0] == (folder / "shards" / "00000" / "train" / "labels.npy").stat().st_size
    assert "crc32" in json.loads((folder / "manifest.json").read_text())
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp")]


def test_damaged_manifest_stops_inspect_and_training(folder, capsys, tmp_path):
    for what, change in json_damage().items():
        with damaged(folder / "manifest.json", change):
            for args in _readers(folder, tmp_path):
                assert_one_error(*run_cli(args, capsys), "manifest.json", damage=f"{what}, {args[0]}")


def test_manifest_without_its_checksum_but_with_file_checksums_is_refused(folder, capsys, tmp_path):
    """Only a folder written before checksums were recorded has a manifest without a "crc32", and it
    records no file checksums either: one that does was edited, its crc32 key removed with it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["crc32"]
    manifest["features"][2]["num_ids"] = 100_000

    def edited(_: bytes) -> bytes:
        return json.dumps(manifest).encode()

    with damaged(folder / "manifest.json", edited):
        for args in _readers(folder, tmp_path):
            line = assert_one_error(*run_cli(args, capsys), "manifest.json", damage=args[0])
            assert "has no checksum (key 'crc32') though it records its files' crc32s" in line, line
    for entry in manifest["shards"]:  # the format before checksums: read as it is
        del entry["files"]
    with damaged(folder / "manifest.json", edited):
        assert PreprocessedSource(folder).info.features[2].num_ids == 100_000


def _npy_damage() -> dict:
    return {
        "header": lambda d: flipped(d, 20, 0x01),  # inside the .npy header's dict (dtype, shape)
        "first value": lambda d: flipped(d, 128, 0x01),  # data starts after the 128-byte header
        "last value": lambda d: flipped(d, -1, 0x01),
        "truncated": lambda d: d[:-4],
        "empty": lambda d: b"",
    }


@pytest.mark.parametrize("name", ["labels.npy", "dense.npy", "ids_C2.npy", "lengths_C2.npy", "weights_C4.npy"])
def test_damaged_npy_column_stops_inspect_and_training(folder, capsys, tmp_path, name):
    path = folder / "shards" / "00000" / "train" / name
    for what, change in _npy_damage().items():
        with damaged(path, change):
            for args in _readers(folder, tmp_path):
                assert_one_error(*run_cli(args, capsys), f"00000/train/{name}", damage=f"{what}, {args[0]}")
    assert run_cli(_readers(folder, tmp_path)[0], capsys)[0] == 0


def test_damaged_shard_meta_is_never_copied_into_the_manifest(tmp_path, neorec_warnings):
    """A shard's meta.json is checked when a run resumes (and read back when the last shard is done, to
    complete the manifest): a damaged one makes the run write its shard again, saying why."""
    cfg = load_config("default", [*DATA, "data.synthetic.train_samples=40000"])  # 3 training blocks
    spec = spec_from_config(cfg.data.synthetic, cfg.seed)
    out = tmp_path / "pre"
    preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False, max_shards=1)  # unfinished
    meta = out / "shards" / "00000" / "meta.json"
    good = meta.read_bytes()
    for what, change in json_damage().items():
        meta.write_bytes(change(good))
        neorec_warnings.clear()
        again = preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False, max_shards=1)
        assert (again.written, again.complete, meta.read_bytes()) == (1, False, good), what
        assert re.search(r"shard 00000 is written again: .*00000/meta\.json", neorec_warnings.text), what
    assert preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False).complete
    meta.write_bytes(json_damage()["value digit"](good))
    with pytest.raises(DataError, match=r"00000/meta\.json.*damaged"):
        manifest = load_manifest(out)
        complete_manifest(out, manifest, [shard_name(s["index"]) for s in manifest["shards"]])


@pytest.mark.parametrize("name", ["../evil", "a/b", "a\\b", "", "..", "x\0y"])
def test_feature_names_that_are_not_plain_names_are_refused(tmp_path, capsys, name):
    """When the manifest is started (preprocessing), and when a manifest is read (the reader, inspect,
    training), whether or not its checksum matches."""
    features = [{"name": "C1", "num_ids": 5, "multi_hot": False, "weighted": False},
                {"name": name, "num_ids": 5, "multi_hot": False, "weighted": False}]  # fmt: skip
    with pytest.raises(DataError, match=rf"manifest\.json: feature {re.escape(repr(name))} is not a plain name"):
        start_manifest(tmp_path, {"input": "synthetic"}, [], 0, features, {})
    assert not (tmp_path / "manifest.json").exists()
    manifest = {"format": "neorec-columnar-1", "complete": True, "settings": {"input": "synthetic"}, "num_dense": 0,
                "features": features, "notes": {}, "shards": [], "num_samples": {"train": 0}, "skipped": {}}  # fmt: skip
    for text in (json_text(manifest), json.dumps(manifest)):  # with a valid checksum, and without one
        (tmp_path / "manifest.json").write_text(text)
        with pytest.raises(DataError, match=rf"manifest\.json: feature {re.escape(repr(name))} is not"):
            PreprocessedSource(tmp_path)
        args = ["data", "inspect", "--set", "data.source=preprocessed", "--set", f"data.preprocessed.path={tmp_path}"]
        assert_one_error(*run_cli(args, capsys), "manifest.json", repr(name))
