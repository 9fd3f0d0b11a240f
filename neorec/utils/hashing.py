"""SplitMix64 (the finaliser of Steele et al.'s SplitMix64), the one integer hash of neorec.

The same bits on numpy uint64 arrays (readers and the host generator hash raw values with it) and on
torch int64 tensors (the GPU generator, id maps, initial rows), with wrapping multiplies: ids and
rows are stable across runs, machines, devices and versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the callers of the torch functions: the numpy ones run without it
    import torch

MASK63 = (1 << 63) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """On numpy: any integer array, taken as uint64 -> uint64."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """On torch int64 tensors: the bits of `splitmix64`, as int64."""
    z = x + signed(_GOLDEN)
    z = (z ^ shift_right(z, 30)) * signed(_M1)
    z = (z ^ shift_right(z, 27)) * signed(_M2)
    return z ^ shift_right(z, 31)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64_torch with the top bit cleared: a hash in [0, 2^63)."""
    import torch

    return splitmix64_torch(x.to(torch.int64)) & MASK63
