"""Triton kernels for the fused engine on CUDA: the pooled lookup, and backward fused with the update.

The torch path (lookup.py) runs everywhere; on a GPU it costs several kernels and passes over
memory per step (embedding_bag for the segment sums, a gather of rows and state, the rule's
elementwise ops, a scatter back). These two kernels do the same work in one pass each:

- `pool`: one program per (bag, block of columns) reads the bag's rows straight from the table
  (fp32, fp16 or bf16) and sums them in fp32, `block_n` ids at a time; writes [bags, dim].
- `fused_update`: one program per unique row (ids already sorted by row, see
  lookup.sort_by_row) sums that row's gradient over its ids in id order, then applies SGD,
  AdaGrad or row-wise AdaGrad to the row and its state and stores the row back in its dtype
  (round to nearest). The gradient never reaches device memory, except the partial sums of
  hot rows' chunks of ids (see fused_update).

Both are deterministic: each output element is summed by one program in a fixed order, with no
atomics, so the same inputs give bitwise the same results on every run. They agree with the torch
path to fp32 rounding (the sums associate differently), which tests/test_fused_cuda.py checks.

Triton is optional: it ships with CUDA builds of PyTorch. `usable(device)` says whether the kernels
can run; with TRITON_INTERPRET=1 they also run on CPU tensors through Triton's interpreter (slow;
for testing the kernels without a GPU).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None

# update rules the fused kernel implements (the others run through the torch path)
RULE_IDS = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2}
# ids of one row that one program sums; a row with more is split into chunks summed in parallel
LONG_ROW_CHUNK = 1024


def usable(device: torch.device) -> bool:
    """Triton is importable and can run on `device` (a GPU, or any device under the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _block_d(dim: int) -> int:
    return min(triton.next_power_of_2(dim), 128)


if triton is not None:

    @triton.jit
    def _sum_rows(start, end, index, scales, table, cols, col_ok, stride,
                  HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        """fp32 sum over i in [start, end) of scales[i] * table[index[i], cols], BLOCK_N at a time:
        a bag's pooled rows (index: rows of the table) or a row's gradient (index: bags of d(pooled))."""
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            i = first + tl.arange(0, BLOCK_N)
            ok = i < end
            at = tl.load(index + i, mask=ok, other=0)
            ptrs = table + at[:, None] * stride + cols[None, :]
            vals = tl.load(ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if HAS_SCALES:
                s = tl.load(scales + i, mask=ok, other=0.0)
                vals = vals * s[:, None]
            acc += tl.sum(vals, axis=0)
        return acc

    @triton.jit
    def _pool_kernel(
        weight, rows, offsets, scales, out, dim, w_stride,
        HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        bag = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        start = tl.load(offsets + bag)
        end = tl.load(offsets + bag + 1)
        acc = _sum_rows(start, end, rows, scales, weight, cols, col_ok, w_stride, HAS_SCALES, BLOCK_N, BLOCK_D)
        tl.store(out + bag.to(tl.int64) * dim + cols, acc, mask=col_ok)

    @triton.jit
    def _partial_kernel(
        part_rows, part_index, seg_offsets, bags, scales, grad, partial, dim, g_stride,
        HAS_SCALES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """partial[p] = the summed gradient of ids [CHUNK * k, CHUNK * (k + 1)) of a long row's ids."""
        p = tl.program_id(0)
        u = tl.load(part_rows + p)
        k = tl.load(part_index + p)
        start = tl.load(seg_offsets + u) + k * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(seg_offsets + u + 1))
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        g = _sum_rows(start, end, bags, scales, grad, cols, col_ok, g_stride, HAS_SCALES, BLOCK_N, BLOCK_D)
        tl.store(partial + p.to(tl.int64) * dim + cols, g, mask=col_ok)

    @triton.jit
    def _update_kernel(
        unique_rows, seg_offsets, part_offsets, partial, bags, scales, grad, weight, state, dim, w_stride,
        g_stride, lr, eps, weight_decay,
        RULE: tl.constexpr, HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        u = tl.program_id(0)
        row = tl.load(unique_rows + u)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        # the row's summed gradient, in id order: straight from its ids, or (a long row) from the
        # partial sums of its chunks of ids, in chunk order
        p0 = tl.load(part_offsets + u)
        p1 = tl.load(part_offsets + u + 1)
        start = tl.load(seg_offsets + u)
        end = tl.where(p1 > p0, start, tl.load(seg_offsets + u + 1))
        g = _sum_rows(start, end, bags, scales, grad, cols, col_ok, g_stride, HAS_SCALES, BLOCK_N, BLOCK_D)
        for p in range(p0, p1):
            g += tl.load(partial + p * dim + cols, mask=col_ok, other=0.0)
        w_ptrs = weight + row * w_stride + cols
        w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        g = g + weight_decay * w
        if RULE == 0:  # sgd
            w = w - lr * g
        elif RULE == 1:  # row-wise adagrad: one accumulator per row, the mean of g^2
            acc = tl.load(state + row) + tl.sum(g * g, axis=0) / dim
            tl.store(state + row, acc)
            w = w - lr * g / (tl.sqrt_rn(acc) + eps)
        else:  # adagrad: one accumulator per element
            s_ptrs = state + row * dim + cols
            acc = tl.load(s_ptrs, mask=col_ok, other=0.0) + g * g
            tl.store(s_ptrs, acc, mask=col_ok)
            w = w - lr * g / (tl.sqrt_rn(acc) + eps)
        tl.store(w_ptrs, w.to(weight.dtype.element_ty), mask=col_ok)


def pool(
    weight: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor:
    """[bags, dim] fp32: bag k = sum over ids i in [offsets[k], offsets[k+1]) of scales[i] * weight[rows[i]]."""
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty(num_bags, dim, dtype=torch.float32, device=weight.device)
    if num_bags == 0:
        return out
    block_d = _block_d(dim)
    # one id per program step when bags hold about one id (one-hot features), else 16 at a time
    block_n = 1 if rows.numel() <= num_bags else 16
    _pool_kernel[(num_bags, triton.cdiv(dim, block_d))](
        weight, rows, offsets, scales if scales is not None else rows, out, dim, weight.stride(0),
        HAS_SCALES=scales is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=1 if block_n * block_d <= 256 else 4,
    )  # fmt: skip
    return out


def fused_update(
    rule: str,
    unique_rows: torch.Tensor,
    seg_offsets: torch.Tensor,
    bags: torch.Tensor,
    scales: torch.Tensor | None,
    grad: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    lr: float,
    eps: float,
    weight_decay: float,
    chunk: int | None = None,
) -> None:
    """Sum each unique row's gradient over its ids and update the row (and state) in place.

    unique_rows [U] ascending; the ids of unique row u are [seg_offsets[u], seg_offsets[u+1]) of
    `bags` (their bag: a row of `grad` [bags, dim]) and `scales`. state: row-wise adagrad's [rows]
    or adagrad's [rows, dim] fp32 accumulator; None for sgd.

    A row with more than `chunk` ids (a hot row of a skewed batch can have 100k) would keep one
    program busy long after the others finish; its ids are summed in chunks of `chunk` ids by
    programs of their own first, and its update adds those partial sums in chunk order. The chunks
    depend only on the ids, so the result is still the same on every run. Costs one host sync (the
    number of chunks), on top of unique_consecutive's.
    """
    num_unique, dim = unique_rows.numel(), weight.shape[1]
    chunk = chunk or LONG_ROW_CHUNK
    if num_unique == 0:
        return
    if dim > 1024:
        raise ValueError(f"the fused update kernel takes dims up to 1024, got {dim}")
    block_d = triton.next_power_of_2(dim)
    block_n = max(1, min(16, 2048 // block_d))
    num_warps = 1 if block_n * block_d <= 256 else 4
    has_scales = scales is not None
    scales = scales if has_scales else grad  # any pointer; not read
    counts = seg_offsets[1:] - seg_offsets[:-1]
    parts = torch.where(counts > chunk, (counts + chunk - 1) // chunk, 0)
    part_offsets = torch.zeros(num_unique + 1, dtype=torch.int64, device=grad.device)
    torch.cumsum(parts, 0, out=part_offsets[1:])
    num_parts = int(part_offsets[-1])
    partial = grad  # any pointer when there are no long rows
    if num_parts:
        part_rows = torch.repeat_interleave(torch.arange(num_unique, device=grad.device), parts, output_size=num_parts)
        part_index = torch.arange(num_parts, device=grad.device) - part_offsets.index_select(0, part_rows)
        partial = torch.empty(num_parts, dim, dtype=torch.float32, device=grad.device)
        _partial_kernel[(num_parts,)](
            part_rows, part_index, seg_offsets, bags, scales, grad, partial, dim, grad.stride(0),
            HAS_SCALES=has_scales, CHUNK=chunk, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    _update_kernel[(num_unique,)](
        unique_rows, seg_offsets, part_offsets, partial, bags, scales, grad, weight,
        state if state is not None else weight, dim, weight.stride(0), grad.stride(0),
        float(lr), float(eps), float(weight_decay),
        RULE=RULE_IDS[rule], HAS_SCALES=has_scales, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
