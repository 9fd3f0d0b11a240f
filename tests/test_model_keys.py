"""Model keys that the chosen model does not read are refused before any work (neorec/config/model_keys.py),
counting only what `--set` and the config file itself write; DIN's cross layers take model.low_rank."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from neorec.cli import main
from neorec.config.load import dump_config, load_config, shipped_configs
from neorec.errors import ConfigError

ML_ROOT = Path(__file__).parents[2] / "shared" / "data" / "ml-latest-small"
needs_movielens = pytest.mark.skipif(
    not (ML_ROOT / "ratings.csv").is_file(), reason=f"shared MovieLens latest-small not found at {ML_ROOT}"
)
TASKS = "model.tasks=[{name: click}]"
DLRM_TRUNK = "multitask with model.trunk dlrm"
DCN_USERS = "dcnv2, multitask with model.trunk dcnv2, din with model.din.cross_layers > 0"


@pytest.mark.parametrize(
    "config, sets, key, model, users",
    [
        ("default", ["model.arch=dcnv2", "model.self_interaction=true"], "self_interaction",
         "model.arch dcnv2", f"dlrm, {DLRM_TRUNK}"),
        ("default", ["model.arch=deepfm", "model.self_interaction=true"], "self_interaction",
         "model.arch deepfm", f"dlrm, {DLRM_TRUNK}"),
        ("default", ["model.arch=multitask", TASKS, "model.trunk=dcnv2", "model.self_interaction=true"],
         "self_interaction", "model.arch multitask with model.trunk dcnv2", f"dlrm, {DLRM_TRUNK}"),
        ("default", ["model.arch=dlrm", "model.low_rank=4"], "low_rank", "model.arch dlrm", DCN_USERS),
        ("default", ["model.arch=dlrm", "model.cross_layers=7"], "cross_layers", "model.arch dlrm",
         "dcnv2, multitask with model.trunk dcnv2"),
        ("default", ["model.arch=deepfm", "model.low_rank=4"], "low_rank", "model.arch deepfm", DCN_USERS),
        ("default", ["model.arch=multitask", TASKS, "model.low_rank=4"], "low_rank",
         "model.arch multitask with model.trunk dlrm", DCN_USERS),
        ("default", ["model.trunk=dcnv2"], "trunk", "model.arch dlrm", "multitask"),
        ("default", ["model.din.max_len=9"], "din.max_len", "model.arch dlrm", "din"),
        ("default", ["model.two_tower.temperature=0.1"], "two_tower.temperature", "model.arch dlrm",
         "two_tower"),
        ("movielens_two_tower", ["model.precision=bf16"], "precision", "model.arch two_tower",
         "dlrm, dcnv2, deepfm, multitask, din"),
        ("movielens_two_tower", ["model.bottom_mlp=[7,3]"], "bottom_mlp", "model.arch two_tower",
         "dlrm, dcnv2, deepfm, multitask, din"),
        ("movielens_two_tower", ["model.top_mlp=[5]"], "top_mlp", "model.arch two_tower",
         "dlrm, dcnv2, deepfm, multitask, din"),
        ("movielens_seq", ["model.din.cross_layers=0", "model.low_rank=2"], "low_rank",
         "model.arch din with model.din.cross_layers 0 (no cross layers)", DCN_USERS),
        ("movielens_seq", ["model.cross_layers=5"], "cross_layers", "model.arch din",
         "dcnv2, multitask with model.trunk dcnv2"),
    ],
)  # fmt: skip
def test_a_key_the_model_does_not_read_is_refused_naming_key_model_and_users(config, sets, key, model, users):
    with pytest.raises(ConfigError) as e:
        load_config(config, sets)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"key 'model.{key}' is set, but {model} does not use it (used by: {users}); remove it" in msg, msg


def test_the_command_line_refuses_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--set", "model.arch=dlrm", "--set", "model.low_rank=4", "--output-dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1, err
    assert "key 'model.low_rank' is set, but model.arch dlrm does not use it" in err
    assert not out.exists()


def test_a_config_file_of_your_own_counts_and_its_bases_do_not(tmp_path):
    (tmp_path / "dcn.yaml").write_text("model: {arch: dcnv2, low_rank: 8, cross_layers: 2}\n")
    (tmp_path / "fm.yaml").write_text("base: dcn.yaml\nmodel: {arch: deepfm, bottom_mlp: [64, 16]}\n")
    assert load_config(str(tmp_path / "fm.yaml")).model.low_rank == 8  # from its base: kept, not read
    (tmp_path / "fm_own.yaml").write_text("base: dcn.yaml\nmodel: {arch: deepfm, self_interaction: true}\n")
    with pytest.raises(ConfigError, match=r"fm_own.yaml over .*: key 'model.self_interaction' is set, but"):
        load_config(str(tmp_path / "fm_own.yaml"))
    (tmp_path / "ml.yaml").write_text("base: movielens\nmodel: {arch: deepfm}\n")  # movielens: cross_layers 3
    assert load_config(str(tmp_path / "ml.yaml")).model.arch == "deepfm"
    # a key written with its default value asks for nothing the model lacks
    assert load_config("default", ["model.arch=dcnv2", "model.self_interaction=false"]).model.arch == "dcnv2"


@pytest.mark.parametrize("name", shipped_configs())
def test_shipped_configs_load_switch_model_and_their_runs_config_yaml_loads(name, tmp_path):
    cfg = load_config(name)
    for arch in ("dlrm", "dcnv2", "deepfm"):  # what a shipped config writes does not count
        try:
            load_config(name, [f"model.arch={arch}"])
        except ConfigError as e:
            assert "is set, but" not in str(e), e
    # a run's config.yaml lists every key (a record of the run): it loads as the config it records
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_config(str(tmp_path / "config.yaml")) == cfg
    unread = "model.self_interaction" if cfg.model.arch == "two_tower" else "model.two_tower.temperature"
    with pytest.raises(ConfigError, match=f"key '{unread}' is set"):  # --set over it still counts
        load_config(str(tmp_path / "config.yaml"), [f"{unread}=1"])


@needs_movielens
def test_din_cross_layers_take_low_rank(tmp_path):
    from neorec.model.interaction import CrossNetwork
    from neorec.train.build import build_model, build_source, build_tables
    from neorec.train.embeddings import build_embeddings

    root = tmp_path / "ml"
    root.mkdir()
    lines = (ML_ROOT / "ratings.csv").read_text().splitlines()[:2001]
    (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    shutil.copy(ML_ROOT / "movies.csv", root / "movies.csv")

    def din(*sets: str):
        cfg = load_config("movielens_seq", [f"data.movielens.root={root}", "model.din.cross_layers=2", *sets])
        source = build_source(cfg)
        embeddings = build_embeddings(cfg, build_tables(cfg, source.info))
        return build_model(cfg, source.info, embeddings), next(iter(source.train_batches(64, 0)))

    full, batch = din()
    low, _ = din("model.low_rank=3")
    assert isinstance(low.cross, CrossNetwork) and low.cross.low_rank == 3 and len(low.cross.w) == 2
    width = full.cross.w[0].in_features
    assert [tuple(v.weight.shape) for v in low.cross.v] == [(3, width)] * 2
    assert sum(p.numel() for p in low.parameters()) < sum(p.numel() for p in full.parameters())
    with torch.no_grad():
        assert low(batch).shape == full(batch).shape and not torch.equal(low(batch), full(batch))
    again, _ = din("model.low_rank=3")  # the same layers from the same seed: a run's export rebuilds them
    pairs = zip(low.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
