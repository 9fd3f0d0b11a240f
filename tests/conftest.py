"""Set-up shared by every test.

Without a CUDA device, Triton's kernels are built for its interpreter, which runs them on CPU tensors
(tests/test_triton_kernels.py checks the kernels that way). Triton decides this when a kernel is
decorated and when triton.language itself is imported, so TRITON_INTERPRET must be set before any
test module imports neorec's kernels. It changes nothing else: the engine picks the Triton kernels on
its own only on CUDA devices (kernels="auto"), so on CPU they run only where a test asks for them.

Fixture `staged_on_cpu`: the row cache's GPU path with CPU tensors standing in for device memory.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def staged_on_cpu(monkeypatch) -> list[int]:
    """The device path of the cache (DeviceIO: reads ahead staged through host buffers, records
    copied across on the training thread) with CPU tensors standing in for device memory, so that it
    runs without a GPU. Returns the rows of every read ahead staged so far."""
    from neorec.embedding.cache import device_io

    staged: list[int] = []

    class CountedRead(device_io.StagedRead):
        def __init__(self, read, host, buffer, slots) -> None:
            super().__init__(read, host, buffer, slots)
            staged.append(host.shape[0])

    monkeypatch.setattr(device_io, "stages_through_host", lambda device: True)
    monkeypatch.setattr(device_io, "StagedRead", CountedRead)
    return staged


@pytest.fixture
def neorec_warnings(caplog, monkeypatch):
    """caplog receiving the warnings of neorec's loggers whatever an earlier test did to logging: a
    command run in this process (neorec/utils/logging.py) stops the "neorec" logger propagating to the
    root logger, where caplog listens."""
    import logging

    logger = logging.getLogger("neorec")
    logger.addHandler(caplog.handler)
    monkeypatch.setattr(logger, "propagate", False)  # each record once, whatever the root has
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)
