"""The fused lookup: all pooled lookups of a group of tables in one call, and its backward.

Forward pools each pooled group's sample-major bags (bags.py) with one `embedding_bag` over the
group's buffer (`pool`); backward turns d(pooled) into one summed gradient per unique row
(row_gradients.py) and has the engine apply its update rule to those rows and their state in
place (FusedLookup.backward, the engine's apply_update). The tables are never autograd inputs.

On CPU the lookup of fp16/bf16 or non-plain storage runs in blocks of about `chunk_elements` rows
x dim, so the fp32 copy of the rows stays cache-sized.

Sequence groups (pooling none) are the same machinery with one bag per id: "pooling" each one-id bag
is a gather of its row (times its weight), and the backward, with d(rows) as the bags' gradient,
sums each unique row's ids in id order and applies the same update.

With the Triton kernels (triton_pool.py, triton_fused_update.py; on a GPU) the same bags and sorted
ids go to one launch for all groups instead of a call per group: the pooling kernel writes each bag
straight into its feature's columns of the output (no `assemble`), and the fused update reads each
bag's gradient straight from d(pooled) (no `group_gradient`). A group in a row cache goes too: when
every row of the batch has a slot (a batch its prefetch brought in) the kernels read and update the
cache's records in place at the rows' slots, which are then marked for write-back; otherwise they
work on copies of the rows read through the cache, and the updated copies are written back through
it (cached_update). Groups the kernels do not take (a gradient hook, a rule or width they lack)
still run as above and are copied into their columns.

The engine (FusedEmbeddingCollection) is passed in as a `LookupEngine`: what the lookup needs of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.autograd import Variable
from torch.autograd.function import once_differentiable

from neorec.embedding.fused import triton_fused_update, triton_pool
from neorec.embedding.fused.bags import GroupBatch
from neorec.embedding.fused.layout import Layout
from neorec.embedding.fused.row_gradients import (
    add_row_gradients,
    group_gradient,
    row_gradients,
    sort_by_row,
    sort_by_row_on_device,
)
from neorec.embedding.fused.storage import RowStorage, TensorStorage


class LookupEngine(Protocol):
    """What the lookup needs of its engine (neorec/embedding/fused/collection.py): the groups' layout
    and storages, its hooks and counters, and its choices of path per group."""

    layout: Layout
    weights: list[RowStorage]
    states: list[dict[str, RowStorage]]
    num_updates: int
    timings: dict[str, float] | None
    grad_hook: Callable | None
    update_hook: Callable[[int, torch.Tensor], None] | None
    counted_ahead: Callable[[int], int | None] | None

    def triton_lookup(self, gi: int, device: torch.device) -> bool: ...
    def triton_update(self, gi: int, device: torch.device) -> bool: ...
    def cached_kernels(self, gi: int, device: torch.device, update: bool = False) -> bool: ...
    def triton_update_args(self, gi: int) -> dict: ...
    def chunk_rows(self, gi: int, device: torch.device) -> int | None: ...
    def group_hparams(self, gi: int, device: torch.device) -> dict[str, float | torch.Tensor]: ...
    def folded_lr(self, gi: int, hparams: dict, device: torch.device) -> float | None: ...
    def adds_in_place(self, gi: int) -> bool: ...
    def apply_update(
        self, gi: int, rows: torch.Tensor, grads: torch.Tensor, step: int, hparams: dict,
        lr_folded: bool = False, unique: bool = True,
    ) -> None: ...  # fmt: skip


def pool(storage: RowStorage, batch: GroupBatch, chunk_rows: int | None) -> torch.Tensor:
    """[B, F * D] fp32 pooled vectors of one group, with torch ops (see kernel_bags for the Triton kernel).

    fp32 plain storage: one embedding_bag straight over the buffer. Otherwise rows are read through
    the storage and widened to fp32 before pooling, so fp16/bf16 tables accumulate in fp32; this is
    done about chunk_rows ids at a time (whole bags) so the fp32 copy stays cache-sized.
    """
    if storage.dtype == torch.float32 and batch.one_hot:  # a plain gather (through the cache, if any)
        if isinstance(storage, TensorStorage):
            return storage.tensor.index_select(0, batch.rows).view(batch.batch_size, batch.num_features * storage.width)
        return storage.read(batch.rows).view(batch.batch_size, batch.num_features * storage.width)
    if isinstance(storage, TensorStorage) and storage.dtype == torch.float32:
        pooled = F.embedding_bag(
            batch.rows,
            storage.tensor,
            batch.offsets,
            mode="sum",
            per_sample_weights=batch.scales,
            include_last_offset=True,
        )
        return pooled.view(batch.batch_size, batch.num_features * storage.width)
    num_ids, num_bags = batch.rows.numel(), batch.offsets.numel() - 1
    if num_ids == 0:
        return torch.zeros(batch.batch_size, batch.num_features * storage.width, device=batch.rows.device)
    if chunk_rows is None or num_ids <= chunk_rows:
        bag_bounds = [0, num_bags]
    else:  # cut before the bag holding every chunk_rows-th id; one small read
        cuts = batch.bags[chunk_rows::chunk_rows].tolist()
        bag_bounds = sorted({0, num_bags, *cuts})
    id_bounds = batch.offsets[bag_bounds].tolist() if len(bag_bounds) > 2 else [0, num_ids]
    parts = []
    for k in range(len(bag_bounds) - 1):
        lo, hi = id_bounds[k], id_bounds[k + 1]
        # the batch's own rows tensor when it is one part: a cache knows it from its prefetch
        rows = storage.read(batch.rows if hi - lo == num_ids else batch.rows[lo:hi]).to(torch.float32)
        offsets = batch.offsets[bag_bounds[k] : bag_bounds[k + 1] + 1]
        parts.append(
            F.embedding_bag(
                torch.arange(hi - lo, device=rows.device),
                rows,
                offsets - lo if lo else offsets,
                mode="sum",
                per_sample_weights=batch.scales[lo:hi] if batch.scales is not None else None,
                include_last_offset=True,
            )
        )
    pooled = parts[0] if len(parts) == 1 else torch.cat(parts)
    return pooled.view(batch.batch_size, batch.num_features * storage.width)


def kernel_bags(
    storage: RowStorage, batch: GroupBatch, out: torch.Tensor, columns: list[int]
) -> triton_pool.PoolGroup:
    """One group's bags for the Triton pooling kernel, which writes feature f's sums into `out` from
    column columns[f] on (a sequence group: its own [ids, D] output, column 0): from plain storage's
    tensor at the batch's rows; from a row cache's records at the rows' slots, when every row has
    one; else from the batch's rows read through the cache, one per id."""
    if isinstance(storage, TensorStorage):
        weight, rows = storage.tensor, batch.rows
    else:
        rows = storage.resident_slots(batch.rows)
        weight = storage.view
        if rows is None:
            weight = storage.read(batch.rows)
            rows = torch.arange(batch.rows.numel(), device=weight.device)
    b = batch
    return triton_pool.PoolGroup(weight, rows, b.offsets, b.scales, b.num_features, out, columns)


def cached_update(
    engine: LookupEngine, gi: int, batch: GroupBatch
) -> tuple[dict[str, torch.Tensor | None], tuple[torch.Tensor, ...], torch.Tensor, list[torch.Tensor]]:
    """What the fused update kernel needs of group gi, held in a row cache, for `batch`: (its
    buffers' arguments, the sorted ids, each unique row's address in those buffers, and copies
    to write back through the cache once the kernel has run). When every row of the batch has a
    slot, the buffers are the cache's records (views), the addresses the rows' slots, and the slots
    are marked for write-back. Otherwise each unique row's weights and state are read through the
    cache into tensors of their own (the unique rows counted on the host), updated there, and
    written back through it, as the torch path's reads and writes do."""
    storage = engine.weights[gi]
    args = engine.triton_update_args(gi)
    slots = storage.resident_slots(batch.rows)
    if slots is not None:
        sorted_ids = sort_by_row_on_device(batch)
        storage.cache.mark_updated(slots)
        return args, sorted_ids, storage.cache.slot_index(sorted_ids[0]), []  # padding's are never read
    sorted_ids = sort_by_row(batch)
    unique = sorted_ids[0]
    args["weight"] = storage.read(unique)
    args["state"] = {name: state.read(unique) for name, state in engine.states[gi].items()}
    copies = [args["weight"], *args["state"].values()]
    return args, sorted_ids, torch.arange(unique.numel(), device=unique.device), copies


def assemble(
    pooled: list[torch.Tensor],
    columns: list[list[tuple[int, int]]],
    output_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Interleave each group's [B, F_g * D_g] output into [B, output_dim] at its runs of columns:
    into `out` when given (its other columns are left alone), else into a new tensor."""
    if out is None:
        if len(pooled) == 1 and columns[0] == [(0, output_dim)]:
            return pooled[0]
        out = pooled[0].new_empty(pooled[0].shape[0], output_dim)
    for p, runs in zip(pooled, columns, strict=True):
        local = 0
        for start, end in runs:
            out[:, start:end] = p[:, local : local + end - start]
            local += end - start
    return out


class FusedLookup(torch.autograd.Function):
    """Pooled lookup of every pooled group and row gather of every sequence group; backward updates
    the touched rows in place. Outputs: the pooled [B, output_dim], then one [ids, D] per sequence
    group (in group order).

    `anchor` is an empty tensor that requires grad: the tables are not autograd inputs (no table
    gradient is ever formed), so something must make autograd call backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, anchor: torch.Tensor, engine: LookupEngine, batches: list[GroupBatch], batch_size: int
    ) -> tuple[torch.Tensor, ...]:
        ctx.engine, ctx.batches = engine, batches
        ctx.set_materialize_grads(False)  # an unused sequence's gradient stays None: nothing to add
        start = time.perf_counter()
        groups = engine.layout.groups
        device = batches[0].rows.device if batches else torch.device("cpu")
        output_dim = engine.layout.output_dim
        out = None  # the pooled output, made first when the Triton kernel pools into it
        looked_up: list[torch.Tensor | None] = []
        kernel_groups: list[triton_pool.PoolGroup] = []
        for gi, (group, gb) in enumerate(zip(groups, batches, strict=True)):
            if not (engine.triton_lookup(gi, device) or engine.cached_kernels(gi, device)):
                looked_up.append(pool(engine.weights[gi], gb, engine.chunk_rows(gi, device)))
            elif group.sequence:  # its rows come out as its own [ids, D]
                rows = torch.empty(gb.batch_size, group.dim, device=device)
                kernel_groups.append(kernel_bags(engine.weights[gi], gb, rows, [0]))
                looked_up.append(rows)
            else:  # pooled straight into the output's columns
                if out is None:
                    out = torch.empty(batch_size, output_dim, device=device)
                kernel_groups.append(kernel_bags(engine.weights[gi], gb, out, group.feature_columns))
                looked_up.append(None)
        if kernel_groups:  # one launch per weight dtype, whatever the groups' dims
            triton_pool.pool(kernel_groups)
        pooled = [(p, g.output_columns) for p, g in zip(looked_up, groups, strict=True) if not g.sequence]
        pooled = [(p, columns) for p, columns in pooled if p is not None]
        if pooled or out is not None:
            out = assemble([p for p, _ in pooled], [columns for _, columns in pooled], output_dim, out)
        else:
            out = torch.zeros(batch_size, 0, device=device)
        sequences = [p for p, g in zip(looked_up, groups, strict=True) if g.sequence]
        if engine.timings is not None:
            engine.timings["lookup"] += time.perf_counter() - start
        return (out, *sequences)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor | None, *grad_rows: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        engine: LookupEngine = ctx.engine
        start = time.perf_counter()
        if grad_out is not None:
            grad_out = grad_out.to(torch.float32)
        step = engine.num_updates + 1
        sequence = 0
        kernel_groups: list[triton_fused_update.UpdateGroup] = []
        copies: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []  # written back after the kernel
        hooked: list = []
        for gi, (group, gb) in enumerate(zip(engine.layout.groups, ctx.batches, strict=True)):
            hook = engine.grad_hook
            if group.sequence:
                grad_bags = grad_rows[sequence]
                sequence += 1
            else:
                grad_bags = grad_out
            if (gb.rows.numel() == 0 or grad_bags is None) and hook is None:
                continue
            device = gb.rows.device
            hparams = engine.group_hparams(gi, device)
            cached = grad_bags is not None and engine.cached_kernels(gi, device, update=True)
            if cached or engine.triton_update(gi, device):  # (no hook) updated with the others below
                assert grad_bags is not None
                if cached:
                    args, sorted_ids, addresses, written = cached_update(engine, gi, gb)
                    if written:
                        copies.append((gi, sorted_ids[0], written))
                else:
                    args, sorted_ids, addresses = engine.triton_update_args(gi), sort_by_row_on_device(gb), None
                # the kernel reads each bag's gradient straight from d(pooled), at its feature's columns
                columns = [0] if group.sequence else group.feature_columns
                kernel_groups.append(
                    triton_fused_update.UpdateGroup(
                        group.optimizer, sorted_ids, grad_bags.to(torch.float32).contiguous(), gb.num_features,
                        columns, hparams=hparams, addresses=addresses, **args,
                    )
                )  # fmt: skip
                continue
            if group.sequence:
                grad_bags = gb.rows.new_zeros(gb.rows.numel(), group.dim, dtype=torch.float32) if grad_bags is None \
                    else grad_bags.to(torch.float32).contiguous()  # fmt: skip
            elif grad_bags is None:  # only sequences were used; the hook still needs its exchange
                grad_bags = gb.rows.new_zeros(gb.batch_size * gb.num_features, group.dim, dtype=torch.float32)
            else:
                grad_bags = group_gradient(grad_bags, group.output_columns, group.dim)
            id_scale = engine.folded_lr(gi, hparams, device)
            if id_scale is not None and hook is None and engine.adds_in_place(gi):  # plain SGD, fp32 table
                add_row_gradients(engine.weights[gi].tensor, gb, grad_bags, id_scale)
                continue
            chunk_rows = engine.chunk_rows(gi, device)
            folded = id_scale is not None
            if hook is None:
                # a cache that prefetched the batch knows its unique rows: the sums and the update's
                # reads of them then need nothing from the host
                storage = engine.weights[gi]
                known = storage.unique_count(gb.rows) if hasattr(storage, "unique_count") else None
                for rows, grads in row_gradients(gb, grad_bags, chunk_rows, id_scale, known):
                    if known is not None:
                        storage.rows_of(gb.rows, rows)
                    engine.apply_update(gi, rows, grads, step, hparams, lr_folded=folded)
                continue
            # The hook sees the whole group's sums at once (one exchange per group); its result is
            # then applied in blocks, as above (in place in one pass where SGD's step is a plain add).
            known = engine.counted_ahead(gi) if engine.counted_ahead is not None else None
            summed = hook(gi, *next(row_gradients(gb, grad_bags, None, id_scale, known)))
            if (folded and engine.adds_in_place(gi)) or known is not None:  # (rows may repeat: one block)
                chunk_rows = None
            hooked.append((gi, summed, hparams, folded, chunk_rows, known is None))
        if kernel_groups:  # one launch per (rule, weight dtype), whatever the groups' dims
            triton_fused_update.fused_update(kernel_groups, step)
        for gi, rows, written in copies:  # rows updated outside their cache's slots go back through it
            storages = [engine.weights[gi], *engine.states[gi].values()]
            for storage, values in zip(storages, written, strict=True):
                storage.write(rows, values)
        engine.num_updates = step
        started = [h for h in hooked if callable(h[1])]
        _apply_hooked(engine, [h for h in hooked if not callable(h[1])], step)
        if started:  # their exchanges travel during the rest of backward; applied at its end
            Variable._execution_engine.queue_callback(lambda: _apply_hooked(engine, started, step, timed=True))
        if engine.timings is not None:
            engine.timings["update"] += time.perf_counter() - start
        return None, None, None, None


def _apply_hooked(engine: LookupEngine, hooked: list, step: int, timed: bool = False) -> None:
    """Apply the updates of groups whose gradients went through the engine's grad_hook: each entry
    (group, (rows, gradients) or a function that waits for them, hparams, lr folded, rows per block,
    whether the rows are unique). timed: add the time to the engine's "update" timing (when called
    outside backward)."""
    start = time.perf_counter()
    for gi, summed, hparams, folded, chunk_rows, unique in hooked:
        rows, grads = summed() if callable(summed) else summed
        for lo, hi in _blocks(rows.numel(), chunk_rows):
            engine.apply_update(gi, rows[lo:hi], grads[lo:hi], step, hparams, lr_folded=folded, unique=unique)
        if engine.update_hook is not None:
            engine.update_hook(gi, rows)
    if timed and engine.timings is not None:
        engine.timings["update"] += time.perf_counter() - start


def _blocks(n: int, size: int | None) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most `size` (None: one range) covering 0..n; none when n is 0."""
    step = size or max(n, 1)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]
