"""Process-wide settings that a library call changes for its own duration only.

torch's intra-op thread count, its default dtype and the global random number generators (torch's on
the CPU and on CUDA devices already in use, numpy's, Python's) belong to the whole process. A library
call that left them changed would change what its caller computes afterwards: a model scored with
another thread count can give other bits, and a seeded generator makes the caller's "random" draws
the library's. `process_settings` sets what a call needs (the threads) and, when the call returns or
raises, puts back what the caller had, whatever the call did to these settings meanwhile (a model's
seeded initialisation, a checkpoint's generator states restored on resume).

The trainer runs its constructor and fit() under it (neorec/train/trainer.py), and `neorec eval`
its evaluation; the signal handlers a run installs are put back by neorec/train/signals.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def process_settings(threads: int | None = None) -> Iterator[None]:
    """Inside: torch's intra-op threads set to `threads` (None: as they are). On leaving, by return or
    exception: the caller's threads, default dtype and global generator states."""
    saved_threads = torch.get_num_threads()
    saved_dtype = torch.get_default_dtype()
    saved_rng = _rng_states()
    try:
        if threads and threads != saved_threads:
            torch.set_num_threads(threads)
        yield
    finally:
        if torch.get_num_threads() != saved_threads:
            torch.set_num_threads(saved_threads)
        if torch.get_default_dtype() != saved_dtype:
            torch.set_default_dtype(saved_dtype)
        _set_rng_states(saved_rng)


def _rng_states() -> dict:
    """The global generators' states: torch's CPU generator, every CUDA device's once CUDA is in use
    (reading them earlier would start CUDA), numpy's and Python's."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
