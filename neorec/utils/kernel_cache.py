"""Where compiled kernels are kept between runs (`train.kernel_cache`).

Triton compiles the fused engine's kernels (neorec/embedding/fused/triton_*.py) the first time a
run launches each of their variants, and torch.compile (`train.compile`) compiles the dense stages.
Both keep what they compiled in a cache folder and load it in later runs instead of compiling
again: Triton in TRITON_CACHE_DIR (default ~/.triton/cache), inductor in TORCHINDUCTOR_CACHE_DIR
(default <tmp>/torchinductor_<user>, which a reboot may empty). `train.kernel_cache` names one
folder for both, as its triton/ and inductor/: for a machine whose home or /tmp is not kept
between jobs, or a folder shared by the jobs of a cluster. Unset, each keeps its own default (or
the variable the user set).

Both read their variable each time they compile, so setting it as the run starts, before its first
kernel, is enough; the processes it starts inherit it. It stays set for the rest of the process.
"""

from __future__ import annotations

import os
from pathlib import Path

from neorec.errors import ConfigError

VARIABLES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def kernel_cache_folders(directory: str | Path) -> dict[str, Path]:
    """The folder each compiler's variable is set to: `directory`/triton and `directory`/inductor."""
    root = Path(directory).expanduser().absolute()
    return {variable: root / sub for variable, sub in VARIABLES.items()}


def check_kernel_cache(directory: str | Path) -> None:
    """Make the folders of `directory` (kernel_cache_folders); ConfigError naming train.kernel_cache
    where one cannot be made or written, before any work starts."""
    for path in kernel_cache_folders(directory).values():
        blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise ConfigError(f"train.kernel_cache {directory}: {blocked} is not a folder; give a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"train.kernel_cache {directory}: cannot make {path} ({e.strerror or e}); give a writable folder"
            ) from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"train.kernel_cache {directory}: {path} is not writable; give a writable folder")


def use_kernel_cache(directory: str | Path | None) -> None:
    """Point Triton and inductor at `directory`'s folders for the rest of this process (and the
    processes it starts); None leaves them as they are."""
    if directory is None:
        return
    check_kernel_cache(directory)
    for variable, path in kernel_cache_folders(directory).items():
        os.environ[variable] = str(path)
