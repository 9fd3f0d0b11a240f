"""`neorec eval` of a run whose model.pt does not fit the config it is given (`--set model...`, or a
pooling of the same shapes), or whose model.pt is truncated: one `neorec: error:` line naming model.pt,
exit 2, before any evaluation; and with other training data (`--set` of a data setting or the seed
that makes the training set), which would make another held-out set: refused the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from neorec.cli import main

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=1000", "data.synthetic.eval_samples=500", "data.batch_size=250",
    "train.max_steps=2", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip


def fails(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("neorec: error:") == 1 and err.startswith("neorec: error: "), err
    assert "Traceback" not in err and "auc" not in captured.out.lower(), err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *[x for kv in TINY for x in ("--set", kv)], "--output-dir", str(out)]) == 0
    return out


def test_how_two_tower_recall_is_counted_may_change():
    """Which items recall@K leaves out is a choice of the evaluation, not of the model."""
    from neorec.train.eval_data import check_eval_overrides

    check_eval_overrides(["model.two_tower.exclude_seen", "data.eval_batch_size"])


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.bottom_mlp=[32, 16]", ["size mismatch for bottom", "leave out the --set"]),
        ("model.top_mlp=[64, 64, 64, 64]", ["model.pt does not fit", "top"]),
        ("model.arch=dcnv2", ["model.pt does not fit"]),
        ("embedding.dim=8", ["model.bottom_mlp must end in embedding.dim"]),  # the config alone is wrong
        # another training set: its held-out set may hold trained samples (a MovieLens split, say)
        ("data.synthetic.rows=[50, 300, 7, 101]", ["--set data.synthetic.rows [50, 300, 7, 101]", "trained"]),
        ("seed=5", ["--set seed 5", "trained with 0", "held-out set"]),
        ("data.synthetic.train_samples=900", ["--set data.synthetic.train_samples 900"]),
        # the same shapes, another model: refused, as a checkpoint (its manifest) refuses it
        ("embedding.pooling=mean", ["model.pt: table 'C1' has pooling sum in", "but mean in --set"]),
        ("embedding.tables={C3: {pooling: mean}}", ["table 'C3' has pooling sum in"]),
        # the same shapes and state, another computation: metrics of another model, printed as the run's
        ("embedding.dtype=fp16", ["--set embedding.dtype: changes how the run's model computes"]),
        ("model.precision=bf16", ["--set model.precision: changes how the run's model computes"]),
        # a section given whole: its keys count one by one
        ("embedding.tables={C3: {dtype: fp16}}", ["--set embedding.tables.C3.dtype: changes how"]),
    ],
)
def test_eval_with_a_config_that_does_not_fit_model_pt(run, capsys, override, words):
    err = fails(capsys, ["eval", str(run), "--set", override])
    for w in words:
        assert any(alternative in err for alternative in w.split("|")), err


def test_eval_on_other_held_out_samples_of_the_same_training_data(run, capsys):
    assert main(["eval", str(run), "--set", "data.synthetic.eval_samples=300"]) == 0
    assert "num_samples | 300" in capsys.readouterr().out


@pytest.mark.parametrize("keep", [0, 100, 3000, -1000])
def test_eval_of_a_truncated_model_pt(run, tmp_path, capsys, keep):
    damaged = tmp_path / "run"
    damaged.mkdir()
    (damaged / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    data = (run / "model.pt").read_bytes()
    (damaged / "model.pt").write_bytes(data[:keep])
    fails(capsys, ["eval", str(damaged)], "model.pt")


def test_export_with_another_config_that_pools_otherwise(run, tmp_path, capsys):
    """`neorec export RUN --config OTHER`: model.pt of the run under a config whose tables pool
    otherwise has the same shapes; refused like a checkpoint's (it exported another model before)."""
    other = tmp_path / "mean.yaml"
    other.write_text((run / "config.yaml").read_text().replace("pooling: sum", "pooling: mean"))
    fails(capsys, ["export", str(run), "--config", str(other), "--out", str(tmp_path / "m.nrx"), "--no-eval"],
          f"model.pt: table 'C1' has pooling sum in {run / 'config.yaml'} but mean in {other}")  # fmt: skip
    assert not (tmp_path / "m.nrx").exists()
