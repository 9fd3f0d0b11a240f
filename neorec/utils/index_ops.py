"""Index helpers: the same results as torch's, cheaper on CPU.

The row cache and the sharded collection work on 1-D index tensors of a few thousand to a few
hundred thousand entries every step (a batch's unique rows, its misses, the slots' keys, the rows
of replicated tables' gradients). For those sizes torch's CPU kernels for `nonzero`, boolean-mask
indexing, `sort` and `unique` cost several times numpy's (measured on this project's 2-core machine:
nonzero of 26k entries 169 us against 30, of 260k 1.3 ms against 0.26; argsort of 7.4k rows 0.50 ms
against 0.13; unique of 50k ids 3.5 ms against 0.6). On CPU these go through numpy views of the same
memory; elsewhere (GPU) through torch. The exception is sorting TORCH_RADIX_MIN integers or more:
there torch's CPU sort is a parallel radix sort, faster than numpy's (benchmarks/index_sorts.py, 2
threads, values below 26M: the unique values of 438k found in 4.2 ms against numpy's 21.2).
"""

from __future__ import annotations

import numpy as np
import torch


def where(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the True entries of a 1-D bool tensor, ascending (mask.nonzero().flatten())."""
    if mask.device.type != "cpu":
        return mask.nonzero().flatten()
    return torch.from_numpy(np.flatnonzero(mask.numpy()))


def split(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(where(mask), where(~mask))."""
    if mask.device.type != "cpu":
        return mask.nonzero().flatten(), (~mask).nonzero().flatten()
    m = mask.numpy()
    return torch.from_numpy(np.flatnonzero(m)), torch.from_numpy(np.flatnonzero(~m))


def runs(ordered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of equal values in a sorted 1-D tensor: (whether each entry is its run's first, each
    entry's run index), without reading anything back (the number of runs is which[-1] + 1)."""
    first = torch.ones(ordered.numel(), dtype=torch.bool, device=ordered.device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    return first, torch.cumsum(first, 0).sub_(1)


def padded_runs(ordered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of equal values in a sorted 1-D tensor of n int64 values, without reading anything back:
    (each run's value [n], where each run starts [n + 1], the number of runs U as a [1] tensor).
    Entries past U are padding: values 0, empty runs starting at n."""
    n, device = ordered.numel(), ordered.device
    _, which = runs(ordered)  # each entry's run
    values = torch.zeros(n, dtype=torch.int64, device=device).scatter_(0, which, ordered)
    starts = torch.full((n + 1,), n, dtype=torch.int64, device=device)
    starts.scatter_reduce_(0, which, torch.arange(n, device=device), reduce="amin")
    return values, starts, which[-1:] + 1


def compact(mask: torch.Tensor, count: int) -> torch.Tensor:
    """where(mask) when the number of True entries, `count`, is already known on the host: the
    positions are scattered to their places without reading anything back (on a GPU, no sync)."""
    place = torch.cumsum(mask, 0).sub_(1)
    place = torch.where(mask, place, count)  # the False entries all land in one spare slot
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, place, torch.arange(mask.numel(), device=mask.device))
    return out[:count]


# From this many entries torch's CPU sort of integers is a parallel radix sort (FBGEMM's, in builds
# with OpenMP: at::internal::GRAIN_SIZE); below it, a comparison sort, where numpy's is cheaper.
TORCH_RADIX_MIN = 32768


def sort(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ascending, their positions) of a 1-D tensor of distinct values (so any sort gives the
    same order), as torch.sort."""
    if values.device.type != "cpu" or values.numel() >= TORCH_RADIX_MIN:
        return torch.sort(values)
    order = torch.from_numpy(np.argsort(values.numpy()))
    return values.index_select(0, order), order


def sorted_unique(rows: torch.Tensor) -> torch.Tensor:
    """torch.unique(rows) (ascending): on CPU one sort (see TORCH_RADIX_MIN) and a comparison of neighbours."""
    if rows.device.type != "cpu" or rows.numel() < 2:
        return torch.unique(rows)
    ordered = torch.sort(rows).values.numpy() if rows.numel() >= TORCH_RADIX_MIN else np.sort(rows.numpy())
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return torch.from_numpy(ordered[keep])


def stable_sort(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(values, stable=True) of 1-D int64 values that may repeat: equal values keep their
    order. On CPU, torch's own radix sort where it uses one (TORCH_RADIX_MIN entries and up: the 438k
    ids of an MLPerf multi-hot batch of 2048 over 26M rows in 3.5 ms, against 10.8 ms for numpy's
    radix below, on this project's 2-core machine: benchmarks/index_sorts.py); for fewer values in
    [0, 2^48), a least-significant-digit radix sort, one numpy stable argsort of 16-bit digits per 16
    bits of the largest value (numpy sorts 16-bit keys by radix, in linear time): 20k values in
    0.2 ms against torch's comparison sort's 0.9 ms."""
    n = values.numel()
    if values.device.type != "cpu" or n < 2 or n >= TORCH_RADIX_MIN:
        return torch.sort(values, stable=True)
    v = values.numpy()
    low, high = int(v.min()), int(v.max())
    if low < 0 or high >= 1 << 48:
        return torch.sort(values, stable=True)
    order = None
    for shift in range(0, max(high.bit_length(), 1), 16):
        keys = v if order is None else v[order]
        digit = ((keys >> shift) & 0xFFFF).astype(np.uint16)
        step = np.argsort(digit, kind="stable")
        order = step if order is None else order[step]
    order_t = torch.from_numpy(order)
    return values.index_select(0, order_t), order_t
