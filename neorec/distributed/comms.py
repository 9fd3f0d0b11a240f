"""Every exchange of the sharded model goes through here: variable-size all-to-all (ids, rows),
reduce-scatter and all-reduce built on all-to-all, the two-hop (intra-node, then inter-node) variant,
the float codecs, and a count of the bytes each direction sends to other ranks.

Only `all_to_all_single` is used (plus all_reduce for fp32 dense gradients), so everything works
on gloo, which has no reduce-scatter, as well as on NCCL. Every call returns a `Pending` whose
`wait()` gives the result, so a pipeline can start an exchange and collect it later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from neorec.distributed.codecs import Codec
from neorec.distributed.comm_stats import CommStats
from neorec.distributed.shm import ShmGroup
from neorec.distributed.shm import available as shm_available
from neorec.distributed.staging import Staging
from neorec.distributed.topology import Topology


class Pending:
    """A started exchange; wait() finishes it (once) and returns the result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any]) -> None:
        self._works, self._finish, self._done, self._value = list(works), finish, False, None

    def wait(self) -> Any:
        if not self._done:
            for w in self._works:
                w.wait()
            self._value, self._done = self._finish(), True
        return self._value

    @staticmethod
    def ready(value: Any) -> Pending:
        return Pending([], lambda: value)


class Group:
    """A set of ranks that exchange together (the whole world, one node, or one local index)."""

    def __init__(self, ranks: list[int], my_rank: int, pg: Any) -> None:
        self.ranks, self.pg = ranks, pg
        self.index = ranks.index(my_rank)
        self.shm: ShmGroup | None = None  # shared-memory collectives when every rank is on this machine

    @property
    def size(self) -> int:
        return len(self.ranks)


class Comms:
    def __init__(
        self, topo: Topology, stats: CommStats | None = None, transport: str = "shm", stage: bool = False
    ) -> None:
        """transport: 'shm' moves the bytes between ranks of one machine through shared memory
        (neorec/distributed/shm.py; CPU tensors, x86-64), 'backend' always uses the process group.
        Tensors on another device than the transport's are staged (neorec/distributed/staging.py);
        stage=True stages every tensor (CPU tensors standing in for GPU ones, in tests)."""
        if transport not in ("shm", "backend"):
            raise ValueError(f"transport must be 'shm' or 'backend', got {transport!r}")
        self.topo = topo
        self.stats = stats or CommStats()
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "gloo"
        self.staging = Staging(backend, force=stage)
        self.world = Group(list(range(topo.world_size)), topo.rank, None)
        # Hierarchical groups; new_group is collective, so every rank creates every group, in order.
        self.node_group, self.cross_group = self.world, Group([topo.rank], topo.rank, None)
        if topo.world_size > 1 and 1 < topo.local_world_size < topo.world_size:
            for node in range(topo.num_nodes):
                ranks = topo.node_ranks(node)
                pg = dist.new_group(ranks)
                if node == topo.node:
                    self.node_group = Group(ranks, topo.rank, pg)
            for local in range(topo.local_world_size):
                ranks = [n * topo.local_world_size + local for n in range(topo.num_nodes)]
                pg = dist.new_group(ranks)
                if local == topo.local_rank:
                    self.cross_group = Group(ranks, topo.rank, pg)
        elif topo.local_world_size == 1 and topo.world_size > 1:
            self.node_group = Group([topo.rank], topo.rank, None)
            self.cross_group = self.world
        # The id exchange has its own communicator, so a pipeline can run it on a background thread
        # for the next batch while this thread exchanges the current batch's embeddings.
        self.ids = self.world
        # The id exchange's sizes (host counts) go beside it on the same thread, over gloo even where
        # the model's exchanges use NCCL, so that reading them never waits for a GPU.
        self.ids_host = self.world
        self.control = None  # the communicator of sum_flags: gloo, for host flags beside NCCL too
        if topo.world_size > 1:
            everyone = list(range(topo.world_size))
            self.ids = Group(everyone, topo.rank, dist.new_group(everyone))
            self.ids_host = self.ids
            if backend == "nccl":
                self.ids_host = Group(everyone, topo.rank, dist.new_group(everyone, backend="gloo"))
            self.control = dist.new_group(everyone, backend="gloo")
        if transport == "shm" and shm_available() and topo.world_size > 1:
            self._attach_shm()

    def _attach_shm(self) -> None:
        """Shared-memory collectives for the groups that lie inside one machine (collective: every
        rank attaches the same groups in the same order)."""
        topo = self.topo
        if topo.num_nodes == 1:
            for group in (self.world, self.ids):
                group.shm = ShmGroup(group.ranks, topo.rank, group.pg)
        elif self.node_group.size > 1:
            self.node_group.shm = ShmGroup(self.node_group.ranks, topo.rank, self.node_group.pg)

    # ---- the primitive ---------------------------------------------------------------------------
    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        direction: str,
        group: Group | None = None,
    ) -> Pending:
        """Rows send[sum(send_splits[:k]) : ...] go to the group's k-th rank; returns the received rows
        (from rank 0 of the group first) as one tensor. Counts the bytes sent to other ranks."""
        group = group or self.world
        row_bytes = send[:1].numel() * send.element_size() if send.dim() > 1 else send.element_size()
        if send.dim() > 1 and send.shape[0] == 0:
            row_bytes = send.shape[1:].numel() * send.element_size()
        self.stats.add(direction, (sum(send_splits) - send_splits[group.index]) * row_bytes)
        if group.size == 1:
            return Pending.ready(send)
        if self.staging.needed(send):
            device = send.device
            got = self._all_to_all_wire(self.staging.down(send), send_splits, recv_splits, group)
            return Pending([got], lambda: self.staging.up(got.wait(), device))
        return self._all_to_all_wire(send, send_splits, recv_splits, group)

    def _all_to_all_wire(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group) -> Pending:
        """all_to_all of a tensor that lies on the transport's device (a staged one is pinned, and so is
        what it receives, which then goes up to the GPU without another copy)."""
        shape = (sum(recv_splits), *send.shape[1:])
        recv = torch.empty(shape, dtype=send.dtype, pin_memory=True) if send.is_pinned() else send.new_empty(shape)
        if group.shm is not None and send.device.type == "cpu":
            group.shm.all_to_all(recv, send.contiguous(), recv_splits, send_splits)
            return Pending.ready(recv)
        work = dist.all_to_all_single(
            recv, send.contiguous(), recv_splits, send_splits, group=group.pg, async_op=True
        )
        return Pending([work], lambda: recv)

    def all_to_all_host(
        self, sizes: list[int], send_splits: list[int], recv_splits: list[int], direction: str
    ) -> list[int]:
        """all_to_all of a few host integers (the sizes of an exchange that follows): sizes[a:b] of
        each split to the group's ranks in order; what every rank sent here, in rank order. On the id
        exchange's host communicator (`ids_host`), so the result is known on the host without
        reading anything back from a GPU."""
        group = self.ids_host
        self.stats.add(direction, (sum(send_splits) - send_splits[group.index]) * 8)
        send = torch.tensor(sizes, dtype=torch.int64)
        if group.size == 1:
            return [int(n) for n in sizes]
        return self._all_to_all_wire(send, send_splits, recv_splits, group).wait().tolist()

    def all_gather(self, mine: torch.Tensor, direction: str) -> torch.Tensor:
        """Every rank's `mine` (all of one shape), concatenated in rank order along dim 0."""
        n, world = mine.shape[0], self.world.size
        got = self.all_to_all(mine.repeat(world, *[1] * (mine.dim() - 1)), [n] * world, [n] * world, direction)
        return got.wait()

    def sum_over_ranks(self, values: torch.Tensor, direction: str) -> torch.Tensor:
        """Every rank's `values` (a host tensor of one shape on all ranks) gathered and added in rank
        order: the same sum on every rank, bitwise (counters, losses and histograms of a log step)."""
        return self.all_gather(values.reshape(1, -1), direction).sum(0).reshape(values.shape)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """`t` (in place) becomes rank `src`'s."""
        if self.world.size == 1:
            return
        wire = self.staging.down(t) if self.staging.needed(t) else t
        dist.broadcast(wire, src=src)
        if wire is not t:
            t.copy_(wire)

    def all_gather_bytes(self, payload: torch.Tensor, direction: str, sizes: list[int] | None = None) -> Pending:
        """Every rank's `payload` (1-D uint8; sizes may differ), as a list in rank order. `sizes`: every
        rank's payload size when the caller already knows them. Otherwise, in shared memory, one
        exchange (the sizes travel in its header); over the backend the sizes go first, and the
        payload when the result is waited for."""
        if self.world.size > 1 and self.staging.needed(payload):
            device = payload.device
            got = self._all_gather_bytes(self.staging.down(payload), direction, sizes)
            return Pending([got], lambda: [self.staging.up(p, device) for p in got.wait()])
        return self._all_gather_bytes(payload, direction, sizes)

    def _all_gather_bytes(self, payload: torch.Tensor, direction: str, sizes: list[int] | None) -> Pending:
        world = self.world
        if world.size == 1:
            return Pending.ready([payload])
        if sizes is None and world.shm is not None and payload.device.type == "cpu":
            self.stats.add(direction, (world.size - 1) * (payload.numel() + 8))  # + its size, in the header
            return Pending.ready(world.shm.all_gather_bytes(payload.contiguous()))
        n = payload.numel()
        if sizes is None:  # the sizes go first; the payload follows when they are waited for
            size = torch.tensor([n], dtype=torch.int64, device=payload.device)
            sized = self.all_to_all(size.repeat(world.size), [1] * world.size, [1] * world.size, direction)

            def rest() -> list[torch.Tensor]:
                theirs = sized.wait().tolist()
                got = self.all_to_all(payload.repeat(world.size), [n] * world.size, theirs, direction)
                return list(got.wait().split(theirs))

            return Pending([], rest)
        got = self.all_to_all(payload.repeat(world.size), [n] * world.size, sizes, direction)
        return Pending([got], lambda: list(got.wait().split(sizes)))

    def all_to_all_bytes(
        self, payload: torch.Tensor, sizes: list[int], direction: str, recv_sizes: list[int] | None = None
    ) -> Pending:
        """Parts of `payload` (1-D uint8) of `sizes` bytes to the ranks in order; the part every rank
        sent here, as a list in rank order. recv_sizes: the bytes every rank sends here, when the
        caller knows them. Otherwise in shared memory one exchange (the sizes travel in its header);
        over the backend the sizes go first."""
        if self.world.size > 1 and self.staging.needed(payload):
            device = payload.device
            got = self._all_to_all_bytes(self.staging.down(payload), sizes, direction, recv_sizes)
            return Pending([got], lambda: [self.staging.up(p, device) for p in got.wait()])
        return self._all_to_all_bytes(payload, sizes, direction, recv_sizes)

    def _all_to_all_bytes(
        self, payload: torch.Tensor, sizes: list[int], direction: str, recv_sizes: list[int] | None
    ) -> Pending:
        world = self.world
        if world.size == 1:
            return Pending.ready([payload])
        if recv_sizes is None and world.shm is not None and payload.device.type == "cpu":
            # one exchange, each size in its header
            self.stats.add(direction, sum(sizes) - sizes[world.index] + 8 * (world.size - 1))
            return Pending.ready(world.shm.all_to_all_bytes(payload.contiguous(), sizes))
        theirs = recv_sizes
        if theirs is None:
            mine = torch.tensor(sizes, dtype=torch.int64, device=payload.device)
            theirs = self.all_to_all(mine, [1] * world.size, [1] * world.size, direction).wait().tolist()
        got = self.all_to_all(payload, sizes, theirs, direction)
        return Pending([got], lambda: list(got.wait().split(theirs)))

    def sum_flags(self, flags: torch.Tensor) -> Pending:
        """Start summing a few int64 flags (a CPU tensor) over all ranks (control, such as a stop
        request); wait() gives the sum. It runs on gloo's own thread and a communicator of its own,
        beside the model's exchanges, so a caller that waits one step later never waits and no
        device is synchronised. Not counted in `stats`."""
        if self.world.size == 1:
            return Pending.ready(flags)
        flags = flags.clone()
        work = dist.all_reduce(flags, group=self.control, async_op=True)
        return Pending([work], lambda: flags)

    # ---- float rows with a codec ----------------------------------------------------------------
    def all_to_all_rows(
        self,
        rows: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        codec: Codec,
        direction: str,
        group: Group | None = None,
    ) -> Pending:
        """all_to_all of fp32 rows [N, D] sent in the codec's wire format, decoded to fp32 on arrival."""
        sent = self.all_to_all(codec.encode(rows), send_splits, recv_splits, direction, group)
        return Pending([sent], lambda: codec.decode(sent.wait()))

    def reduce_scatter_rows(
        self, blocks: torch.Tensor, codec: Codec, direction: str, group: Group | None = None
    ) -> Pending:
        """blocks [G * n, D]: block k (rows k*n..) is this rank's contribution to group rank k. Returns
        [n, D], the sum over the group of the blocks for this rank, added in group-rank order (so the
        result is the same on every backend). Built on all_to_all: gloo has no reduce-scatter."""
        group = group or self.world
        n = blocks.shape[0] // group.size
        got = self.all_to_all_rows(blocks, [n] * group.size, [n] * group.size, codec, direction, group)

        def finish() -> torch.Tensor:
            parts = got.wait().view(group.size, n, -1)
            out = parts[0].clone()
            for k in range(1, group.size):
                out += parts[k]
            return out

        return Pending([got], finish)

    def all_reduce_sum(
        self, flat: torch.Tensor | list[torch.Tensor], codec: Codec, direction: str
    ) -> Pending:
        """Sum of a 1-D fp32 tensor (or of the concatenation of a list of them) over all ranks.
        fp32: the backend's all_reduce (in shared memory, a list is concatenated straight into the
        send buffer). fp16/bf16: the codec on the wire but fp32 sums (reduce-scatter of 1/W
        slices, then all-gather, both as all_to_all), so summing W ranks cannot overflow fp16 and
        the order is rank order."""
        world = self.world
        parts = flat if isinstance(flat, list) else None
        if parts is not None and (world.size == 1 or world.shm is None or codec.name != "fp32" or
                                  parts[0].device.type != "cpu"):  # fmt: skip
            flat, parts = torch.cat(parts), None
        if world.size == 1:
            return Pending.ready(flat)
        if codec.name == "fp32":
            numel = sum(p.numel() for p in parts) if parts is not None else flat.numel()
            self.stats.add(direction, 2 * (world.size - 1) * numel * 4 // world.size)
            if parts is not None:
                return Pending.ready(world.shm.sum_parts(parts))
            if self.staging.needed(flat):
                device = flat.device
                summed = self._all_reduce_wire(self.staging.down(flat))
                return Pending([summed], lambda: self.staging.up(summed.wait(), device))
            return self._all_reduce_wire(flat)
        width = 256  # per-row scale granularity of the fp16 codec
        per_rank = -(-flat.numel() // (world.size * width)) * width
        padded = flat.new_zeros(world.size * per_rank)
        padded[: flat.numel()] = flat
        mine = self.reduce_scatter_rows(padded.view(-1, width), codec, direction).wait()
        rows = per_rank // width
        gathered = self.all_to_all_rows(
            mine.repeat(world.size, 1), [rows] * world.size, [rows] * world.size, codec, direction
        ).wait()
        # Our own slice was summed in fp32 but the others arrive through the codec: round ours the
        # same way, so every rank ends with identical values.
        gathered = gathered.view(world.size, rows, width)
        gathered[world.index] = codec.decode(codec.encode(mine))
        return Pending.ready(gathered.reshape(-1)[: flat.numel()])

    def _all_reduce_wire(self, flat: torch.Tensor) -> Pending:
        """In-place fp32 sum over the world of a tensor on the transport's device."""
        world = self.world
        if world.shm is not None and flat.device.type == "cpu":
            world.shm.all_reduce(flat)
            return Pending.ready(flat)
        work = dist.all_reduce(flat, async_op=True)
        return Pending([work], lambda: flat)

    # ---- blocks of different widths ---------------------------------------------------------------
    def exchange(
        self,
        blocks: list[torch.Tensor],
        recv_shapes: list[tuple[int, int]],
        codec: Codec,
        direction: str,
        group: Group | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending:
        """blocks[k] ([rows, width] fp32) goes to the group's k-th rank; the result lists what each
        group rank sent us, decoded to fp32, shaped recv_shapes[k]. Widths may differ per block
        (each rank holds different tables): blocks travel flattened in one all_to_all. `out`
        [sum of received rows, width] (all widths equal): the blocks are decoded into it, one
        after another, and the result is `out`."""
        sizes = [b.shape[0] * codec.wire_width(b.shape[1]) for b in blocks]
        device = blocks[0].device if blocks else None
        send = torch.empty(sum(sizes), dtype=codec.wire_dtype, device=device)
        for b, part in zip(blocks, send.split(sizes), strict=True):  # encode straight into the send buffer
            codec.encode(b, part.view(b.shape[0], codec.wire_width(b.shape[1])))  # 0 rows: no -1 to infer
        recv_splits = [r * codec.wire_width(c) for r, c in recv_shapes]
        got = self.all_to_all(send, sizes, recv_splits, direction, group)

        def finish() -> list[torch.Tensor] | torch.Tensor:
            parts = got.wait().split(recv_splits)
            if out is not None:
                row = 0
                for p, (r, c) in zip(parts, recv_shapes, strict=True):
                    codec.decode(p.view(r, codec.wire_width(c)), out[row : row + r])
                    row += r
                return out
            return [
                codec.decode(p.view(r, codec.wire_width(c))) for p, (r, c) in zip(parts, recv_shapes, strict=True)
            ]

        return Pending([got], finish)

    def exchange_pieces(
        self,
        pieces: list[list[torch.Tensor]],
        recv_shapes: list[list[tuple[int, int]]],
        codec: Codec,
        direction: str,
        group: Group | None = None,
    ) -> Pending:
        """Like `exchange`, with several blocks per rank: pieces[k] (fp32 [rows, width] each, any
        shapes) go to the group's k-th rank, all in one all_to_all; the result lists, per group rank,
        what it sent us, decoded to fp32 and shaped recv_shapes[k] (e.g. the pooled block and the
        rows of sequence features)."""

        def size(r: int, c: int) -> int:
            return r * codec.wire_width(c)

        sizes = [[size(*p.shape) for p in per_rank] for per_rank in pieces]
        device = next((p.device for per_rank in pieces for p in per_rank), None)
        send = torch.empty(sum(map(sum, sizes)), dtype=codec.wire_dtype, device=device)
        parts = send.split([n for per_rank in sizes for n in per_rank])
        flat_pieces = [p for per_rank in pieces for p in per_rank]
        for p, part in zip(flat_pieces, parts, strict=True):  # encode straight into the send buffer
            codec.encode(p, part.view(p.shape[0], codec.wire_width(p.shape[1])))
        recv_splits = [sum(size(r, c) for r, c in shapes) for shapes in recv_shapes]
        got = self.all_to_all(send, [sum(s) for s in sizes], recv_splits, direction, group)

        def finish() -> list[list[torch.Tensor]]:
            out = []
            for block, shapes in zip(got.wait().split(recv_splits), recv_shapes, strict=True):
                wires = block.split([size(r, c) for r, c in shapes])
                out.append([codec.decode(w.view(r, codec.wire_width(c))) for w, (r, c) in zip(wires, shapes, strict=True)])
            return out

        return Pending([got], finish)

    # ---- two hops: inside the node, then across nodes --------------------------------------------
    def two_hop(
        self, rows: torch.Tensor, block: int, combine: str, widths: list[int], codec: Codec, direction: str
    ) -> list[torch.Tensor]:
        """For tables that live inside one node (TWRW, TWCW). rows [W * block, d]: rows k*block.. are
        for world rank k; every rank of this node has the same d. Hop 1 (intra-node): the peer with
        local index l gets the blocks of the ranks (node k, local l) for every k, and combines what
        the L peers sent: 'sum' (TWRW partial sums, reduced before the slow link) or 'cat' (TWCW
        column slices side by side, peer order). Hop 2 (inter-node): the combined block for rank
        (k, l) goes to it. widths[k] is the combined width of node k's block; returns one
        [block, widths[k]] tensor per node k."""
        topo = self.topo
        L, N = topo.local_world_size, topo.num_nodes
        d = rows.shape[1]
        by_local = rows.reshape(N, L, block, d).transpose(0, 1).reshape(L, N * block, d)
        hop1 = self.exchange(list(by_local), [(N * block, d)] * L, codec, direction, self.node_group).wait()
        got = torch.stack(hop1)  # [L, N * block, d]
        if combine == "sum":
            mixed = got[0].clone()
            for k in range(1, L):
                mixed += got[k]
        else:
            mixed = got.permute(1, 0, 2).reshape(N * block, L * d)
        blocks = list(mixed.view(N, block, -1))
        return self.exchange(blocks, [(block, w) for w in widths], codec, direction, self.cross_group).wait()

    def two_hop_backward(
        self, grads: list[torch.Tensor], block: int, combine: str, d: int, codec: Codec, direction: str
    ) -> torch.Tensor:
        """Gradient of two_hop: grads[k] [block, widths[k]] -> [W * block, d] for this rank's rows."""
        topo = self.topo
        L, N = topo.local_world_size, topo.num_nodes
        width = d if combine == "sum" else L * d
        back = self.exchange(grads, [(block, width)] * N, codec, direction, self.cross_group).wait()
        back = torch.stack(back)  # [N, block, width]: the gradient of the block we sent to node k
        if combine == "sum":  # every peer contributed to the sum: each gets the whole gradient
            to_peers = [back.reshape(N * block, d)] * L
        else:  # each peer gets the gradient of its own column slice
            to_peers = list(back.view(N, block, L, d).permute(2, 0, 1, 3).reshape(L, N * block, d))
        got = self.exchange(to_peers, [(N * block, d)] * L, codec, direction, self.node_group).wait()
        # from peer l: the gradient of our rows for ranks (k, l); back to world rank order
        return torch.stack(got).view(L, N, block, d).transpose(0, 1).reshape(N * L * block, d)
