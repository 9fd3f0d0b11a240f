"""Output distribution: pooled rows back to the ranks that own the samples, and the reverse for
gradients. One autograd function does every exchange of a step, in a fixed order, so that all ranks
issue their collectives in the same order whatever their graphs look like.

Forward, from the local pooled [W * B, local width] (rows of rank s's samples at s*B..):
- flat shards (tw, cw, rw): one all-to-all; rank s gets [B, flat width of j] from every rank j;
- twrw: two hops, partial sums added inside the node before crossing nodes;
- twcw: two hops, column slices joined inside the node before crossing nodes;
- dp: nothing to send (the replicated tables looked up the local batch);
- sequence shards (pooling none): one row per id, back to the rank of the id's sample, in the flat
  all-to-all next to the pooled block (sequence_dist.py says how many rows and how they are put
  back in order). The function then also returns the received rows.
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

Overlap with the bottom MLP (ShardedEmbeddingCollection.start_pooled, for layouts of flat shards
and replicated tables only): the flat all-to-all is started (`start_flat`) right after the lookup,
before the model runs its bottom MLP, and OutputDist waits for it only when it assembles. In
backward the gradient's all-to-all is started and OutputDist.backward returns at once; the bottom
MLP's backward, whose gradient OutputDist.backward has just produced, runs while it travels, and
`AwaitGradient`, between the lookup and OutputDist, waits for it before the fused update reads
it. The order is autograd's: of two nodes ready together, the one created later in forward runs
first, and the bottom MLP's nodes are created after the lookup's. Every rank issues the same
collectives in the same order either way.
"""

from __future__ import annotations

import bisect
import time

import torch
from torch.autograd.function import once_differentiable

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms, Pending
from neorec.distributed.layout import ShardLayout
from neorec.distributed.sequence_dist import SequenceRoutes


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
        started: Pending | None = None,
        grad_slot: list[Pending] | None = None,
        routes: SequenceRoutes | None = None,
        *rows: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """-> [B, output width] in feature order, after `prefix` [B, P] when one is given.
        With sequence shards (routes given, `rows` this rank's looked-up rows in layout.sequences
        order): that, then the rows every rank sent back (by rank, in its layout.sequences order).
        started: start_flat's exchange of `local`, begun earlier (None: exchanged here).
        grad_slot: given (with `local` from AwaitGradient, flat shards only), backward starts the
        gradient's exchange, puts it in the slot and returns its unfilled buffer (module doc)."""
        topo, b = comms.topo, batch_size
        fwd = codecs[0]
        ctx.layout, ctx.comms, ctx.codecs, ctx.b, ctx.timings = layout, comms, codecs, b, timings
        ctx.assembly, ctx.routes, ctx.device, ctx.grad_slot = assembly, routes, local.device, grad_slot
        ctx.prefix_width = prefix.shape[1] if prefix is not None else 0
        me = topo.rank
        fw, rw = layout.flat_width[me], layout.twrw_width[topo.node]
        flat = local[:, :fw]
        ctx.widths = (fw, rw, local.shape[1] - fw - rw)
        blocks = list(flat.reshape(topo.world_size, b, fw))
        received: list[torch.Tensor] = []
        if routes is not None:
            ctx.set_materialize_grads(False)  # unused rows: no gradient to send but zeros
            pieces = [[blocks[s], *_cut(rows, routes.send, s)] for s in range(topo.world_size)]
            shapes = [
                [(b, layout.flat_width[j]), *((n, u.width) for n, (u, _) in zip(routes.recv[j], layout.sequences[j], strict=True))]
                for j in range(topo.world_size)
            ]  # fmt: skip
            got = []
            for per_rank in comms.exchange_pieces(pieces, shapes, fwd, "fwd").wait():
                got.append(per_rank[0])
                received += per_rank[1:]
        elif started is not None:
            got = started.wait()
        elif any(layout.flat_width):
            got = comms.exchange(blocks, [(b, w) for w in layout.flat_width], fwd, "fwd").wait()
        else:  # no flat shard anywhere (e.g. every table replicated): nothing to wait for
            got = [local.new_empty((b, 0)) for _ in layout.flat_width]
        if layout.has_twrw:
            got += comms.two_hop(local[:, fw : fw + rw], b, "sum", layout.twrw_width, fwd, "fwd")
        if layout.has_twcw:
            got += comms.two_hop(local[:, fw + rw :], b, "cat", layout.twcw_width, fwd, "fwd")
        out = assembly.place([*got, dp], b, prefix)
        return out if routes is None else (out, *received)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor | None, *grad_received: torch.Tensor | None):  # type: ignore[override]
        layout: ShardLayout = ctx.layout
        comms: Comms = ctx.comms
        topo, b, bwd = comms.topo, ctx.b, ctx.codecs[1]
        routes: SequenceRoutes | None = ctx.routes
        start = time.perf_counter()
        p = ctx.prefix_width
        if grad is None:  # only sequences were used
            grad = torch.zeros(b, p + ctx.assembly.width, device=ctx.device)
        grad_prefix = grad[:, :p] if p else None
        pieces = ctx.assembly.cut(grad[:, p:], 1.0 / topo.world_size)
        grad_dp = pieces.pop()
        fw, rw, cw = ctx.widths
        w = topo.world_size
        grad_rows: list[torch.Tensor] = []
        if routes is not None:  # the rows' gradients go back with the pooled blocks' in one exchange
            k, back = 0, []
            for j in range(w):
                mine = []
                for n, (u, _) in zip(routes.recv[j], layout.sequences[j], strict=True):
                    g = grad_received[k]
                    mine.append(grad.new_zeros(n, u.width) if g is None else g * (1.0 / w))
                    k += 1
                back.append([pieces[j], *mine])
            me = layout.sequences[topo.rank]
            shapes = [[(b, fw), *((n, u.width) for n, (u, _) in zip(routes.send[s], me, strict=True))] for s in range(w)]
            got = comms.exchange_pieces(back, shapes, bwd, "bwd").wait()
            flat = torch.cat([per_rank[0] for per_rank in got]) if w > 1 else got[0][0]
            grad_rows = [torch.cat([per_rank[1 + i] for per_rank in got]) for i in range(len(me))]
        elif any(layout.flat_width):  # decoded straight into this rank's [W * B, flat width] gradient
            into = grad.new_empty((w * b, fw))
            pending = comms.exchange(pieces[:w], [(b, fw)] * w, bwd, "bwd", out=into)
            if ctx.grad_slot is not None:  # AwaitGradient waits for it (module doc)
                ctx.grad_slot.append(pending)
                flat = into
            else:
                flat = pending.wait()
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
        return None, grad_local, grad_dp, grad_prefix, None, None, None, None, None, None, None, None, None, *grad_rows


def start_flat(local: torch.Tensor, layout: ShardLayout, comms: Comms, codec: Codec, batch_size: int) -> Pending | None:
    """Start the flat all-to-all of this rank's pooled [W * B, local width] (layouts of flat shards
    and replicated tables only); OutputDist's `started`. None when no rank holds a flat shard."""
    if not any(layout.flat_width):
        return None
    fw = layout.flat_width[comms.topo.rank]
    blocks = list(local.detach()[:, :fw].reshape(comms.topo.world_size, batch_size, fw))  # OutputDist differentiates
    with torch.no_grad():
        return comms.exchange(blocks, [(batch_size, w) for w in layout.flat_width], codec, "fwd")


class AwaitGradient(torch.autograd.Function):
    """Identity in forward. In backward, waits for the gradient exchange that OutputDist.backward
    started and left in `slot` (module doc), and passes on the gradient it filled in."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, slot: list[Pending], timings: dict[str, float]) -> torch.Tensor:  # type: ignore[override]
        ctx.slot, ctx.timings = slot, timings
        return local.view_as(local)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        start = time.perf_counter()
        if ctx.slot:
            grad = ctx.slot.pop().wait()
        ctx.timings["output_dist_bwd"] += time.perf_counter() - start
        return grad, None, None


def _cut(rows: list[torch.Tensor], send: list[list[int]], s: int) -> list[torch.Tensor]:
    """The rows of rank s's ids, one block per sequence (unit, feature): each local batch holds
    the ranks' ids one rank after another."""
    out = []
    for k, r in enumerate(rows):
        start = sum(send[q][k] for q in range(s))
        out.append(r[start : start + send[s][k]])
    return out


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
