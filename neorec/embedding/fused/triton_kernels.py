"""Triton kernels for the fused engine on CUDA: the pooled lookup, and backward fused with the update.

The torch path (lookup.py) runs everywhere; on a GPU it costs several kernels and passes over
memory per step (embedding_bag for the segment sums, a gather of rows and state, the rule's
elementwise ops, a scatter back). These kernels do the same work in one pass each:

- `pool`: one program per (bag, block of up to 128 columns) reads the bag's rows straight from the
  table (fp32, fp16 or bf16; contiguous columns, so loads are coalesced and vectorised) and sums
  them in fp32, `block_n` ids at a time, each times its scale (per-sample weight, 1/length for
  mean pooling); writes [bags, dim]. Empty bags give zeros.
- `fused_update`: one program per unique row (ids already sorted by row, see
  lookup.sort_by_row) sums that row's gradient over its ids in id order, then applies SGD,
  AdaGrad, row-wise AdaGrad or Adam (triton_rules.apply_rule) to the whole row and its state and
  stores the row back in its dtype, to nearest or stochastically (triton_rules.stochastic_round,
  bitwise rounding.py's rounding). Hyper-parameters come from a small per-table table, so tables of
  one group may differ. The gradient never reaches device memory, except the partial sums of hot
  rows' chunks of ids (see fused_update).

Each group (one dim, see layout.py) is one launch of each kernel; a model with mixed dims launches
them once per group. Both kernels are deterministic: each output element is summed by one program
in a fixed order, with no atomics, so the same inputs give bitwise the same results on every run.
They agree with the torch path to fp32 rounding (the sums associate differently), which
tests/test_triton_kernels.py checks against a float64 reference.

Triton is optional: it ships with CUDA builds of PyTorch. `usable(device)` says whether the kernels
can run; with TRITON_INTERPRET=1 set before this module is imported they also run on CPU tensors
through Triton's interpreter (slow; for testing the kernels without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from neorec.embedding.fused import rounding
from neorec.embedding.fused.triton_rules import HPARAM_COLUMNS, RULE_IDS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None

if triton is not None:
    from neorec.embedding.fused.triton_rules import apply_rule, stochastic_round, uniform_noise

# ids of one row that one program sums; a row with more is split into chunks summed in parallel
LONG_ROW_CHUNK = 1024
# the widest row the update kernel takes (one program holds a whole row); wider groups use the torch path
MAX_UPDATE_DIM = 1024
# the kernels were built for Triton's interpreter (decided when triton.jit decorates them, at import)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def usable(device: torch.device) -> bool:
    """Triton is importable and can run on `device` (a GPU, or any device under the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or INTERPRETED


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
        num_parts, part_rows, part_index, seg_offsets, bags, scales, grad, partial, dim, g_stride,
        HAS_SCALES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """partial[p] = the summed gradient of ids [CHUNK * k, CHUNK * (k + 1)) of a long row's ids.
        The grid is a bound on the number of chunks known on the host; num_parts holds the real one."""
        p = tl.program_id(0)
        if p >= tl.load(num_parts):
            return
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
        unique_rows, seg_offsets, part_offsets, partial, bags, scales, grad, weight, state1, state2,
        row_table, hparams, row_starts, keys, num_unique, dim, w_stride, g_stride,
        RULE: tl.constexpr, HAS_SCALES: tl.constexpr, MULTI_TABLE: tl.constexpr, STOCHASTIC: tl.constexpr,
        NUM_HPARAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BOUNDED: tl.constexpr,
    ):  # fmt: skip
        u = tl.program_id(0)
        if BOUNDED:  # launched over a bound on the unique rows; num_unique holds the real count
            if u >= tl.load(num_unique):
                return
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
        table = tl.load(row_table + u) if MULTI_TABLE else 0
        hp = hparams + table * NUM_HPARAMS
        w_ptrs = weight + row * w_stride + cols
        w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        g = g + tl.load(hp + 2) * w  # weight decay
        w = apply_rule(w, g, row, cols, col_ok, state1, state2, dim, hp, RULE)
        if STOCHASTIC:
            key = tl.load(keys + table).to(tl.uint32)
            noise = uniform_noise(key, row - tl.load(row_starts + table), cols)
            stored = stochastic_round(w, noise, weight.dtype.element_ty)
        else:
            stored = w.to(weight.dtype.element_ty)
        tl.store(w_ptrs, stored, mask=col_ok)

    @triton.jit
    def _round_kernel(x, keys, rows, out, dim, BLOCK_D: tl.constexpr):
        """out[u] = stochastic_round(x[u]) with the noise of row rows[u] under key keys[u]."""
        u = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        v = tl.load(x + u.to(tl.int64) * dim + cols, mask=col_ok, other=0.0)
        noise = uniform_noise(tl.load(keys + u).to(tl.uint32), tl.load(rows + u), cols)
        rounded = stochastic_round(v, noise, out.dtype.element_ty)
        tl.store(out + u.to(tl.int64) * dim + cols, rounded, mask=col_ok)


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


def hparam_table(
    hparams: Mapping[str, float | torch.Tensor], step: int, num_tables: int, device: torch.device
) -> torch.Tensor:
    """[1 or num_tables, len(HPARAM_COLUMNS)] fp32: the update's hyper-parameters (floats, or [T]
    tensors where a group's tables differ), with adam's bias corrections of `step` folded in.
    One row when all are floats, computed in float64 like the torch path's Python floats."""
    if all(isinstance(v, float) for v in hparams.values()):
        values = {k: torch.tensor([v], dtype=torch.float64) for k, v in hparams.items()}
    else:  # where the group's tables differ, on the device they are on (no read back to the host)
        values = {
            k: v.to(torch.float64) if isinstance(v, torch.Tensor)
            else torch.full((num_tables,), v, dtype=torch.float64, device=device)
            for k, v in hparams.items()
        }  # fmt: skip
    b1, b2 = values["beta1"], values["beta2"]
    columns = {
        "lr": values["lr"],
        "eps": values["eps"],
        "weight_decay": values["weight_decay"],
        "one_minus_beta1": 1.0 - b1,
        "one_minus_beta2": 1.0 - b2,
        "adam_lr": values["lr"] / (1.0 - b1**step),
        "adam_sqrt_bias2": (1.0 - b2**step).sqrt(),
    }
    table = torch.stack([columns[name] for name in HPARAM_COLUMNS], dim=1).to(torch.float32)
    if table.device.type == "cpu" and device.type == "cuda":
        # From pinned memory the copy is queued on the stream and the host goes on; the caching host
        # allocator records the copy and keeps the pinned block until it has run, so the source may go.
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def max_chunks(num_ids: int, chunk: int) -> int:
    """An upper bound on the number of chunks fused_update splits `num_ids` ids into, from sizes alone.

    Only a row with c > chunk ids is split, into ceil(c / chunk) chunks, and ceil(c / chunk) <=
    2c / (chunk + 1) for every such c (c = k * chunk + r with k >= 1 and 1 <= r <= chunk: the right
    side less the left is ((k - 1)(chunk - 1) + 2(r - 1)) / (chunk + 1) >= 0). Summed over the split
    rows, whose ids number at most num_ids, there are at most 2 * num_ids / (chunk + 1) chunks;
    none when no row can have more than `chunk` ids. The bound is reached by rows of chunk + 1 ids.
    """
    return 0 if num_ids <= chunk else 2 * num_ids // (chunk + 1)


def fused_update(
    rule: str,
    sorted_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    grad: torch.Tensor,
    weight: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    hparams: Mapping[str, float | torch.Tensor],
    step: int,
    row_starts: torch.Tensor,
    table_seeds: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """Sum each unique row's gradient over its ids and update the row (and state) in place.

    sorted_ids: lookup.sort_by_row's (unique rows [U] ascending, offsets [U + 1] of each row's
    ids, the bag of each id, its scale or None): the ids of unique row u are [offsets[u],
    offsets[u+1]), their bags are rows of `grad` [bags, dim]; or lookup.sort_by_row_on_device's,
    padded to one entry per id with U as a fifth, device, entry (the update programs past U return). weight: the group's [rows, dim]
    buffer (fp32, fp16 or bf16); state: the rule's fp32 state by name (optimizers.RULES).
    hparams: the group's (engine.group_hparams: floats, or [T] tensors where its tables differ);
    step: the engine's update count, from 1 (adam's bias correction; stochastic rounding's noise).
    row_starts [T]: each table's first row in the buffer. table_seeds [T]: round fp16/bf16 rows
    stochastically with these tables' seeds (rounding.py); None rounds to nearest.

    A row with more than `chunk` ids (a hot row of a skewed batch can have 100k) would keep one
    program busy long after the others finish; its ids are summed in chunks of `chunk` ids by
    programs of their own first, and its update adds those partial sums in chunk order. The chunks
    depend only on the ids, so the result is still the same on every run. The number of chunks
    stays on the device: the chunk programs are launched over max_chunks(ids, chunk), a bound
    known on the host, and those past the real count return at once. The hyper-parameters travel
    by an asynchronous copy (hparam_table), so with sort_by_row_on_device's ids the update reads
    nothing back to the host.
    """
    unique_rows, seg_offsets, bags, scales = sorted_ids[:4]
    count = sorted_ids[4] if len(sorted_ids) > 4 else None  # padded: the real number of unique rows
    num_unique, dim = unique_rows.numel(), weight.shape[1]
    chunk = chunk or LONG_ROW_CHUNK
    if num_unique == 0:
        return
    if dim > MAX_UPDATE_DIM:
        raise ValueError(f"the fused update kernel takes dims up to {MAX_UPDATE_DIM}, got {dim}")
    block_d = triton.next_power_of_2(dim)
    block_n = max(1, min(16, 2048 // block_d))
    num_warps = 1 if block_n * block_d <= 256 else 4
    has_scales = scales is not None
    scales = scales if has_scales else grad  # any pointer; not read
    counts = seg_offsets[1:] - seg_offsets[:-1]
    parts = torch.where(counts > chunk, (counts + chunk - 1) // chunk, 0)
    part_offsets = torch.zeros(num_unique + 1, dtype=torch.int64, device=grad.device)
    torch.cumsum(parts, 0, out=part_offsets[1:])
    bound = max_chunks(bags.numel(), chunk)
    partial = grad  # any pointer when there are no long rows
    if bound:
        # chunk p belongs to the row u with part_offsets[u] <= p < part_offsets[u + 1]; p past the
        # real count gets u = num_unique, which its program never reads
        p = torch.arange(bound, device=grad.device)
        part_rows = torch.searchsorted(part_offsets[1:], p, right=True)
        part_index = p - part_offsets.index_select(0, part_rows)
        partial = torch.empty(bound, dim, dtype=torch.float32, device=grad.device)
        _partial_kernel[(bound,)](
            part_offsets[num_unique:], part_rows, part_index, seg_offsets, bags, scales, grad, partial,
            dim, grad.stride(0),
            HAS_SCALES=has_scales, CHUNK=chunk, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip

    stochastic = table_seeds is not None and weight.dtype != torch.float32
    hp = hparam_table(hparams, step, row_starts.numel(), grad.device)
    multi_table = row_starts.numel() > 1 and (stochastic or hp.shape[0] > 1)
    row_table = unique_rows  # any pointer when every row uses table 0's values
    if multi_table:
        row_table = torch.searchsorted(row_starts, unique_rows, right=True) - 1
        hp = hp.expand(row_starts.numel(), -1).contiguous()
    keys = rounding.step_keys(table_seeds, step) if stochastic else row_starts
    state1 = state.get("momentum1", weight)  # any pointer for sgd
    _update_kernel[(num_unique,)](
        unique_rows, seg_offsets, part_offsets, partial, bags, scales, grad, weight,
        state1, state.get("momentum2", state1), row_table, hp, row_starts, keys,
        count if count is not None else row_starts, dim, weight.stride(0), grad.stride(0),
        RULE=RULE_IDS[rule], HAS_SCALES=has_scales, MULTI_TABLE=multi_table, STOCHASTIC=stochastic,
        NUM_HPARAMS=len(HPARAM_COLUMNS), BLOCK_N=block_n, BLOCK_D=block_d, BOUNDED=count is not None,
        num_warps=num_warps,
    )  # fmt: skip


def stochastic_round_rows(
    x: torch.Tensor, dtype: torch.dtype, keys: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The update kernel's rounding on its own: [U, D] fp32 -> dtype (fp16/bf16), row u with the
    noise of row rows[u] (within its table) under keys[u] (rounding.step_keys of its table).
    Bitwise rounding.stochastic_round(x, dtype, rounding.uniform_noise(...)) for the same inputs."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.shape[0]:
        block_d = triton.next_power_of_2(x.shape[1])
        _round_kernel[(x.shape[0],)](x.contiguous(), keys, rows, out, x.shape[1], BLOCK_D=block_d)
    return out
