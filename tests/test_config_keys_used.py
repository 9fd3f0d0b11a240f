"""Keys a config sets for a part of the run that does not read them (neorec/config/unread_keys.py): a
record of a run is told from a hand-written file by every key of the schema; settings of a data source
other than data.source are refused as model keys of another model are. Per-table optimizer sections
merge over embedding.optimizer; a run's config.yaml records the folder it wrote."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from tiny_cli import TINY, sets

from neorec.cli import main
from neorec.config.load import dump_config, load_config, shipped_configs
from neorec.config.schema import ModelConfig
from neorec.errors import ConfigError

ROOT = Path(__file__).parents[1]
SIX_KEYS = "model: {arch: dlrm, bottom_mlp: [64,16], top_mlp: [128,64], self_interaction: false, "
PARQUET = "data.parquet={paths: [a.parquet], eval_column: f, features: [a]}"
PREPROCESSED = ["data.source=preprocessed", "data.preprocessed.path=p"]


def show(capsys, *argv: str) -> str:
    """The stdout of `neorec config show ARGV` (which must succeed)."""
    assert main(["config", "show", *argv]) == 0
    return capsys.readouterr().out


def refused(capsys, *argv: str) -> str:
    """The one error line of `neorec ARGV`, which must stop with status 2."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---- a record of a run, and a hand-written file ---------------------------------------------------
def test_a_hand_written_model_section_of_six_keys_is_no_record(tmp_path, capsys):
    path = tmp_path / "f4.yaml"
    path.write_text(SIX_KEYS + "cross_layers: 7, low_rank: 4}\n")
    err = refused(capsys, "config", "show", "--config", str(path))
    assert "key 'model.cross_layers' is set, but model.arch dlrm does not use it" in err
    assert "key 'model.low_rank' is set, but model.arch dlrm does not use it" in err


def test_a_record_lists_every_key_of_the_model_and_of_its_sections(tmp_path):
    cfg = load_config(None, ["model.arch=dcnv2", "model.low_rank=8"])
    record = yaml.safe_load(dump_config(cfg))
    record["model"]["arch"] = "deepfm"
    record["model"]["bottom_mlp"] = [64, 16]
    (tmp_path / "record.yaml").write_text(yaml.safe_dump(record))
    assert load_config(str(tmp_path / "record.yaml")).model.low_rank == 8  # a record: kept, not read
    for section in ("din", "two_tower"):  # a section not in full: no record, and low_rank counts
        partial = yaml.safe_load(dump_config(cfg))
        partial["model"]["arch"] = "deepfm"
        partial["model"]["bottom_mlp"] = [64, 16]
        partial["model"][section].popitem()
        (tmp_path / f"no_{section}.yaml").write_text(yaml.safe_dump(partial))
        with pytest.raises(ConfigError, match="key 'model.low_rank' is set, but model.arch deepfm"):
            load_config(str(tmp_path / f"no_{section}.yaml"))
    every_field = {name: record["model"][name] for name in ModelConfig.model_fields}
    assert every_field == record["model"]  # the record these files were cut from holds nothing more


def test_an_older_runs_config_yaml_without_a_newer_key_is_read_as_a_hand_written_file(tmp_path):
    """What the module docstring of neorec/config/unread_keys.py says of such a file."""
    older = yaml.safe_load(dump_config(load_config(None, ["model.arch=dcnv2"])))
    older["model"].pop("din")  # a key added later
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older))
    assert load_config(str(tmp_path / "config.yaml")).model.arch == "dcnv2"  # its unread keys hold defaults
    older["model"]["arch"] = "deepfm"
    older["model"]["bottom_mlp"] = [64, 16]
    older["model"]["low_rank"] = 8
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older))
    with pytest.raises(ConfigError, match="key 'model.low_rank' is set"):
        load_config(str(tmp_path / "config.yaml"))


@pytest.mark.parametrize("name", shipped_configs())
def test_config_show_output_loads_back_as_the_config_it_shows(name, tmp_path, capsys):
    (tmp_path / "shown.yaml").write_text(show(capsys, "--config", name))
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(name)


def test_config_show_and_a_runs_config_yaml_hold_unread_keys_of_bases_and_load_back(tmp_path, capsys):
    (tmp_path / "dcn.yaml").write_text("model: {arch: dcnv2, low_rank: 8, cross_layers: 2}\n")
    (tmp_path / "fm.yaml").write_text("base: dcn.yaml\nmodel: {arch: deepfm}\n")
    cfg = load_config(str(tmp_path / "fm.yaml"), TINY)
    assert cfg.model.low_rank == 8  # from its base: kept, not read
    (tmp_path / "shown.yaml").write_text(show(capsys, "--config", str(tmp_path / "fm.yaml"), *sets(TINY)))
    assert load_config(str(tmp_path / "shown.yaml")) == cfg
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "fm.yaml"), *sets(TINY), "--output-dir", str(out)]) == 0
    capsys.readouterr()
    run = load_config(str(out / "config.yaml"))
    assert run.model_copy(update={"output_dir": cfg.output_dir}) == cfg


# ---- settings of a data source the run does not use -----------------------------------------------
@pytest.mark.parametrize(
    "config, overrides, key, source, reader",
    [
        ("default", ["data.movielens.history=50"], "data.movielens.history", "synthetic", "movielens"),
        ("default", ["data.criteo={train_paths: [x.tsv]}"], "data.criteo.train_paths", "synthetic",
         "criteo_tsv"),
        ("default", ["data.preprocessed.path=p"], "data.preprocessed.path", "synthetic", "preprocessed"),
        ("default", [PARQUET], "data.parquet.paths", "synthetic", "parquet"),
        ("default", ["data.shards_dir=s"], "data.shards_dir", "synthetic", "shards"),
        ("movielens", ["data.synthetic.train_samples=100"], "data.synthetic.train_samples", "movielens",
         "synthetic"),
        ("criteo_kaggle", [*PREPROCESSED, "data.synthetic.max_rows=9"], "data.synthetic.max_rows",
         "preprocessed", "synthetic"),
    ],
)  # fmt: skip
def test_a_setting_of_another_data_source_is_refused_naming_key_and_source(config, overrides, key, source,
                                                                          reader):
    with pytest.raises(ConfigError) as e:
        load_config(config, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    used = f"used by: data.source {reader}"
    assert f"key '{key}' is set, but data.source {source} does not use it ({used}); remove it" in msg, msg


def test_the_command_line_refuses_another_sources_settings_before_any_work(tmp_path, capsys):
    err = refused(capsys, "config", "show", "--set", "data.movielens.history=50")
    assert "key 'data.movielens.history' is set, but data.source synthetic does not use it" in err
    err = refused(capsys, "config", "show", "--set", "data.criteo={train_paths: [x.tsv]}")
    assert "key 'data.criteo.train_paths' is set, but data.source synthetic" in err
    out = tmp_path / "run"
    err = refused(capsys, "train", "--set", "data.movielens.split=random", "--output-dir", str(out))
    assert "data.movielens.split" in err and not out.exists()


def test_a_config_file_of_your_own_counts_and_bases_shipped_configs_and_defaults_do_not(tmp_path):
    (tmp_path / "mine.yaml").write_text("data: {source: movielens, synthetic: {train_samples: 10}}\n")
    with pytest.raises(ConfigError, match=r"mine.yaml over .*: key 'data.synthetic.train_samples' is set, "
                       r"but data.source movielens"):  # fmt: skip
        load_config(str(tmp_path / "mine.yaml"))
    (tmp_path / "ml.yaml").write_text("base: movielens\ndata: {source: synthetic}\n")
    assert load_config(str(tmp_path / "ml.yaml")).data.movielens.val_fraction == 0.2  # the base's: not read
    # docs/data.md's command
    assert load_config("criteo_kaggle", PREPROCESSED).data.synthetic.preset == "criteo_kaggle"
    kaggle = "base: criteo_kaggle\ndata: {source: preprocessed, preprocessed: {path: q}}\n"
    (tmp_path / "kaggle.yaml").write_text(kaggle)
    assert load_config(str(tmp_path / "kaggle.yaml")).data.source == "preprocessed"
    # values left at their defaults, and a section set to null, set nothing
    assert load_config("default", ["data.movielens.history=0", "data.criteo=null"]).data.criteo is None
    # a command that reads another source's settings (neorec data preprocess --parquet) names it
    assert load_config("default", [PARQUET], reads=("parquet",)).data.parquet is not None


def test_a_record_of_a_run_on_another_source_loads_back(tmp_path, capsys):
    (tmp_path / "shown.yaml").write_text(show(capsys, "--config", "criteo_kaggle", *sets(PREPROCESSED)))
    cfg = load_config(str(tmp_path / "shown.yaml"))
    assert cfg == load_config("criteo_kaggle", PREPROCESSED)
    assert cfg.data.synthetic.preset == "criteo_kaggle"  # a record holds every source's settings
    with pytest.raises(ConfigError, match="key 'data.synthetic.max_rows' is set"):  # --set over it counts
        load_config(str(tmp_path / "shown.yaml"), ["data.synthetic.max_rows=9"])


# ---- per-table optimizer sections -----------------------------------------------------------------
def test_a_table_optimizer_section_merges_key_by_key_over_embedding_optimizer(tmp_path, capsys):
    from neorec.data.source import FeatureSpec, SourceInfo
    from neorec.train.build import build_tables

    overrides = ["embedding.optimizer.eps=0.001", "embedding.optimizer.initial_accumulator=0.5",
                 "embedding.tables.C3.optimizer={lr: 0.05}",
                 "embedding.tables.C4.optimizer={name: sgd}"]  # fmt: skip
    cfg = load_config("default", overrides)  # default.yaml: adagrad, lr 0.1
    base = cfg.embedding.optimizer
    c3, c4 = cfg.embedding.tables["C3"].optimizer, cfg.embedding.tables["C4"].optimizer
    assert c3 == base.model_copy(update={"lr": 0.05}) and c3.name == "adagrad" and c3.eps == 0.001
    assert c4 == base.model_copy(update={"name": "sgd"}) and c4.lr == 0.1
    tables = build_tables(cfg, SourceInfo(13, [FeatureSpec(f"C{i}", 10) for i in (1, 3, 4)]))
    assert [t.optimizer for t in tables] == [None, c3, c4]
    shown = yaml.safe_load(show(capsys, *sets(overrides)))
    assert shown["embedding"]["tables"]["C3"]["optimizer"] == c3.model_dump()
    (tmp_path / "shown.yaml").write_text(yaml.safe_dump(shown))
    assert load_config(str(tmp_path / "shown.yaml")) == cfg  # merged again: the same


def test_the_per_table_example_of_docs_configuration_md_means_what_it_says(tmp_path):
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = next(b.split("```")[0] for b in page.split("```yaml\n")[1:] if "C7: {optimizer" in b)
    (tmp_path / "tables.yaml").write_text(block)
    e = load_config(str(tmp_path / "tables.yaml"), ["model.bottom_mlp=[64, 64]"]).embedding
    assert e.optimizer.name == "rowwise_adagrad" and e.optimizer.lr == 0.05
    assert e.tables["C3"].optimizer == e.optimizer.model_copy(update={"name": "adam", "lr": 0.001})
    assert e.tables["C7"].optimizer == e.optimizer.model_copy(update={"lr": 0.01})


# ---- a run's config.yaml records the folder it wrote -------------------------------------------------
def test_dump_config_records_the_folder_the_run_writes(tmp_path):
    cfg = load_config("default")
    (tmp_path / "config.yaml").write_text(dump_config(cfg, "runs/dlrm0"))
    assert load_config(str(tmp_path / "config.yaml")).resolved_output_dir == "runs/dlrm0"
    assert yaml.safe_load(dump_config(cfg, Path("runs/default")))["output_dir"] == "runs/{name}"  # its own
    assert dump_config(cfg) == dump_config(cfg, None)


# ---- docs ---------------------------------------------------------------------------------------------
def test_docs_name_every_model_and_shipped_config_and_say_what_null_does():
    archs = typing.get_args(ModelConfig.model_fields["arch"].annotation)
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in configuration.splitlines() if line.startswith("| `model` |"))
    assert all(f" {arch} " in row.replace("\\|", " ").replace("`", " ") for arch in archs), row
    guide = (ROOT / "docs" / "config.md").read_text().split("## Every key")[0]
    assert all(f"`{name}`" in guide for name in shipped_configs())
    assert all(f"`{name}`" in configuration for name in shipped_configs())
    assert "null` to\n   unset" not in guide and "not a reset to the default" in guide
    assert load_config("default", ["train.max_steps=null", "data.criteo=null"]).train.max_steps is None
    with pytest.raises(ConfigError, match="key 'model.din'"):
        load_config("default", ["model.din=null"])
