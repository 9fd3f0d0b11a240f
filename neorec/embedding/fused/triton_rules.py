"""The fused update's per-row math as Triton device functions: the kernel-side twins of the update
rules (optimizers.py) and of stochastic rounding (rounding.py), used by triton_fused_update.py.

The rules follow optimizers.py formula for formula (weight decay added to the gradient, adagrad's
per-element and row-wise sums, the row-wise one added in a fixed order of pairs (pairwise_sum), lazy
adam with the global step's bias correction), in fp32 with IEEE square roots; divisions by the
rules' denominators may be the GPU's fast division, so the weights agree with the torch path to
fp32 rounding, not bitwise.

Stochastic rounding is bitwise rounding.py's: the same counter-based hash of (table seed, step,
row within the table, column) in uint32 arithmetic (rounding.py computes it in int64 masked to 32
bits, the same bits), the same neighbours and the same correctly rounded probability
(div_rn), so the same fp32 value rounds to the same fp16/bf16 value on either path and any device.
The (table seed, step) part is hashed once per step on the host (rounding.step_keys).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None

# rule name -> the RULE argument of the update kernel
RULE_IDS = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2, "adam": 3}
# columns of the [tables, len(HPARAM_COLUMNS)] fp32 hyper-parameter table the update kernel reads
# (adam_lr = lr / (1 - beta1^step), adam_sqrt_bias2 = sqrt(1 - beta2^step): the step's bias corrections)
HPARAM_COLUMNS = (
    "lr",
    "eps",
    "weight_decay",
    "one_minus_beta1",
    "one_minus_beta2",
    "adam_lr",
    "adam_sqrt_bias2",
)


if triton is not None:

    @triton.jit
    def mix32(x):
        """rounding.mix32 on uint32 values (the multiplies wrap modulo 2^32, as its masks do)."""
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def fold(x):
        """rounding._fold: int64 -> uint32 depending on all 64 bits."""
        low = (x & 0xFFFFFFFF).to(tl.uint32)
        high = ((x >> 32) & 0xFFFFFFFF).to(tl.uint32)
        return low ^ mix32(high)

    @triton.jit
    def uniform_noise(key, row_in_table, cols):
        """rounding.uniform_noise of one row: key = rounding.step_keys of its table (uint32),
        row_in_table int64, cols [BLOCK_D] column indices -> [BLOCK_D] floats in [0, 1)."""
        h = mix32(key ^ fold(row_in_table))
        h = mix32(h ^ (cols.to(tl.uint32) * 0x9E3779B9))
        return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def stochastic_round(x, noise, DTYPE: tl.constexpr):
        """rounding.stochastic_round: fp32 x to DTYPE (fp16/bf16), up in magnitude with probability
        (|x| - lo) / (hi - lo), lo and hi the representable magnitudes around |x|."""
        mag = tl.abs(x)
        near = mag.to(DTYPE)
        near_f = near.to(tl.float32)
        bits = near.to(tl.int16, bitcast=True)
        above = near_f > mag
        other = tl.where(above, bits - 1, bits + 1).to(DTYPE, bitcast=True).to(tl.float32)
        lo = tl.where(above, other, near_f)
        hi = tl.where(above, near_f, other)
        p_up = tl.math.div_rn(mag - lo, hi - lo)
        out = tl.where(noise < p_up, hi, lo)
        # copysign through the bits, so that a negative value rounded to zero keeps its sign
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        out = (out.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return out.to(DTYPE)

    @triton.jit
    def _halve(x, N: tl.constexpr):
        """[N] -> [N / 2]: each pair of neighbours added."""
        return tl.sum(tl.reshape(x, [N // 2, 2]), axis=1)

    @triton.jit
    def pairwise_sum(x, BLOCK_D: tl.constexpr):
        """The sum of x [BLOCK_D] (a power of two up to 1024) in one fixed order: neighbours in pairs,
        then pairs of pairs, and so on. Each add is of two values, so the bits do not depend on how the
        compiler spreads x over threads; and zeros past a row's dim leave them as they are, so a row
        sums to the same bits in a block of any width (a launch shared with wider groups)."""
        tl.static_assert(BLOCK_D <= 1024)
        for level in tl.static_range(10):  # unrolled: x holds BLOCK_D >> level values at each level
            if (BLOCK_D >> level) >= 2:
                x = _halve(x, BLOCK_D >> level)
        return tl.sum(x, axis=0)

    @triton.jit
    def read_state(state1, state2, cols, col_ok, RULE: tl.constexpr):
        """A row's optimizer state before its step, for apply_rule: (state1's, state2's) values
        (row-wise adagrad's sum; adagrad's sums or adam's m [BLOCK_D]; adam's v), zeros for what
        the rule has not. Read apart from the step so that a kernel can read it before the row's
        gradient is summed: the reads do not wait on the sum."""
        if RULE == 1:
            s1 = tl.load(state1)
            s2 = 0.0
        elif RULE == 2:
            s1 = tl.load(state1 + cols, mask=col_ok, other=0.0)
            s2 = 0.0
        elif RULE == 3:
            s1 = tl.load(state1 + cols, mask=col_ok, other=0.0)
            s2 = tl.load(state2 + cols, mask=col_ok, other=0.0)
        else:
            s1 = 0.0
            s2 = 0.0
        return s1, s2

    @triton.jit
    def apply_rule(w, g, s1, s2, cols, col_ok, state1, state2, dim, hp,
                   RULE: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        """One row's step of optimizers.py's rule RULE: w, g [BLOCK_D] fp32 (g with weight decay
        added, zero past the row's dim), s1, s2 the row's state as read_state read it; stores the
        new state in place (state1: adagrad's sum or adam's m, state2: adam's v, each pointing at
        the row's first value) and returns the new w. hp points at the row's table's
        hyper-parameters (HPARAM_COLUMNS)."""
        if RULE == 0:  # sgd
            w = w - tl.load(hp) * g
        elif RULE == 1:  # row-wise adagrad: one accumulator per row, the mean of g^2
            # each square rounded by itself (an fma with a zero addend), so that the compiler cannot
            # fuse it into the adds that follow, which it could do or not depending on the layout
            acc = s1 + pairwise_sum(tl.fma(g, g, 0.0), BLOCK_D) / dim
            tl.store(state1, acc)
            w = w - tl.load(hp) * g / (tl.sqrt_rn(acc) + tl.load(hp + 1))
        elif RULE == 2:  # adagrad: one accumulator per element
            acc = s1 + g * g
            tl.store(state1 + cols, acc, mask=col_ok)
            w = w - tl.load(hp) * g / (tl.sqrt_rn(acc) + tl.load(hp + 1))
        else:  # lazy adam: m, v lerp towards g, g^2; bias corrections of the global step
            m = s1 + tl.load(hp + 3) * (g - s1)
            v = s2 + tl.load(hp + 4) * (g * g - s2)
            tl.store(state1 + cols, m, mask=col_ok)
            tl.store(state2 + cols, v, mask=col_ok)
            w = w - tl.load(hp + 5) * m / (tl.sqrt_rn(v) / tl.load(hp + 6) + tl.load(hp + 1))
        return w
