"""Progress bars (tqdm) for the phases of a run that take seconds: filling tables, planning,
training, the final evaluation. A bar is drawn only where someone watches: when asked for (rank 0
with train.progress on) and stderr is a terminal, so logs written to files stay free of bar redraws."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def progress_bar(
    total: float | None, desc: str | None = None, enabled: bool = True, unit: str = "it", delay: float = 0.0, **kwargs
):
    """A tqdm bar on stderr, or None when not enabled or stderr is not a terminal. delay: seconds
    before it is first drawn (phases that end sooner show nothing)."""
    if not enabled or not _is_terminal(sys.stderr):
        return None
    from tqdm import tqdm

    if not total and desc and "bar_format" not in kwargs:  # no total: a count, not a bar
        kwargs["bar_format"] = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}]"
    return tqdm(total=total or None, desc=desc, unit=unit, delay=delay, dynamic_ncols=True, mininterval=0.5, **kwargs)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


@contextmanager
def phase(desc: str, enabled: bool = True, budget_seconds: float | None = None) -> Iterator[None]:
    """A bar for a phase that reports no progress of its own (planning): seconds elapsed, against
    `budget_seconds` when the phase has a time budget; drawn after a second, gone when it ends."""
    if budget_seconds is None:
        bar = progress_bar(None, desc, enabled, delay=1.0, leave=False, bar_format="{desc}: {elapsed}")
    else:
        budget = f"{{desc}}: {{percentage:3.0f}}%|{{bar}}| {{elapsed}} of a {budget_seconds:g} s budget"
        bar = progress_bar(budget_seconds, desc, enabled, delay=1.0, leave=False, bar_format=budget)
    if bar is None:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        while not done.wait(0.25):
            elapsed = time.perf_counter() - start
            if elapsed >= bar.delay:  # refresh() itself would draw it before the delay
                bar.n = min(elapsed, budget_seconds) if budget_seconds is not None else elapsed
                bar.refresh()

    thread = threading.Thread(target=tick, name="neorec-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()
