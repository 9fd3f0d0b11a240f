"""Output distribution: pooled rows back to the ranks that own the samples, and the reverse for
gradients. One autograd function does every exchange of a step, in a fixed order, so that all ranks
issue their collectives in the same order whatever their graphs look like.

Forward, from the local pooled [W * B, local width] (rows of rank s's samples at s*B..):
- flat shards (tw, cw, rw): one all-to-all; rank s gets [B, flat width of j] from every rank j;
- twrw: two hops, partial sums added inside the node before crossing nodes;
- twcw: two hops, column slices joined inside the node before crossing nodes;
- dp: nothing to send (the replicated tables looked up the local batch).
The received blocks are placed straight into the output [B, sum of feature dims] (feature order)
by column segments (`Assembly`): one concatenation of the runs of columns, after the model's dense
vector when it passes one (EmbeddingCollection.pooled_after, so that the interaction's input is not
copied once more), then an add per later row shard of row-split tables (their partial sums, added
in shard order). So the forward writes the output once, and the backward cuts each block's gradient
out of the output's gradient in one pass.

Backward sends each gradient block back the way its rows came, with the backward codec, after
scaling it by 1/W: every rank's loss is a mean over its own B samples, and 1/W makes the update
the one a single process would make on the global batch of W * B samples (as DDP's averaging
does for the dense part).
"""

from __future__ import annotations

import bisect
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
        prefix: torch.Tensor | None,
        layout: ShardLayout,
        comms: Comms,
        codecs: tuple[Codec, Codec],
        batch_size: int,
        timings: dict[str, float],
        assembly: Assembly,
    ) -> torch.Tensor:
        """-> [B, output width] in feature order, after `prefix` [B, P] when one is given."""
        topo, b = comms.topo, batch_size
        fwd = codecs[0]
        ctx.layout, ctx.comms, ctx.codecs, ctx.b, ctx.timings = layout, comms, codecs, b, timings
        ctx.assembly = assembly
        ctx.prefix_width = prefix.shape[1] if prefix is not None else 0
        me = topo.rank
        fw, rw = layout.flat_width[me], layout.twrw_width[topo.node]
        flat = local[:, :fw]
        ctx.widths = (fw, rw, local.shape[1] - fw - rw)
        blocks = list(flat.reshape(topo.world_size, b, fw))
        if any(layout.flat_width):
            got = comms.exchange(blocks, [(b, w) for w in layout.flat_width], fwd, "fwd").wait()
        else:  # no flat shard anywhere (e.g. every table replicated): nothing to wait for
            got = [local.new_empty((b, 0)) for _ in layout.flat_width]
        if layout.has_twrw:
            got += comms.two_hop(local[:, fw : fw + rw], b, "sum", layout.twrw_width, fwd, "fwd")
        if layout.has_twcw:
            got += comms.two_hop(local[:, fw + rw :], b, "cat", layout.twcw_width, fwd, "fwd")
        return assembly.place([*got, dp], b, prefix)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        layout: ShardLayout = ctx.layout
        comms: Comms = ctx.comms
        topo, b, bwd = comms.topo, ctx.b, ctx.codecs[1]
        start = time.perf_counter()
        p = ctx.prefix_width
        grad_prefix = grad[:, :p] if p else None
        pieces = ctx.assembly.cut(grad[:, p:], 1.0 / topo.world_size)
        grad_dp = pieces.pop()
        fw, rw, cw = ctx.widths
        w = topo.world_size
        if any(layout.flat_width):  # decoded straight into this rank's [W * B, flat width] gradient
            into = grad.new_empty((w * b, fw))
            flat = comms.exchange(pieces[:w], [(b, fw)] * w, bwd, "bwd", out=into).wait()
        else:
            flat = grad.new_empty((w * b, 0))
        parts = [flat]
        k = w
        if layout.has_twrw:
            n = topo.num_nodes
            parts.append(comms.two_hop_backward(pieces[k : k + n], b, "sum", rw, bwd, "bwd"))
            k += n
        if layout.has_twcw:
            n = topo.num_nodes
            slice_width = cw
            parts.append(comms.two_hop_backward(pieces[k : k + n], b, "cat", slice_width, bwd, "bwd"))
        grad_local = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        ctx.timings["output_dist_bwd"] += time.perf_counter() - start
        return None, grad_local, grad_dp, grad_prefix, None, None, None, None, None, None


class Assembly:
    """Where each received column goes in the output, as runs of columns ("segments").

    Built once from ShardLayout.assembly() and the widths of the received pieces (flat blocks by
    owner, twrw blocks by node, twcw blocks by node, then dp): a segment copies (term 0) or adds
    (term k > 0: the k-th row shard's partial sums, in shard order) columns [s, s + n) of one piece
    to output columns [d, d + n). Every received column feeds exactly one output column, so the
    gradient of a piece is made of the same segments of the output's gradient."""

    def __init__(self, terms: list[tuple[list[int], list[int]]], width: int, piece_widths: list[int]) -> None:
        self.width, self.piece_widths = width, list(piece_widths)
        starts = [0]
        for pw in piece_widths:
            starts.append(starts[-1] + pw)
        covered = [False] * width
        self.segments: list[tuple[bool, int, int, int, int]] = []  # (add, piece, s, d, n)
        for term, (dst, src) in enumerate(terms):
            for d, s in zip(dst, src, strict=True):
                piece = bisect.bisect_right(starts, s) - 1  # the last piece starting at or before s
                s -= starts[piece]
                last = self.segments[-1] if self.segments else None
                if last is not None and last[0] == (term > 0) and last[1] == piece and \
                        last[2] + last[4] == s and last[3] + last[4] == d:  # fmt: skip
                    self.segments[-1] = (*last[:4], last[4] + 1)
                else:
                    self.segments.append((term > 0, piece, s, d, 1))
                if term == 0:
                    covered[d] = True
        if not all(covered):
            raise ValueError("assembly: term 0 does not cover every output column")
        # the copies in output order (they tile the output), then the adds in shard order
        self._copies = sorted((seg for seg in self.segments if not seg[0]), key=lambda seg: seg[3])
        self._adds = [seg for seg in self.segments if seg[0]]

    def place(
        self, pieces: list[torch.Tensor], batch: int, prefix: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output [batch, width] from the received pieces, after `prefix` [batch, P] if given:
        one concatenation of the copied segments in output order (one pass over the output), then
        the adds."""
        parts = [] if prefix is None else [prefix]
        parts += [pieces[p][:, s : s + n] for _, p, s, _, n in self._copies]
        out = torch.cat(parts, dim=1) if parts else pieces[-1].new_empty((batch, 0))
        offset = 0 if prefix is None else prefix.shape[1]
        for _, p, s, d, n in self._adds:
            out[:, offset + d : offset + d + n] += pieces[p][:, s : s + n]
        return out

    def cut(self, grad: torch.Tensor, scale: float) -> list[torch.Tensor]:
        """The gradient of every piece (contiguous), times `scale`, from the output's gradient."""
        pieces = [grad.new_empty((grad.shape[0], w)) for w in self.piece_widths]
        for _, p, s, d, n in self.segments:
            torch.mul(grad[:, d : d + n], scale, out=pieces[p][:, s : s + n])
        return pieces
