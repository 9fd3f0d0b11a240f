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


def test_early_stop_releases_producer():
    it = prefetch(iter(range(10**9)), depth=2)
    assert next(it) == 0
    it.close()  # the finally block stops and joins the producer thread


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
