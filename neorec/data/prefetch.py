"""Produce batches in background threads so the training step does not wait for the reader.

Order is unchanged (one producer and one FIFO queue, or several workers whose results are handed
out in the order of their inputs), so training stays deterministic. numpy and torch release the GIL
in their heavy ops, so generation and parsing overlap with the step, and with each other.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
_DONE = object()


def prefetch(items: Iterable[T], depth: int = 4) -> Iterator[T]:
    """Iterate `items` with up to `depth` of them made ahead; the producer's exceptions re-raise here."""
    if depth <= 0:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        """Queue `item` unless the consumer has stopped (a full queue it no longer reads would
        hold the producer, and the items in it, for good); False once it has."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer
            put(e)

    thread = threading.Thread(target=produce, name="neorec-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, depth: int = 4) -> Iterator[R]:
    """`fn` of each item, in the order of `items`, computed by `workers` threads with up to `depth`
    results made ahead (at least `workers`); one worker: `prefetch` of the map. `items` is advanced on
    the consumer's thread as results are taken, so it must be cheap (the cut of a batch, not its
    gathering); an exception of `fn` re-raises here, where its result would have come."""
    if workers <= 1:
        yield from prefetch(map(fn, items), depth)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="neorec-batch")
    ahead: deque[Future] = deque()
    it = iter(items)
    try:
        for item in it:
            ahead.append(pool.submit(fn, item))
            if len(ahead) > max(depth, workers):
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        for future in ahead:
            future.cancel()
        pool.shutdown(wait=True)
