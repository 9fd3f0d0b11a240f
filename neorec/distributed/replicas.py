"""Replicated (dp) tables: every rank keeps a whole copy, and the copies must stay equal.

Each rank looks its own samples up in its copy. In backward the fused engine calls `start_gradients`
once per group of replicated tables with the rank's unique rows and their summed gradients; the
exchange travels during the rest of backward, and at its end the engine updates the rows that the
returned function gives:

- Update rules without state (plain SGD): every rank gets every rank's rows and gradients (one
  all-gather), sums them the same way and applies the same update to every row touched anywhere.
- Rules with state (adagrad, rowwise adagrad, adam): each row has an owner, rank `row % world`
  (rows of the group's buffer). Gradients go to the owners only (one all-to-all, the row counts
  in its headers); each owner updates its rows and their state, then `share_updated` sends
  the new rows to every rank (one all-gather of the storage dtype's raw bytes, so the copies stay
  bitwise equal). A rank thus updates 1/W of the touched rows, weights and state, instead of all
  of them. The state is current on the owners only: `sync_state` copies it from the owners to
  every rank, which checkpoints and gather_tables call first.

Either way a row's gradient is summed over ranks in rank order (the same sums on every rank and
path). A group so small that its whole gradient is fewer bytes than the touched rows goes through
one dense all-reduce of [rows, dim + 1] instead (the extra column marks the touched rows), chosen
from the ranks' row counts, which every rank knows.

Counts read one batch ahead (`count_ahead`, on GPUs over NCCL): the rows each rank touches in a
batch are known when its ids are, a step before its backward. The training pipeline counts them
then, on the id exchange's thread and stream (one read of the counts of every group), and the ranks
swap them over the host communicator. The backward then knows every size on the host: this rank's unique
rows, every exchange's parts, and a bound on the rows each owner updates (the rows it receives).
The rows merged from several ranks come out padded to that bound with copies of the first row and
its sum, so their number is never read back either. The update reads, computes and writes every
copy alike, and writing a row several times with the same values leaves it as once, so results
are bitwise those of the exact path. The padding costs the bound's spare rows in the update and in
`share_updated`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.fused.optimizers import RULES
from neorec.embedding.fused.storage import RowStorage, TensorStorage, read_storage, write_storage
from neorec.sparse import SparseBatch, lengths_to_offsets
from neorec.utils import index_ops

DENSE_BYTES = 4 << 20  # groups whose whole gradient is this small may be all-reduced densely
_WINDOW_BYTES = 64 << 20  # sync_state copies state in windows of about this many bytes


@dataclass
class ReplicaCounts:
    """Rows touched in one batch, per replicated group: counts[gi][k] is rank k's, per owner
    ([W] each, rules with state) or in all ([1]), as count_ahead found them."""

    counts: list[list[list[int]]]


def updates_by_owner(optimizer: str) -> bool:
    """Whether a replicated group with this update rule is updated by row owners (rules with state)."""
    return bool(RULES[optimizer].state)


class ReplicaSync:
    """The gradient hook and the update hook of the engine that holds the replicated tables."""

    def __init__(
        self, engine: FusedEmbeddingCollection, comms: Comms, codec: Codec, read_ahead: bool | None = None
    ) -> None:
        """read_ahead: count each batch's rows ahead (count_ahead). Default: on GPUs that exchange
        over NCCL, where a count read in the backward pass would stop the host until the device
        catches up. Ranks sharing a GPU stage every exchange through host memory anyway (a wait for
        the device each), and there the padding's extra bytes through gloo cost more."""
        self.engine, self.comms, self.codec = engine, comms, codec
        self.world, self.rank = comms.topo.world_size, comms.topo.rank
        self.read_ahead = read_ahead
        self.current: ReplicaCounts | None = None  # the counts of the batch being trained, if known
        self._updated: dict[int, list[int]] = {}  # group -> rows each owner updates, padded (known counts)

    def by_owner(self, gi: int) -> bool:
        return self.world > 1 and updates_by_owner(self.engine.layout.groups[gi].optimizer)

    def _row_bytes(self, dim: int) -> int:
        """Bytes of one row's gradient on the wire."""
        return self.codec.wire_width(dim) * torch.empty(0, dtype=self.codec.wire_dtype).element_size()

    # ---- counts, one batch ahead ---------------------------------------------------------------
    def count_ahead(self, sparse: SparseBatch) -> ReplicaCounts | None:
        """Every rank's rows touched per group by a coming batch (its local `sparse`); collective, on
        the id exchange's thread. None where the backward counts instead: one process, read_ahead
        off, or a group whose rows are not in plain tensors (a row cache's writes take unique rows)
        or whose ids are mapped during the lookup (managed collision)."""
        engine = self.engine
        if self.world == 1 or not engine.layout.groups or sparse.batch_size == 0:
            return None
        read_ahead = self.read_ahead
        if read_ahead is None:
            read_ahead = sparse.values.device.type == "cuda" and not self.comms.staging.needed(sparse.values)
        plain = all(
            isinstance(storage, TensorStorage) and all(isinstance(s, TensorStorage) for s in states.values())
            for storage, states in zip(engine.weights, engine.states, strict=True)
        )
        if not read_ahead or not plain or engine.mapped:
            return None
        mine = []
        for gi, gb in enumerate(engine.prepare(sparse)):
            ordered = torch.sort(gb.rows).values
            first, _ = index_ops.runs(ordered)
            if self.by_owner(gi):
                per_owner = torch.zeros(self.world, dtype=torch.int64, device=ordered.device)
                mine.append(per_owner.scatter_add_(0, ordered % self.world, first.to(torch.int64)))
            else:
                mine.append(first.sum(dtype=torch.int64).view(1))
        flat = torch.cat(mine).tolist()  # the one read of the batch
        n = len(flat)
        got = self.comms.all_to_all_host(flat * self.world, [n] * self.world, [n] * self.world, "dp")
        counts, start = [], 0
        for part in mine:
            k = part.numel()
            counts.append([got[r * n + start : r * n + start + k] for r in range(self.world)])
            start += k
        return ReplicaCounts(counts)

    def unique_count(self, gi: int) -> int | None:
        """This rank's unique rows of group gi in the batch being trained, when counted ahead."""
        return sum(self.current.counts[gi][self.rank]) if self.current is not None else None

    # ---- gradients ------------------------------------------------------------------------------
    def start_gradients(
        self, gi: int, rows: torch.Tensor, grads: torch.Tensor
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start summing group gi's gradients over ranks; the returned function waits for the
        exchange and gives (rows this rank updates, their summed gradients). The fused engine calls
        it at the end of the backward pass, so the exchange travels while the rest of backward (the
        sharded tables' update) runs. Row counts that decide the path are exchanged here, at once."""
        if self.world == 1:
            return lambda: (rows, grads)
        if self.current is not None:
            return self._start_counted(gi, rows, grads, self.current.counts[gi])
        group = self.engine.layout.groups[gi]
        wire = self._row_bytes(group.dim)
        dense_bytes = 2 * group.num_rows * (group.dim + 1) * 4
        matrix = counts = None
        if self.by_owner(gi):  # rows to owners
            order, per_owner = _by_owner(rows, self.world)
            rows, grads = rows.index_select(0, order), grads.index_select(0, order)
            if dense_bytes > DENSE_BYTES:
                return self._to_owners(rows, grads, per_owner.tolist(), wire)
            # every rank's count per owner, [W, W], to choose between sparse and dense
            got = self.comms.all_gather_bytes(
                per_owner.view(torch.uint8), "dp", [8 * self.world] * self.world
            )
            matrix = torch.stack([part.view(torch.int64) for part in got.wait()]).tolist()
            counts = [sum(line) for line in matrix]
        elif dense_bytes <= DENSE_BYTES:
            count = torch.tensor([rows.numel()], dtype=torch.int64)
            counts = self.comms.all_to_all(count.repeat(self.world), [1] * self.world, [1] * self.world, "dp")
            counts = counts.wait().tolist()
        if counts is not None and dense_bytes <= DENSE_BYTES and dense_bytes < sum(counts) * (wire + 8):
            summed = self._all_reduce(rows, grads, group.num_rows, group.dim)
            if matrix is None:
                return summed

            def owned() -> tuple[torch.Tensor, torch.Tensor]:
                touched, sums = summed()
                mine = index_ops.where(touched % self.world == self.rank)
                return touched.index_select(0, mine), sums.index_select(0, mine)

            return owned
        if matrix is not None:
            return self._to_owners(rows, grads, matrix[self.rank], wire)
        return self._gather(rows, grads, wire, counts)

    def _start_counted(
        self, gi: int, rows: torch.Tensor, grads: torch.Tensor, counts: list[list[int]]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """start_gradients with every rank's row counts known (counts[k]: rank k's, per owner or in
        all): the same choices of path, nothing read back, the merged rows padded (module doc)."""
        group = self.engine.layout.groups[gi]
        if rows.numel() != sum(counts[self.rank]):
            raise RuntimeError(
                f"replicated group {gi}: {rows.numel()} rows in backward, {sum(counts[self.rank])} counted ahead"
            )
        wire = self._row_bytes(group.dim)
        dense_bytes = 2 * group.num_rows * (group.dim + 1) * 4
        totals = [sum(line) for line in counts]
        dense = dense_bytes <= DENSE_BYTES and dense_bytes < sum(totals) * (wire + 8)
        if not self.by_owner(gi):
            if dense:
                bound = min(group.num_rows, sum(totals))
                return self._all_reduce(rows, grads, group.num_rows, group.dim, bound=bound)
            return self._gather(rows, grads, wire, totals, padded=True)
        received = [sum(line[k] for line in counts) for k in range(self.world)]  # rows sent to each owner
        if dense:  # at most the rows it owns
            self._updated[gi] = [min(n, len(range(k, group.num_rows, self.world))) for k, n in enumerate(received)]
            bound = self._updated[gi][self.rank]
            return self._all_reduce(rows, grads, group.num_rows, group.dim, bound=bound, owned=True)
        self._updated[gi] = received
        order = index_ops.stable_sort(rows % self.world)[1]
        rows, grads = rows.index_select(0, order), grads.index_select(0, order)
        return self._to_owners(rows, grads, counts[self.rank], wire, [line[self.rank] for line in counts])

    def _gather(
        self, rows: torch.Tensor, grads: torch.Tensor, wire: int, counts: list[int] | None, padded=False
    ):
        """Every rank's rows and gradients to every rank. counts: every rank's number of rows, when
        already exchanged (else they travel with the rows: comms.all_gather_bytes). padded: see _merge."""
        payload = self._pack(rows, grads, wire)
        sizes = None if counts is None else [_padded(c * (8 + wire)) for c in counts]
        got = self.comms.all_gather_bytes(payload, "dp", sizes)
        dim = grads.shape[1]
        return lambda: self._merge(
            [(part, part.numel() // (8 + wire)) for part in got.wait()], dim, padded=padded
        )

    def _to_owners(
        self,
        rows: torch.Tensor,
        grads: torch.Tensor,
        per_owner: list[int],
        wire: int,
        received: list[int] | None = None,
    ):
        """Rows (ordered by owner, `per_owner` each) and gradients to their owners; this rank's rows
        summed. The row counts travel with the rows (comms.all_to_all_bytes), unless `received`
        gives every rank's count of rows for this one (then the sums come out padded: _merge); the
        rank's own rows stay as they are (no wire format)."""
        me = self.rank
        sizes = [0 if k == me else _padded(c * (8 + wire)) for k, c in enumerate(per_owner)]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=rows.device)
        start = offset = 0
        for k, (c, size) in enumerate(zip(per_owner, sizes, strict=True)):  # per owner: [rows | gradients]
            if k == me:
                own = (rows[start : start + c], grads[start : start + c])
            else:
                self._pack(
                    rows[start : start + c], grads[start : start + c], wire, send[offset : offset + size]
                )
            start, offset = start + c, offset + size
        recv_sizes = None
        if received is not None:
            recv_sizes = [0 if k == me else _padded(c * (8 + wire)) for k, c in enumerate(received)]
        got = self.comms.all_to_all_bytes(send, sizes, "dp", recv_sizes)
        dim = grads.shape[1]
        padded = received is not None
        return lambda: self._merge(
            [(part, part.numel() // (8 + wire)) for part in got.wait()], dim, own, padded=padded
        )

    def _pack(
        self, rows: torch.Tensor, grads: torch.Tensor, wire: int, payload: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[rows as int64 | gradients in the wire format] as bytes, padded to a multiple of 8 (into
        `payload`, 8-byte aligned, when given)."""
        n, width = rows.numel(), self.codec.wire_width(grads.shape[1])
        if payload is None:
            payload = torch.empty(_padded(n * (8 + wire)), dtype=torch.uint8, device=rows.device)
        payload[: n * 8].view(torch.int64).copy_(rows)
        self.codec.encode(grads, payload[n * 8 : n * (8 + wire)].view(self.codec.wire_dtype).view(n, width))
        return payload

    def _merge(
        self,
        parts: list[tuple[torch.Tensor, int]],
        dim: int,
        own: tuple[torch.Tensor, torch.Tensor] | None = None,
        padded: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the (payload, row count) parts of all ranks, in rank order, per unique row. own: this
        rank's (rows, fp32 gradients), in place of its part. padded: without reading the number of
        unique rows back; as many rows as the parts hold, those past the unique ones copies of the
        first row and its sum."""
        width = self.codec.wire_width(dim)
        wire = self._row_bytes(dim)
        me = self.rank if own is not None else -1
        counts = [own[0].numel() if k == me else n for k, (_, n) in enumerate(parts)]
        all_rows = torch.cat(
            [own[0] if k == me else part[: n * 8].view(torch.int64) for k, (part, n) in enumerate(parts)]  # type: ignore[index]
        )
        all_grads = torch.empty(all_rows.numel(), dim, device=all_rows.device)
        start = 0
        for k, ((part, _), n) in enumerate(zip(parts, counts, strict=True)):  # into one buffer
            if k == me:
                all_grads[start : start + n].copy_(own[1])  # type: ignore[index]
            else:
                block = part[n * 8 : n * (8 + wire)].view(self.codec.wire_dtype).view(n, width)
                self.codec.decode(block, all_grads[start : start + n])
            start += n
        order_rows, order = index_ops.stable_sort(all_rows)
        if not padded:
            unique, per_row = torch.unique_consecutive(order_rows, return_counts=True)
            offsets = lengths_to_offsets(per_row)
        else:
            n = all_rows.numel()
            if n == 0:
                return all_rows, all_grads
            unique, offsets, num_unique = index_ops.padded_runs(order_rows)
        summed = F.embedding_bag(order, all_grads, offsets, mode="sum", include_last_offset=True)
        if padded:  # past the unique rows: empty bags; make them copies of the first
            real = torch.arange(n, device=all_rows.device) < num_unique
            unique = torch.where(real, unique, unique[:1])
            summed = torch.where(real.unsqueeze(1), summed, summed[:1])
        return unique, summed

    def _all_reduce(
        self,
        rows: torch.Tensor,
        grads: torch.Tensor,
        total_rows: int,
        dim: int,
        bound: int | None = None,
        owned: bool = False,
    ):
        """The group's whole gradient summed over ranks; finish() gives the touched rows (only those
        this rank owns, when `owned`) and their sums. bound: the most such rows, known on the host;
        then nothing is read back and the rows come padded to it (see _merge)."""
        dense = grads.new_zeros(total_rows, dim + 1)
        dense[rows, :dim] = grads
        dense[rows, dim] = 1.0  # touched by this rank
        pending = self.comms.all_reduce_sum(dense.view(-1), self.codec, "dp")

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            summed = pending.wait().view(total_rows, dim + 1)
            touched = summed[:, dim] > 0
            if owned:
                touched &= torch.arange(total_rows, device=touched.device) % self.world == self.rank
            if bound is None:
                picked = index_ops.where(touched)
            else:  # the touched rows first, ascending; padded with the first
                picked = torch.sort((~touched).to(torch.int32), stable=True).indices[:bound]
                real = torch.arange(bound, device=touched.device) < touched.sum()
                picked = torch.where(real, picked, picked[:1])
            return picked, summed[:, :dim].index_select(0, picked)

        return finish

    # ---- updated rows and state -----------------------------------------------------------------
    def share_updated(self, gi: int, rows: torch.Tensor) -> None:
        """After group gi's update: the rows this rank owns and just updated, to every rank."""
        if not self.by_owner(gi):
            return
        storage = self.engine.weights[gi]
        n, width = rows.numel(), storage.width
        size = torch.empty(0, dtype=storage.dtype).element_size() * width
        payload = torch.empty(n * (8 + size), dtype=torch.uint8, device=rows.device)
        payload[: n * 8].view(torch.int64).copy_(rows)
        values = payload[n * 8 :].view(storage.dtype).view(n, width)
        if isinstance(storage, TensorStorage):  # read straight into the payload
            torch.index_select(storage.tensor, 0, rows, out=values)
        else:
            values.copy_(storage.read(rows))
        sizes = None  # every owner's rows, padded, when counted ahead: nothing to read back
        if self.current is not None and gi in self._updated:
            sizes = [k * (8 + size) for k in self._updated[gi]]
        got = self.comms.all_gather_bytes(payload, "dp", sizes).wait()
        others = [part for k, part in enumerate(got) if k != self.rank and part.numel()]
        if not others:
            return
        counts = [part.numel() // (8 + size) for part in others]
        theirs = [part[: k * 8].view(torch.int64) for part, k in zip(others, counts, strict=True)]
        values = [
            part[k * 8 :].view(storage.dtype).view(k, width) for part, k in zip(others, counts, strict=True)
        ]
        if len(others) > 1:
            theirs, values = [torch.cat(theirs)], [torch.cat(values)]
        storage.write(theirs[0], values[0])

    def sync_state(self) -> None:
        """Collective: the optimizer state of owner-updated groups, from the owners to every rank."""
        for gi, group in enumerate(self.engine.layout.groups):
            if self.by_owner(gi):
                for storage in self.engine.states[gi].values():
                    self._copy_from_owners(storage, group.num_rows)

    def _copy_from_owners(self, storage: RowStorage, num_rows: int) -> None:
        """Every rank's rows of `storage` to every rank, in windows of rows whose starts are owned
        by rank 0 (a multiple of W rows each)."""
        W, me = self.world, self.rank
        row_bytes = max(storage.width, 1) * torch.empty(0, dtype=storage.dtype).element_size()
        window = max(1, _WINDOW_BYTES // (row_bytes * W)) * W
        for a in range(0, num_rows, window):
            b = min(a + window, num_rows)
            rows = read_storage(storage, a, b)  # a plain tensor's view: written in place
            got = self.comms.all_gather_bytes(
                rows[me::W].contiguous().view(-1).view(torch.uint8), "dp"
            ).wait()
            for k in range(W):
                if k != me:
                    rows[k::W] = got[k].view(storage.dtype).view(rows[k::W].shape)
            if not isinstance(storage, TensorStorage):
                write_storage(storage, a, b, rows)


def _by_owner(rows: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order that groups rows by owner, ascending within each owner; rows per owner [W] int64)."""
    owner = rows % world
    _, order = index_ops.stable_sort(owner)
    return order, torch.bincount(owner, minlength=world)


def _padded(n: int) -> int:
    return -(-n // 8) * 8
