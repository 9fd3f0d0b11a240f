"""Set-up shared by every test.

Without a CUDA device, Triton's kernels are built for its interpreter, which runs them on CPU tensors
(tests/test_triton_kernels.py and test_triton_engine.py check the kernels that way). Triton decides this when a kernel is
decorated and when triton.language itself is imported, so TRITON_INTERPRET must be set before any
test module imports neorec's kernels. It changes nothing else: the engine picks the Triton kernels on
its own only on CUDA devices (kernels="auto"), so on CPU they run only where a test asks for them.
Under the interpreter, tests/triton_interpreter.py spares device-function calls Triton's repeated
mapping of triton.language (the same kernels, run as before, in about half the time).

Fixture `staged_on_cpu`: the row cache's GPU path with CPU tensors standing in for device memory.

Tests run with one intra-op thread a process (OMP_NUM_THREADS=1, unless set): xdist runs a process a core.

Every test runs under `process_settings_kept` (autouse): a test that leaves torch's thread count or
default dtype changed fails, since every test after it in the same process would run under its
settings (library calls put back what they change: neorec/utils/process_state.py).
"""

from __future__ import annotations

import os

import pytest

# pytest-xdist runs one test process per core: each keeps to one intra-op thread, and so do the processes
# it starts (tests that are about threads set them). OpenMP threads of several processes on the same
# cores spin in their barriers: with two threads a process, training steps of small tables take 3-4x
# longer. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import install

    install()  # the interpreter without its repeated walks over triton.language (tests/triton_interpreter.py)


@pytest.fixture(autouse=True)
def process_settings_kept():
    """Fail a test that leaves torch.get_num_threads() or torch.get_default_dtype() changed, after
    putting them back, so that the tests after it run as they would alone."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    left = torch.get_num_threads(), torch.get_default_dtype()
    if left != (threads, dtype):
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        pytest.fail(f"the test left torch's (threads, default dtype) at {left}, not {(threads, dtype)}")


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
