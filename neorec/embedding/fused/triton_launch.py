"""Setting up the fused engine's Triton launches on the host: whether Triton can run, and the
small tables that carry several groups' buffers into one launch.

The torch path (lookup.py) runs everywhere; on a GPU it costs several kernels and passes over
memory per step (embedding_bag for the segment sums, a gather of rows and state, the rule's
elementwise ops, a scatter back). The Triton kernels do the same work in one pass each: the pooled
lookup (triton_pool.py) and the backward fused with the update (triton_fused_update.py), both
summing rows with the device functions of triton_sums.py.

Groups of mixed dims share launches: `pool` is one launch per weight dtype over all the groups it
is given, `fused_update` one launch (and one of the hot rows' partial sums) per (rule, weight
dtype) over its groups. The groups keep their own 2-D buffers (layout.py); a launch gets each
group's pointers, strides, dims and sizes as small int64 device tensors, one entry per group
(`_int_tables`), and its programs find their group from where their index falls among the groups'
first bags or first unique rows (`_firsts`). Columns are blocked for the launch's widest dim and
masked for each group's own; a launch over one group is the same kernel with one entry.

Triton is optional: it ships with CUDA builds of PyTorch. `usable(device)` says whether the kernels
can run; with TRITON_INTERPRET=1 set before the kernel modules are imported they also run on CPU
tensors through Triton's interpreter (slow; for testing the kernels without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from itertools import accumulate

import torch

try:
    import triton
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None

# the kernels were built for Triton's interpreter (decided when triton.jit decorates them, when
# triton_pool.py and triton_fused_update.py are imported, after this module)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def usable(device: torch.device) -> bool:
    """Triton is importable and can run on `device` (a GPU, or any device under the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or INTERPRETED


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting: from pinned memory the copy is queued on the
    stream and the host goes on; the caching host allocator records the copy and keeps the pinned
    block until it has run, so the source may go."""
    if table.device.type == "cpu" and device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def _int_tables(columns: Mapping[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Small int64 tables (the groups' pointers, strides, sizes) on `device`, all in one copy: views
    of one tensor, each starting 16 bytes aligned (Triton specialises on aligned pointers), so a
    column of odd length is followed by a zero, which its view holds too (the kernels index the
    columns by group and never read it). One split makes the views: a slice per column costs a
    dispatch each, and a launch takes up to 26 columns every step."""
    flat: list[int] = []
    sizes = []
    for values in columns.values():
        pad = len(values) % 2
        flat += values + [0] * pad
        sizes.append(len(values) + pad)
    packed = _to_device(torch.tensor(flat, dtype=torch.int64), device)
    return dict(zip(columns, packed.split(sizes), strict=True))


def _num_warps(block_d: int) -> int:
    """Warps for a program that works on block_d columns at a time: a column per thread, up to 4 warps."""
    return max(1, min(4, block_d // 32))


def _resident_programs(device: torch.device, work: int, num_warps: int) -> int:
    """A grid for a kernel whose programs loop over `work` items: as many programs of `num_warps`
    warps as the device holds at once (64 warps, at most 32 programs, per multiprocessor), no more
    than there are items. Launching one program per item instead costs a program start per padded
    item, which on a padded sort is most of them."""
    if device.type != "cuda":  # Triton's interpreter runs the programs one after the other
        return max(1, min(work, 16))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work, sms * min(32, 64 // num_warps)))


def _firsts(sizes: list[int]) -> list[int]:
    """[0, sizes[0], sizes[0] + sizes[1], ...]: where each group's items start, and the total."""
    return [0, *accumulate(sizes)]
