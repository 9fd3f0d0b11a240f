"""train.compile: the dense stages under torch.compile train like eager ones, and checkpoints move
between compiled and eager runs.

Tolerance of compiled against eager losses (1e-5 relative): inductor fuses the bias, ReLU and
reductions into kernels of its own, which sum in another order than eager's (fp32 rounding, ~1e-7
relative per step); over 10 steps of a smooth model those differences stay orders of magnitude
below 1e-5, while a wrong gradient or a stale weight would move the loss by 1e-3 or more."""

from __future__ import annotations

import pytest
import torch

from neorec.config.load import load_config
from neorec.errors import ConfigError
from neorec.model import compile as compile_module
from neorec.model.compile import CompileError, apply_compile, check_compiler
from neorec.train.trainer import Trainer
from neorec.utils.kernel_cache import VARIABLES


def has_cpp_compiler() -> bool:
    try:
        check_compiler(torch.device("cpu"))
    except ConfigError:
        return False
    return True


# 3000 samples in batches of 256: 11 full batches and one of 184, which gets kernels of its own
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=5",
    "train.eval_every=null", "train.max_steps=14", "train.epochs=2", "model.bottom_mlp=[16,8]",
    "model.top_mlp=[16]", "embedding.dim=8", "checkpoint.every_steps=7", "checkpoint.keep=3",
]  # fmt: skip


def config(compiled: bool, *extra: str):
    return load_config("default", [*TINY, f"train.compile={str(compiled).lower()}", *extra])


@pytest.mark.slow
@pytest.mark.skipif(
    not has_cpp_compiler(), reason="torch.compile's CPU kernels need a C++ compiler (g++/clang++)"
)
def test_compiled_training_matches_eager_and_checkpoints_are_interchangeable(tmp_path, monkeypatch):
    eager = Trainer(config(False), tmp_path / "eager").fit()
    for variable in VARIABLES:  # the compiled run points them at its kernel cache; put back after the test
        monkeypatch.setenv(variable, str(tmp_path / "before" / variable))
    compiled_trainer = Trainer(config(True, f"train.kernel_cache={tmp_path / 'kernels'}"), tmp_path / "compiled")
    compiled = compiled_trainer.fit()
    # what inductor compiled for the dense stages is kept in train.kernel_cache, for the next run to load
    assert any(f.is_file() for f in (tmp_path / "kernels" / "inductor").rglob("*"))
    assert not (tmp_path / "before").exists()
    assert len(compiled.losses) == len(eager.losses) == 14  # the last batch of epoch 0 (184 samples) included
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    assert compiled.eval["auc"] == pytest.approx(eager.eval["auc"], abs=1e-4)

    # the same keys in checkpoints and model.pt: no `_orig_mod.` from the compiled stages
    eager_state = torch.load(tmp_path / "eager" / "model.pt", weights_only=True)
    compiled_state = torch.load(tmp_path / "compiled" / "model.pt", weights_only=True)
    assert sorted(compiled_state) == sorted(eager_state)
    for key, value in eager_state.items():
        torch.testing.assert_close(compiled_state[key], value, rtol=1e-4, atol=1e-5, msg=key)

    # an eager run resumes from the compiled run's step-7 checkpoint, a compiled one from the eager run's
    step7 = "checkpoints/step-00000007"
    from_compiled = Trainer(config(False), tmp_path / "a", resume=tmp_path / "compiled" / step7).fit()
    from_eager = Trainer(config(True), tmp_path / "b", resume=tmp_path / "eager" / step7).fit()
    assert from_compiled.losses == pytest.approx(eager.losses[7:], rel=1e-5)
    assert from_eager.losses == pytest.approx(eager.losses[7:], rel=1e-5)


def test_compiled_model_keeps_its_state_dict_keys_and_evaluates_eagerly():
    from neorec.train.build import build_model, build_source, build_tables
    from neorec.train.embeddings import build_embeddings

    cfg = config(False)
    source = build_source(cfg)
    model = build_model(cfg, source.info, build_embeddings(cfg, build_tables(cfg, source.info)))
    keys = list(model.state_dict())
    apply_compile(model, torch.device("cpu"))  # compiles lazily: nothing is built before a training call
    assert list(model.state_dict()) == keys
    assert not any("_orig_mod" in k for k in keys)
    model.eval()
    batch = next(iter(source.eval_batches(8)))
    with torch.no_grad():
        assert model(batch).shape == (8,)  # evaluation takes the eager stages
    assert not model.bottom_stage.compiled_once and not model.top_stage.compiled_once


def test_missing_cpp_compiler_is_a_config_error():
    import torch._inductor.config as inductor_config
    from torch._inductor import cpp_builder

    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        # torch's own patch of its config: pytest's monkeypatch (9.2 and later) deletes on undo an
        # attribute the object did not hold itself, and torch's config then has no cpp.cxx at all
        with inductor_config.patch({"cpp.cxx": ("no-such-compiler-neorec",)}):
            with pytest.raises(ConfigError, match="train.compile"):
                check_compiler(torch.device("cpu"))
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()


def test_a_failing_compilation_names_the_setting(monkeypatch):
    def broken_compile(fn, dynamic=False):
        def run(x):
            raise RuntimeError("C++ compile error: cannot build the kernel")

        return run

    monkeypatch.setattr(compile_module, "check_compiler", lambda device: None)
    monkeypatch.setattr(compile_module.torch, "compile", broken_compile)
    model = torch.nn.Module()
    model.bottom_stage = lambda x: x
    model.top_stage = lambda x: x
    apply_compile(model, torch.device("cpu"))
    with pytest.raises(CompileError, match=r"train.compile.*bottom_stage.*cannot build the kernel"):
        model.bottom_stage(torch.ones(2))


def test_an_architecture_without_dense_stages_is_refused_before_launch():
    from neorec.train.build import check_before_launch

    with pytest.raises(ConfigError, match="train.compile.*deepfm"):
        check_before_launch(config(True, "model.arch=deepfm"), 1)
