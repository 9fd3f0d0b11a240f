"""The optimizer step of FusedEmbeddingCollection, fused into backward: FusedLookup.backward
(lookup.py) sums each unique row's gradient and calls `apply_update`, which applies the group's rule
(optimizers.py) to the rows and their state in place, with the hyper-parameters of `group_hparams`.

Speed on CPU: the work after the lookup runs in blocks of `chunk_elements` (rows x dim, default
2^19: 2 MiB fp32 temporaries; `chunk_rows`) so temporaries stay in cache; results do not depend on
the block size. On a plain fp32 table a rule that does not read the weights (no weight decay) adds
its deltas in place (index_add_, one pass over the touched rows); plain SGD there skips the blocks
too: one scatter_add_ of the rows' sums (see folded_lr). With several intra-op threads on a machine
whose cores are shared with other busy processes, prefer OMP_WAIT_POLICY=PASSIVE (or one thread):
spinning OpenMP barriers then dominate every op.

It is a base class of FusedEmbeddingCollection (collection.py) and works on the groups, storages
and settings that the collection's __init__ sets up.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from neorec.embedding.fused.optimizers import RULES, Hparams, folded_sgd
from neorec.embedding.fused.param_groups import FusedEmbeddingOptimizer
from neorec.embedding.fused.rounding import to_storage, uniform_noise
from neorec.embedding.fused.storage import TensorStorage
from neorec.utils.stages import staged


class CollectionUpdate:
    """The collection's fused update: rules applied to rows, hyper-parameters, block sizes."""

    @staged("update")
    def apply_update(
        self,
        gi: int,
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        hparams: dict[str, float | torch.Tensor],
        lr_folded: bool = False,
        unique: bool = True,
    ) -> None:
        """Update unique global rows `rows` of group gi with their summed gradients `grads`.

        hparams comes from group_hparams, resolved once per backward rather than once per chunk.
        lr_folded: the sums already carry SGD's -lr (see folded_lr); the step only adds them.
        unique=False: rows may repeat, as copies of one row with the same gradient; every copy is
        then read, updated and written alike (never added in place), which leaves the row as once.
        """
        g = self.layout.groups[gi]
        storage, state_storage = self.weights[gi], self.states[gi]
        if lr_folded and unique and self.adds_in_place(gi):  # w += g in one pass (rows are unique: no order)
            storage.tensor.index_add_(0, rows, grads)
            return
        table = None  # which table of the group each row belongs to, when needed
        per_row: dict[str, float | torch.Tensor] = {}
        for name, value in hparams.items():
            if isinstance(value, torch.Tensor):
                table = self._table_of(gi, rows) if table is None else table
                value = value.index_select(0, table).unsqueeze(1)
            per_row[name] = value
        hp = Hparams(**per_row)
        state = {name: s.read(rows) for name, s in state_storage.items()}
        wd = hp.weight_decay
        if unique and self.adds_in_place(gi) and rows.device.type == "cpu" and isinstance(wd, float) and wd == 0.0:
            # the step does not read the weights: add its deltas in place, one pass over the rows
            # (on CPU index_add_ adds row by row; rows are unique, so no order is involved)
            delta, state = RULES[g.optimizer].delta(grads, state, step, hp)
            storage.tensor.index_add_(0, rows, delta)
            for name, s in state_storage.items():
                s.write(rows, state[name])
            return
        weights = storage.read(rows).to(torch.float32)
        rule = folded_sgd if lr_folded else RULES[g.optimizer].update
        weights, state = rule(weights, grads, state, step, hp)
        noise = None
        if self.stochastic_rounding and g.dtype != torch.float32:
            c = self._constants[gi]
            table = self._table_of(gi, rows) if table is None else table
            noise = uniform_noise(c.table_seeds[table], rows - c.row_starts[table], step, g.dim)
        storage.write(rows, to_storage(weights, g.dtype, noise))
        for name, s in state_storage.items():
            s.write(rows, state[name])

    def group_hparams(self, gi: int, device: torch.device) -> dict[str, float | torch.Tensor]:
        """Current hyper-parameters of group gi: a float where its tables agree (the usual case), else
        a [T_g] tensor with one value per table. Learning rates come from the trainer's optimizer."""
        tables = self.layout.groups[gi].tables
        lrs = self._optimizer.lrs() if self._optimizer is not None else [c.lr for c in self._configs]
        out: dict[str, float | torch.Tensor] = {}
        for f in fields(Hparams):
            values = [float(lrs[t] if f.name == "lr" else getattr(self._configs[t], f.name)) for t in tables]
            if all(v == values[0] for v in values):
                out[f.name] = values[0]
            else:
                out[f.name] = torch.tensor(values, dtype=torch.float32, device=device)
        return out

    def folded_lr(
        self, gi: int, hparams: dict[str, float | torch.Tensor], device: torch.device
    ) -> float | None:
        """-lr when group gi's step is plain SGD (one learning rate, no weight decay) on CPU, else None.

        Then every path multiplies each id's gradient term by -lr while summing (free: the sums
        take per-id weights anyway) and adds the sums to the rows, so that plain fp32 tables can
        take the in-place path (row_gradients.add_row_gradients) and a cache or any other storage in
        front of the same rows stays bitwise equal to it. A gradient hook (the sharded
        collection's replica sum) then sums the -lr-weighted sums over ranks.
        """
        lr, wd = hparams["lr"], hparams["weight_decay"]
        if self.layout.groups[gi].optimizer != "sgd" or device.type != "cpu":
            return None
        if not isinstance(lr, float) or not isinstance(wd, float) or wd != 0.0:
            return None
        return -lr

    def adds_in_place(self, gi: int) -> bool:
        """Group gi's weights are one plain fp32 tensor (no cache, no rounding), which an SGD step
        with a folded learning rate can add to directly."""
        storage = self.weights[gi]
        return isinstance(storage, TensorStorage) and storage.dtype == torch.float32

    def _table_of(self, gi: int, rows: torch.Tensor) -> torch.Tensor:
        """Position in the group of the table that holds each global row."""
        return torch.searchsorted(self._constants[gi].row_starts, rows, right=True) - 1

    def chunk_rows(self, gi: int, device: torch.device) -> int | None:
        """Rows per block of work on CPU, so temporaries stay cache-sized (see row_gradients.py);
        None (one block, no host syncs) on GPU."""
        if device.type == "cuda" or self.chunk_elements is None:
            return None
        return max(1, self.chunk_elements // self.layout.groups[gi].dim)

    def build_optimizer(self) -> FusedEmbeddingOptimizer:
        """The object the trainer schedules and steps; the engine reads its learning rates."""
        newer = FusedEmbeddingOptimizer([t.name for t in self.tables], [c.lr for c in self._configs])
        if self._optimizer is not None:
            self._optimizer.replaced = True
        self._optimizer = newer
        return newer
