"""Manifests with wrong values but a matching checksum (a hand edit, or a tool that recomputed the
"crc32" key): a preprocessed folder's manifest.json and a checkpoint's manifest.json, a random value at a
random key path replaced by a random JSON value, then `neorec data inspect`, `neorec checkpoint inspect
--verify` and `neorec export` (in this process). Each either succeeds or stops with exactly one
`neorec: error:` line, exit 2, no traceback. Then the cases found by hand, one by one, with the key path
the error names; resuming (too slow to fuzz) with a few fixed cases."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_files_writer import assert_one_error, run_cli
from tiny_cli import TINY, sets

from neorec.data.preprocess import preprocess_synthetic
from neorec.data.synthetic import spec_from_config
from neorec.errors import DataError
from neorec.utils.files import json_text

DATA = TINY[:5]  # the tiny run's data: four tables of 50, 300, 7 and 100 rows, 1000 + 500 samples
TRAIN = TINY[5:]  # the rest of it, for a run on the preprocessed folder (which holds the data)
STEP = "checkpoints/step-00000004"
NAN, INF = math.nan, math.inf

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([0, 1, -1, -5, 2**31, 2**63, 2**64, 10**15, 10**30]),
    st.floats(), st.sampled_from([NAN, INF, -INF, 0.5, 4.0, 1e300]),
    st.text(max_size=12), st.sampled_from(["", "4", "50", "x", "../x", "a/b", "float32", "train", "C1"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


# ---- the manifests ------------------------------------------------------------------------------------
def key_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every key path inside `value` (its keys and list positions, at any depth), the root left out."""
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    found = []
    for key, child in children:
        if path == () and key == "crc32":
            continue
        found.append((*path, key))
        found += key_paths(child, (*path, key))
    return found


def replaced(manifest: dict, path: tuple, value: Any) -> dict:
    """A deep copy of `manifest` with the value at `path` replaced."""
    out = json.loads(json.dumps(manifest))
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return out


def write_manifest(path: Path, manifest: dict) -> None:
    """`manifest` with its "crc32" key recomputed, as json_text writes it (NaN and Infinity as Python
    writes them)."""
    path.write_text(json_text({k: v for k, v in manifest.items() if k != "crc32"}))


def original(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "crc32"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny preprocessed folder, and a tiny run with checkpoints at steps 2 and 4 (made once)."""
    root = tmp_path_factory.mktemp("manifest-fuzz")
    assert (
        run_quiet(["data", "preprocess", "--synthetic", "--out", root / "pp", "--no-progress", *sets(DATA)])
        == 0
    )
    run = [
        "train",
        "--output-dir",
        root / "run",
        *sets(TINY),
        *sets(["train.max_steps=4", "checkpoint.every_steps=2"]),
    ]
    assert run_quiet(run) == 0
    return {"pp": root / "pp", "run": root / "run", "root": root}


def run_quiet(args: list) -> int:
    from neorec.cli import main

    return main([str(a) for a in args])


def inspect_data(folder: Path) -> list:
    reads = ["data.source=preprocessed", f"data.preprocessed.path={folder}", "data.batch_size=100"]
    return ["data", "inspect", *sets(reads), "--batches", "1"]


def assert_ok_or_one_error(code: int, err: str, damage: str) -> None:
    assert "Traceback" not in err, (damage, err)
    if code != 0:
        assert_one_error(code, err, "manifest.json", damage=damage)


@pytest.fixture(scope="module")
def copies(folders) -> dict[str, Path]:
    """Copies the fuzz tests damage (a fresh manifest is written for every example)."""
    pp, run = folders["root"] / "pp-fuzz", folders["root"] / "run-fuzz"
    shutil.copytree(folders["pp"], pp)
    shutil.copytree(folders["run"], run)
    return {"pp": pp, "run": run}


# ---- fuzzing -------------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data(), value=values)
def test_preprocessed_manifest_with_any_value_anywhere(folders, copies, capsys, data, value):
    manifest = original(folders["pp"] / "manifest.json")
    path = data.draw(st.sampled_from(key_paths(manifest)))
    write_manifest(copies["pp"] / "manifest.json", replaced(manifest, path, value))
    assert_ok_or_one_error(*run_cli(inspect_data(copies["pp"]), capsys), f"{path} = {value!r}")


@FUZZ
@given(data=st.data(), value=values)
def test_checkpoint_manifest_with_any_value_anywhere(folders, copies, capsys, data, value):
    manifest = original(folders["run"] / STEP / "manifest.json")
    path = data.draw(st.sampled_from(key_paths(manifest)))
    write_manifest(copies["run"] / STEP / "manifest.json", replaced(manifest, path, value))
    args = ["checkpoint", "inspect", "--verify", copies["run"] / STEP]
    assert_ok_or_one_error(*run_cli(args, capsys), f"{path} = {value!r}")


@settings(FUZZ, max_examples=15)
@given(data=st.data(), value=values)
def test_export_of_a_checkpoint_with_any_value_anywhere(folders, copies, capsys, data, value):
    manifest = original(folders["run"] / STEP / "manifest.json")
    path = data.draw(st.sampled_from(key_paths(manifest)))
    write_manifest(copies["run"] / STEP / "manifest.json", replaced(manifest, path, value))
    args = ["export", copies["run"] / STEP, "--out", folders["root"] / "fuzz.nrx", "--no-eval"]
    assert_ok_or_one_error(*run_cli(args, capsys), f"{path} = {value!r}")


# ---- fixed cases: preprocessed folders ----------------------------------------------------------------
PREPROCESSED = [
    (("num_dense",), NAN, "num_dense is NaN, expected a whole number"),
    (("num_dense",), "13", 'num_dense is "13"'),
    (("features", 0, "num_ids"), NAN, "features[0].num_ids is NaN, expected a whole number in [1, 2^63)"),
    (("features", 0, "num_ids"), "many", 'features[0].num_ids is "many"'),
    (("features", 0, "num_ids"), 10**30, "features[0].num_ids is 1000000000000000000000000000000"),
    (("features", 0, "num_ids"), -5, "features[0].num_ids is -5"),
    (("features", 1, "name"), "C1", "features[1].name is 'C1', which an earlier feature has too"),
    (("settings",), [1], "settings is [1], expected an object"),
    (("shards", 0, "files"), [], "shards[0].files is [], expected an object"),
    (("shards", 0, "index"), 1, "shards[0].index is 1, expected 0"),
    (
        ("shards", 0, "samples", "train"),
        999,
        "num_samples is {'eval': 500, 'train': 1000}, but the shards hold",
    ),
    (("num_samples",), NAN, "num_samples is NaN, expected an object"),
    (("num_samples", "train"), "1000", 'num_samples.train is "1000"'),
    (("complete",), "yes", 'complete is "yes", expected true or false'),
    (
        ("shards", 0, "files", "train/labels.npy", 0),
        "4128",
        'shards[0].files["train/labels.npy"][0] is "4128"',
    ),
    (("shards", 0, "files", "train/labels.npy", 1), -1, 'shards[0].files["train/labels.npy"][1] is -1'),
    (("notes",), {"dense": ["a"]}, "notes.dense names 1 dense features, but num_dense is 13"),
    (("features", 0, "multi_hot"), True, 'files lists no "train/lengths_C1.npy", which features[0] (multi_hot) needs'),
]


def test_preprocessed_manifest_cases(folders, copies, capsys, tmp_path):
    """Each refused by `data inspect` naming the key path; the first cases also by `train`."""
    manifest = original(folders["pp"] / "manifest.json")
    assert run_cli(inspect_data(folders["pp"]), capsys)[0] == 0
    for i, (path, value, expected) in enumerate(PREPROCESSED):
        write_manifest(copies["pp"] / "manifest.json", replaced(manifest, path, value))
        assert_one_error(
            *run_cli(inspect_data(copies["pp"]), capsys), "manifest.json", expected, damage=str(path)
        )
        if i < 6:
            train = ["train", "--output-dir", tmp_path / "run", "--overwrite", *sets(TRAIN),
                     *sets(["data.source=preprocessed", f"data.preprocessed.path={copies['pp']}"])]  # fmt: skip
            assert_one_error(*run_cli(train, capsys), "manifest.json", expected, damage=f"train {path}")
    write_manifest(copies["pp"] / "manifest.json", manifest)


def test_shard_meta_with_wrong_values_is_never_copied_into_the_manifest(tmp_path, neorec_warnings):
    """A shard's meta.json is checked the same way when a run resumes (its shard is then written again,
    with a warning naming the key path) and when it is read back as the last shard is written."""
    from neorec.config.load import load_config
    from neorec.data.manifest import complete_manifest, load_manifest, shard_name

    cfg = load_config("default", DATA)
    spec = spec_from_config(cfg.data.synthetic, cfg.seed)
    out = tmp_path / "pp"
    preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False, max_shards=1)  # shard 0 of 2
    meta = out / "shards" / "00000" / "meta.json"
    good = original(meta)
    for path, value, expected in [
        (("samples", "train"), NAN, "samples.train is NaN"),
        (("samples",), {"test": 5}, 'samples has key "test", expected one of train, eval'),
        (("files", "train/labels.npy"), [1], 'files["train/labels.npy"] is [1], expected [size, crc32]'),
        (("skipped",), [], "skipped is [], expected an object"),
    ]:
        write_manifest(meta, replaced(good, path, value))
        neorec_warnings.clear()
        again = preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False, max_shards=1)
        assert (again.written, again.complete, original(meta)) == (1, False, good), expected
        assert re.search(rf"shard 00000 is written again: \S*00000/meta\.json: {re.escape(expected)}",
                         neorec_warnings.text), expected  # fmt: skip
        write_manifest(meta, replaced(good, path, value))
        manifest = load_manifest(out)
        with pytest.raises(DataError, match=rf"00000/meta\.json: {re.escape(expected)}"):
            complete_manifest(out, manifest, [shard_name(s["index"]) for s in manifest["shards"]])
    write_manifest(meta, good)
    assert preprocess_synthetic(spec, out, blocks_per_shard=1, progress=False).complete


# ---- fixed cases: checkpoints -------------------------------------------------------------------------
CHECKPOINT = [
    (("tables",), None, "tables is null, expected a list"),
    (("tables",), {}, "tables is {}, expected a list"),
    (("tables", 0, "rows"), "50", 'tables[0].rows is "50"'),
    (("state",), [1], "state is [1], expected an object"),
    (("optimizer",), "adam", 'optimizer is "adam", expected an object'),
    (("plan",), 5, "plan is malformed"),
    (("pieces", 0, "rows"), [0, 25, 50], "pieces[0].rows is [0, 25, 50], expected [start, end]"),
    (("pieces", 0, "rows"), [0, 51], "pieces[0].rows is [0, 51], expected a range inside [0, 50]"),
    (("pieces", 0, "shape"), [NAN, 16], "pieces[0].shape is [NaN, 16], expected [50] or [50, 16]"),
    (("pieces", 0, "shape"), [10**12, 10**12], "pieces[0].shape is [1000000000000, 1000000000000]"),
    (("pieces", 0, "dtype"), "complex999", 'pieces[0].dtype is "complex999", expected one of "float32"'),
    (
        ("pieces", 0, "offset"),
        10**15,
        "pieces[0] lies at bytes [1000000000000000, 1000000000003200) of rank-00000.bin",
    ),
    (("pieces", 0, "offset"), -1, "pieces[0].offset is -1"),
    (("pieces", 0, "offset"), "0", 'pieces[0].offset is "0"'),
    (
        ("pieces", 1, "offset"),
        58496 - 3199,
        "pieces[1] lies at bytes [55297, 58497) of rank-00000.bin, which has 58496",
    ),
    (("embedding_steps",), "four", 'embedding_steps is "four", expected an object'),
    (("embedding_steps", "C1"), "four", 'embedding_steps.C1 is "four"'),
    (("step",), NAN, "step is NaN, expected a whole number in [0, 2^63)"),
    (("step",), 4.0, "step is 4.0"),
    (("step",), -4, "step is -4"),
    (("step",), 10**30, "step is 1000000000000000000000000000000"),
    (("step",), "4", 'step is "4"'),
    (("world_size",), 0, "world_size is 0, expected a whole number in [1, 1048576]"),
    (("world_size",), 10**9, "world_size is 1000000000"),
    (("world_size",), "1", 'world_size is "1"'),
    (("local_world_size",), 2, "local_world_size is 2, expected a whole number in [1, 1]"),
    (("files", 0, "rank"), 1, "files[0].rank is 1, expected a whole number in [0, 0]"),
    (("version",), "2", 'version is "2", this neorec reads format versions 1 and 2'),
    (("version",), True, "version is true"),
    (("state", "batches"), "x", 'state.batches is "x"'),
    (("dense", "name"), "0", "0: cannot read (No such file or directory), though its manifest.json lists it"),
]


def test_checkpoint_manifest_cases(folders, copies, capsys):
    """Each refused by `checkpoint inspect --verify` and by `export`, naming the key path (exit 2)."""
    manifest = original(folders["run"] / STEP / "manifest.json")
    assert run_cli(["checkpoint", "inspect", "--verify", folders["run"] / STEP], capsys)[0] == 0
    for i, (path, value, expected) in enumerate(CHECKPOINT):
        write_manifest(copies["run"] / STEP / "manifest.json", replaced(manifest, path, value))
        inspect = ["checkpoint", "inspect", "--verify", copies["run"] / STEP]
        assert_one_error(*run_cli(inspect, capsys), "manifest.json", expected, damage=str(path))
        if i % 3 == 0:  # export reads the manifest the same way; a third of the cases suffice
            export = ["export", copies["run"] / STEP, "--out", folders["root"] / "x.nrx", "--no-eval"]
            assert_one_error(*run_cli(export, capsys), "manifest.json", expected, damage=f"export {path}")
    write_manifest(copies["run"] / STEP / "manifest.json", manifest)


def test_export_of_a_manifest_that_does_not_fit_its_model(folders, copies, capsys):
    """Values valid on their own that differ from the model the run's config builds: named, with the
    manifest that holds them (found by the fuzz test above)."""
    manifest = original(folders["run"] / STEP / "manifest.json")
    name, first = manifest["tables"][2]["name"], manifest["tables"][0]["name"]
    cases = [
        (
            ("tables", 2, "managed_collision"),
            {},
            f"table {name!r} has managed_collision {{'eviction': 'lru', 'buckets': 1}} in its manifest.json but None",
        ),
        (("pieces",), [], f"its manifest.json lists table {first!r} but no piece of its weight"),
    ]
    export = ["export", copies["run"] / STEP, "--out", folders["root"] / "x.nrx", "--no-eval"]
    for path, value, expected in cases:
        write_manifest(copies["run"] / STEP / "manifest.json", replaced(manifest, path, value))
        assert_one_error(*run_cli(export, capsys), "manifest.json", expected, damage=str(path))
    write_manifest(copies["run"] / STEP / "manifest.json", manifest)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("step",), NAN, "step is NaN"),
        (("step",), "4", 'step is "4"'),
        (("step",), -4, "step is -4"),
        (("world_size",), 0, "world_size is 0"),
        (("world_size",), 10**9, "world_size is 1000000000"),
        (("state", "batches"), "x", 'state.batches is "x"'),
    ],
)
def test_resume_from_a_manifest_with_wrong_values(folders, tmp_path, capsys, path, value, expected):
    """Refused before anything is said ("resumed from ...") or written: the run folder is as it was."""
    run = tmp_path / "run"
    shutil.copytree(folders["run"], run)
    write_manifest(
        run / STEP / "manifest.json", replaced(original(folders["run"] / STEP / "manifest.json"), path, value)
    )
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "neorec.lock"}
    args = [
        "train",
        "--output-dir",
        run,
        "--resume",
        *sets(TINY),
        *sets(["train.max_steps=6", "checkpoint.every_steps=2"]),
    ]
    capsys.readouterr()
    code = run_quiet(args)
    out, err = capsys.readouterr()
    assert_one_error(code, err, "manifest.json", expected)
    assert "resumed from" not in out + err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "neorec.lock"} == before
