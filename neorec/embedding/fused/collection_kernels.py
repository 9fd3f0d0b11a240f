"""Which groups of FusedEmbeddingCollection the Triton kernels take (triton_pool.py,
triton_fused_update.py): the pooled lookup of plain storages, the fused update where the kernel has
the group's rule and width and no gradient hook needs the sums, and groups held in a row cache; and
what the update kernel needs of a group (`triton_update_args`). The others take the torch path
(lookup.py).

It is a base class of FusedEmbeddingCollection (collection.py) and works on the groups, storages
and settings that the collection's __init__ sets up.
"""

from __future__ import annotations

import torch

from neorec.embedding.fused import triton_fused_update, triton_launch
from neorec.embedding.fused.storage import TensorStorage


class CollectionKernels:
    """The collection's choice of Triton kernels or torch ops per group."""

    def _triton(self, device: torch.device) -> bool:
        if self.kernels == "torch":
            return False
        if self.kernels == "auto":
            return device.type == "cuda" and triton_launch.usable(device)
        if not triton_launch.usable(device):
            raise RuntimeError(
                f"kernels='triton' but Triton cannot run on {device}: it needs a CUDA device and the "
                "triton package (or TRITON_INTERPRET=1 to interpret the kernels on the CPU)"
            )
        return True

    def triton_lookup(self, gi: int, device: torch.device) -> bool:
        """Whether group gi is pooled by the Triton kernel (plain storage; one launch for all such)."""
        return isinstance(self.weights[gi], TensorStorage) and self._triton(device)

    def triton_update(self, gi: int, device: torch.device) -> bool:
        """Whether group gi's backward runs in the fused Triton update kernel: plain storage, a rule the
        kernel has, rows it can hold, no gradient hook (whose exchange needs the sums by themselves)."""
        g = self.layout.groups[gi]
        return (
            g.optimizer in triton_fused_update.RULE_IDS
            and g.dim <= triton_fused_update.MAX_UPDATE_DIM
            and self.grad_hook is None
            and isinstance(self.weights[gi], TensorStorage)
            and all(isinstance(s, TensorStorage) for s in self.states[gi].values())
            and self._triton(device)
        )

    def cached_kernels(self, gi: int, device: torch.device, update: bool = False) -> bool:
        """Whether group gi is held in a row cache and goes through the Triton kernels (update: its
        backward too: a rule the kernel has, rows it can hold, no gradient hook). The kernels then
        read and update the cache's records in place at the rows' slots, or, for a batch whose rows
        do not all have one, copies of its rows read and written through the cache (lookup.py)."""
        storage = self.weights[gi]
        if not hasattr(storage, "resident_slots") or storage.cache.device != device:
            return False
        if not self._triton(device):
            return False
        if not update:
            return True
        g = self.layout.groups[gi]
        return (
            g.optimizer in triton_fused_update.RULE_IDS
            and g.dim <= triton_fused_update.MAX_UPDATE_DIM
            and self.grad_hook is None
            and all(getattr(s, "cache", None) is storage.cache for s in self.states[gi].values())
        )

    def triton_update_args(self, gi: int) -> dict[str, torch.Tensor | None]:
        """What triton_fused_update.fused_update needs of group gi beyond the batch: its buffers' tensors
        (a row cache's views of its records), each table's first row and, with stochastic rounding of
        fp16/bf16 rows, each table's seed."""
        c = self._constants[gi]
        rounds = self.stochastic_rounding and self.layout.groups[gi].dtype != torch.float32
        field = "view" if hasattr(self.weights[gi], "cache") else "tensor"  # a cache's records, in place
        return {
            "weight": getattr(self.weights[gi], field),
            "state": {name: getattr(s, field) for name, s in self.states[gi].items()},
            "row_starts": c.row_starts,
            "table_seeds": c.table_seeds if rounds else None,
        }
