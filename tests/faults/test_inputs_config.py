"""Damaged or extreme configs through the real command line: each is one `neorec: error:` line with exit
2, before any work (no run folder, no file written), never a traceback and never minutes of parsing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tiny_cli import TINY, sets

from neorec.cli import main
from neorec.errors import ConfigError


def fails(capsys, argv: list[str], *words: str, code: int = 2) -> str:
    """`neorec argv` in this process: exit `code` with exactly one error line holding `words`."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("neorec: error:") == 1 and err.startswith("neorec: error: "), err
    assert "Traceback" not in err and len(err) < 2000, err
    for w in words:
        assert w in err, err
    return err


def train(tmp_path: Path, *more: str) -> list[str]:
    """`neorec train` of a tiny config into tmp_path/run, with `more` overrides."""
    return ["train", *sets([*TINY, *more]), "--output-dir", str(tmp_path / "run")]


def nothing_written(tmp_path: Path, *allowed: str) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(allowed)


def test_nesting_2000_levels_deep(tmp_path, capsys):
    (tmp_path / "deep.yaml").write_text("train: " + "[" * 2000 + "]" * 2000 + "\n")
    (tmp_path / "deep_map.yaml").write_text("train: " + "{a: " * 2000 + "1" + "}" * 2000 + "\n")
    fails(
        capsys, ["train", "--config", str(tmp_path / "deep.yaml")], "deep.yaml:1", "nested more than 32 deep"
    )
    fails(capsys, ["train", "--config", str(tmp_path / "deep_map.yaml")], "nested more than 32 deep")
    fails(
        capsys, train(tmp_path, "model.top_mlp=" + "[" * 2000 + "]" * 2000), "--set 'model.top_mlp'", "nested"
    )
    fails(capsys, train(tmp_path, "a" + ".a" * 2000 + "=1"), "a key of more than 32 parts")
    nothing_written(tmp_path, "deep.yaml", "deep_map.yaml")


def test_integers_of_5000_digits(tmp_path, capsys):
    (tmp_path / "big.yaml").write_text("seed: " + "9" * 5000 + "\n")
    fails(capsys, ["train", "--config", str(tmp_path / "big.yaml")], "big.yaml:1", "5000 characters")
    fails(capsys, train(tmp_path, "train.max_steps=" + "7" * 4000), "--set 'train.max_steps'", "at most 40")
    fails(capsys, train(tmp_path, "train.max_steps=" + "7" * 30), "train.max_steps", "int64")
    nothing_written(tmp_path, "big.yaml")


def test_a_521_byte_alias_bomb_is_refused_at_once(tmp_path, capsys):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert len(bomb.read_bytes()) < 600
    start = time.perf_counter()
    fails(capsys, ["config", "show", "--config", str(bomb)], "bomb.yaml:2", "alias *a", "no aliases")
    fails(capsys, train(tmp_path, "model.top_mlp=[&x 8, *x]"), "alias *x")
    assert time.perf_counter() - start < 5


def test_duplicate_keys_name_the_key_and_line(tmp_path, capsys):
    (tmp_path / "dup.yaml").write_text("train:\n  max_steps: 3\n  epochs: 1\n  max_steps: 5\n")
    fails(
        capsys, ["train", "--config", str(tmp_path / "dup.yaml")], "dup.yaml:4", "'max_steps' appears twice"
    )
    fails(capsys, train(tmp_path, "model={arch: dlrm, arch: dcnv2}"), "'arch' appears twice")
    nothing_written(tmp_path, "dup.yaml")


@pytest.mark.parametrize(
    "override, words",
    [
        ("seed=18446744073709551616", ["key 'seed'", "less than 9223372036854775808"]),
        ("seed=-1", ["key 'seed'", "greater than or equal to 0"]),
        ("train.dense_optimizer.lr=1e300", ["train.dense_optimizer.lr", "finite number", "float32"]),
        ("embedding.optimizer.lr=.inf", ["embedding.optimizer.lr", "finite number"]),
        ("embedding.optimizer.lr=.nan", ["embedding.optimizer.lr"]),
        ("train.dense_optimizer.lr=-.inf", ["train.dense_optimizer.lr"]),
        ("embedding.cache.size_mib=1e39", ["embedding.cache.size_mib", "finite number"]),
        ("train.threads=1000000000", ["key 'train.threads'", "4 per core"]),
    ],
)
def test_numbers_beyond_what_a_machine_takes(tmp_path, capsys, override, words):
    fails(capsys, train(tmp_path, override), *words)
    nothing_written(tmp_path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("embedding.dim=1000000", "embedding.dim"),
        ("data.synthetic.rows=[50, 300, 7, 10000000000000]", "data.synthetic"),
        ("model.bottom_mlp=[1000000000, 16]", "model"),
        ("model.top_mlp=[64, 100000000000000]", "model"),
        ("data.batch_size=100000000000", "data.batch_size"),
        ("data.synthetic.num_sparse=100000000", "data.synthetic.num_sparse"),
        ("embedding.tables={C1: {dim: 100000}}", "embedding.tables.C1.dim"),
    ],
)
def test_huge_dims_rows_and_mlps_are_refused_by_key(tmp_path, capsys, override, key):
    fails(capsys, train(tmp_path, override), f"key '{key}'", "less than or equal" if "dim" in key else "")
    nothing_written(tmp_path)


def test_sizes_within_bounds_that_exceed_this_machine_name_the_key(tmp_path, capsys, monkeypatch):
    """Tables of 2^40 rows x 8192 are within the schema's bounds but not in this machine's memory: the
    estimate refuses them before anything is allocated (eval and data generate build from a config)."""
    monkeypatch.setattr("neorec.config.limits.machine_memory_bytes", lambda: 64 * 2**30)
    assert main(train(tmp_path)) == 0
    capsys.readouterr()
    run = str(tmp_path / "run")
    huge = sets(["data.synthetic.rows=1099511627776", "data.synthetic.max_rows=null"])
    fails(capsys, ["eval", run, *huge], "--set data.synthetic", "trained with")  # other training data, first
    fails(capsys, ["eval", run, "--set", "model.top_mlp=[16384, 16384, 16384, 16384, 16384, 16384, 16384]",
                   "--set", "data.batch_size=16777216"], "lower model.top_mlp")  # fmt: skip
    big_teacher = sets(
        ["data.synthetic.num_dense=1024", "data.synthetic.latent_dim=8192"]
    )
    fails(
        capsys,
        ["data", "generate", *big_teacher, "--out", str(tmp_path / "gen")],
        "lower data.synthetic.latent_dim",
    )
    assert not (tmp_path / "gen").exists()


def test_tables_the_planner_may_put_on_disk_are_left_to_it(tmp_path):
    """Over several processes with embedding.cache.directory set, the plan chooses which tables live on
    disk where memory is short (and the planner checks every rank's memory): the estimate before the
    launch leaves the tables out then, and counts them for one process or a plan file."""
    from neorec.config.limits import check_memory
    from neorec.config.load import load_config

    cfg = load_config("default", ["data.synthetic.preset=custom", "data.synthetic.rows=[50000000000, 1000]",
                                  "data.synthetic.max_rows=null",
                                  "data.synthetic.num_sparse=2",
                                  f"embedding.cache.directory={tmp_path}"])  # fmt: skip
    check_memory(cfg, memory=64 * 2**30, processes=2)
    with pytest.raises(ConfigError, match="lower data.synthetic.rows"):
        check_memory(cfg, memory=64 * 2**30, processes=1)
    plan = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"plan": "plan.json"})})
    with pytest.raises(ConfigError, match="lower data.synthetic.rows"):  # a plan file: no planner to check
        check_memory(plan, memory=64 * 2**30, processes=2)


def test_a_one_megabyte_run_name(tmp_path, capsys):
    fails(capsys, train(tmp_path, "name=" + "n" * (1 << 20)), "--set", "at most 1048576 bytes")
    (tmp_path / "name.yaml").write_text("name: " + "n" * 5000 + "\n")
    fails(capsys, ["train", "--config", str(tmp_path / "name.yaml")], "name.yaml:1", "5000 characters")
    fails(capsys, train(tmp_path, "name=" + "n" * 256), "key 'name'", "plain folder name", "255 bytes")
    fails(capsys, train(tmp_path, "name=" + "é" * 128), "key 'name'", "255 bytes")  # 256 bytes of UTF-8
    nothing_written(tmp_path, "name.yaml")


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", ".", "x\\y", "nul\0byte"])
def test_a_run_name_must_be_a_plain_folder_name(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inside").mkdir()
    argv = ["train", *sets([*TINY, f"name={name!r}" if "\0" not in name else 'name="nul\\0byte"',
                            "output_dir=inside/{name}"])]  # fmt: skip
    fails(capsys, argv, "key 'name'", "plain folder name")
    nothing_written(tmp_path, "inside")
    assert not any((tmp_path / "inside").iterdir())


def test_config_files_that_are_not_utf8_text(tmp_path, capsys):
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp_path / "utf16.yaml").write_bytes("train: {max_steps: 3}\n".encode("utf-16"))
    for name in ("latin1.yaml", "utf16.yaml"):
        fails(capsys, ["config", "show", "--config", str(tmp_path / name)], name, "not UTF-8 text")


def test_a_config_file_of_100_megabytes_is_not_read(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(100 << 20)  # sparse: nothing is written, and the config is refused before reading it
    fails(capsys, ["config", "show", "--config", str(big)], "big.yaml", "at most 1048576")
