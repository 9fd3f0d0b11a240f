import threading

import pytest

from neorec.data.prefetch import prefetch


def test_order_kept_and_errors_reraised():
    assert list(prefetch(range(100), depth=3)) == list(range(100))
    assert list(prefetch(range(5), depth=0)) == list(range(5))

    def broken():
        yield 1
        raise ValueError("reader failed at line 7")

    it = prefetch(broken(), depth=2)
    assert next(it) == 1
    with pytest.raises(ValueError, match="line 7"):
        next(it)


def _producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "neorec-prefetch" and t.is_alive()]


def _three_items(ending: str, asked_past_the_end: threading.Event):
    """0, 1, 2, then the end of the stream or a failure; `asked_past_the_end` is set once the
    producer has queued the last item and asks for more."""
    yield from range(3)
    asked_past_the_end.set()
    if ending == "failed":
        raise ValueError("reader failed")


@pytest.mark.parametrize("ending", ["producing", "finished", "failed"])
def test_a_consumer_that_stops_early_ends_the_producer(ending):
    """A run that stops before its data ends (train.max_steps) closes the stream with the queue
    full: the producer ends with it, whatever it was doing (making items, or waiting to queue the
    end of the stream or its exception), instead of waiting on the queue for good with its items held."""
    past_the_end = threading.Event()
    items = iter(range(10**9)) if ending == "producing" else _three_items(ending, past_the_end)
    it = prefetch(items, depth=2)
    assert next(it) == 0
    if ending != "producing":  # the queue holds 1 and 2: the producer waits to queue what follows
        assert past_the_end.wait(10)
    it.close()  # the finally block stops and joins the producer thread
    assert _producers() == []


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_ordered_map_keeps_the_order_of_its_inputs(workers):
    """Results in input order whatever finishes first (later items here finish sooner)."""
    import random
    import time

    from neorec.data.prefetch import ordered_map

    delays = random.Random(workers).choices([0.0, 0.002, 0.005], k=60)

    def slow(i: int) -> int:
        time.sleep(delays[i])
        return i * i

    assert list(ordered_map(slow, range(60), workers, depth=4)) == [i * i for i in range(60)]
    assert list(ordered_map(slow, [], workers)) == []


def test_ordered_map_raises_where_the_failed_result_was_and_stops_early():
    import threading

    from neorec.data.prefetch import ordered_map

    def fn(i: int) -> int:
        if i == 7:
            raise ValueError("batch 7 failed")
        return i

    it = ordered_map(fn, range(100), workers=3, depth=4)
    assert [next(it) for _ in range(7)] == list(range(7))
    with pytest.raises(ValueError, match="batch 7"):
        next(it)
    running = threading.active_count()
    early = ordered_map(fn, iter(range(10**9)), workers=3, depth=4)
    assert next(early) == 0
    early.close()  # pending work cancelled, the pool shut down
    assert threading.active_count() <= running
