"""Writing fp32 updates back to fp16/bf16 rows: round to nearest, or stochastically.

Round-to-nearest loses updates smaller than half a unit in the last place of the weight, so small
learning rates stall on fp16/bf16 tables. Stochastic rounding rounds up with probability equal to
the distance from the lower neighbour, so the update survives on average.

The random numbers come from a counter-based hash of (table seed, step, row within the table,
column), not from a generator's stream: the rounding of a row is the same whatever else is in the
batch, however tables are laid out or sharded, and on CPU or GPU. The hash uses only int64 ops on
32-bit values (no overflow), so every device computes the same bits.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values < 2^32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    return (x >> 16) ^ x


def _fold(x: torch.Tensor) -> torch.Tensor:
    """int64 -> a value < 2^32 that depends on all 64 bits."""
    return (x & _MASK) ^ mix32((x >> 32) & _MASK)


def step_keys(table_seeds: torch.Tensor, step: int) -> torch.Tensor:
    """The hash of (table seed, step) for each table seed: the part of the noise that all rows of a
    table share in one step (the Triton update takes one per table, triton_rules.uniform_noise)."""
    return mix32(_fold(table_seeds) ^ mix32(torch.full_like(table_seeds, step & _MASK)))


def uniform_noise(table_seeds: torch.Tensor, rows: torch.Tensor, step: int, width: int) -> torch.Tensor:
    """[U, width] floats in [0, 1) from (table seed [U], row within the table [U], step, column)."""
    h = mix32(step_keys(table_seeds, step) ^ _fold(rows))
    cols = torch.arange(width, dtype=torch.int64, device=rows.device) * 0x9E3779B9 & _MASK
    h = mix32(h.unsqueeze(1) ^ cols)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """fp32 `x` to fp16/bf16, rounding up in magnitude with probability (|x| - lo) / (hi - lo).

    lo, hi are the neighbouring representable magnitudes around |x|. Both formats order positive
    values like their bit patterns, so the other neighbour of the nearest value is one bit step away.
    """
    mag = x.abs()
    near = mag.to(dtype)
    near_f = near.float()
    bits = near.view(torch.int16)
    above = near_f > mag
    other = torch.where(above, bits - 1, bits + 1).view(dtype).float()
    lo = torch.where(above, other, near_f)
    hi = torch.where(above, near_f, other)
    p_up = (mag - lo) / (hi - lo)
    out = torch.where(noise < p_up, hi, lo)
    return out.copysign(x).to(dtype)


def to_storage(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor | None) -> torch.Tensor:
    """Convert updated fp32 rows to the storage dtype (stochastically when noise is given)."""
    if dtype == torch.float32:
        return x
    if noise is None:
        return x.to(dtype)
    return stochastic_round(x, dtype, noise)
