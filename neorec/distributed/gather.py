"""A differentiable all-gather of rows, for losses that need other ranks' samples (two-tower in-batch
negatives): forward gives every rank's rows in rank order, backward sums over ranks the gradient of
this rank's rows (a reduce-scatter, added in rank order), since each rank's loss used them.

Both directions go through Comms (shared memory or the process group, staged where the backend needs
it), so it is the same code on gloo/CPU and NCCL/GPU, and the bytes are counted. Rows travel in fp32:
they are a few per sample, and a rounded copy would make the ranks' losses differ from one process's.
"""

from __future__ import annotations

import torch

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms

_FP32 = Codec("fp32")


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, comms: Comms, direction: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comms, ctx.direction = comms, direction
        return comms.all_gather(rows.contiguous(), direction)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        summed = ctx.comms.reduce_scatter_rows(grad.contiguous(), _FP32, f"{ctx.direction}_bwd").wait()
        return summed, None, None


def gather_rows(rows: torch.Tensor, comms: Comms, direction: str) -> torch.Tensor:
    """rows [n, d] (the same n on every rank) -> [W * n, d], rank r's rows at [r n, (r + 1) n). The
    gradient of `rows` is the sum over ranks of the gradient of their copy of them. `direction`
    names the exchange in the byte counts (the backward's is `direction`_bwd)."""
    if comms.topo.world_size == 1:
        return rows
    return _GatherRows.apply(rows, comms, direction)
