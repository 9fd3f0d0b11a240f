"""What a run's rows mean, kept: `neorec export --config` refuses a config whose data maps raw values
to other rows (or makes other dense inputs) than training did, naming the key and both values; the
Parquet copy of an unfinished `neorec data preprocess --parquet-output` is refused when read, not read
in part; a Criteo TSV input with no line that is not blank is refused as an empty file whatever its
compression, by training, preprocessing and predict alike."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from neorec.cli import main as cli_main
from neorec.config.load import dump_config, load_config
from neorec.config.schema import ParquetConfig
from neorec.data.criteo import CATEGORICAL_NAMES, DENSE_NAMES, CriteoTSVSource
from neorec.data.criteo_lines import check_tsv_file
from neorec.data.parquet import ParquetSource, list_files
from neorec.data.preprocess import preprocess_criteo
from neorec.errors import ConfigError, DataError
from neorec.serving import export_model
from neorec.train.build import build_source, build_tables
from neorec.train.trained_lookups import check_same_mapping, check_trained_lookups
from neorec.train.trainer import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
QUIET = ["train.progress=false", "logging.plot=false", "logging.tensorboard=false"]
SMALL = ["embedding.dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8]", "data.batch_size=6", *QUIET]


def one_error_line(capsys, argv: list[str], *words: str) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


# ---- 1. export --config: the same mapping of values to rows -----------------------------------------
@pytest.fixture(scope="module")
def criteo_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mapping")
    sets = ["data.source=criteo_tsv", f"data.criteo={{train_paths: [{FIXTURE}], table_rows: 50}}",
            "train.max_steps=2", "checkpoint.every_steps=2", *SMALL]  # fmt: skip
    Trainer(load_config("default", sets), root / "run").fit()
    return root / "run"


def with_criteo(run: Path, out: Path, **criteo) -> Path:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["criteo"].update(criteo)
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_export_refuses_another_criteo_hashing_on_one_line(criteo_run, tmp_path, capsys):
    other = with_criteo(criteo_run, tmp_path / "other.yaml", hashing="hash")
    out = tmp_path / "m.nrx"
    one_error_line(
        capsys, ["export", str(criteo_run), "--config", str(other), "--out", str(out), "--no-eval"],
        f"{criteo_run / 'model.pt'}: data.criteo.hashing is 'modulo' in {criteo_run / 'config.yaml'} but "
        f"'hash' in {other}", "--config may change how the data is read, not how values map to rows",
    )  # fmt: skip
    assert not out.exists() and not list(tmp_path.glob(".m.nrx*"))
    checkpoint = r"step-00000002: data\.criteo\.hashing is 'modulo'"
    with pytest.raises(ConfigError, match=checkpoint):
        export_model(criteo_run / "checkpoints", out, config=other, measure=False)


def test_export_takes_a_config_that_only_reads_otherwise(criteo_run, tmp_path):
    """Other held-out files, bad-line policy and line limit: the same rows, so the same model."""
    held_out = tmp_path / "held_out.tsv"
    held_out.write_text("".join(FIXTURE.read_text().splitlines(True)[:5]))
    other = with_criteo(criteo_run, tmp_path / "other.yaml", eval_paths=[str(held_out)], bad_lines="skip",
                        max_line_bytes=8192)  # fmt: skip
    export_model(criteo_run, tmp_path / "m.nrx", config=other, measure=False)
    assert (tmp_path / "m.nrx").is_file()


def criteo_config(**criteo) -> object:
    section = {"train_paths": [str(FIXTURE)], "table_rows": 50, **criteo}
    return load_config("default", ["data.source=criteo_tsv", f"data.criteo={json.dumps(section)}"])


def preprocessed_config(path: Path) -> object:
    return load_config("default", ["data.source=preprocessed", f"data.preprocessed.path={path}"])


def test_table_rows_and_preprocessed_manifests_are_compared(tmp_path, neorec_warnings):
    trained = criteo_config()
    run_config = tmp_path / "run" / "config.yaml"
    rows = [50, 50, 60] + [50] * 23
    with pytest.raises(ConfigError, match=r"data\.criteo\.table_rows of C3 is 50 in .* but 60 in now\.yaml"):
        check_same_mapping(run_config, trained, criteo_config(table_rows=rows), "now.yaml")
    for hashing in ("modulo", "hash"):
        preprocess_criteo([FIXTURE], tmp_path / hashing, table_rows=50, hashing=hashing, progress=False)
    # the same file preprocessed with the same hashing maps alike; with another, it is refused
    check_same_mapping(run_config, trained, preprocessed_config(tmp_path / "modulo"), "now.yaml")
    manifest = tmp_path / "hash" / "manifest.json"
    words = f"data.criteo.hashing is 'modulo' in {run_config} but {manifest} hashing is 'hash' in now.yaml"
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_same_mapping(run_config, trained, preprocessed_config(tmp_path / "hash"), "now.yaml")
    # between two preprocessed folders, and a preprocessed run whose manifest is gone: a warning
    with pytest.raises(ConfigError, match="manifest.json hashing is 'modulo' in .* but .*manifest.json hash"):
        check_same_mapping(run_config, preprocessed_config(tmp_path / "modulo"),
                           preprocessed_config(tmp_path / "hash"), "now.yaml")  # fmt: skip
    check_same_mapping(run_config, preprocessed_config(tmp_path / "gone"), criteo_config(hashing="hash"), "x")
    assert "so how values map to rows is not compared with x" in neorec_warnings.text
    with pytest.raises(ConfigError, match=r"data\.source is criteo_tsv in .* but synthetic in now\.yaml"):
        check_same_mapping(run_config, trained, load_config("default"), "now.yaml")
    # a table under managed collision takes raw ids, not ids hashed into its rows
    section = json.dumps({"train_paths": [str(FIXTURE)], "table_rows": 50})
    mc = ["embedding.tables.C1.managed_collision.eviction=lru", "embedding.tables.C1.rows=50"]
    managed = load_config("default", ["data.source=criteo_tsv", f"data.criteo={section}", *mc])
    words = r"data\.criteo\.table_rows of C1 is 50 in .* but 'raw ids' in now\.yaml"
    with pytest.raises(ConfigError, match=words):
        check_same_mapping(run_config, trained, managed, "now.yaml")


def test_preprocessed_vocabularies_are_compared_by_their_contents(tmp_path):
    """Two folders preprocessed with one vocabulary threshold from other lines give their ids to other
    raw values: refused; the same lines preprocessed again (another folder) map alike."""
    lines = FIXTURE.read_text().splitlines(True)
    (tmp_path / "a.tsv").write_text("".join(lines[:12]))
    (tmp_path / "b.tsv").write_text("".join(lines[8:]))
    for name, source in (("a", "a.tsv"), ("a2", "a.tsv"), ("b", "b.tsv")):
        preprocess_criteo([tmp_path / source], tmp_path / name, vocab_threshold=1, progress=False)
    run_config, trained = tmp_path / "run" / "config.yaml", preprocessed_config(tmp_path / "a")
    check_same_mapping(run_config, trained, preprocessed_config(tmp_path / "a2"), "now.yaml")
    words = r"a/manifest\.json vocab/ is '.*/a/vocab' \(.*crc32 \w+\) in .* but .*b/manifest\.json vocab/ is .*crc32"
    with pytest.raises(ConfigError, match=words):
        check_same_mapping(run_config, trained, preprocessed_config(tmp_path / "b"), "now.yaml")


def parquet_cfg(**section) -> object:
    base = {"paths": ["p/train"], "eval_paths": ["p/eval"], "label": "clicked", "dense": ["x1", "x2"],
            "features": ["user_id", {"name": "item", "strings": "hex"}], "table_rows": 100}  # fmt: skip
    return load_config("default", ["data.source=parquet", f"data.parquet={json.dumps({**base, **section})}"])


@pytest.mark.parametrize(
    "changed, words",
    [
        ({"hashing": "hash"}, "data.parquet.hashing of feature 'user_id' is 'modulo' in"),
        ({"strings": "hex"}, "data.parquet.strings of feature 'user_id' is 'fnv1a' in"),
        ({"features": ["user_id", {"name": "item", "strings": "fnv1a"}]},
         "data.parquet.strings of feature 'item' is 'hex' in"),
        ({"features": [{"name": "user_id", "column": "uid"}, {"name": "item", "strings": "hex"}]},
         "data.parquet.column of feature 'user_id' is 'user_id' in"),
        ({"features": [{"name": "item", "strings": "hex"}, "user_id"]},
         "data.parquet.features (names, in order) is ['user_id', 'item'] in"),
        ({"dense": ["x2", "x1"]}, "data.parquet.dense is ['x1', 'x2'] in"),
        ({"dense_log1p": True}, "data.parquet.dense_log1p is False in"),
        ({"table_rows": 200}, "data.parquet.rows of feature 'user_id' is 100 in"),
        ({"hashing": "vocab", "vocab_dir": "v2"}, "data.parquet.hashing of feature 'user_id' is 'modulo'"),
    ],
)  # fmt: skip
def test_parquet_mapping_keys_are_refused_by_name(tmp_path, changed, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        check_same_mapping(tmp_path / "config.yaml", parquet_cfg(), parquet_cfg(**changed), "other.yaml")
    assert "\n" not in str(e.value)


def test_parquet_vocab_dir_and_weights_column_count_and_reading_settings_do_not(tmp_path):
    w, v = ({"features": ["user_id", {"name": "item", "strings": "hex", "weights": c}]} for c in ("w", "v"))
    with pytest.raises(ConfigError, match=r"data\.parquet\.weights of feature 'item' is 'w' in .* but 'v'"):
        check_same_mapping(tmp_path / "c.yaml", parquet_cfg(**w), parquet_cfg(**v), "o.yaml")
    vocab = {"hashing": "vocab", "vocab_dir": str(tmp_path / "v1")}
    by_path = r"data\.parquet\.vocab_dir is '.*v1' \(.*\) in .* but '.*v2' \(.*\) in"
    with pytest.raises(ConfigError, match=by_path):
        other = parquet_cfg(hashing="vocab", vocab_dir=str(tmp_path / "v2"))  # neither readable: by path
        check_same_mapping(tmp_path / "c.yaml", parquet_cfg(**vocab), other, "other.yaml")
    # vocabularies compare by their contents: the same folder named otherwise, or a copy, is the same
    from neorec.data.vocab import save_vocabs

    names = ["user_id", "item"]
    values = [np.array([3, 5, 9], dtype=np.uint64), np.array([1, 2], dtype=np.uint64)]
    save_vocabs(tmp_path / "v1", names, values, {})
    save_vocabs(tmp_path / "v2", names, values, {})
    for same in (str(tmp_path / "v2"), str(tmp_path / "x" / ".." / "v1")):
        other = parquet_cfg(hashing="vocab", vocab_dir=same)
        check_same_mapping(tmp_path / "c.yaml", parquet_cfg(**vocab), other, "o")
    save_vocabs(tmp_path / "v3", names, [values[0], np.array([1, 4], dtype=np.uint64)], {})
    by_values = r"vocab_dir is .*v1.*vocabularies crc32 .* but .*v3.*vocabularies crc32"
    with pytest.raises(ConfigError, match=by_values):
        check_same_mapping(tmp_path / "c.yaml", parquet_cfg(**vocab),
                           parquet_cfg(hashing="vocab", vocab_dir=str(tmp_path / "v3")), "o")  # fmt: skip
    reading = {"paths": ["q/train"], "eval_paths": ["q/eval"], "shuffle": False, "prefetch": 1, "label": "y",
               "table_rows": 100, "vocab_dir": "unused"}  # fmt: skip
    check_same_mapping(tmp_path / "c.yaml", parquet_cfg(), parquet_cfg(**reading), "other.yaml")


def test_parquet_hashing_refused_through_check_trained_lookups(tmp_path):
    g = np.random.default_rng(0)
    table = pa.table({"clicked": g.integers(0, 2, 12), "user_id": g.integers(0, 1000, 12),
                      "item": pa.array([f"{v:x}" for v in g.integers(0, 999, 12)]),
                      "x1": g.random(12), "x2": g.random(12)})  # fmt: skip
    for role in ("train", "eval"):
        (tmp_path / "p" / role).mkdir(parents=True)
        pq.write_table(table, tmp_path / "p" / role / "a.parquet")
    paths = {"paths": [str(tmp_path / "p" / "train")], "eval_paths": [str(tmp_path / "p" / "eval")]}
    run_config = tmp_path / "run" / "config.yaml"
    run_config.parent.mkdir()
    run_config.write_text(dump_config(parquet_cfg(**paths)))
    cases = (({"shuffle": False}, None), ({"hashing": "hash"}, "hashing of feature 'user_id'"))
    for changed, refused in cases:
        now = parquet_cfg(**paths, **changed)
        info = build_source(now, wait=False).info
        if refused is None:
            check_trained_lookups(run_config, build_tables(now, info), info, "other.yaml", config=now)
            continue
        with pytest.raises(ConfigError, match=re.escape(f"run/model.pt: data.parquet.{refused} is 'modulo'")):
            check_trained_lookups(run_config, build_tables(now, info), info, "other.yaml", config=now)


# ---- 2. the Parquet copy of an unfinished preprocessing --------------------------------------------
def copy_config(out: Path, **kw) -> ParquetConfig:
    kw = {"paths": [str(out / "parquet" / "train")], "eval_paths": [str(out / "parquet" / "eval")], **kw}
    return ParquetConfig(dense=DENSE_NAMES, features=CATEGORICAL_NAMES, hashing="none", table_rows=50, **kw)


def test_an_unfinished_parquet_copy_is_refused_until_the_rerun_finishes_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "prep"
    args = dict(table_rows=50, shard_lines=5, progress=False, parquet_output=True)
    assert not preprocess_criteo([FIXTURE], out, max_shards=1, **args).complete
    assert (out / "parquet" / "train" / "00000.parquet").is_file()
    train = out / "parquet" / "train"
    words = (f"{train}: part of the Parquet copy of a `neorec data preprocess --parquet-output` that did not "
             f"finish ({out / 'manifest.json'} says complete: false; 1 of 4 shards written)")  # fmt: skip
    with pytest.raises(DataError, match=re.escape(words) + ".*same preprocess command again.*--out"):
        ParquetSource(copy_config(out))
    for path in (out / "parquet", out / "parquet" / "eval", train / "00000.parquet"):
        with pytest.raises(DataError, match="did not finish"):
            list_files(str(path))
    for where, path in ((out / "parquet", "train"), (train, "."), (train, "00000.parquet")):  # relative
        monkeypatch.chdir(where)
        with pytest.raises(DataError, match="did not finish"):
            list_files(path)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    section = copy_config(out).model_dump()
    config.write_text(yaml.safe_dump({"data": {"source": "parquet", "parquet": section}}))
    one_error_line(capsys, ["train", "--config", str(config), "--output-dir", str(tmp_path / "run")],
                   "did not finish", "1 of 4 shards written")  # fmt: skip
    assert not (tmp_path / "run" / "model.pt").exists()
    # the same call again finishes it: every shard, read back
    assert preprocess_criteo([FIXTURE], out, **args).complete
    source = ParquetSource(copy_config(out, shuffle=False))
    assert source.num_samples("train") == 18 and source.num_samples("eval") == 2


def test_a_rerun_writing_a_damaged_shard_again_makes_the_copy_unfinished(tmp_path):
    out = tmp_path / "prep"
    args = dict(table_rows=50, shard_lines=5, progress=False, parquet_output=True)
    preprocess_criteo([FIXTURE], out, **args)
    ParquetSource(copy_config(out))
    (out / "shards" / "00001" / "train" / "labels.npy").unlink()
    assert not preprocess_criteo([FIXTURE], out, max_shards=0, **args).complete  # reopened, not yet written
    with pytest.raises(DataError, match="3 of 4 shards written"):
        ParquetSource(copy_config(out))


def test_parquet_folders_no_preprocess_wrote_read_as_before(tmp_path):
    table = pa.table({"label": [0.0, 1.0], **{n: [1.0, 2.0] for n in DENSE_NAMES},
                      **{n: pa.array([1, 2], pa.int32()) for n in CATEGORICAL_NAMES}})  # fmt: skip
    for role in ("train", "eval"):
        (tmp_path / "parquet" / role).mkdir(parents=True)
        pq.write_table(table, tmp_path / "parquet" / role / "a.parquet")
    ParquetSource(copy_config(tmp_path))  # no manifest.json above the parquet folder
    (tmp_path / "manifest.json").write_text(json.dumps({"complete": False, "format": "another tool's"}))
    ParquetSource(copy_config(tmp_path))
    (tmp_path / "manifest.json").write_text("not json")
    ParquetSource(copy_config(tmp_path))


# ---- 3. Criteo TSV inputs with no lines --------------------------------------------------------------
def empty_inputs(tmp_path: Path) -> list[Path]:
    paths = {"empty.tsv": b"", "empty.tsv.gz": gzip.compress(b""), "blank.tsv": b"\n  \n\t\n",
             "blank.tsv.gz": gzip.compress(b"\n\n \n")}  # fmt: skip
    for name, data in paths.items():
        (tmp_path / name).write_bytes(data)
    return [tmp_path / name for name in paths]


def test_tsv_inputs_without_lines_are_one_empty_file_error(tmp_path):
    for path in empty_inputs(tmp_path):
        with pytest.raises(DataError, match=re.escape(f"{path}: empty file (no lines, or blank ones only")):
            check_tsv_file(path)
        with pytest.raises(DataError, match="empty file"):  # as training data or as held-out data
            CriteoTSVSource([FIXTURE], [path], table_rows=50)
        with pytest.raises(DataError, match="empty file"):
            preprocess_criteo([path], tmp_path / f"out-{path.name}", progress=False)
    # lines with blank ones after them, plain or .gz, and a damaged .gz left to the reader to name
    lines = FIXTURE.read_bytes() + b"\n\n"
    (tmp_path / "ok.tsv.gz").write_bytes(gzip.compress(lines))
    check_tsv_file(tmp_path / "ok.tsv.gz")
    source = CriteoTSVSource([tmp_path / "ok.tsv.gz"], table_rows=50)
    assert sum(len(b) for b in source.train_batches(8)) == 18
    (tmp_path / "bad.tsv.gz").write_bytes(b"not gzip at all")
    check_tsv_file(tmp_path / "bad.tsv.gz")


def test_predict_refuses_an_empty_gz_as_an_empty_file(criteo_run, tmp_path, capsys):
    model = tmp_path / "m.nrx"
    export_model(criteo_run, model, measure=False)
    for path in empty_inputs(tmp_path):
        one_error_line(capsys, ["predict", str(model), "--out", str(tmp_path / "p.txt"), "--data", str(path)],
                       f"{path}: empty file")  # fmt: skip
        assert not (tmp_path / "p.txt").exists()
    shutil.copy(FIXTURE, tmp_path / "lines.tsv")
    data = ["--data", str(tmp_path / "lines.tsv")]
    assert cli_main(["predict", str(model), "--out", str(tmp_path / "p.txt"), *data]) == 0
    assert len((tmp_path / "p.txt").read_text().splitlines()) == 20
