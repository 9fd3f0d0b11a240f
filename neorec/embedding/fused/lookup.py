"""The fused lookup: all pooled lookups of a group of tables in one call, and its backward.

Forward reorders each pooled group's ids from the batch's feature-major layout to sample-major bags
(bag `b * F + f` is feature f of sample b) and pools them with one `embedding_bag` over the group's
buffer. Sample-major bags make the pooled [B * F, D] result *be* the [B, F * D] output, so no
transpose of the output is needed, and the incoming gradient is already one row per bag; permuting
the ids costs a few int64 gathers instead of a copy of the much larger output.

Backward never forms a per-id gradient nor a table-sized one. The gradient of global row r is
sum over ids i with row(i) = r of scale(i) * d(pooled)[bag(i)], which is itself a pooled lookup:
sort the ids by row (stable), cut the sorted list at row changes, and call `embedding_bag` with the
bag indices as ids, d(pooled) as the "table" and the row segments as the bags. This is exact (each
unique row's sum is formed once, in id order) and bitwise deterministic: the sort is stable and
`embedding_bag` sums each bag sequentially in one thread, whatever the thread count or device.

On CPU the backward (and the lookup of fp16/bf16 or non-plain storage) runs in blocks of about
`chunk_elements` rows x dim, so every temporary stays cache-sized; see row_gradients. The exception
is plain SGD into a plain fp32 table on CPU: -lr rides along as each id's weight of the sums, and
one `scatter_add_` adds every unique row's sum to its row (add_row_gradients), which is bitwise
what the blocked path gives with the same folded learning rate.

Sequence groups (pooling none) are the same machinery with one bag per id: their ids stay in the
batch's feature-major order, "pooling" each one-id bag is a gather of its row (times its weight),
and the backward above, with d(rows) as the bags' gradient, sums each unique row's ids in id order
and applies the same update.

With the Triton kernels (triton_kernels.py; on a GPU) the same bags and sorted ids go to one launch
for all groups instead of a call per group: the pooling kernel writes each bag straight into its
feature's columns of the output (no `assemble`), and the fused update reads each bag's gradient
straight from d(pooled) (no `group_gradient`). A group in a row cache goes too: when every row of
the batch has a slot (a batch its prefetch brought in) the kernels read and update the cache's
records in place at the rows' slots, which are then marked for write-back; otherwise they work on
copies of the rows read through the cache, and the updated copies are written back through it
(cached_update). Groups the kernels do not take (a gradient hook, a rule or width they lack) still
run as above and are copied into their columns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.autograd import Variable
from torch.autograd.function import once_differentiable

from neorec.embedding.fused import triton_kernels
from neorec.embedding.fused.storage import RowStorage, TensorStorage
from neorec.sparse import SparseBatch, lengths_to_offsets
from neorec.utils import index_ops

if TYPE_CHECKING:
    from neorec.embedding.fused.collection import FusedEmbeddingCollection


@dataclass
class GroupBatch:
    """One group's ids of a batch in sample-major bags, ready to pool."""

    rows: torch.Tensor  # [n] global rows into the group's buffer
    bags: torch.Tensor  # [n] bag of each id, b * num_features + f
    offsets: torch.Tensor  # [B * num_features + 1] first id of each bag
    scales: torch.Tensor | None  # [n] per-id weight times 1/bag length for mean pooling; None = all ones
    batch_size: int
    num_features: int
    one_hot: bool = False  # every bag holds exactly one id and there are no scales: bag i is id i
    # a sequence group (one bag per id, feature-major; batch_size is then the number of ids and
    # num_features 1, so its "pooled" output is [ids, D]): the ids of each of its features
    sequence_counts: list[int] | None = None


def prepare_group(
    sparse: SparseBatch,
    features: torch.Tensor,
    row_offsets: torch.Tensor,
    mean: torch.Tensor | None,
    num_ids: int,
) -> GroupBatch:
    """Gather one group's ids (features = their indices in sparse.keys) into sample-major bags.

    row_offsets[f] is the first global row of feature f's table; mean[f] marks mean pooling
    (None when the group has none). num_ids is the group's id count, known on the host, so that
    no step here waits for the device.
    """
    b, nf = sparse.batch_size, features.numel()
    device = sparse.values.device
    lengths = sparse.lengths.view(-1, b).index_select(0, features)  # [F, B] feature-major
    if (
        num_ids == b * nf
        and sparse.weights is None
        and device.type == "cpu"  # one host sync to check; GPUs take the general path without it
        and bool((lengths == 1).all())
    ):
        return _one_hot_group(sparse, features, row_offsets, b, nf)
    bag_lengths = lengths.t().reshape(-1)  # [B * F] sample-major
    offsets = lengths_to_offsets(bag_lengths)
    bags = torch.arange(b * nf, device=device).repeat_interleave(bag_lengths, output_size=num_ids)

    # Where bag (b, f) starts in the batch's values, minus where it starts in ours: an id's source
    # position is its own position plus its bag's shift.
    fm_bag = (features.view(1, nf) * b + torch.arange(b, device=device).view(b, 1)).reshape(-1)
    shift = sparse.offsets().index_select(0, fm_bag) - offsets[:-1]
    src = shift.index_select(0, bags) + torch.arange(num_ids, device=device)
    rows = sparse.values.index_select(0, src) + row_offsets.repeat(b).index_select(0, bags)

    scales = None
    if sparse.weights is not None:
        scales = sparse.weights.index_select(0, src).to(torch.float32)
    if mean is not None:
        inv = torch.where(mean.repeat(b), bag_lengths.clamp(min=1).to(torch.float32).reciprocal(), 1.0)
        inv = inv.index_select(0, bags)
        scales = inv if scales is None else scales * inv
    return GroupBatch(rows, bags, offsets, scales, b, nf)


def prepare_sequence_group(sparse: SparseBatch, features: list[int], row_offsets: list[int]) -> GroupBatch:
    """A sequence group's ids (features = their indices in sparse.keys, row_offsets[k] the first
    global row of feature k's table) as one bag per id, features one after the other, each in the
    batch's order. Counting each feature's ids costs one host sync per batch (cached on the batch),
    which splitting the rows by feature needs anyway."""
    bounds = sparse.offset_per_key()
    counts = [bounds[i + 1] - bounds[i] for i in features]
    rows = torch.cat([sparse.values[bounds[i] : bounds[i + 1]] + off for i, off in zip(features, row_offsets, strict=True)])
    scales = None
    if sparse.weights is not None:
        scales = torch.cat([sparse.weights[bounds[i] : bounds[i + 1]] for i in features]).to(torch.float32)
    n = rows.numel()
    one_per_id = torch.arange(n + 1, device=rows.device)
    return GroupBatch(rows, one_per_id[:-1], one_per_id, scales, n, 1, one_hot=scales is None, sequence_counts=counts)


def _one_hot_group(
    sparse: SparseBatch, features: torch.Tensor, row_offsets: torch.Tensor, b: int, nf: int
) -> GroupBatch:
    """Every bag of the group holds one id (one-hot features, the Criteo case): the id of bag (b, f)
    is values[f_batch * B + b], so sample-major rows are one transpose of a [F, B] view and pooling
    is a plain gather. Mean pooling of a one-id bag is that id, so `mean` changes nothing."""
    starts = sparse.offsets()[:-1].view(-1, b).index_select(0, features)[:, :1]  # [F, 1] first id of each feature
    rows = sparse.values.index_select(0, (starts + torch.arange(b, device=starts.device)).reshape(-1))
    rows = (rows.view(nf, b) + row_offsets.view(nf, 1)).t().reshape(-1)
    bags = torch.arange(b * nf, device=rows.device)
    offsets = torch.arange(b * nf + 1, device=rows.device)
    return GroupBatch(rows, bags, offsets, None, b, nf, one_hot=True)


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


def sort_by_row(
    batch: GroupBatch, num_unique: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch's ids grouped by row: (unique rows ascending, offsets [U + 1] of each row's ids,
    the bag of each id, its scale or None), ids of a row in their original order (stable sort).
    num_unique: U when the caller knows it (a cache that prefetched the batch): then nothing is read
    back to the host (torch.unique_consecutive reads U).

    On CPU the stable sort is a radix sort (index_ops.stable_sort): about 4 ms for the 438k ids of
    an MLPerf multi-hot batch of 2048 over 26M rows on this project's 2-core machine.
    """
    sorted_rows, order = index_ops.stable_sort(batch.rows)
    bags = batch.bags.index_select(0, order)
    scales = batch.scales.index_select(0, order) if batch.scales is not None else None
    if num_unique is not None and sorted_rows.numel():
        first, _ = index_ops.runs(sorted_rows)
        starts = index_ops.compact(first, num_unique)  # each run's first id
        end = torch.full((1,), sorted_rows.numel(), dtype=starts.dtype, device=starts.device)
        return sorted_rows.index_select(0, starts), torch.cat([starts, end]), bags, scales
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    return unique_rows, lengths_to_offsets(counts), bags, scales


def sort_by_row_on_device(
    batch: GroupBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """sort_by_row without reading the number of unique rows back to the host: (unique rows [n],
    offsets [n + 1], the bag of each id, its scale or None, the number of unique rows U as a [1]
    tensor), n the number of ids. Entries past U are padding: rows 0, empty runs of ids (offsets n).
    The ids of each row are in the same order as sort_by_row's, so sums over them are bitwise the
    same; a kernel launched over n programs returns at once past U."""
    sorted_rows, order = torch.sort(batch.rows, stable=True)
    bags = batch.bags.index_select(0, order)
    scales = batch.scales.index_select(0, order) if batch.scales is not None else None
    unique_rows, offsets, num_unique = index_ops.padded_runs(sorted_rows)
    return unique_rows, offsets, bags, scales, num_unique


def id_weights(
    scales: torch.Tensor | None, bags: torch.Tensor, id_scale: float | None
) -> torch.Tensor | None:
    """Per-id weights of the gradient sums: each id's scale, times id_scale when one is given."""
    if id_scale is None:
        return scales
    if scales is None:
        return torch.full(bags.shape, id_scale, dtype=torch.float32, device=bags.device)
    return scales * id_scale


def row_gradients(
    batch: GroupBatch,
    grad_bags: torch.Tensor,
    chunk_rows: int | None,
    id_scale: float | None = None,
    num_unique: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (unique global rows ascending, their summed gradients [rows, D]), chunk_rows at a time.

    Chunking bounds every temporary of the update that follows (gradients, gathered rows and state,
    the rule's intermediates) to a cache-sized block: on CPU a [U, D] temporary per op would be tens
    of MB, fetched from DRAM at each of the rule's passes and, on hosts where fresh pages are
    expensive, page-faulted in anew at every step. Results do not depend on the chunk size: each
    row's sum and update only ever see that row. None = one chunk (GPUs; no host sync at all).
    id_scale multiplies every id's term of the sums (SGD's folded -lr, see add_row_gradients).
    num_unique: the number of unique rows, when known (see sort_by_row).
    """
    unique_rows, offsets, bags, scales = sort_by_row(batch, num_unique)
    weights = id_weights(scales, bags, id_scale)
    num_unique = unique_rows.numel()
    if num_unique == 0:  # still one (empty) block, so that a gradient hook runs on every rank
        yield unique_rows, grad_bags.new_zeros(0, grad_bags.shape[1])
        return
    starts = list(range(0, num_unique, chunk_rows or max(num_unique, 1)))
    if len(starts) == 1:
        bounds = [0, batch.rows.numel()]
    else:  # where each chunk's ids start: one small read, only on the chunked (CPU) path
        bounds = offsets[torch.tensor([*starts, num_unique], device=offsets.device)].tolist()
    for k, first in enumerate(starts):
        last = starts[k + 1] if k + 1 < len(starts) else num_unique
        lo, hi = bounds[k], bounds[k + 1]
        grads = F.embedding_bag(
            bags[lo:hi],
            grad_bags,
            offsets[first : last + 1] - lo if lo else offsets[first : last + 1],
            mode="sum",
            per_sample_weights=weights[lo:hi] if weights is not None else None,
            include_last_offset=True,
        )
        yield unique_rows[first:last], grads


def add_row_gradients(
    table: torch.Tensor, batch: GroupBatch, grad_bags: torch.Tensor, id_scale: float
) -> None:
    """table[r] += the sum over ids i of row r of id_scale * scale(i) * d(pooled)[bag(i)], once per
    unique row: a plain SGD step (id_scale = -lr) straight into an fp32 table.

    The sums are row_gradients' (same ids, order and weights) and scatter_add_ adds each to its
    row once (rows are unique, so no order is involved): bitwise the general path's result with
    the learning rate folded the same way. It is one pass over the touched rows instead of a read,
    an add and a write per block, and a handful of thread-parallel ops per batch instead of four
    per block: on a 2-core machine that something else also uses, every parallel op can wait a
    time slice for its second thread. One block on purpose: scatter_add_ sorts its index, and
    blocks of 2^17..2^21 elements measured slower than one call.
    """
    unique_rows, offsets, bags, scales = sort_by_row(batch)
    sums = F.embedding_bag(
        bags,
        grad_bags,
        offsets,
        mode="sum",
        per_sample_weights=id_weights(scales, bags, id_scale),
        include_last_offset=True,
    )
    table.scatter_add_(0, unique_rows.unsqueeze(1).expand(-1, table.shape[1]), sums)


def kernel_bags(
    storage: RowStorage, batch: GroupBatch, out: torch.Tensor, columns: list[int]
) -> triton_kernels.PoolGroup:
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
    return triton_kernels.PoolGroup(weight, rows, b.offsets, b.scales, b.num_features, out, columns)


def cached_update(
    engine: FusedEmbeddingCollection, gi: int, batch: GroupBatch
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


def group_gradient(grad_out: torch.Tensor, runs: list[tuple[int, int]], dim: int) -> torch.Tensor:
    """d(pooled) of one group as [B * F_g, D]: one row per sample-major bag."""
    parts = [grad_out[:, start:end] for start, end in runs]
    grad = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return grad.contiguous().view(-1, dim)


class FusedLookup(torch.autograd.Function):
    """Pooled lookup of every pooled group and row gather of every sequence group; backward updates
    the touched rows in place. Outputs: the pooled [B, output_dim], then one [ids, D] per sequence
    group (in group order).

    `anchor` is an empty tensor that requires grad: the tables are not autograd inputs (no table
    gradient is ever formed), so something must make autograd call backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, anchor: torch.Tensor, engine: FusedEmbeddingCollection, batches: list[GroupBatch], batch_size: int
    ) -> tuple[torch.Tensor, ...]:
        ctx.engine, ctx.batches = engine, batches
        ctx.set_materialize_grads(False)  # an unused sequence's gradient stays None: nothing to add
        start = time.perf_counter()
        groups = engine.layout.groups
        device = batches[0].rows.device if batches else torch.device("cpu")
        output_dim = engine.layout.output_dim
        out = None  # the pooled output, made first when the Triton kernel pools into it
        looked_up: list[torch.Tensor | None] = []
        kernel_groups: list[triton_kernels.PoolGroup] = []
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
            triton_kernels.pool(kernel_groups)
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
        engine: FusedEmbeddingCollection = ctx.engine
        start = time.perf_counter()
        if grad_out is not None:
            grad_out = grad_out.to(torch.float32)
        step = engine.num_updates + 1
        sequence = 0
        kernel_groups: list[triton_kernels.UpdateGroup] = []
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
                    triton_kernels.UpdateGroup(
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
            triton_kernels.fused_update(kernel_groups, step)
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


def _apply_hooked(engine: FusedEmbeddingCollection, hooked: list, step: int, timed: bool = False) -> None:
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
