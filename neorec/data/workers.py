"""Preprocessing jobs run over worker processes, with a progress bar (torch-free).

Workers are forked when this process has not imported torch (the command line's preprocessing of TSV
files does not): a forked worker starts at once, where a spawned one imports numpy and pyarrow again
(about a second, which a short job does not pay back). A process that has imported torch spawns them
instead: a forked child would inherit torch's OpenMP thread pool, which does not survive a fork.

Within a `shared_pool` block, the calls of `run_jobs` with its number of workers and initializer run in
one pool, started at the first of them: a command whose phases follow one another (index, count, write)
starts its workers once.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def start_method() -> str:
    """ "fork" where it is safe and available, else "spawn" (see the module's docstring)."""
    if "torch" not in sys.modules and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    return "spawn"


def torch_worker_init() -> None:
    """One torch thread per worker: the workers share the machine's cores."""
    import torch

    torch.set_num_threads(1)


@dataclass
class _SharedPool:
    workers: int
    initializer: Callable[[], None] | None
    pool: ProcessPoolExecutor | None = None


_SHARED: list[_SharedPool] = []  # the pools of the open shared_pool blocks, innermost last


@contextmanager
def shared_pool(workers: int, initializer: Callable[[], None] | None = torch_worker_init) -> Iterator[None]:
    """Run the `run_jobs` calls of this block that ask for `workers` processes and this initializer in
    one pool (see the module's docstring); its workers stop at the end of the block."""
    shared = _SharedPool(workers, initializer)
    _SHARED.append(shared)
    try:
        yield
    finally:
        _SHARED.remove(shared)
        if shared.pool is not None:
            shared.pool.shutdown(cancel_futures=True)


def _pool(
    workers: int, num_jobs: int, initializer: Callable[[], None] | None
) -> tuple[ProcessPoolExecutor, bool]:
    """(the shared pool of `workers` processes, True), else (a new pool for `num_jobs` jobs, False)."""
    ctx = multiprocessing.get_context(start_method())
    for shared in reversed(_SHARED):
        if shared.workers == workers and shared.initializer is initializer:
            if shared.pool is None:
                shared.pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer)
            return shared.pool, True
    return ProcessPoolExecutor(min(workers, num_jobs), mp_context=ctx, initializer=initializer), False


def run_jobs(
    fn: Callable, jobs: list, workers: int, progress: bool, desc: str,
    total: int | None = None, unit_size: Callable[[Any], int] | None = None,
    initializer: Callable[[], None] | None = torch_worker_init,
    keys: list | None = None, stop_key: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:  # fmt: skip
    """fn over jobs, in `workers` processes (in this one for 1), with a progress bar; results unordered.

    `keys` (one per job, in job order) and `stop_key(result)`: once a result's stop key is not None,
    the jobs whose key is greater are not started (those started run to their end)."""
    bar = _bar(total if total is not None else len(jobs), desc) if progress else None
    stop = None
    try:
        if workers <= 1 or len(jobs) <= 1:
            for i, job in enumerate(jobs):
                if stop is not None and keys is not None and keys[i] > stop:
                    continue
                result = fn(job)
                stop = _least(stop, stop_key(result) if stop_key else None)
                _advance(bar, unit_size(result) if unit_size else 1)
                yield result
            return
        pool, shared = _pool(workers, len(jobs), initializer)
        futures = []
        try:
            futures = [pool.submit(fn, job) for job in jobs]
            for fut in as_completed(futures):
                if fut.cancelled():
                    continue
                result = fut.result()
                key = stop_key(result) if stop_key else None
                if key is not None:
                    stop = _least(stop, key)
                    for i, other in enumerate(futures):
                        if keys is not None and keys[i] > stop:
                            other.cancel()
                _advance(bar, unit_size(result) if unit_size else 1)
                yield result
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        finally:
            if not shared:
                pool.shutdown()
    finally:
        if bar is not None:
            bar.close()


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm  # only with a bar: its import costs a short command about 0.05 s

    return tqdm(total=total, desc=desc, leave=False)


def _advance(bar: Any, n: int) -> None:
    if bar is not None:
        bar.update(n)


def _least(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else min(a, b)
