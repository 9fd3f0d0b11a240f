"""Batches onto the training device ahead of the step.

A worker thread takes the reader's host batches, pins them (page-locked memory, so the copy is a
DMA that does not block the host) and starts their copy to the GPU on a stream of its own; an event
marks each copy's end. The training step waits on that event on its own stream, never on the host,
so up to `depth` batches travel while earlier ones compute. Device tensors made on the copy stream
are handed to the compute stream (record_stream), so the allocator does not reuse their memory
while the step still reads them. On the CPU batches pass through unchanged (the reader's own
prefetch thread makes them ahead) and only the wait is counted.

`wait_seconds` sums the time the consumer waited for the next batch: the data wait per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext

import torch

from neorec.data.batch import Batch
from neorec.data.prefetch import prefetch
from neorec.utils import streams

_DONE = object()


def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    s = batch.sparse
    return [t for t in (batch.dense, batch.labels, s.values, s.lengths, s.weights) if t is not None]


class DeviceFeed:
    def __init__(
        self, batches: Iterable[Batch], device: torch.device | str, depth: int = 2, worker: bool | None = None
    ) -> None:
        """depth: batches on their way to the device at once (at least 1). worker: copy on a worker
        thread (default: on a GPU; tests run the worker on the CPU too, with no streams)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the worker thread sets this device by index
            device = torch.device("cuda", torch.cuda.current_device())
        self.batches, self.device, self.depth = batches, device, max(1, depth)
        self.wait_seconds = 0.0
        self._cuda = self.device.type == "cuda"
        self._worker = self._cuda if worker is None else worker

    def _copy(self, batch: Batch, stream) -> tuple[Batch, object]:
        """Start `batch`'s copy to the device on `stream`; (device batch, event at its end)."""
        if batch.dense.device == self.device:  # on the device already (the CPU, or data.synthetic.on_device)
            return batch, None
        batch.sparse.length_per_key()  # counted on the host now, so the device batch never reads them
        batch.sparse.id_limits()  # likewise each feature's smallest and largest id, for the id check
        if not batch.dense.is_pinned():
            batch = batch.pin_memory()
        with torch.cuda.stream(stream):
            moved = batch.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return moved, done

    def _hand_over(self, batch: Batch, done) -> Batch:
        """Order the compute stream after the copy, and tell the allocator it uses the tensors."""
        streams.hand_over(done, batch_tensors(batch))
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self._fed() if self._worker else self._timed(self.batches)

    def _timed(self, items: Iterable) -> Iterator:
        """`items` as they come, the wait for each one counted."""
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            item = next(it, _DONE)
            self.wait_seconds += time.perf_counter() - t0
            if item is _DONE:
                return
            yield item

    def _copies(self) -> Iterator[tuple[Batch, object]]:
        """Run on the prefetch thread: every batch's copy started on a copy stream of its own."""
        stream = None
        if self._cuda:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for batch in self.batches:
                yield self._copy(batch, stream)

    def _fed(self) -> Iterator[Batch]:
        copies = prefetch(self._copies(), self.depth)  # the worker thread, `depth` copies ahead
        try:
            for item in self._timed(copies):
                yield self._hand_over(*item)
        finally:
            copies.close()  # stops and joins the worker when the consumer stops early
