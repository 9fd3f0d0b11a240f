import pytest

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
    ],
)
def test_bad_configs_name_the_key(raw, expected):
    with pytest.raises(ConfigError, match=expected):
        validate_config(raw)


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
