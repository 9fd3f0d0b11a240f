"""What every part of the TorchRec interop shares: its error, the lazy import of TorchRec, and the
checks of one state_dict entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from neorec.errors import NeorecError


class TorchRecInteropError(NeorecError):
    """A TorchRec object or state_dict that has no neorec counterpart, or does not fit the model."""


def import_torchrec() -> Any:
    """The torchrec package; TorchRec is an optional dependency, imported on first use."""
    try:
        import torchrec
    except ImportError as e:
        raise TorchRecInteropError(
            "neorec.interop.torchrec needs TorchRec: pip install fbgemm-gpu-cpu (or fbgemm-gpu) and then "
            f"pip install --no-deps torchrec; see docs/torchrec.md ({e})"
        ) from None
    return torchrec


def sharded_kind(value: Any) -> str | None:
    """ "ShardedTensor" or "DTensor" for a tensor that holds only this process's shards, else None."""
    names = {c.__name__ for c in type(value).__mro__}
    return next((n for n in ("ShardedTensor", "DTensor") if n in names), None)


def expect(state_dict: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """state_dict[key], checked to be a full tensor of `shape` (the error names the key)."""
    if key not in state_dict:
        raise TorchRecInteropError(
            f"the state_dict has no {key!r}; the neorec model needs one of shape {shape}"
        )
    value = state_dict[key]
    if not isinstance(value, torch.Tensor) or sharded_kind(value):
        raise TorchRecInteropError(
            f"{key!r} is a {type(value).__name__}, not a full tensor: gather a sharded (DistributedModelParallel) "
            f"state_dict into full tensors on one process first (gather_torchrec_state)"
        )
    if tuple(value.shape) != shape:
        raise TorchRecInteropError(f"{key!r} has shape {tuple(value.shape)}; the neorec model needs {shape}")
    return value
