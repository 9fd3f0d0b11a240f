"""The Triton kernels of the fused engine's backward fused with the update (`fused_update`).

A grid the size of the device, each program taking unique rows in turn (ids already sorted by row,
see row_gradients.sort_by_row), sums a row's gradient over its ids in id order, reading it straight
from d(pooled) at the columns of each id's feature (triton_sums._sum_rows), then applies SGD,
AdaGrad, row-wise AdaGrad or Adam (triton_rules.apply_rule) to the whole row and its state and
stores the row back in its dtype, to nearest or stochastically (triton_rules.stochastic_round,
bitwise rounding.py's rounding). Hyper-parameters come from a small per-table table
(`hparam_table`), so tables of one group may differ. The gradient never reaches device memory,
except the partial sums of hot rows' chunks of ids (see fused_update). One launch per (rule, weight
dtype, rounding) covers all the groups it is given (triton_launch.py).

`stochastic_round_rows` runs the update kernel's rounding on its own, for checking it against
rounding.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from neorec.embedding.fused import rounding
from neorec.embedding.fused.triton_launch import (
    _firsts,
    _int_tables,
    _num_warps,
    _resident_programs,
    _to_device,
)
from neorec.embedding.fused.triton_rules import HPARAM_COLUMNS, RULE_IDS
from neorec.utils.stages import staged

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None
    tl = None

if triton is not None:
    from neorec.embedding.fused.triton_rules import apply_rule, read_state, stochastic_round, uniform_noise
    from neorec.embedding.fused.triton_sums import _group_of, _pointer, _sum_rows

# ids of one row that one program sums; a row with more is split into chunks summed in parallel
LONG_ROW_CHUNK = 1024
# the widest row the update kernel takes (one program holds a whole row); wider groups use the torch path
MAX_UPDATE_DIM = 1024


@dataclass
class UpdateGroup:
    """One group's update for `fused_update`.

    sorted_ids: row_gradients.sort_by_row's (unique rows [U] ascending, offsets [U + 1] of each row's ids,
    the bag of each id, its scale or None); or row_gradients.sort_by_row_on_device's, padded to one entry
    per id with U as a fifth, device, entry (the update programs past U return). Bag k = b *
    num_features + f takes its gradient from grad[b, columns[f] : columns[f] + dim] (grad: fp32,
    contiguous; d(pooled) [B, output columns], or a sequence group's d(rows) [ids, dim] with one
    feature at column 0). weight: the group's [rows, dim] buffer (fp32, fp16 or bf16); state: the
    rule's fp32 state by name (optimizers.RULES), [rows] or [rows, dim]. hparams: the group's
    (engine.group_hparams: floats, or [T] tensors where its tables differ). row_starts [T]: each
    table's first row in the buffer. table_seeds [T]: round fp16/bf16 rows stochastically with these
    tables' seeds (rounding.py); None rounds to nearest. addresses: where each unique row is in
    weight and state, one entry per sorted_ids[0] entry, when not at the row itself: a row cache's
    slots, with weight and state strided views of its records (contiguous columns).
    """

    rule: str
    sorted_ids: tuple[torch.Tensor, ...]  # (its scales entry may be None)
    grad: torch.Tensor
    num_features: int
    columns: list[int]
    weight: torch.Tensor
    state: Mapping[str, torch.Tensor]
    hparams: Mapping[str, float | torch.Tensor]
    row_starts: torch.Tensor
    table_seeds: torch.Tensor | None = None
    addresses: torch.Tensor | None = None


if triton is not None:

    @triton.jit
    def _row_gradient(g, start, end, bags, scales, scaled, grads, g_strides, num_features, first_feature,
                      feature_cols, cols, col_ok,
                      HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        """Group g's sum over its sorted ids [start, end) of scale * d(pooled) of the id's bag."""
        return _sum_rows(
            start, end, _pointer(bags, g, tl.int64), _pointer(scales, g, tl.float32),
            tl.load(scaled + g) != 0,
            _pointer(grads, g, tl.float32), cols, col_ok, tl.load(g_strides + g), tl.load(num_features + g),
            feature_cols + tl.load(first_feature + g), HAS_SCALES, True, BLOCK_N, BLOCK_D,
        )  # fmt: skip

    @triton.jit
    def _partial_kernel(
        num_parts, part_rows, part_index, partial, p_stride, num_groups, first_unique, dims, seg_offsets,
        bags, scales, scaled, grads, g_strides, num_features, first_feature, feature_cols,
        HAS_SCALES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """partial[p] = the summed gradient of ids [CHUNK * k, CHUNK * (k + 1)) of a long row's ids
        (row u of the launch: group g's are [first_unique[g], first_unique[g + 1])). The grid is a
        bound on the number of chunks known on the host; num_parts holds the real one."""
        p = tl.program_id(0)
        if p >= tl.load(num_parts):
            return
        u = tl.load(part_rows + p)
        k = tl.load(part_index + p)
        g = _group_of(u, first_unique, num_groups)
        local = u - tl.load(first_unique + g)
        row_offsets = _pointer(seg_offsets, g, tl.int64)
        start = tl.load(row_offsets + local) + k * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(row_offsets + local + 1))
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < tl.load(dims + g)
        grad = _row_gradient(
            g, start, end, bags, scales, scaled, grads, g_strides, num_features, first_feature, feature_cols,
            cols, col_ok, HAS_SCALES, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        tl.store(partial + p.to(tl.int64) * p_stride + cols, grad, mask=col_ok)

    @triton.jit
    def _update_kernel(
        weight, num_groups, first_unique, counts, unique_rows, addresses, seg_offsets, part_offsets, partial,
        p_stride, bags, scales, scaled, grads, g_strides, num_features, first_feature, feature_cols, weights,
        w_strides, dims, states1, states2, s_strides, hparams, row_tables, row_starts, keys,
        RULE: tl.constexpr, HAS_SCALES: tl.constexpr, MULTI_TABLE: tl.constexpr, STOCHASTIC: tl.constexpr,
        NUM_HPARAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """The unique rows of every group (group g's are [first_unique[g], first_unique[g + 1]) of the
        launch, of which the first counts[g] are real), program p taking rows p, p + P, p + 2P, ...
        of each group for a grid of P programs: the grid fits the device, not the padded row count,
        so padding costs nothing. A row's weights and state are at its address (addresses: its row,
        or a cache's slot of it) in its group's buffers. weight: any group's buffer, for the element
        type they share."""
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        for g in range(num_groups):
            first = tl.load(first_unique + g)
            count = tl.load(_pointer(counts, g, tl.int64)).to(tl.int32)
            dim = tl.load(dims + g)
            cols = tl.arange(0, BLOCK_D)
            col_ok = cols < dim
            rows = _pointer(unique_rows, g, tl.int64)
            at = _pointer(addresses, g, tl.int64)
            row_offsets = _pointer(seg_offsets, g, tl.int64)
            w_stride = tl.load(w_strides + g)
            table_ptr = _pointer(weights, g, weight.dtype.element_ty)
            state1 = _pointer(states1, g, tl.float32)
            state2 = _pointer(states2, g, tl.float32)
            s_stride = tl.load(s_strides + g)
            for local in range(pid, count, num_programs):
                u = first + local
                row = tl.load(rows + local)
                address = tl.load(at + local)
                # the row's weights and state are read first, while its gradient is summed (they do
                # not wait on it)
                w_ptrs = table_ptr + address * w_stride + cols
                w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(tl.float32)
                state_at = address * s_stride
                s1, s2 = read_state(state1 + state_at, state2 + state_at, cols, col_ok, RULE)
                # the row's summed gradient, in id order: straight from its ids, or (a long row) from
                # the partial sums of its chunks of ids, in chunk order
                p0 = tl.load(part_offsets + u)
                p1 = tl.load(part_offsets + u + 1)
                start = tl.load(row_offsets + local)
                end = tl.where(p1 > p0, start, tl.load(row_offsets + local + 1))
                grad = _row_gradient(
                    g, start, end, bags, scales, scaled, grads, g_strides, num_features, first_feature,
                    feature_cols, cols, col_ok, HAS_SCALES, BLOCK_N, BLOCK_D,
                )  # fmt: skip
                for p in range(p0, p1):
                    grad += tl.load(partial + p * p_stride + cols, mask=col_ok, other=0.0)
                table = tl.load(_pointer(row_tables, g, tl.int64) + local) if MULTI_TABLE else 0
                hp = _pointer(hparams, g, tl.float32) + table * NUM_HPARAMS
                grad = grad + tl.load(hp + 2) * w  # weight decay
                w = apply_rule(
                    w, grad, s1, s2, cols, col_ok, state1 + state_at, state2 + state_at, dim, hp, RULE, BLOCK_D
                )
                if STOCHASTIC:
                    key = tl.load(_pointer(keys, g, tl.int64) + table).to(tl.uint32)
                    noise = uniform_noise(key, row - tl.load(_pointer(row_starts, g, tl.int64) + table), cols)
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


def _gradient_source(groups: list[UpdateGroup]) -> dict[str, list[int]]:
    """Where each group's ids and gradient are: the int64 tables _row_gradient reads."""
    return {
        "bags": [grp.sorted_ids[2].data_ptr() for grp in groups],
        # an unscaled group's ids read no scale; any pointer does
        "scales": [
            (grp.sorted_ids[3] if grp.sorted_ids[3] is not None else grp.sorted_ids[2]).data_ptr()
            for grp in groups
        ],
        "scaled": [int(grp.sorted_ids[3] is not None) for grp in groups],
        "grads": [grp.grad.data_ptr() for grp in groups],
        "g_strides": [grp.grad.stride(0) for grp in groups],
        "num_features": [grp.num_features for grp in groups],
        "first_feature": _firsts([grp.num_features for grp in groups])[:-1],
        "feature_cols": [c for grp in groups for c in grp.columns],
    }


# the device tables of hyper-parameters that are floats, by (values, step, device): a step whose
# hyper-parameters are those of an earlier one reuses its table (launches only read it)
_FLOAT_TABLES: dict[tuple, torch.Tensor] = {}
_FLOAT_TABLES_KEPT = 16


def hparam_table(
    hparams: Mapping[str, float | torch.Tensor], step: int, num_tables: int, device: torch.device
) -> torch.Tensor:
    """[1 or num_tables, len(HPARAM_COLUMNS)] fp32: the update's hyper-parameters (floats, or [T]
    tensors where a group's tables differ), with adam's bias corrections of `step` folded in.

    One row when all are floats, computed with Python floats as the torch path computes them
    (optimizers.py), and kept: the next step with the same values and step gets the same table
    with no work on the host or the device (a rule other than adam passes step 1, since it reads
    no bias correction). Otherwise in float64 on the device the tensors are on (no read back)."""
    if all(isinstance(v, float) for v in hparams.values()):
        key = (tuple(sorted(hparams.items())), step, str(device))
        table = _FLOAT_TABLES.get(key)
        if table is None:
            row = _hparam_columns(hparams, step, math.sqrt)
            table = _to_device(torch.tensor([row], dtype=torch.float32), device)
            if len(_FLOAT_TABLES) >= _FLOAT_TABLES_KEPT:
                del _FLOAT_TABLES[next(iter(_FLOAT_TABLES))]  # the oldest
            _FLOAT_TABLES[key] = table
        return table
    values = {
        k: v.to(torch.float64) if isinstance(v, torch.Tensor)
        else torch.full((num_tables,), v, dtype=torch.float64, device=device)
        for k, v in hparams.items()
    }  # fmt: skip
    table = torch.stack(_hparam_columns(values, step, torch.sqrt), dim=1).to(torch.float32)
    return _to_device(table, device)


def _hparam_columns(h: Mapping, step: int, sqrt: Callable) -> list:
    """The values of HPARAM_COLUMNS, in order, from hyper-parameters `h` (Python floats, or float64
    tensors with `sqrt` torch.sqrt): adam's bias corrections of `step` folded into two of them."""
    columns = {
        "lr": h["lr"],
        "eps": h["eps"],
        "weight_decay": h["weight_decay"],
        "one_minus_beta1": 1.0 - h["beta1"],
        "one_minus_beta2": 1.0 - h["beta2"],
        "adam_lr": h["lr"] / (1.0 - h["beta1"] ** step),
        "adam_sqrt_bias2": sqrt(1.0 - h["beta2"] ** step),
    }
    return [columns[name] for name in HPARAM_COLUMNS]


def max_chunks(num_ids: int, chunk: int) -> int:
    """An upper bound on the number of chunks fused_update splits `num_ids` ids into, from sizes alone.

    Only a row with c > chunk ids is split, into ceil(c / chunk) chunks, and ceil(c / chunk) <=
    2c / (chunk + 1) for every such c (c = k * chunk + r with k >= 1 and 1 <= r <= chunk: the right
    side less the left is ((k - 1)(chunk - 1) + 2(r - 1)) / (chunk + 1) >= 0). Summed over the split
    rows, whose ids number at most num_ids, there are at most 2 * num_ids / (chunk + 1) chunks;
    none when no row can have more than `chunk` ids. The bound is reached by rows of chunk + 1 ids.
    """
    return 0 if num_ids <= chunk else 2 * num_ids // (chunk + 1)


def fused_update(groups: list[UpdateGroup], step: int, chunk: int | None = None) -> None:
    """Sum each unique row's gradient over its ids and update the row (and state) in place, for
    every group: one launch per (rule, weight dtype, stochastic rounding or not) among them.

    step: the engine's update count, from 1 (adam's bias correction; stochastic rounding's noise).

    A row with more than `chunk` ids (a hot row of a skewed batch can have 100k) would keep one
    program busy long after the others finish; its ids are summed in chunks of `chunk` ids by
    programs of their own first, and its update adds those partial sums in chunk order. The chunks
    depend only on the ids, so the result is still the same on every run. The number of chunks
    stays on the device: the chunk programs are launched over max_chunks(ids, chunk), a bound
    known on the host, and those past the real count return at once. The hyper-parameters and the
    groups' tables travel by asynchronous copies (_to_device), so with sort_by_row_on_device's ids
    the update reads nothing back to the host.
    """
    launches: dict[tuple[str, torch.dtype, bool], list[UpdateGroup]] = {}
    for grp in groups:
        if grp.sorted_ids[0].numel() == 0:
            continue
        if grp.weight.shape[1] > MAX_UPDATE_DIM:
            dim = grp.weight.shape[1]
            raise ValueError(f"the fused update kernel takes dims up to {MAX_UPDATE_DIM}, got {dim}")
        assert grp.weight.stride(1) == 1 and grp.grad.stride(1) == 1 and grp.grad.dtype == torch.float32
        assert grp.grad.shape[0] * grp.num_features < 2**31  # the kernel's bag indices are int32
        assert len({t.stride(0) for t in grp.state.values()}) <= 1  # one state stride per group
        assert all(t.dim() == 1 or t.stride(1) == 1 for t in grp.state.values())
        stochastic = grp.table_seeds is not None and grp.weight.dtype != torch.float32
        launches.setdefault((grp.rule, grp.weight.dtype, stochastic), []).append(grp)
    for (rule, _, stochastic), same in launches.items():
        _launch_update(rule, same, step, chunk or LONG_ROW_CHUNK, stochastic)


def _launch_update(rule: str, groups: list[UpdateGroup], step: int, chunk: int, stochastic: bool) -> None:
    """One launch of the update (and one of the long rows' partial sums) over `groups`, which share
    the rule, the weight dtype and the rounding. The launch's unique rows are the groups' one after
    the other (padded ones included): the programs of group g are [first_unique[g], first_unique[g + 1])."""
    launch = _setup(rule, groups, step, chunk, stochastic)
    partial = _partial_sums(launch, groups, chunk)
    _update_rows(launch, groups, rule, partial, stochastic)


@dataclass
class _Launch:
    """What _setup prepares on the host for a launch's kernels: block sizes, the launch's unique rows
    and ids, where each row's chunks of partial sums are, and the groups' tables (_int_tables)."""

    device: torch.device
    max_dim: int
    block_d: int
    block_n: int
    num_warps: int
    has_scales: bool
    multi_table: bool
    num_unique: int
    num_ids: int
    part_offsets: torch.Tensor
    tables: dict[str, torch.Tensor]
    gradient: dict[str, torch.Tensor]  # the tables the sums read (both kernels)
    # the tensors made here whose addresses the tables hold (counts, hyper-parameters, each row's
    # table, rounding keys): kept alive until the kernels are launched
    held: list[torch.Tensor]


@staged("update_setup")
def _setup(rule: str, groups: list[UpdateGroup], step: int, chunk: int, stochastic: bool) -> _Launch:
    """The host's part of a launch: block sizes, hyper-parameter tables, the chunks of long rows and
    the groups' pointer tables, all queued for the device without waiting on it."""
    device = groups[0].weight.device
    max_dim = max(grp.weight.shape[1] for grp in groups)
    block_d = triton.next_power_of_2(max_dim)
    block_n = max(1, min(16, 2048 // block_d))
    num_warps = _num_warps(block_d)
    has_scales = any(grp.sorted_ids[3] is not None for grp in groups)
    first_unique = _firsts([grp.sorted_ids[0].numel() for grp in groups])
    num_unique, num_ids = first_unique[-1], sum(grp.sorted_ids[2].numel() for grp in groups)
    # the real number of unique rows of each group: on the device for padded ids, else known here
    counts = [
        grp.sorted_ids[4] if len(grp.sorted_ids) > 4
        else torch.full((1,), grp.sorted_ids[0].numel(), dtype=torch.int64, device=device)
        for grp in groups
    ]  # fmt: skip

    table_step = step if rule == "adam" else 1  # only adam reads the step's bias corrections
    hps = [hparam_table(grp.hparams, table_step, grp.row_starts.numel(), device) for grp in groups]
    # which table of its group each row belongs to, where tables' hyper-parameters or seeds differ
    multi_table = any(
        grp.row_starts.numel() > 1 and (stochastic or hp.shape[0] > 1)
        for grp, hp in zip(groups, hps, strict=True)
    )
    row_tables = [grp.sorted_ids[0] for grp in groups]  # any pointer when every row uses its group's table 0
    if multi_table:
        row_tables = [torch.searchsorted(grp.row_starts, grp.sorted_ids[0], right=True) - 1 for grp in groups]
        hps = [hp.expand(len(grp.row_starts), -1).contiguous() for grp, hp in zip(groups, hps, strict=True)]
    keys = [rounding.step_keys(grp.table_seeds, step) if stochastic else grp.row_starts for grp in groups]

    # the chunks of long rows, over the launch's unique rows
    seg_offsets = [grp.sorted_ids[1] for grp in groups]
    ids_per_row = torch.cat([off[1:] - off[:-1] for off in seg_offsets])
    parts = torch.where(ids_per_row > chunk, (ids_per_row + chunk - 1) // chunk, 0)
    part_offsets = torch.zeros(num_unique + 1, dtype=torch.int64, device=device)
    torch.cumsum(parts, 0, out=part_offsets[1:])

    source = _gradient_source(groups)
    tables = _int_tables(
        {
            "first_unique": first_unique,
            "dims": [grp.weight.shape[1] for grp in groups],
            "seg_offsets": [off.data_ptr() for off in seg_offsets],
            **source,
            "counts": [c.data_ptr() for c in counts],
            "unique_rows": [grp.sorted_ids[0].data_ptr() for grp in groups],
            "addresses": [
                (grp.addresses if grp.addresses is not None else grp.sorted_ids[0]).data_ptr()
                for grp in groups
            ],
            "weights": [grp.weight.data_ptr() for grp in groups],
            "w_strides": [grp.weight.stride(0) for grp in groups],
            # sgd has no state and only adam a second one: any pointer does, none is read
            "states1": [grp.state.get("momentum1", grp.weight).data_ptr() for grp in groups],
            "states2": [grp.state.get("momentum2", grp.weight).data_ptr() for grp in groups],
            # values from one row's state to the next's: dim for [rows, dim], 1 for [rows], a
            # record's for a cache's views (a rule's states share their layout)
            "s_strides": [
                grp.state["momentum1"].stride(0) if "momentum1" in grp.state else 0 for grp in groups
            ],
            "hparams": [hp.data_ptr() for hp in hps],
            "row_tables": [t.data_ptr() for t in row_tables],
            "row_starts": [grp.row_starts.data_ptr() for grp in groups],
            "keys": [k.data_ptr() for k in keys],
        },
        device,
    )
    gradient = {name: tables[name] for name in ("first_unique", "dims", "seg_offsets", *source)}
    return _Launch(
        device, max_dim, block_d, block_n, num_warps, has_scales, multi_table, num_unique, num_ids, part_offsets,
        tables, gradient, held=[*counts, *hps, *row_tables, *keys],
    )  # fmt: skip


@staged("partial_sums")
def _partial_sums(launch: _Launch, groups: list[UpdateGroup], chunk: int) -> torch.Tensor:
    """The summed gradient of each chunk of `chunk` ids of the launch's long rows, [chunks, max_dim]
    (launched over max_chunks' bound; programs past the real count return at once); when no row can
    be long, any fp32 tensor (the update kernel reads none)."""
    bound = max_chunks(launch.num_ids, chunk)
    if not bound:
        return groups[0].grad
    # chunk p belongs to the row u with part_offsets[u] <= p < part_offsets[u + 1]; p past the real
    # count gets u = num_unique, which its program never reads
    part_offsets, device = launch.part_offsets, launch.device
    p = torch.arange(bound, device=device)
    part_rows = torch.searchsorted(part_offsets[1:], p, right=True)
    part_index = p - part_offsets.index_select(0, part_rows)
    partial = torch.empty(bound, launch.max_dim, dtype=torch.float32, device=device)
    _partial_kernel[(bound,)](
        part_offsets[launch.num_unique :], part_rows, part_index, partial, launch.max_dim, len(groups),
        **launch.gradient, HAS_SCALES=launch.has_scales, CHUNK=chunk, BLOCK_N=launch.block_n,
        BLOCK_D=launch.block_d, num_warps=launch.num_warps,
    )  # fmt: skip
    return partial


@staged("update")
def _update_rows(
    launch: _Launch, groups: list[UpdateGroup], rule: str, partial: torch.Tensor, stochastic: bool
) -> None:
    """The update kernel over the launch's unique rows: each row's gradient summed (with its chunks'
    partial sums) and the rule applied to it and its state."""
    _update_kernel[(_resident_programs(launch.device, launch.num_unique, launch.num_warps),)](
        groups[0].weight, len(groups), part_offsets=launch.part_offsets, partial=partial, p_stride=launch.max_dim,
        **launch.tables, RULE=RULE_IDS[rule], HAS_SCALES=launch.has_scales, MULTI_TABLE=launch.multi_table,
        STOCHASTIC=stochastic, NUM_HPARAMS=len(HPARAM_COLUMNS), BLOCK_N=launch.block_n, BLOCK_D=launch.block_d,
        num_warps=launch.num_warps,
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
