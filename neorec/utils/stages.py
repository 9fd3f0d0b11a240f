"""Named stages of the embedding engine's step, as ranges a profiler shows.

`stage("sort")` marks a region as the profiler range "neorec.sort" (torch.profiler.record_function)
while a profiler is recording, so a profile gives each stage's host time and, on a GPU, the device
time of the kernels launched inside it (benchmarks/embedding_stages.py sums them per stage). With no
profiler running it is one check (about 0.2 us) and an empty context: a record_function costs
about 15 us even then, too much for a step that enters a dozen stages.

The engine's stages, in step order (names as they appear after "neorec."):
- check_ids: the batch's ids against their tables' sizes (neorec/data/checks.py);
- prepare_bags: ids to rows and bags, per group of tables (embedding/fused/bags.py);
- lookup: the pooled lookup (one Triton launch, or embedding_bag per group);
- sort: ids grouped by row for the backward (row_gradients.sort_by_row[_on_device]);
- row_sums: the torch path's per-row gradient sums (embedding_bag over the sorted ids);
- partial_sums: the Triton path's sums of hot rows' chunks of ids (triton_fused_update);
- update_setup: the host's part of a fused update launch (hyper-parameters, pointer tables);
- update: the rule applied to the rows and their state (the Triton path: with the sums of the rest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import torch
from torch.autograd.profiler import record_function

F = TypeVar("F", bound=Callable)
PREFIX = "neorec."
NAMES = ("check_ids", "prepare_bags", "lookup", "sort", "row_sums", "partial_sums", "update_setup", "update")


def stage(name: str) -> AbstractContextManager:
    """The profiler range PREFIX + name while a profiler records; else a context that does nothing."""
    if torch.autograd._profiler_enabled():
        return record_function(PREFIX + name)
    return nullcontext()


def staged(name: str) -> Callable[[F], F]:
    """A decorator: each call of the function is the stage `name` (see stage)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with stage(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
