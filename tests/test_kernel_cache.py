"""train.kernel_cache: one folder where Triton and torch.compile keep compiled kernels between runs
(neorec/utils/kernel_cache.py); a folder that cannot be used stops the command before any run starts.
tests/test_compile.py checks that a compiled run leaves its kernels there."""

from __future__ import annotations

import os

import pytest
from forked import run_neorec
from tiny_cli import TINY, sets

from neorec.errors import ConfigError
from neorec.utils.kernel_cache import VARIABLES, check_kernel_cache, kernel_cache_folders, use_kernel_cache


@pytest.fixture
def variables_kept(monkeypatch):
    """The compilers' variables as they were, put back after the test (use_kernel_cache sets them)."""
    for variable in VARIABLES:
        if variable in os.environ:
            monkeypatch.setenv(variable, os.environ[variable])
        else:
            monkeypatch.delenv(variable, raising=False)


def test_the_compilers_cache_in_the_folders_of_the_setting(tmp_path, variables_kept):
    use_kernel_cache(tmp_path / "kernels")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels" / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / "inductor")
    assert all(p.is_dir() for p in kernel_cache_folders(tmp_path / "kernels").values())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "kernels" / "inductor")
    triton = pytest.importorskip("triton")
    if hasattr(triton, "knobs"):  # Triton 3.4 and later read the variable through their knobs
        assert triton.knobs.cache.dir == str(tmp_path / "kernels" / "triton")


def test_no_setting_leaves_the_compilers_as_they_are(variables_kept):
    before = {v: os.environ.get(v) for v in VARIABLES}
    use_kernel_cache(None)
    assert {v: os.environ.get(v) for v in VARIABLES} == before


def test_a_file_in_the_way_is_a_config_error(tmp_path):
    (tmp_path / "kernels").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"train.kernel_cache .*kernels is not a folder; give a folder"):
        check_kernel_cache(tmp_path / "kernels")
    (tmp_path / "k2").mkdir()
    (tmp_path / "k2" / "triton").write_text("")
    with pytest.raises(ConfigError, match=r"train.kernel_cache .*k2/triton is not a folder"):
        check_kernel_cache(tmp_path / "k2")


def test_an_unusable_kernel_cache_stops_the_command_before_the_run_starts(tmp_path):
    (tmp_path / "kernels").write_text("not a folder")
    out = tmp_path / "run"
    argv = ["train", *sets([*TINY, f"train.kernel_cache={tmp_path / 'kernels'}"]), "--output-dir", str(out)]
    p = run_neorec(argv, timeout=120)  # `python -m neorec`, forked from a process that imported neorec
    assert p.returncode == 2, p.stderr
    assert "train.kernel_cache" in p.stderr and "is not a folder; give a folder" in p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()
