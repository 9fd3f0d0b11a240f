import re
from pathlib import Path

import pytest

import neorec
from neorec.config.load import load_config, shipped_configs, validate_config
from neorec.errors import ConfigError


def test_shipped_configs_validate():
    names = shipped_configs()
    assert {"default", "criteo_kaggle", "mlperf_dcnv2", "movielens"} <= set(names)
    for name in names:
        load_config(name)


def test_overrides_apply_and_parse_yaml():
    cfg = load_config("default", ["train.max_steps=7", "model.top_mlp=[8, 4]", "embedding.optimizer.name=sgd"])
    assert cfg.train.max_steps == 7 and cfg.model.top_mlp == [8, 4] and cfg.embedding.optimizer.name == "sgd"


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"train": {"lrr": 1}}, r"unknown key 'train.lrr'; allowed keys here: .*dense_optimizer"),
        ({"train": {"dense_optimizer": {"name": "adamw"}}}, r"train.dense_optimizer.name': Input should be 'adam', 'adagrad' or 'sgd'"),
        ({"data": {"batch_size": 0}}, r"data.batch_size': Input should be greater than 0"),
        ({"data": {"batch_size": "many"}}, r"data.batch_size': Input should be a valid integer"),
        ({"embedding": {"pooling": "max"}}, r"embedding.pooling': Input should be 'sum' or 'mean'"),
        ({"data": {"source": "criteo_tsv"}}, r"key 'data': source criteo_tsv needs a data.criteo section"),
        ({"model": {"bottom_mlp": [64, 32]}}, r"bottom_mlp must end in embedding.dim \(16\)"),
        ({"data": {"synthetic": {"rows": [10, 20]}}}, r"rows has 2 entries but num_sparse is 26"),
        ({"embedding": {"tables": {"C1": {"dimm": 3}}}}, r"unknown key 'embedding.tables.C1.dimm'"),
        ({"embedding": {"tables": {"C99": {"dim": 8}}}}, r"embedding.tables.C99.dim 8 against embedding.dim"),
    ],
)
def test_bad_configs_name_the_key(raw, expected):
    with pytest.raises(ConfigError, match=expected):
        validate_config(raw)


def test_a_section_lists_its_allowed_keys_once_however_many_of_its_keys_are_unknown():
    with pytest.raises(ConfigError) as e:
        validate_config({"train": {"lrr": 1, "epoch": 2}, "model": {"archh": "dlrm"}})
    message = str(e.value)
    assert "unknown key 'train.lrr'" in message and "unknown key 'train.epoch'" in message
    assert message.count("allowed keys here") == 2  # train's once, model's once
    assert message.count("dense_optimizer") == 1


def test_table_settings_of_the_custom_preset_are_refused_under_another_preset():
    """data.synthetic.num_sparse and rows choose the custom preset's tables: under a preset with its
    own tables they would do nothing, so changing them there is refused, naming them."""
    with pytest.raises(ConfigError, match=r"data.synthetic.num_sparse choose the tables of preset custom; "
                       r"preset criteo_kaggle has its own 26"):  # fmt: skip
        load_config("default", ["data.synthetic.num_sparse=4"])  # default.yaml: preset criteo_kaggle
    with pytest.raises(ConfigError, match=r"data.synthetic.num_sparse and data.synthetic.rows choose"):
        load_config("default", ["data.synthetic.num_sparse=4", "data.synthetic.rows=50"])
    assert load_config("default", ["data.synthetic.preset=custom", "data.synthetic.num_sparse=4"]).data.synthetic.num_tables == 4
    # a saved config holds every key at its value: the defaults pass under any preset
    cfg = load_config("default")
    assert validate_config(cfg.model_dump(mode="json")) == cfg


def test_a_check_across_sections_is_its_own_message():
    with pytest.raises(ConfigError) as e:
        load_config("default", ["embedding.dim=8"])  # the default bottom MLP ends in 16
    assert str(e.value).endswith(": model.bottom_mlp must end in embedding.dim (8) for dlrm's pairwise interaction, "
                                 "got [64, 16]"), str(e.value)  # fmt: skip
    assert "top level" not in str(e.value)


def test_a_key_with_control_characters_is_named_on_one_line():
    """A key is shown escaped: the error stays one line whatever a --set or a file puts in it."""
    with pytest.raises(ConfigError) as info:
        validate_config({"data": {"follow": {"\n": None, "a\tb": 1}}})
    assert "\n" not in str(info.value) and "\t" not in str(info.value)
    assert "unknown key 'data.follow.\\n'" in str(info.value)
    assert "unknown key 'data.follow.a\\tb'" in str(info.value)


def test_bad_override_syntax_and_unknown_file(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config("default", ["train.max_steps"])
    with pytest.raises(ConfigError, match="neither a file nor a shipped config"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(str(bad))
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(bad))


def test_unknown_table_override_is_rejected_before_training():
    from neorec.data.source import FeatureSpec, SourceInfo
    from neorec.train.build import build_tables

    cfg = load_config("default", ["embedding.tables={C99: {dim: 16}}"])
    with pytest.raises(ConfigError, match=r"embedding.tables names \['C99'\]"):
        build_tables(cfg, SourceInfo(13, [FeatureSpec("C1", 10)]))


# ---- how a config is resolved: file, base, --set ---------------------------------------------------
def test_a_config_file_is_merged_over_default_and_set_applies_last(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("embedding:\n  dim: 32\n  optimizer: {lr: 0.5}\nmodel: {bottom_mlp: [64, 32]}\ntrain: {max_steps: 5}\n")
    cfg = load_config(str(mine), ["train.max_steps=7"])
    assert cfg.embedding.dim == 32 and cfg.model.bottom_mlp == [64, 32] and cfg.train.max_steps == 7
    default = load_config("default")
    assert cfg.data == default.data  # the file left data alone: default's, not the schema's
    assert cfg.embedding.optimizer.name == default.embedding.optimizer.name != "sgd"  # merged key by key
    assert cfg.embedding.optimizer.lr == 0.5 and cfg.model.top_mlp == default.model.top_mlp


def test_base_names_a_shipped_config_or_a_path_next_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "parent.yaml").write_text("base: movielens\ntrain: {epochs: 3}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: sub/parent.yaml\nembedding: {dim: 64}\nmodel: {bottom_mlp: [64, 64]}\n")
    cfg = load_config(str(child))
    movielens = load_config("movielens")
    assert cfg.data == movielens.data and cfg.train.epochs == 3 and cfg.embedding.dim == 64
    assert cfg.model.top_mlp == movielens.model.top_mlp


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"bases form a cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"),
        ({"a.yaml": "base: [default]\n"}, r"a.yaml: key 'base': expected a shipped config name or a path"),
        ({"a.yaml": "base: nowhere.yaml\n"}, r"a.yaml: key 'base': 'nowhere.yaml' \(looked for .*\)"),
        # in a chain, the config that names the missing base
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: gone\n"}, r"b.yaml: key 'base': 'gone' \(looked for"),
        ({"a.yaml": "base: default\ntrain: {lrr: 1}\n"}, r"a.yaml over neorec/configs/default.yaml: unknown key 'train.lrr'"),
    ],
)
def test_bad_bases_are_errors(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(str(tmp_path / "a.yaml"))


def test_shipped_configs_keep_every_value_they_set():
    import yaml

    from neorec.config.load import DEFAULT_BASE

    def leaves(raw, prefix=""):
        for k, v in raw.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

    for name in shipped_configs():
        raw = yaml.safe_load((Path(neorec.__file__).parent / "configs" / f"{name}.yaml").read_text())
        cfg = load_config(name).model_dump(mode="json")
        for key, value in leaves(raw):
            if key == "base":  # which config it is merged over, not a value of its own
                continue
            node = cfg
            for part in key.split("."):
                node = node[part]
            assert node == value, (name, key)
    assert load_config(DEFAULT_BASE) == validate_config(
        yaml.safe_load((Path(neorec.__file__).parent / "configs" / "default.yaml").read_text())
    )


def test_empty_unreadable_and_valueless_inputs_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--set 'train.max_steps=': empty value"):
        load_config("default", ["train.max_steps="])
    for name, data in [("empty.yaml", b""), ("comments.yaml", b"# only a comment\n"), ("bin.yaml", b"\xff\xfe\x00")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"{name}: (empty config|not a YAML config)"):
            load_config(str(tmp_path / name))
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(str(tmp_path))
    assert load_config("default", ["train.max_steps=null"]).train.max_steps is None


# ---- numbers are never booleans --------------------------------------------------------------------
def _numeric_keys():
    from neorec.config.reference import TABLE, config_keys

    for k in config_keys():
        kinds = k.type.split(" or ")
        if "bool" not in kinds and ({"int", "float"} & set(kinds) or {"list[int]", "list[float]"} & set(kinds)):
            yield k.key.replace(TABLE, "C1"), any(t.startswith("list") for t in kinds) and not (
                {"int", "float"} & set(kinds)
            )


@pytest.mark.parametrize("key, only_list", list(_numeric_keys()))
def test_every_number_field_rejects_booleans(key, only_list):
    value = "[true]" if only_list else "true"
    with pytest.raises(ConfigError, match=rf"key '{re.escape(key)}': expected a (number|list of numbers)"):
        load_config("default", [f"{key}={value}"])


def test_boolean_fields_still_take_booleans():
    cfg = load_config("default", ["logging.plot=false", "embedding.cache.io_thread=true", "train.progress=false"])
    assert cfg.logging.plot is False and cfg.embedding.cache.io_thread is True and cfg.train.progress is False
    with pytest.raises(ConfigError, match="data.synthetic.rows': expected a list of numbers"):
        load_config("default", ["data.synthetic.rows=[3, true]"])


def test_sharding_of_an_unknown_table_is_an_error_with_one_process():
    from neorec.data.source import FeatureSpec, SourceInfo
    from neorec.train.build import build_tables

    cfg = load_config("default", ["distributed.sharding={C99: {kind: tw, ranks: [0]}}"])
    with pytest.raises(ConfigError, match=r"distributed.sharding names \['C99'\], which are not tables"):
        build_tables(cfg, SourceInfo(13, [FeatureSpec("C1", 10)]))


# ---- config show, config keys, docs/config.md ------------------------------------------------------
def test_show_config_reads_back_and_explains_every_key():
    import yaml

    from neorec.config.load import apply_override, read_config
    from neorec.config.reference import config_keys, show_config

    # every source's section, validated as a record holds them (load_config refuses those of a source
    # other than data.source that --set writes)
    raw, _ = read_config("default")
    for item in ["embedding.tables={C1: {dim: 16, optimizer: {name: sgd}}}",
                 "data.criteo={train_paths: [a.tsv]}", "data.preprocessed={path: p}",
                 "data.parquet={paths: [a.parquet], eval_column: f, features: [a, {name: b}]}"]:  # fmt: skip
        apply_override(raw, item)
    cfg = validate_config(raw)
    text = show_config(cfg)
    assert validate_config(yaml.safe_load(text)) == cfg
    described = [k for k in config_keys() if k.description and "<table>" not in k.key]
    follow = show_config(load_config("continuous"))  # data.follow needs a Parquet or preprocessed source
    for k in described:  # every key is shown with its description
        shown = follow if k.key.startswith("data.follow.") else text
        assert f"{k.key.split('.')[-1]}:" in shown and f"# {k.description}" in shown, k.key


def test_docs_config_md_is_current():
    from neorec.config.reference import keys_markdown

    page = Path(__file__).parents[1] / "docs" / "config.md"
    assert page.read_text() == keys_markdown() + "\n", (
        "docs/config.md is out of date with neorec/config: run `neorec config keys --markdown > docs/config.md`"
    )


def test_docs_config_md_example_loads(tmp_path):
    """The config that docs/config.md shows loads, and means what the page says."""
    page = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    (tmp_path / "mine.yaml").write_text(page.split("```yaml\n")[1].split("```")[0])
    cfg = load_config(str(tmp_path / "mine.yaml"), ["train.max_steps=20"])
    assert cfg.data.source == "movielens" and cfg.embedding.dim == 64 and cfg.train.epochs == 3
    assert cfg.model == load_config("movielens").model and cfg.train.max_steps == 20
