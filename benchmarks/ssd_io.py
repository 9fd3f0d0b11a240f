"""How to move scattered rows between a file and memory: positioned reads/writes vs a memory map.

The SSD tier (neorec/embedding/cache/backing.py) reads a batch's misses and writes back its evicted
rows, a few thousand scattered records of a few hundred bytes each. This measures, on a file of
`--rows` records of `--record-bytes` under --dir, for batches of `--batch` sorted random rows:
- reads: os.pread per row (1 and 16 threads) vs a gather from a memory map (torch index_select,
  1 and 16 threads), with the file in the page cache (warm) and dropped from it (cold);
- writes: os.pwrite per row vs stores into a shared map (index_copy_), warm;
- resident memory (RssFile) a map gains per row read or written.
Prints a table and appends it to RESULTS.md; deletes the file.

    python benchmarks/ssd_io.py --dir /work/tmp
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import append_results, markdown_table  # noqa: E402


def rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_300_000)
    p.add_argument("--record-bytes", type=int, default=512)
    p.add_argument("--batch", type=int, default=9400, help="rows per batch (a 20%% cache's misses per step)")
    p.add_argument("--repeats", type=int, default=3, help="batches per measurement (best kept)")
    p.add_argument("--dir", default="/work/tmp")
    p.add_argument("--note", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows_n, rb, n = args.rows, args.record_bytes, args.batch
    path = Path(args.dir) / "ssd-io-bench.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for a in range(0, rows_n, 1 << 16):
            f.write(np.zeros((min(1 << 16, rows_n - a), rb), np.uint8).tobytes())
    fd = os.open(path, os.O_RDWR)
    pool = ThreadPoolExecutor(16)
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.choice(rows_n, n, replace=False)) for _ in range(4 * args.repeats)]
    batch_iter = iter(batches * 8)
    words = rb // 8

    def drop() -> None:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def fresh_map():
        m = np.memmap(path, dtype=np.int64, mode="r+", shape=(rows_n, words))
        return m, torch.from_numpy(m)

    def split(rows: np.ndarray, threads: int, work) -> None:
        step = -(-len(rows) // threads)
        list(pool.map(work, [(a, min(a + step, len(rows))) for a in range(0, len(rows), step)]))

    def pread(rows: np.ndarray, threads: int) -> None:
        offsets = (rows * rb).tolist()
        split(rows, threads, lambda b: b"".join([os.pread(fd, rb, o) for o in offsets[b[0] : b[1]]]))

    def map_read(rows: np.ndarray, threads: int) -> None:
        m, t = fresh_map()  # a new map: nothing of it resident, as after the pages are dropped
        r = torch.from_numpy(rows)
        split(rows, threads, lambda b: t.index_select(0, r[b[0] : b[1]]))

    def pwrite(rows: np.ndarray) -> None:
        data = memoryview(np.ones((len(rows), rb), np.uint8)).cast("B")
        for i, o in enumerate((rows * rb).tolist()):
            os.pwrite(fd, data[i * rb : (i + 1) * rb], o)

    def map_write(rows: np.ndarray) -> None:
        m, t = fresh_map()
        t.index_copy_(0, torch.from_numpy(rows), torch.ones(len(rows), words, dtype=torch.int64))

    def best(fn, cold: bool) -> float:
        times = []
        for _ in range(args.repeats):
            rows = next(batch_iter)
            if cold:
                drop()
            else:
                pread(rows, 16)  # these rows' pages in the page cache
            start = time.perf_counter()
            fn(rows)
            times.append(time.perf_counter() - start)
        return min(times) / n * 1e6

    cases = [
        ("read", "os.pread per row, 1 thread", lambda r: pread(r, 1)),
        ("read", "os.pread per row, 16 threads", lambda r: pread(r, 16)),
        ("read", "map gather (index_select), 1 thread", lambda r: map_read(r, 1)),
        ("read", "map gather (index_select), 16 threads", lambda r: map_read(r, 16)),
        ("write", "os.pwrite per row, 1 thread", pwrite),
        ("write", "map stores (index_copy_), 1 thread", map_write),
    ]
    table = []
    for kind, name, fn in cases:
        warm = best(fn, cold=False)
        cold = best(fn, cold=True) if kind == "read" else float("nan")
        table.append([kind, name, f"{warm:.2f}", "-" if kind == "write" else f"{cold:.2f}"])
        print(table[-1], flush=True)
    # resident memory a map gains per row it reads or writes (the page cache holds the file)
    pread(np.arange(rows_n), 16)
    m, t = fresh_map()
    rows = next(batch_iter)
    before = rss_file_kib()
    t.index_select(0, torch.from_numpy(rows))
    read_kib = (rss_file_kib() - before) / n
    m._mmap.madvise(mmap.MADV_DONTNEED)
    before = rss_file_kib()
    t.index_copy_(0, torch.from_numpy(next(batch_iter)), torch.ones(n, words, dtype=torch.int64))
    write_kib = (rss_file_kib() - before) / n
    del m, t
    os.close(fd)
    path.unlink()
    header = ["", "how", "us per row, page cache (warm)", "us per row, from disk (cold)"]
    notes = (
        f"{n:,} sorted random rows of {rb} bytes per batch from a file of {rows_n:,} rows "
        f"({rows_n * rb / 2**30:.2f} GiB) in {args.dir}; best of {args.repeats} batches, wall time per row. "
        f"A map's fresh pages are faulted in (a new map per batch, as after its pages are dropped to bound "
        f"memory). Resident memory a map gains: {read_kib:.1f} KiB per row read (fault-around maps "
        f"neighbouring pages too), {write_kib:.1f} KiB per row written. {args.note}"
    )
    append_results("SSD backing: reading and writing scattered rows", markdown_table(header, table), notes)
    print(markdown_table(header, table))
    print(notes)


if __name__ == "__main__":
    main()
