"""The training pipeline: the next batch's id exchange runs while this batch computes.

For sharded embeddings, batch i+1 is cut to this rank's slice and its input distribution (the id
all-to-all) is started on a background thread, on a communicator of its own, before batch i's
forward runs; batch i's forward then only waits if the exchange is not finished yet. Data loading
itself is overlapped by the prefetch thread (neorec/data/prefetch.py). No graph tracing is involved:
any model that calls the embedding collection keeps the pipeline. The pipeline changes timing
only: losses are bitwise the same with and without it (tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator


def pipelined(
    batches: Iterable,
    local_batch,
    embeddings,
    depth: int = 1,
    flush_after: Callable[[int], bool] | None = None,
) -> Iterator[tuple[object, object]]:
    """Yield (global batch, local batch); when `embeddings` can prefetch, the `depth` batches after
    the yielded one already have their id exchange under way. `flush_after(i)` True for the i-th
    batch (1-based): the batches held are yielded without waiting for the next one, which may be
    long in coming (a followed stream's partition ends: the next has perhaps not landed yet)."""
    prefetch = getattr(embeddings, "prefetch", None)
    ahead: deque = deque()
    for i, batch in enumerate(batches, 1):
        local = local_batch(batch)
        if prefetch is not None and depth > 0:
            prefetch(local.sparse)
        ahead.append((batch, local))
        if flush_after is not None and flush_after(i):
            while ahead:
                yield ahead.popleft()
        elif len(ahead) > depth:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()
