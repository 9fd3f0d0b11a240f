"""The cores this process may use and the run's processes on this machine: what the "auto" settings
of threads (the row cache's I/O thread, the reader's gathering threads, a waiting rank's spin) divide."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, as a container or `taskset` limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def processes_on_node() -> int:
    """The run's processes on this machine (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
