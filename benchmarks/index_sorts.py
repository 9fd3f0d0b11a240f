"""The sorts behind the fused backward and the row cache on CPU: neorec/utils/index_ops.py against
numpy's and torch's own, on row indices of the sizes a training step sorts.

- stable sort (the fused backward groups a batch's ids by row with it): numpy's LSD radix sort of
  16-bit digits, torch.sort(stable=True), and index_ops.stable_sort (which picks one by size);
- unique (the row cache's unique rows of a batch): np.sort + a comparison of neighbours, the same
  after torch.sort, and index_ops.sorted_unique.

Values are drawn uniformly below 26M (the rows of 26 tables of 1M, as in embedding_ops.py); 438,272
is an MLPerf multi-hot batch of 2048 (214 ids a sample). Each cell is the median of the repeats, all
variants timed in turn in one process.

    python benchmarks/index_sorts.py
    python benchmarks/index_sorts.py --sizes 20000,438272 --repeats 51 --no-record
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from neorec.utils import index_ops  # noqa: E402


def numpy_radix_stable_sort(values: torch.Tensor) -> torch.Tensor:
    """Positions of `values` (non-negative) in stable ascending order: one numpy stable argsort per
    16-bit digit, least significant first."""
    v = values.numpy()
    order = None
    for shift in range(0, max(int(v.max()).bit_length(), 1), 16):
        keys = v if order is None else v[order]
        step = np.argsort(((keys >> shift) & 0xFFFF).astype(np.uint16), kind="stable")
        order = step if order is None else order[step]
    return torch.from_numpy(order)


def unique_after(ordered: np.ndarray) -> np.ndarray:
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="20000,53248,213000,438272,2000000")
    p.add_argument("--high", type=int, default=26_000_000, help="values are drawn below this")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    header = ["values", "stable: numpy radix ms", "stable: torch ms", "stable: index_ops ms",
              "unique: numpy ms", "unique: torch sort ms", "unique: index_ops ms"]  # fmt: skip
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        values = torch.randint(0, args.high, (n,), generator=gen)
        expected = torch.sort(values, stable=True).indices
        assert torch.equal(numpy_radix_stable_sort(values), expected)
        assert torch.equal(index_ops.stable_sort(values)[1], expected)
        variants = [
            lambda v: numpy_radix_stable_sort(v),
            lambda v: torch.sort(v, stable=True),
            lambda v: index_ops.stable_sort(v),
            lambda v: unique_after(np.sort(v.numpy())),
            lambda v: unique_after(torch.sort(v).values.numpy()),
            lambda v: index_ops.sorted_unique(v),
        ]
        cells = [median_ms(lambda f=f, v=values: f(v), args.repeats) for f in variants]
        rows.append([f"{n:,}", *(round(c, 2) for c in cells)])
        print(rows[-1], flush=True)
    table = markdown_table(header, rows)
    print(table)
    if not args.no_record:
        notes = (
            f"Values uniform below {args.high:,}; median of {args.repeats} repeats, variants in turn in one "
            f"process; {args.threads} threads. index_ops switches to torch's sort from "
            f"{index_ops.TORCH_RADIX_MIN:,} values (torch's CPU radix sort starts there)."
        )
        append_results("Index sorts on CPU (benchmarks/index_sorts.py)", table, notes)


if __name__ == "__main__":
    main()
