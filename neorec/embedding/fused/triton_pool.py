"""The Triton kernel of the fused engine's pooled lookup (`pool`).

One program per (bag, block of up to 128 columns) reads the bag's rows straight from the table
(fp32, fp16 or bf16; contiguous columns, so loads are coalesced) and sums them in fp32, each times
its scale (per-sample weight, 1/length for mean pooling), in id order (triton_sums._sum_rows), then
writes the sum straight into the [B, output columns] output at its feature's columns. Empty bags
give zeros. One launch per weight dtype covers all the groups it is given (triton_launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.embedding.fused.triton_launch import _firsts, _int_tables, _num_warps

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None

if triton is not None:
    from neorec.embedding.fused.triton_sums import _group_of, _pointer, _sum_rows


@dataclass
class PoolGroup:
    """One group's bags for `pool`: bag k = b * num_features + f (feature f of sample b) holds ids
    [offsets[k], offsets[k + 1]) of `rows` (int64 rows of `weight`, [rows, dim] with contiguous
    columns); its sum goes to out[b, columns[f] : columns[f] + dim] (out: fp32, contiguous columns;
    the pooled [B, output columns] that several groups share, or a sequence group's own [ids, dim])."""

    weight: torch.Tensor
    rows: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor | None  # [ids] fp32 factor of each id; None = all ones
    num_features: int
    out: torch.Tensor
    columns: list[int]  # first column of each feature in `out`


if triton is not None:

    @triton.jit
    def _pool_kernel(
        weight, num_groups, first_bags, weights, w_strides, dims, rows, offsets, scales, scaled, outs,
        out_strides, num_features, first_feature, feature_cols,
        HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Bag k of the launch (group g's are [first_bags[g], first_bags[g + 1])) into its group's
        output. weight: any group's buffer, for the element type they all share."""
        k = tl.program_id(0)
        g = _group_of(k, first_bags, num_groups)
        dim = tl.load(dims + g)
        first_col = tl.program_id(1) * BLOCK_D
        if first_col >= dim:  # a column block past this group's dim (the launch's widest sets the grid)
            return
        cols = first_col + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        bag = k - tl.load(first_bags + g)
        bag_offsets = _pointer(offsets, g, tl.int64)
        start = tl.load(bag_offsets + bag)
        end = tl.load(bag_offsets + bag + 1)
        table = _pointer(weights, g, weight.dtype.element_ty)
        acc = _sum_rows(
            start, end, _pointer(rows, g, tl.int64), _pointer(scales, g, tl.float32),
            tl.load(scaled + g) != 0, table, cols, col_ok, tl.load(w_strides + g), 1, feature_cols,
            HAS_SCALES, False, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        nf = tl.load(num_features + g)
        col = tl.load(feature_cols + tl.load(first_feature + g) + bag % nf)
        out = _pointer(outs, g, tl.float32) + (bag // nf) * tl.load(out_strides + g) + col
        tl.store(out + cols, acc, mask=col_ok)


def pool(groups: list[PoolGroup]) -> None:
    """Pool every bag of every group into its output at its feature's columns: out[b, columns[f] +
    c] = sum over the ids i of bag b * num_features + f of scales[i] * weight[rows[i], c]. One launch
    per weight dtype among the groups; the outputs' other columns are left alone."""
    by_dtype: dict[torch.dtype, list[PoolGroup]] = {}
    for grp in groups:
        assert grp.weight.stride(1) == 1 and grp.rows.dtype == grp.offsets.dtype == torch.int64
        assert grp.out.dtype == torch.float32 and grp.out.stride(1) == 1
        if grp.offsets.numel() > 1:
            by_dtype.setdefault(grp.weight.dtype, []).append(grp)
    for same in by_dtype.values():
        bags = [grp.offsets.numel() - 1 for grp in same]
        max_dim = max(grp.weight.shape[1] for grp in same)
        block_d = min(triton.next_power_of_2(max_dim), 128)
        # ids per program step: one when bags hold about one id (one-hot features), else about a
        # bag's mean (a power of two, at most 16), so that few of a step's loads are masked off
        per_bag = max((grp.rows.numel() + n - 1) // n for grp, n in zip(same, bags, strict=True))
        block_n = min(16, triton.next_power_of_2(max(1, per_bag)))
        tables = _int_tables(
            {
                "first_bags": _firsts(bags),
                "weights": [grp.weight.data_ptr() for grp in same],
                "w_strides": [grp.weight.stride(0) for grp in same],
                "dims": [grp.weight.shape[1] for grp in same],
                "rows": [grp.rows.data_ptr() for grp in same],
                "offsets": [grp.offsets.data_ptr() for grp in same],
                # an unscaled group's ids read no scale; any pointer does
                "scales": [(grp.scales if grp.scales is not None else grp.rows).data_ptr() for grp in same],
                "scaled": [int(grp.scales is not None) for grp in same],
                "outs": [grp.out.data_ptr() for grp in same],
                "out_strides": [grp.out.stride(0) for grp in same],
                "num_features": [grp.num_features for grp in same],
                "first_feature": _firsts([grp.num_features for grp in same])[:-1],
                "feature_cols": [c for grp in same for c in grp.columns],
            },
            same[0].weight.device,
        )
        _pool_kernel[(sum(bags), triton.cdiv(max_dim, block_d))](
            same[0].weight, len(same), **tables,
            HAS_SCALES=any(grp.scales is not None for grp in same), BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=_num_warps(block_d),
        )  # fmt: skip
