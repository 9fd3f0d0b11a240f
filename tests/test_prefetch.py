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
