"""Output distribution: pooled rows back to the ranks that own the samples, and the reverse for
gradients. One autograd function does every exchange of a step, in a fixed order, so that all ranks
issue their collectives in the same order whatever their graphs look like.

Forward, from the local pooled [W * B, local width] (rows of rank s's samples at s*B..):
- flat shards (tw, cw, rw): one all-to-all; rank s gets [B, flat width of j] from every rank j;
- twrw: two hops, partial sums added inside the node before crossing nodes;
- twcw: two hops, column slices joined inside the node before crossing nodes;
- dp: nothing to send (the replicated tables looked up the local batch).
Backward sends each gradient block back the way its rows came, with the backward codec, after
scaling it by 1/W: every rank's loss is a mean over its own B samples, and 1/W makes the update
the one a single process would make on the global batch of W * B samples (as DDP's averaging
does for the dense part).
"""

from __future__ import annotations

import time

import torch
from torch.autograd.function import once_differentiable

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms
from neorec.distributed.layout import ShardLayout


class OutputDist(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        anchor: torch.Tensor,
        local: torch.Tensor,
        dp: torch.Tensor,
        layout: ShardLayout,
        comms: Comms,
        codecs: tuple[Codec, Codec],
        batch_size: int,
        timings: dict[str, float],
    ) -> torch.Tensor:
        topo, b = comms.topo, batch_size
        fwd = codecs[0]
        ctx.layout, ctx.comms, ctx.codecs, ctx.b, ctx.timings = layout, comms, codecs, b, timings
        me = topo.rank
        fw, rw = layout.flat_width[me], layout.twrw_width[topo.node]
        flat = local[:, :fw]
        ctx.widths = (fw, rw, local.shape[1] - fw - rw)
        blocks = list(flat.reshape(topo.world_size, b, fw))
        got = comms.exchange(blocks, [(b, w) for w in layout.flat_width], fwd, "fwd").wait()
        if layout.has_twrw:
            got += comms.two_hop(local[:, fw : fw + rw], b, "sum", layout.twrw_width, fwd, "fwd")
        if layout.has_twcw:
            got += comms.two_hop(local[:, fw + rw :], b, "cat", layout.twcw_width, fwd, "fwd")
        return torch.cat([*got, dp], dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        layout: ShardLayout = ctx.layout
        comms: Comms = ctx.comms
        topo, b, bwd = comms.topo, ctx.b, ctx.codecs[1]
        start = time.perf_counter()
        grad = grad * (1.0 / topo.world_size)
        fw, rw, cw = ctx.widths
        sizes = list(layout.flat_width)
        if layout.has_twrw:
            sizes += layout.twrw_width
        if layout.has_twcw:
            sizes += layout.twcw_width
        sizes.append(layout.dp_width)
        pieces = list(grad.split(sizes, dim=1))
        grad_dp = pieces.pop()
        w = topo.world_size
        back = comms.exchange(pieces[:w], [(b, fw)] * w, bwd, "bwd").wait()
        parts = [torch.cat(back, dim=0)]
        k = w
        if layout.has_twrw:
            n = topo.num_nodes
            parts.append(comms.two_hop_backward(pieces[k : k + n], b, "sum", rw, bwd, "bwd"))
            k += n
        if layout.has_twcw:
            n = topo.num_nodes
            slice_width = cw
            parts.append(comms.two_hop_backward(pieces[k : k + n], b, "cat", slice_width, bwd, "bwd"))
        grad_local = torch.cat(parts, dim=1)
        ctx.timings["output_dist_bwd"] += time.perf_counter() - start
        return None, grad_local, grad_dp, None, None, None, None, None


class AssembleColumns(torch.autograd.Function):
    """[B, width] output from the received columns: term 0 places every output column once, later
    terms add further row shards' partial sums in shard order (deterministic). Every received
    column feeds exactly one output column, so the backward is a single gather."""

    @staticmethod
    def forward(ctx, received: torch.Tensor, plan: ColumnPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        out = received.index_select(1, plan.first)
        for dst, src in plan.more:
            out.index_add_(1, dst, received.index_select(1, src))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.index_select(1, ctx.plan.source_of), None


class ColumnPlan:
    """Index tensors for AssembleColumns, built once from ShardLayout.assembly()."""

    def __init__(self, terms: list[tuple[list[int], list[int]]], width: int, received: int, device) -> None:
        dst0, src0 = terms[0]
        first = [0] * width
        for d, s in zip(dst0, src0, strict=True):
            first[d] = s
        self.first = torch.tensor(first, dtype=torch.int64, device=device)
        self.more = [
            (torch.tensor(d, dtype=torch.int64, device=device), torch.tensor(s, dtype=torch.int64, device=device))
            for d, s in terms[1:]
        ]
        source_of = [0] * received  # the output column each received column feeds
        for d_list, s_list in terms:
            for d, s in zip(d_list, s_list, strict=True):
                source_of[s] = d
        self.source_of = torch.tensor(source_of, dtype=torch.int64, device=device)

    def to(self, device) -> ColumnPlan:
        self.first, self.source_of = self.first.to(device), self.source_of.to(device)
        self.more = [(d.to(device), s.to(device)) for d, s in self.more]
        return self
