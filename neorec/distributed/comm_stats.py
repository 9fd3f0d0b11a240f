"""Bytes sent to other ranks by the exchanges of neorec/distributed/comms.py, per direction."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class CommStats:
    """Bytes sent to other ranks, per direction (e.g. 'input_dist', 'fwd', 'bwd', 'dense').

    `set_aside()` gives a thread the counts of what it sends inside the block instead, for sends that
    are not a training step's: an evaluation's (counted under "eval"), a prefetched batch's id exchange
    (counted when the batch is trained, dropped when it never is)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # the pipeline counts from a second thread
        self._aside = threading.local()

    def add(self, direction: str, n: int) -> None:
        aside = getattr(self._aside, "counts", None)
        if aside is not None:
            aside[direction] += int(n)
            return
        with self._lock:
            self.bytes[direction] += int(n)

    def add_counts(self, counts: dict[str, int]) -> None:
        """Counts set aside before (`set_aside`), added now."""
        for direction, n in counts.items():
            self.add(direction, n)

    @contextmanager
    def set_aside(self) -> Iterator[dict[str, int]]:
        """The bytes this thread sends inside the block go to the dict it yields, not to the totals."""
        outer = getattr(self._aside, "counts", None)
        self._aside.counts = counts = defaultdict(int)
        try:
            yield counts
        finally:
            self._aside.counts = outer

    def run_aside(self, fn: Callable[[], T]) -> tuple[T, dict[str, int]]:
        """fn()'s result and the bytes this thread sent running it (`set_aside`), to add later."""
        with self.set_aside() as sent:
            return fn(), sent

    @contextmanager
    def counted_as(self, direction: str) -> Iterator[None]:
        """What this thread sends inside the block counts under `direction` (e.g. "eval")."""
        with self.set_aside() as sent:
            yield
        self.add(direction, sum(sent.values()))

    def take(self) -> dict[str, int]:
        """The counts since the last take, then start again."""
        with self._lock:
            out = dict(self.bytes)
            self.bytes.clear()
        return out
