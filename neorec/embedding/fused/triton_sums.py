"""The Triton device functions that the fused engine's kernels share: finding a program's group in a
launch over several groups, and summing rows in id order.

The kernels are deterministic and their sums do not depend on the launch: each sum is formed by
one program in one fixed order, with no atomics: the ids' terms one at a time in id order
(`_sum_rows`), row-wise adagrad's squares in fixed pairs (triton_rules.pairwise_sum). So a row's
result is bitwise the same on every run, whichever groups share its launch and whatever the block
sizes. They agree with the torch path to fp32 rounding, which tests/test_triton_kernels.py checks
against a float64 reference.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _pointer(table, g, TYPE: tl.constexpr):
        """Group g's pointer from a launch's int64 table of pointers, as a pointer to TYPE."""
        return tl.load(table + g).to(tl.pointer_type(TYPE))

    @triton.jit
    def _group_of(k, first, num_groups):
        """The group g whose items [first[g], first[g + 1]) hold item k (first ascending from 0)."""
        g = tl.full([], 0, tl.int32)
        for i in range(1, num_groups):
            g = tl.where(k >= tl.load(first + i), i, g)
        return g

    @triton.jit
    def _term(i, at, scales, scaled, table, cols, col_ok, stride, num_features, feature_cols,
              HAS_SCALES: tl.constexpr, BY_FEATURE: tl.constexpr):  # fmt: skip
        """Term i of _sum_rows, in fp32: the row of `at`, id i's entry of its index."""
        if BY_FEATURE:  # int32 division: bags * features stay under 2^31 (fused_update checks)
            at32 = at.to(tl.int32)
            nf = num_features.to(tl.int32)
            base = (at32 // nf).to(tl.int64) * stride + tl.load(feature_cols + at32 % nf)
        else:
            base = at * stride
        vals = tl.load(table + base + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_SCALES:  # an unscaled group's ids count once (x * 1.0 is x)
            vals = vals * tl.load(scales + i, mask=scaled, other=1.0)
        return vals

    @triton.jit
    def _sum_rows(start, end, index, scales, scaled, table, cols, col_ok, stride, num_features, feature_cols,
                  HAS_SCALES: tl.constexpr, BY_FEATURE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
        """fp32 sum over i in [start, end), in order, of scales[i] (when `scaled`) times a row of
        `table` at columns cols: a bag's pooled rows (index: rows of the table), or a row's gradient
        (BY_FEATURE; index: bags b * num_features + f, read at table[b, feature_cols[f] + cols]).

        The terms are added one at a time in id order, so the sum is the same whatever BLOCK_N,
        BLOCK_D and the launch. Whole blocks of BLOCK_N ids have their loads issued together (the
        inner loop is unrolled); the ids after the last whole block go one at a time, so a row or
        bag of few ids spends nothing on slots it does not have, and each of them has its index
        entry read while the row of the id before it is read (the row's address waits on the
        entry: read one after the other, every id would wait for two reads)."""
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        whole = start + (end - start) // BLOCK_N * BLOCK_N
        for first in range(start, whole, BLOCK_N):
            for j in tl.static_range(BLOCK_N):
                acc += _term(first + j, tl.load(index + first + j), scales, scaled, table, cols, col_ok, stride,
                             num_features, feature_cols, HAS_SCALES, BY_FEATURE)  # fmt: skip
        at = tl.load(index + whole, mask=whole < end, other=0)
        for i in range(whole, end):
            following = tl.load(index + i + 1, mask=i + 1 < end, other=0)
            acc += _term(i, at, scales, scaled, table, cols, col_ok, stride, num_features, feature_cols,
                         HAS_SCALES, BY_FEATURE)  # fmt: skip
            at = following
        return acc
