"""Work started on a side CUDA stream and handed to the compute stream by an event.

Copies of coming batches and the id exchange of coming batches run on streams of their own, so that
they overlap the current step's kernels; the compute stream waits on an event (the host never
waits), and the tensors made on the side stream are recorded as used by the compute stream, so the
caching allocator does not reuse their memory while the step still reads them. On the CPU there are
no streams and every call here does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current end of `device`'s current stream (None on the CPU): what side work
    started now must wait for (the tensors it reads are made there)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def run_on(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None, fn: Callable[[], T]) -> tuple[T, object]:
    """fn() on `stream` once `after` has happened (from any thread); (its result, an event at its
    end). Without a stream: (fn(), None)."""
    if stream is None:
        return fn(), None
    torch.cuda.set_device(stream.device)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        out = fn()
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def hand_over(done: object, tensors: Iterable[torch.Tensor | None]) -> None:
    """Make the current stream wait for `done` (from run_on) and own `tensors`; no-op for None."""
    if done is None:
        return
    compute = torch.cuda.current_stream()
    compute.wait_event(done)  # type: ignore[arg-type]
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(compute)
