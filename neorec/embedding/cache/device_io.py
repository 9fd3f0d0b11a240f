"""Moving records between a row cache in device memory and its backing store in host memory or a file.

On a GPU (`device="cuda"`: the paper's cache of hot rows in device memory over host DRAM, or over
the SSD tier's files) the records and all the bookkeeping live in device memory and the backing
store in host memory or a file; rows and records cross between the two only in `DeviceIO` (misses
in, write-backs out), so the cache's logic, and its exactness, are the same code on both. The worker
thread reads and writes host memory only: a read ahead lands in a pinned host buffer, whose copy to
the device the worker starts on a stream of its own, and the batch's lookup places the records in
their slots after that copy (`StagedRead`); a write-back's records are copied to pinned host memory
on another stream, in the step's order, and the worker writes them once they are there. The
training thread reads one thing back from the device per read ahead (the counts of its rows,
_classify_on_device in read_ahead.py) and nothing in the lookup or the update of a batch read ahead
completely.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from neorec.embedding.cache.background import BackgroundIO
from neorec.embedding.cache.records import as_words
from neorec.utils import index_ops, streams


def stages_through_host(device: torch.device) -> bool:
    """Whether the cache's records on `device` reach the host-side backing store through DeviceIO:
    on every device but the CPU (tests force it on the CPU to run that path without a GPU)."""
    return device.type != "cpu"


class DeviceIO:
    """BackgroundIO for a cache in device memory over a host-side backing store (host memory or a
    file): the one place where rows and records cross between the device and the host (misses in,
    write-backs out). Whatever the worker thread reads or writes is host memory.

    On a GPU, nothing here makes the training thread wait for the device: what goes to the host
    (the missing rows of a read ahead; an eviction's rows, updated flags and records) is copied into
    pinned buffers on a stream of its own, after the work queued so far, and the worker waits for
    that copy before it uses them; records read ahead go up on a second stream as soon as the worker
    has them, and the batch's lookup only orders its stream after that copy (StagedRead)."""

    def __init__(self, io: BackgroundIO, device: torch.device) -> None:
        self.io, self.device, self.background = io, device, io.background
        self.layout = io.layout
        # pinned host buffers make the copies to and from the device asynchronous (torch keeps a
        # pinned block until the copies that use it are done); only a CUDA device has them
        self._pin = device.type == "cuda"
        self._down = torch.cuda.Stream(device) if self._pin else None  # device -> host
        self._up = torch.cuda.Stream(device) if self._pin else None  # host -> device

    def read_ahead(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> StagedRead:
        """Start reading the records of `rows` (sorted, unique) on the worker thread (after every
        write submitted so far) into host memory, and copying them to the device; result() places
        them in buffer[slots]."""
        (host_rows,), copied = self._to_host([rows])
        host = self.layout.empty(rows.numel(), pin=self._pin)

        def read() -> tuple[torch.Tensor, object]:
            if copied is not None:
                copied.synchronize()
            self.io.backing.read_into(host_rows, host, None)
            return streams.run_on(self._up, None, lambda: host.to(self.device, non_blocking=True))

        return StagedRead(self.io.submit(read), host, buffer, slots)

    def write_back(
        self, rows: torch.Tensor, dirty: torch.Tensor, records: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write back the records in `slots` of those `rows` that are `dirty` (rows of empty slots are
        -1 and never dirty), without waiting: the records are gathered now, in the current stream's
        order, and the worker picks the updated ones once the copy to host memory is done."""
        (rows, dirty, words), copied = self._to_host([rows, dirty, as_words(records).index_select(0, slots)])

        def ready() -> tuple[torch.Tensor, torch.Tensor]:
            if copied is not None:
                copied.synchronize()
            keep = index_ops.where(dirty)
            kept, order = index_ops.sort(rows.index_select(0, keep))
            return kept, words.index_select(0, keep.index_select(0, order)).view(torch.uint8)

        self.io.write_when(ready)

    def _to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Host copies of `tensors`, made on the down stream after the work the current stream has
        queued: (the copies, an event at their end). On the CPU (tests standing in for a device) the
        tensors themselves, which nothing changes afterwards, and no event."""
        if self._down is None:
            return [t.to("cpu") for t in tensors], None
        after = streams.mark(self.device)

        def copy() -> list[torch.Tensor]:
            out = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._down)  # the allocator keeps t until the copy has read it
                out.append(host)
            return out

        return streams.run_on(self._down, after, copy)  # type: ignore[return-value]

    def read_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        as_words(buffer).index_copy_(0, slots, as_words(self.read(rows)))

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """The records are copied to host memory here, on the caller's thread (a synchronous copy
        that waits for the kernels that wrote them); the worker writes that copy."""
        self.io.write(rows.cpu(), records.cpu())

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.io.read(rows.cpu()).to(self.device)

    def drain(self) -> None:
        self.io.drain()

    def close(self) -> None:
        self.io.close()


class StagedRead:
    """A read ahead of DeviceIO: records read into a host buffer on the worker thread and copied to
    the device there (on the up stream), placed in their slots by result() on the caller's thread (the
    cache calls it at the batch's lookup, or before anything touches those slots)."""

    def __init__(self, read: Future, host: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """read: the worker's job, which gives (the records on the device, an event at the end of
        their copy); host: the host buffer it reads them into (the job keeps it as long as needed)."""
        self._read: Future | None = read
        self._buffer, self._slots = buffer, slots

    def done(self) -> bool:
        """Whether the records are in their device slots."""
        return self._read is None

    def result(self) -> None:
        """Wait for the worker's read, order this stream after its copy up, then put the records in
        their slots (once)."""
        if self._read is None:
            return
        staged, arrived = self._read.result()
        streams.hand_over(arrived, [staged])
        as_words(self._buffer).index_copy_(0, self._slots, as_words(staged))
        self._read = None
        del self._buffer, self._slots  # the buffers go with the last reference
