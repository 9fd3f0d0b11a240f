"""What the trainer holds for the fused engine in place of a torch.optim.Optimizer.

The fused engine updates rows inside backward, so there is nothing left for `step()` to do but
count. What the trainer still needs is the optimizer surface: LR schedulers write `param_groups[i]
["lr"]` (one group per table, in table order) and the engine reads it at every backward, so the
schedule applies to embeddings exactly as it does to dense parameters. Subclassing
torch.optim.Optimizer (with one empty placeholder tensor per group, never part of any module) keeps
torch.optim.lr_scheduler working unchanged.

Optimizer *state* (adagrad sums, adam moments) is not here: it lives with the rows and is saved by
the collection's state_dict, keyed by table, so that checkpoints do not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FusedEmbeddingOptimizer(torch.optim.Optimizer):
    """Learning rates per table and a step count; the update itself happened in backward."""

    def __init__(self, table_names: list[str], lrs: list[float]) -> None:
        groups = [
            {"params": [torch.zeros(0, requires_grad=True)], "lr": lr, "table": name}
            for name, lr in zip(table_names, lrs, strict=True)
        ]
        # torch.optim refuses an empty list; an engine without tables (a rank with no shard) still
        # needs an optimizer, so it gets one placeholder group that no table reads.
        groups = groups or [{"params": [torch.zeros(0, requires_grad=True)], "lr": 0.0, "table": None}]
        super().__init__(groups, defaults={})
        self.num_steps = 0
        # set when a later build_optimizer() on the same collection took over: the engine then reads
        # that one's learning rates, and stepping this one is an error, not a schedule no table follows
        self.replaced = False

    def lrs(self) -> list[float]:
        """Current learning rate of each table, in table order."""
        return [float(g["lr"]) for g in self.param_groups if g["table"] is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self.replaced:
            raise RuntimeError(
                "this embedding optimizer was replaced by a later build_optimizer() on its collection; "
                "the tables' learning rates follow the newest one only: step and schedule that one"
            )
        loss = closure() if closure is not None else None
        self.num_steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: no gradient of the tables is ever stored."""

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["num_steps"] = self.num_steps
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.num_steps = int(state_dict.pop("num_steps", 0))
        super().load_state_dict(state_dict)
