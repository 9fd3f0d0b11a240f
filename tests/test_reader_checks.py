"""Readers stop at bad values with the file, row, column and value (neorec/data/checks.py): labels other
than 0 or 1, dense values and id weights that are not finite, ids outside their tables (error / warn /
off), and MovieLens ratings and ids; never train on them silently."""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_movielens import ROOT as MOVIELENS
from test_sharded_reader import write_tsv

from neorec.config.load import load_config
from neorec.config.schema import ParquetConfig
from neorec.data import checks
from neorec.data.manifest import load_manifest, shard_name, write_manifest
from neorec.data.movielens import MovieLensSource
from neorec.data.parquet import ParquetSource
from neorec.data.preprocess import preprocess_criteo, preprocess_synthetic
from neorec.data.sharded_reader import PreprocessedSource
from neorec.data.shards import ShardSource, write_shards
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import ConfigError, DataError
from neorec.train.build import build_source
from neorec.utils.files import file_crc32, write_json

ONE_HOT = SyntheticSpec(rows=[50, 1000, 7], num_dense=4, train_samples=2000, eval_samples=500, seed=3)
MULTI_HOT = replace(ONE_HOT, bag_sizes=[2, 1, 3], variable_bags=True)
WEIGHTED = replace(MULTI_HOT, weighted=True)
SPECS = {"one_hot": ONE_HOT, "multi_hot": MULTI_HOT, "weighted": WEIGHTED}


# ---- fixtures: clean data written by the project's own writers, corrupted per test --------------------
@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """{(format, kind): folder}: preprocessed shards and generated .npz files of both specs."""
    root = tmp_path_factory.mktemp("clean")
    out = {}
    for kind, spec in SPECS.items():
        preprocess_synthetic(spec, root / f"pre_{kind}", progress=False)
        write_shards(SyntheticSource(spec), root / f"npz_{kind}")
        out["preprocessed", kind], out["npz", kind] = root / f"pre_{kind}", root / f"npz_{kind}"
    return out


def copy(clean, tmp_path: Path, fmt: str, kind: str = "one_hot") -> Path:
    return Path(shutil.copytree(clean[fmt, kind], tmp_path / f"{fmt}_{kind}"))


def part(root: Path, split: str) -> Path:
    """The folder of the first preprocessed shard part of `split`."""
    return sorted(root.glob(f"shards/*/{split}"))[0]


def set_npy(path: Path, index, value) -> None:
    """A bad value in a column. In a preprocessed folder the manifest then records the file's new size
    and crc32, as if the value had come with the data: the value check meets it, not the checksum
    (tests/faults/test_files_data.py damages files behind the manifest's back)."""
    a = np.load(path)
    a[index] = value
    np.save(path, a)
    root = path.parents[3]
    if (root / "manifest.json").is_file():
        manifest = load_manifest(root)
        for entry in manifest["shards"]:
            if shard_name(entry["index"]) == path.parents[1].name:
                entry["files"][f"{path.parent.name}/{path.name}"] = [path.stat().st_size, file_crc32(path)]
        write_manifest(root, manifest)


def set_npz(path: Path, key: str, index, value) -> None:
    """Change a value in a generated .npz shard, and its size and crc32 in meta.json with it (so that
    the value check, not the checksum, is what meets it)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[key][index] = value
    np.savez(path, **arrays)
    meta = json.loads((path.parent / "meta.json").read_text())
    meta["files"][path.name] = [path.stat().st_size, file_crc32(path)]
    write_json(path.parent / "meta.json", meta, "test file")


def read_all(source, split: str = "train") -> list:
    return list(source.train_batches(256) if split == "train" else source.eval_batches(256))


def preprocessed(root: Path, **kw) -> PreprocessedSource:
    return PreprocessedSource(root, shuffle=False, **kw)


# ---- labels and dense values ---------------------------------------------------------------------------
@pytest.mark.parametrize("label", [7.0, -1.0, 0.5])
def test_preprocessed_label_not_0_or_1_names_file_and_row(clean, tmp_path, label):
    root = copy(clean, tmp_path, "preprocessed")
    set_npy(part(root, "train") / "labels.npy", 5, label)
    where = re.escape(f"{part(root, 'train')}/labels.npy, row 5: label = {np.float32(label)} is not 0 or 1")
    with pytest.raises(DataError, match=where + ".*labels must be exactly 0 or 1"):
        read_all(preprocessed(root))


@pytest.mark.parametrize("label", [7.0, -1.0, 0.5])
def test_npz_label_not_0_or_1_names_file_and_row(clean, tmp_path, label):
    root = copy(clean, tmp_path, "npz")
    set_npz(root / "train-00000.npz", "labels", 5, label)
    where = re.escape(f"{root / 'train-00000.npz'}, row 5: label = {np.float32(label)} is not 0 or 1")
    with pytest.raises(DataError, match=where):
        read_all(ShardSource(root))


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_preprocessed_dense_not_finite_names_file_row_and_column(clean, tmp_path, split, value):
    root = copy(clean, tmp_path, "preprocessed")
    set_npy(part(root, split) / "dense.npy", (9, 2), value)
    where = re.escape(
        f"{part(root, split)}/dense.npy, row 9: dense column 2 = {np.float32(value)} is not finite"
    )
    with pytest.raises(DataError, match=where + ".*must be finite numbers"):
        read_all(preprocessed(root), split)


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_npz_dense_not_finite_names_file_row_and_column(clean, tmp_path, split, value):
    root = copy(clean, tmp_path, "npz")
    set_npz(root / f"{split}-00000.npz", "dense", (9, 2), value)
    where = re.escape(
        f"{root / f'{split}-00000.npz'}, row 9: dense column 2 = {np.float32(value)} is not finite"
    )
    with pytest.raises(DataError, match=where):
        read_all(ShardSource(root), split)


def sample_of(lengths: np.ndarray, position: int) -> int:
    """The sample that holds value `position` of a multi-hot column with these bag sizes."""
    return int(np.searchsorted(np.cumsum(lengths), position, side="right"))


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_preprocessed_weight_not_finite_names_file_row_and_feature(clean, tmp_path, split, value):
    """A NaN weight would scale its id's row into the pooled sum: the run would stop steps later at a
    NaN loss blamed on the learning rates, naming no file."""
    root = copy(clean, tmp_path, "preprocessed", "weighted")
    folder = part(root, split)
    set_npy(folder / "weights_C3.npy", 40, value)
    row = sample_of(np.load(folder / "lengths_C3.npy"), 40)
    where = re.escape(
        f"{folder}/weights_C3.npy, row {row}: weight {np.float32(value)} of an id of feature 'C3'"
    )
    with pytest.raises(DataError, match=where + " is not finite.*must be finite numbers"):
        read_all(preprocessed(root), split)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_npz_weight_not_finite_names_file_row_and_feature(clean, tmp_path, split):
    root = copy(clean, tmp_path, "npz", "weighted")
    path = root / f"{split}-00000.npz"
    set_npz(path, "weights_C1", 25, np.nan)
    with np.load(path) as z:
        row = sample_of(z["lengths_C1"], 25)
    with pytest.raises(DataError, match=re.escape(f"{path}, row {row}: weight nan of an id of feature 'C1'")):
        read_all(ShardSource(root), split)


def test_dense_columns_are_named_when_the_manifest_names_them(tmp_path):
    preprocess_criteo(
        [write_tsv(tmp_path / "a.tsv", 0, 30)], tmp_path / "out", table_rows=1000, progress=False
    )
    folder = part(tmp_path / "out", "train")
    set_npy(folder / "dense.npy", (4, 3), np.nan)
    with pytest.raises(DataError, match=re.escape(f"{folder}/dense.npy, row 4: dense column 3 (I4) = nan")):
        read_all(preprocessed(tmp_path / "out"))


# ---- ids against their tables ----------------------------------------------------------------------------
def bad_position(lengths: np.ndarray | None, sample: int) -> tuple[int, int]:
    """(position in its column, sample) of the first id of the first sample >= `sample` with a non-empty
    bag (`lengths` None: one id per sample)."""
    if lengths is None:
        return sample, sample
    sample += int(np.flatnonzero(lengths[sample:])[0])
    return int(np.sum(lengths[:sample])), sample


def corrupt_ids(path: Path, fmt: str, kind: str, bad_id: int) -> tuple[str, int]:
    """Put `bad_id` among feature C1's ids (50 rows) of the first training file, at a sample >= 7 (whose
    position in a multi-hot column differs from the sample); returns (the file an error names, the sample)."""
    if fmt == "preprocessed":
        folder = part(path, "train")
        lengths = np.load(folder / "lengths_C1.npy") if kind == "multi_hot" else None
        pos, sample = bad_position(lengths, 7)
        set_npy(folder / "ids_C1.npy", pos, bad_id)
        return f"{folder}/ids_C1.npy", sample
    file = path / "train-00000.npz"
    with np.load(file) as z:
        lengths = z["lengths_C1"] if kind == "multi_hot" else None
    pos, sample = bad_position(lengths, 7)
    set_npz(file, "values_C1", pos, bad_id)
    return str(file), sample


def source_of(fmt: str, root: Path, mode: str):
    return (
        preprocessed(root, bounds_check=mode)
        if fmt == "preprocessed"
        else ShardSource(root, bounds_check=mode)
    )


def c1_ids(batches) -> list[int]:
    return [i for b in batches for i in b.sparse.feature("C1")[0].tolist()]


@pytest.mark.parametrize("fmt", ["preprocessed", "npz"])
@pytest.mark.parametrize("kind", ["one_hot", "multi_hot"])
@pytest.mark.parametrize("bad_id", [1000, 50, -1], ids=["too_large", "rows", "negative"])
def test_id_outside_its_table_stops_with_error(clean, tmp_path, fmt, kind, bad_id):
    root = copy(clean, tmp_path, fmt, kind)
    where, row = corrupt_ids(root, fmt, kind, bad_id)
    message = re.escape(f"{where}, row {row}: feature C1 has id {bad_id}, outside its table of 50 rows")
    with pytest.raises(DataError, match=message + ".*or set embedding.bounds_check: warn to drop such ids"):
        read_all(source_of(fmt, root, "error"))


@pytest.mark.parametrize("fmt", ["preprocessed", "npz"])
@pytest.mark.parametrize("kind", ["one_hot", "multi_hot"])
@pytest.mark.parametrize("bad_id", [1000, -1], ids=["too_large", "negative"])
def test_id_outside_its_table_warns_once_and_passes_through(
    clean, tmp_path, neorec_warnings, fmt, kind, bad_id
):
    root = copy(clean, tmp_path, fmt, kind)
    where, row = corrupt_ids(root, fmt, kind, bad_id)
    source = source_of(fmt, root, "warn")
    for epoch in (0, 1):  # a file is checked (and warned about) once, however often it is read
        assert c1_ids(source.train_batches(256, epoch)).count(bad_id) == 1
    records = [r.getMessage() for r in neorec_warnings.records]
    assert len(records) == 1, records
    assert records[0].startswith(
        f"{where}: 1 ids of feature C1 outside its table of 50 rows (ids must lie in [0, 50)), "
        f"the first at row {row}: {bad_id}; passed on"
    )


@pytest.mark.parametrize("fmt", ["preprocessed", "npz"])
@pytest.mark.parametrize("kind", ["one_hot", "multi_hot"])
def test_bounds_check_off_reads_no_id(clean, tmp_path, neorec_warnings, monkeypatch, fmt, kind):
    root = copy(clean, tmp_path, fmt, kind)
    corrupt_ids(root, fmt, kind, 1000)

    def scanned(*args, **kw):
        raise AssertionError("bounds_check off scanned ids")

    monkeypatch.setattr(checks, "_scan_ids", scanned)
    assert c1_ids(source_of(fmt, root, "off").train_batches(256)).count(1000) == 1
    assert not neorec_warnings.records
    with pytest.raises(AssertionError, match="scanned ids"):  # the same data under warn is scanned
        read_all(source_of(fmt, root, "warn"))


@pytest.mark.parametrize("kind", ["one_hot", "multi_hot"])
def test_checked_parts_give_their_batches_id_limits(clean, tmp_path, kind):
    """A part whose ids were all checked gives its batches its tables' bounds as id limits, so the
    engines' id check reads none of their ids again (a GPU step reads nothing back); a part that
    passed a bad id on (warn) or was not checked (off) gives none, and its ids are then scanned."""
    root = copy(clean, tmp_path, "preprocessed", kind)
    rows = SPECS[kind].rows
    for b in preprocessed(root, bounds_check="error").train_batches(256):
        assert b.sparse.known_id_limits() == ([0, 0, 0], [r - 1 for r in rows])
        for key, r in zip(b.sparse.keys, rows, strict=True):
            ids = b.sparse.feature(key)[0]
            assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < r)
    assert all(b.sparse.known_id_limits() is None for b in read_all(preprocessed(root, bounds_check="off")))
    corrupt_ids(root, "preprocessed", kind, 1000)
    batches = read_all(preprocessed(root, bounds_check="warn"))
    (bad,) = [b for b in batches if 1000 in b.sparse.feature("C1")[0].tolist()]
    assert bad.sparse.known_id_limits() is None and bad.sparse.id_limits()[1][0] == 1000


def test_raw_ids_of_managed_collision_tables_need_only_be_nonnegative(tmp_path):
    paths = [write_tsv(tmp_path / "a.tsv", 0, 30)]
    preprocess_criteo(paths, tmp_path / "out", table_rows=1000, raw_features=["C1"], progress=False)
    folder = part(tmp_path / "out", "train")
    set_npy(folder / "ids_C1.npy", 3, 1 << 40)  # far beyond the table's rows: a raw id the id map maps
    set_npy(folder / "ids_C2.npy", 3, 999)
    source = preprocessed(tmp_path / "out")
    assert (
        sum(len(b) for b in read_all(source)) == source.num_samples("train") == 27
    )  # every 10th line held out
    set_npy(folder / "ids_C1.npy", 4, -5)
    message = re.escape(
        f"{folder}/ids_C1.npy, row 4: feature C1 has raw id -5, negative (raw ids of its managed"
    )
    with pytest.raises(DataError, match=message):
        read_all(preprocessed(tmp_path / "out"))


def test_bounds_check_comes_from_the_config(clean, tmp_path, neorec_warnings):
    pre = copy(clean, tmp_path, "preprocessed")
    npz = copy(clean, tmp_path, "npz")
    corrupt_ids(pre, "preprocessed", "one_hot", 1000)
    corrupt_ids(npz, "npz", "one_hot", 1000)
    sources = {"preprocessed": [f"data.preprocessed.path={pre}", "data.preprocessed.shuffle=false"],
               "shards": [f"data.shards_dir={npz}"]}  # fmt: skip
    for name, sets in sources.items():
        cfg = load_config(None, [f"data.source={name}", *sets])
        with pytest.raises(DataError, match="or set embedding.bounds_check: warn"):
            read_all(build_source(cfg))
        cfg = load_config(None, [f"data.source={name}", *sets, "embedding.bounds_check=warn"])
        assert c1_ids(build_source(cfg).train_batches(256)).count(1000) == 1
    assert len(neorec_warnings.records) == 2
    with pytest.raises(ConfigError, match="bounds_check must be one of"):
        ShardSource(npz, bounds_check="drop")


# ---- Parquet dense columns -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300], ids=["nan", "inf", "beyond_float32"])
@pytest.mark.parametrize("log1p", [False, True])
def test_parquet_dense_not_finite_names_file_row_group_row_and_column(tmp_path, value, log1p):
    d = [0.5, 1.0, 2.0, value, 3.0]
    table = pa.table({"label": [0, 1, 0, 1, 0], "d0": [1.0] * 5, "d1": d, "ids": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    path = str(tmp_path / "t.parquet")
    shutil.copy(path, tmp_path / "e.parquet")  # the held-out file: the same rows under another name
    held = str(tmp_path / "e.parquet")
    config = ParquetConfig(paths=[path], eval_paths=[held], dense=["d0", "d1"], dense_log1p=log1p,
                           features=["ids"], shuffle=False)  # fmt: skip
    if log1p and value == 1e300:  # log(1 + 1e300) is 690.8: finite
        assert len(read_all(ParquetSource(config))[0]) == 5
        return
    for split, name in (("train", "t.parquet"), ("eval", "e.parquet")):
        where = re.escape(
            f"{tmp_path / name}, row group 1, row 1: dense column 'd1' = {value!r} is not finite"
        )
        with pytest.raises(DataError, match=where):
            read_all(ParquetSource(config), split)


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 1e300], ids=["nan", "inf", "beyond_float32"])
@pytest.mark.parametrize("multi_hot", [False, True])
def test_parquet_weight_not_finite_names_file_row_group_row_and_feature(tmp_path, value, multi_hot):
    """Zero and negative weights are weights; NaN, inf and a float64 beyond float32 are not."""
    weights = [[0.5, 0.0], [-2.0], [1.0, value], [1.0]] if multi_hot else [0.5, -2.0, value, 0.0]
    ids = [[1, 2], [3], [4, 5], [6]] if multi_hot else [1, 3, 4, 6]
    table = pa.table({"label": [0, 1, 0, 1], "d0": [1.0] * 4, "ids": ids, "w": weights})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    path = str(tmp_path / "t.parquet")
    shutil.copy(path, tmp_path / "e.parquet")  # the held-out file: the same rows under another name
    held = str(tmp_path / "e.parquet")
    config = ParquetConfig(paths=[path], eval_paths=[held], dense=["d0"], shuffle=False,
                           features=[{"name": "ids", "weights": "w"}])  # fmt: skip
    for split, name in (("train", "t.parquet"), ("eval", "e.parquet")):
        where = re.escape(
            f"{tmp_path / name}, row group 1, row 0: weight {value!r} of an id of feature 'ids'"
        )
        with pytest.raises(DataError, match=where):
            read_all(ParquetSource(config), split)
    table = table.set_column(
        3, "w", pa.array([[0.5, 0.0], [-2.0], [1.0, 3.0], [1.0]] if multi_hot else [0.5, -2.0, 3.0, 0.0])
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    batch = read_all(ParquetSource(config))[0]
    assert batch.sparse.weights.tolist() == (
        [0.5, 0.0, -2.0, 1.0, 3.0, 1.0] if multi_hot else [0.5, -2.0, 3.0, 0.0]
    )


# ---- MovieLens ------------------------------------------------------------------------------------------
def movielens_lines() -> tuple[list[str], str]:
    """(the header and first 49 lines of ratings.csv, movies.csv) of the real copy, or, where there is
    none, of a made-up one in its form (quoted titles with commas, a movie without genres)."""
    if (MOVIELENS / "ratings.csv").is_file():
        ratings = (MOVIELENS / "ratings.csv").read_text().splitlines()[:50]
        return ratings, (MOVIELENS / "movies.csv").read_text()
    genres = ["Comedy", "Drama|Romance", "Adventure|Animation|Children", "(no genres listed)"]
    movies = [f'{m},"Movie {m}, The ({1990 + m % 20})",{genres[m % 4]}' for m in range(1, 61)]
    rng = random.Random(0)
    ratings = [f"{1 + i // 20},{1 + i % 60},{rng.randrange(1, 11) / 2},{964_980_000 + 37 * i}"
               for i in range(49)]  # fmt: skip
    return ["userId,movieId,rating,timestamp", *ratings], "\n".join(["movieId,title,genres", *movies]) + "\n"


def movielens(
    tmp_path: Path, edit: dict[int, str] | None = None, column: int = 2, all_to: str | None = None
) -> Path:
    """A folder with the first 49 ratings of a MovieLens copy (movielens_lines; line numbers as an editor
    shows them, header line 1), `column` of line k set to edit[k] (or of every line to `all_to`)."""
    root = tmp_path / "ml"
    root.mkdir()
    lines, movies = movielens_lines()
    for k in range(2, len(lines) + 1):
        value = all_to if all_to is not None else (edit or {}).get(k)
        if value is not None:
            fields = lines[k - 1].split(",")
            fields[column] = value
            lines[k - 1] = ",".join(fields)
    (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    (root / "movies.csv").write_text(movies)
    return root


@pytest.mark.parametrize("rating", ["nan", "NaN", "-3", "7", "500", "inf", "0", "5.5"])
def test_movielens_rating_outside_the_scale_names_file_and_line(tmp_path, rating):
    root = movielens(tmp_path, {12: rating})
    message = re.escape(f"{root / 'ratings.csv'}:12: rating = {rating!r} is not a number in [0.5, 5.0]")
    with pytest.raises(DataError, match=message):
        MovieLensSource(root)


def test_movielens_all_nan_ratings_are_an_error(tmp_path):
    root = movielens(tmp_path, all_to="nan")
    with pytest.raises(DataError, match=re.escape(f"{root / 'ratings.csv'}:2: rating = 'nan'")):
        MovieLensSource(root)


@pytest.mark.parametrize(("value", "what"), [(str(2**63), "is not an integer that fits int64"),
                                             ("-1", "is negative; ids must be integers >= 0"),
                                             ("1.5", "is not an integer that fits int64")])  # fmt: skip
def test_movielens_user_id_must_fit_int64_and_be_nonnegative(tmp_path, value, what):
    root = movielens(tmp_path, {30: value}, column=0)
    with pytest.raises(DataError, match=re.escape(f"{root / 'ratings.csv'}:30: userId = {value!r} {what}")):
        MovieLensSource(root)


def test_movielens_error_quotes_a_short_prefix_of_a_huge_field(tmp_path):
    root = movielens(tmp_path, {7: "9" * 100_000}, column=0)
    with pytest.raises(DataError) as info:
        MovieLensSource(root)
    message = str(info.value)
    assert (
        message.startswith(f"{root / 'ratings.csv'}:7: userId = '999") and len(message) < len(str(root)) + 150
    )


def test_quote_cuts_long_values():
    assert checks.quote(np.float32(0.5)) == "0.5" and checks.quote(float("nan")) == "nan"
    assert checks.quote(7) == "7" and checks.quote(np.int64(-1)) == "-1"
    long = checks.quote("x" * 1000)
    assert len(long) == checks.QUOTE + 3 and long.startswith("'xxx") and long.endswith("...")


def test_several_labels_per_sample_name_the_task_and_memory_stays_in_pieces(monkeypatch):
    monkeypatch.setattr(checks, "CHUNK", 4)  # pieces of 2 samples of 2 labels: rows count across pieces
    labels = np.array([[0, 1], [1, 1], [0, 0], [1, 0.25], [1, 1]], np.float32)
    with pytest.raises(DataError, match=r"^x\.npz, row 3: label 1 = 0\.25 is not 0 or 1"):
        checks.check_labels(labels, "x.npz")
    ids = np.array([0, 1, 2, 3, 4, 9, 5, 9], np.int32)
    assert checks.check_ids(ids, "x", "C", 9, mode="warn") == 2
    with pytest.raises(DataError, match=r"^x, row 4: feature C has id 9"):  # value 5 is sample 4's first id
        checks.check_ids(ids, "x", "C", 9, lengths=np.array([2, 0, 3, 0, 2, 1]))
