"""Tensors to and from the device the transport works on.

NCCL moves GPU tensors; gloo's all-to-all and the shared-memory transport move host tensors. Where
ranks share a GPU (more ranks than GPUs, so gloo), a device tensor crosses through a pinned host
buffer: copied down before the exchange, and the received host tensor copied up with a
non-blocking transfer (pinned memory makes it asynchronous; torch's pinned-memory allocator keeps
the buffer alive until the copy is done). Under NCCL a host tensor (a score gathered for
evaluation, a size) goes up to the rank's GPU first. Comms asks here for every exchange, so this is
the one place that decides what is staged; the trainer and the sharding code never do.
"""

from __future__ import annotations

import torch


class Staging:
    def __init__(self, backend: str, force: bool = False) -> None:
        """backend: the process group's ("nccl" moves device tensors, anything else host tensors).
        force: stage every tensor through a separate buffer even where it already lies on the
        wire's device (tests use it with CPU tensors standing in for GPU ones)."""
        self.backend, self.force = backend, force

    def wire_device(self, t: torch.Tensor) -> torch.device:
        """Where `t` must lie for the transport."""
        if self.backend == "nccl":
            return t.device if t.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def needed(self, t: torch.Tensor) -> bool:
        return self.force or t.device != self.wire_device(t)

    def down(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the wire's device, in a buffer of its own (pinned where it is host memory for a GPU
        tensor). A GPU -> host copy finishes before this returns: the host transport reads it next."""
        wire = self.wire_device(t)
        pin = wire.type == "cpu" and t.device.type == "cuda"
        out = torch.empty(t.shape, dtype=t.dtype, device=wire, pin_memory=pin)
        out.copy_(t)  # blocking: a CPU-side collective reads the buffer right after
        return out

    def up(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A received wire tensor on `device` (the caller's). Host -> GPU from pinned memory does not
        block the host; the copy is ordered before later work on the current stream."""
        if t.device == device and not self.force:
            return t
        if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(t, non_blocking=t.device.type == "cpu" and device.type == "cuda")
        return out
