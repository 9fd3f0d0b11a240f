"""DeviceFeed: batches reach the training device ahead of the step, in order, and the wait is counted.

The worker path runs here on the CPU (no streams: the copy is the identity); on a GPU the same path
pins each batch and copies it on a side stream (tests/test_train_cuda.py trains through it)."""

from __future__ import annotations

import time

import pytest
import torch
from dist_helpers import make_batches, make_tables

from neorec.data.device_feed import DeviceFeed


def slow(batches, delay: float):
    for b in batches:
        time.sleep(delay)
        yield b


@pytest.mark.parametrize("worker", [False, True])
def test_batches_arrive_in_order_and_the_wait_is_counted(worker):
    batches = make_batches(make_tables(), 6, 8)
    feed = DeviceFeed(slow(batches, 0.02), "cpu", depth=2, worker=worker)
    got = list(feed)
    assert len(got) == 6 and all(torch.equal(a.dense, b.dense) for a, b in zip(got, batches, strict=True))
    assert all(a.sparse == b.sparse for a, b in zip(got, batches, strict=True))
    assert feed.wait_seconds >= 6 * 0.02 * 0.5  # the consumer did nothing but wait for the reader


def test_the_readers_error_reaches_the_consumer():
    def broken():
        yield from make_batches(make_tables(), 2, 4)
        raise ValueError("bad shard line 7")

    with pytest.raises(ValueError, match="line 7"):
        list(DeviceFeed(broken(), "cpu", worker=True))


def test_a_consumer_that_stops_early_ends_the_worker():
    import threading

    def workers() -> int:
        return sum(t.name == "neorec-prefetch" and t.is_alive() for t in threading.enumerate())

    before = workers()
    feed = DeviceFeed(iter(make_batches(make_tables(), 50, 4)), "cpu", depth=2, worker=True)
    it = iter(feed)
    next(it)
    assert workers() == before + 1
    it.close()  # the generator's finally stops and joins the worker
    assert workers() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_batches_are_copied_ahead_without_host_syncs():
    batches = make_batches(make_tables(), 4, 64)
    feed = DeviceFeed(iter(batches), "cuda", depth=2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        # the hand-over waits on events, never on the host; each feature's number of ids was
        # counted on the host and travels with the batch
        got = [(b.dense.sum(), b.sparse.length_per_key()) for b in feed]
        fed = list(DeviceFeed(iter(batches), "cuda", depth=2))
        limits = [b.sparse.id_limits() for b in fed]  # counted on the host too, for the engines' id check
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert limits == [b.sparse.id_limits() for b in batches]
    want = [b.dense.sum() for b in batches]
    assert [float(x) for x, _ in got] == pytest.approx([float(x) for x in want])
    assert [n for _, n in got] == [b.sparse.length_per_key() for b in batches]
