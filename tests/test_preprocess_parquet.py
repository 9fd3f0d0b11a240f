"""`neorec data preprocess` with Parquet: Parquet input gives the shards the Parquet source's samples,
and Parquet output next to the shards reads back as the same samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_parquet import FIXTURE, SPEC, criteo_config, tsv_to_parquet
from test_preprocess import tree_digest
from test_rank_data import assert_same

from neorec.cli import main
from neorec.config.schema import ParquetConfig
from neorec.data.criteo import CATEGORICAL_NAMES, CriteoTSVSource
from neorec.data.parquet import ParquetSource
from neorec.data.preprocess import load_manifest, preprocess_criteo, preprocess_synthetic
from neorec.data.preprocess_parquet import preprocess_parquet
from neorec.data.sharded_reader import PreprocessedSource
from neorec.data.synthetic import SyntheticSource
from neorec.errors import ConfigError, DataError


def same_batches(got, want) -> None:
    got, want = list(got), list(want)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def test_parquet_input_gives_the_tsv_readers_samples_and_resumes_to_identical_bytes(tmp_path):
    """Row groups of 3 rows, shards of at least 7 rows: 9 + 9 + 2 rows from one file."""
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 3)
    cfg = criteo_config([path], hashing="hash")
    result = preprocess_parquet(cfg, tmp_path / "out", shard_rows=7, progress=False)
    assert result.complete and result.num_shards == 3 and result.num_samples == {"train": 18, "eval": 2}
    assert [s["count"] for s in load_manifest(tmp_path / "out")["shards"]] == [3, 3, 1]
    tsv = CriteoTSVSource(FIXTURE, table_rows=1000, hashing="hash")
    shards = PreprocessedSource(tmp_path / "out", shuffle=False)
    same_batches(shards.train_batches(5), tsv.train_batches(5))
    same_batches(shards.eval_batches(5), tsv.eval_batches(5))

    partial = preprocess_parquet(cfg, tmp_path / "again", shard_rows=7, progress=False, max_shards=1)
    assert not partial.complete and partial.written == 1
    preprocess_parquet(cfg, tmp_path / "again", shard_rows=7, progress=False)
    assert tree_digest(tmp_path / "again") == tree_digest(tmp_path / "out")


def test_parquet_output_reads_back_as_the_shards_samples(tmp_path):
    """Synthetic multi-hot weighted data: the Parquet copy, the shards and the generator agree."""
    preprocess_synthetic(SPEC, tmp_path, blocks_per_shard=1, progress=False, parquet_output=True)
    assert sorted(p.name for p in (tmp_path / "parquet" / "train").iterdir()) == ["00000.parquet", "00001.parquet"]
    features = [{"name": f"C{i + 1}", "rows": r, "hashing": "none", "weights": f"w_C{i + 1}"}
                for i, r in enumerate(SPEC.rows)]  # fmt: skip
    copy = ParquetSource(ParquetConfig(
        paths=[str(tmp_path / "parquet" / "train")], eval_paths=[str(tmp_path / "parquet" / "eval")],
        dense=["d0", "d1", "d2"], features=features, shuffle=False,
    ))  # fmt: skip
    assert [f.multi_hot for f in copy.info.features] == [True, True, True]
    shards = PreprocessedSource(tmp_path, shuffle=False)
    same_batches(copy.train_batches(999), shards.train_batches(999))
    same_batches(copy.eval_batches(999), SyntheticSource(SPEC).eval_batches(999))


def test_cli_parquet_in_and_out(tmp_path, capsys):
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 4)
    config = tmp_path / "p.yaml"
    section = criteo_config([path]).model_dump(mode="json")
    config.write_text(yaml.safe_dump({"data": {"source": "parquet", "parquet": section}}))
    args = ["data", "preprocess", "--parquet", "--config", str(config), "--out", str(tmp_path / "o"),
            "--shard-lines", "8", "--parquet-output", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert "3 shards (3 written now); samples: eval 2, train 18" in capsys.readouterr().out
    out = tmp_path / "o" / "parquet"
    copy = ParquetConfig(paths=[str(out / "train")], eval_paths=[str(out / "eval")], dense=section["dense"],
                         features=CATEGORICAL_NAMES, hashing="none", table_rows=1000, shuffle=False)  # fmt: skip
    original = ParquetSource(criteo_config([path]))
    same_batches(ParquetSource(copy).train_batches(4), original.train_batches(4))
    same_batches(ParquetSource(copy).eval_batches(4), original.eval_batches(4))

    assert main(["data", "preprocess", "--parquet", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: --parquet needs a data.parquet section") and "Traceback" not in err
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    bad = ["--set", f"data.parquet.paths=[{tmp_path / 'bad.parquet'}]"]
    assert main([*args[:-2], "--out", str(tmp_path / "y"), *bad, "--no-progress"]) == 2
    assert f"neorec: error: {Path(tmp_path / 'bad.parquet')}: not a readable Parquet file" in capsys.readouterr().err


def test_the_commands_of_docs_data_parquet_run(tmp_path, monkeypatch, capsys):
    """docs/data-parquet.md: its config on Parquet files with its column names, then its commands."""
    import re
    import shlex

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    page = (Path(__file__).parents[1] / "docs" / "data-parquet.md").read_text()
    (tmp_path / "parquet.yaml").write_text(re.findall(r"```yaml\n(.*?)```", page, re.S)[0])
    rng = np.random.default_rng(0)
    for split, n in (("train", 600), ("eval", 200)):
        tags = [list(rng.integers(0, 500, rng.integers(0, 4))) for _ in range(n)]
        table = pa.table({
            "clicked": rng.integers(0, 2, n), "price": rng.random(n), "age": rng.integers(18, 90, n),
            "user_id": rng.integers(0, 10**9, n), "country": rng.choice(["de", "fr", "us", None], n),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "tag_weights": pa.array([list(rng.random(len(t))) for t in tags], pa.list_(pa.float32())),
        })  # fmt: skip
        (tmp_path / "data" / split).mkdir(parents=True)
        pq.write_table(table, tmp_path / "data" / split / "part-0.parquet", row_group_size=128)
    monkeypatch.chdir(tmp_path)
    commands = re.findall(r"```bash\n(.*?)```", page, re.S)
    assert len(commands) == 3
    for command in commands:
        args = shlex.split(command.strip())
        assert args[0] == "neorec" and main(args[1:]) == 0, command
    assert "samples: eval 200, train 600" in capsys.readouterr().out
    assert (tmp_path / "prepared" / "parquet" / "train" / "00000.parquet").is_file()
    assert sorted(p.name for p in (tmp_path / "counted" / "vocab").glob("*.npy"))  # vocabularies counted


def test_vocabulary_counted_from_parquet_matches_the_criteo_tsv_one(tmp_path, monkeypatch):
    """--vocab-threshold on Parquet input counts the training rows' raw values (held-out rows excluded) and
    gives the shards, vocabularies and table sizes that Criteo TSV preprocessing with the same threshold
    gives; a Parquet source reading the files through the counted vocabularies reads the same ids. The
    counting and the writing run in one pool of workers, started once."""
    from neorec.data import workers

    pools = []

    class CountedPool(workers.ProcessPoolExecutor):
        def submit(self, *args, **kwargs):
            if self not in pools:
                pools.append(self)
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(workers, "ProcessPoolExecutor", CountedPool)
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 3)
    out = tmp_path / "out"
    cfg = criteo_config([path], hashing="vocab", vocab_dir=str(out / "vocab"))
    preprocess_parquet(cfg, out, shard_rows=7, progress=False, vocab_threshold=2, workers=2)
    assert len(pools) == 1
    preprocess_criteo([FIXTURE], tmp_path / "tsv", vocab_threshold=2, progress=False)
    for name in CATEGORICAL_NAMES:
        assert np.array_equal(np.load(out / "vocab" / f"{name}.npy"), np.load(tmp_path / "tsv" / "vocab" / f"{name}.npy"))
    want = PreprocessedSource(tmp_path / "tsv", shuffle=False)
    got = PreprocessedSource(out, shuffle=False)
    assert [f.num_ids for f in got.info.features] == [f.num_ids for f in want.info.features]
    assert max(f.num_ids for f in got.info.features) > 1  # some value occurs twice in the training rows
    same_batches(got.train_batches(5), want.train_batches(5))
    same_batches(got.eval_batches(5), want.eval_batches(5))
    same_batches(ParquetSource(cfg).train_batches(5), want.train_batches(5))


def test_vocabulary_threshold_errors_name_the_setting(tmp_path):
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 3)
    with pytest.raises(ConfigError, match="set data.parquet.vocab_dir to that folder"):
        cfg = criteo_config([path], hashing="vocab", vocab_dir=str(tmp_path / "elsewhere"))
        preprocess_parquet(cfg, tmp_path / "out", progress=False, vocab_threshold=2)
    with pytest.raises(ConfigError, match="has none"):
        preprocess_parquet(criteo_config([path]), tmp_path / "out", progress=False, vocab_threshold=2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        preprocess_parquet(criteo_config([path]), tmp_path / "out", progress=False, vocab_threshold=0)
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_column_that_is_a_list_in_one_file_and_not_in_another_is_refused_before_writing(tmp_path):
    """Shards of a feature holding bags in one file and single ids in another cannot be read: preprocessing
    refuses the files as the Parquet source does, before it writes anything."""
    base = {"clicked": [0, 1] * 4, "price": [1.0] * 8, "user_id": list(range(8))}
    for split in ("train", "eval"):
        (tmp_path / split).mkdir()
    pq.write_table(pa.table({**base, "tags": pa.array([[1, 2]] * 8)}), tmp_path / "train" / "a.parquet")
    pq.write_table(pa.table({**base, "tags": pa.array(list(range(8)))}), tmp_path / "train" / "b.parquet")
    pq.write_table(pa.table({**base, "tags": pa.array([[1]] * 8)}), tmp_path / "eval" / "a.parquet")
    cfg = ParquetConfig(paths=[str(tmp_path / "train")], eval_paths=[str(tmp_path / "eval")], label="clicked",
                        dense=["price"], table_rows=100, features=["user_id", "tags"])  # fmt: skip
    error = r"train/b\.parquet: column 'tags' is not a list here but a list in \S*train/a\.parquet$"
    with pytest.raises(DataError, match=error):
        preprocess_parquet(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=error):
        ParquetSource(cfg)


@pytest.mark.parametrize("flag", [2, -1])
def test_an_integer_held_out_flag_other_than_0_or_1_is_refused(tmp_path, flag):
    """A cast to bool would hold a row flagged 2 out; preprocessing and the Parquet source refuse it,
    naming the file, row group, row and value."""
    flags = [1 if i % 5 == 0 else 0 for i in range(40)]
    flags[27] = flag  # row 7 of row group 1
    table = pa.table({"clicked": [i % 2 for i in range(40)], "price": [1.0] * 40, "user_id": list(range(40)),
                      "is_eval": pa.array(flags, pa.int8())})  # fmt: skip
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=20)
    cfg = ParquetConfig(paths=[str(tmp_path / "p.parquet")], eval_column="is_eval", label="clicked",
                        dense=["price"], table_rows=100, features=["user_id"])  # fmt: skip
    error = (rf"p\.parquet, row group 1, row 7: column 'is_eval' \(data\.parquet\.eval_column\) = {flag}; "
             "the held-out flag must be a boolean or 0/1 integer")  # fmt: skip
    with pytest.raises(DataError, match=error):
        preprocess_parquet(cfg, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=error):
        ParquetSource(cfg)
    flags[27] = 1
    fixed = table.set_column(3, "is_eval", pa.array(flags, pa.int8()))
    pq.write_table(fixed, tmp_path / "p.parquet", row_group_size=20)
    assert preprocess_parquet(cfg, tmp_path / "ok", progress=False).num_samples == {"train": 31, "eval": 9}
