"""One group's ids of a batch as sample-major bags, the form the fused lookup pools.

The batch holds its ids feature-major (all ids of feature 0 for samples 0..B-1, then feature 1, ...).
A group's lookup wants them sample-major: bag `b * F + f` is feature f of sample b. Pooling those bags
with one `embedding_bag` over the group's buffer gives a [B * F, D] result that *is* the [B, F * D]
output, so no transpose of the output is needed and the incoming gradient is already one row per bag;
permuting the ids costs a few int64 gathers instead of a copy of the much larger output. Each id also
becomes its global row: its table's first row in the group's buffer plus the id.

Sequence groups (pooling none) keep the batch's feature-major order with one bag per id, features one
after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.sparse import SparseBatch, lengths_to_offsets


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
