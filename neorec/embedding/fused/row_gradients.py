"""The backward's row gradients: one summed gradient per unique row, exact and deterministic.

Backward never forms a per-id gradient nor a table-sized one. The gradient of global row r is
sum over ids i with row(i) = r of scale(i) * d(pooled)[bag(i)], which is itself a pooled lookup:
sort the ids by row (stable), cut the sorted list at row changes, and call `embedding_bag` with the
bag indices as ids, d(pooled) as the "table" and the row segments as the bags. This is exact (each
unique row's sum is formed once, in id order) and bitwise deterministic: the sort is stable and
`embedding_bag` sums each bag sequentially in one thread, whatever the thread count or device.

On CPU the sums (and the update that follows them) run in blocks of about `chunk_elements` rows x
dim, so every temporary stays cache-sized; see row_gradients. The exception is plain SGD into a plain
fp32 table on CPU: -lr rides along as each id's weight of the sums, and one `scatter_add_` adds every
unique row's sum to its row (add_row_gradients), which is bitwise what the blocked path gives with
the same folded learning rate.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from neorec.embedding.fused.bags import GroupBatch
from neorec.sparse import lengths_to_offsets
from neorec.utils import index_ops
from neorec.utils.stages import stage


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
    with stage("sort"):
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
    with stage("sort"):
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
        with stage("row_sums"):
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
    with stage("row_sums"):
        sums = F.embedding_bag(
            bags,
            grad_bags,
            offsets,
            mode="sum",
            per_sample_weights=id_weights(scales, bags, id_scale),
            include_last_offset=True,
        )
    with stage("update"):
        table.scatter_add_(0, unique_rows.unsqueeze(1).expand(-1, table.shape[1]), sums)


def group_gradient(grad_out: torch.Tensor, runs: list[tuple[int, int]], dim: int) -> torch.Tensor:
    """d(pooled) of one group as [B * F_g, D]: one row per sample-major bag."""
    parts = [grad_out[:, start:end] for start, end in runs]
    grad = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return grad.contiguous().view(-1, dim)
