"""How to move scattered rows between a file and memory: positioned reads/writes vs a memory map.

The SSD tier (neorec/embedding/cache/backing.py) reads a batch's misses and writes back its evicted
rows, a few thousand scattered records of a few hundred bytes each. This measures, on a file of
`--rows` records of `--record-bytes` under --dir, for batches of `--batch` sorted random rows:
- reads: os.pread per row (1 and 16 threads) vs a gather from a memory map (torch index_select,
  1 and 16 threads; and 1 thread with the map asking for large folios, MADV_HUGEPAGE, as SsdBacking
  does), with the file in the page cache (warm) and dropped from it (cold); and SsdBacking's own
  gather, which cuts a read into pieces by the 2 MiB regions its rows touch (rows in ascending
  order, as the cache passes them) or, for rows in any other order, into pieces of 64 rows with
  resident memory checked after each;
- writes: os.pwrite per row vs stores into a shared map (index_copy_), alone and followed by dropping
  the map's pages again (MADV_DONTNEED, as SsdBacking does to bound memory), vs appending the records
  to a write log (write_log.py: one pwrite per batch) and folding the log back into the file (the
  file's windows read and rewritten; per record appended, for a log of the file's size), warm;
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
from neorec.embedding.cache.backing import SsdBacking  # noqa: E402
from neorec.embedding.cache.records import RecordLayout  # noqa: E402
from neorec.embedding.cache.write_log import WriteLog  # noqa: E402


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

    def fresh_map(huge: bool = False):
        m = np.memmap(path, dtype=np.int64, mode="r+", shape=(rows_n, words))
        if huge:
            m._mmap.madvise(mmap.MADV_HUGEPAGE)
        return m, torch.from_numpy(m)

    def split(rows: np.ndarray, threads: int, work) -> None:
        step = -(-len(rows) // threads)
        list(pool.map(work, [(a, min(a + step, len(rows))) for a in range(0, len(rows), step)]))

    def pread(rows: np.ndarray, threads: int) -> None:
        offsets = (rows * rb).tolist()
        split(rows, threads, lambda b: b"".join([os.pread(fd, rb, o) for o in offsets[b[0] : b[1]]]))

    def map_read(rows: np.ndarray, threads: int, huge: bool = False) -> None:
        m, t = fresh_map(huge)  # a new map: nothing of it resident, as after the pages are dropped
        r = torch.from_numpy(rows)
        split(rows, threads, lambda b: t.index_select(0, r[b[0] : b[1]]))

    def pwrite(rows: np.ndarray) -> None:
        data = memoryview(np.ones((len(rows), rb), np.uint8)).cast("B")
        for i, o in enumerate((rows * rb).tolist()):
            os.pwrite(fd, data[i * rb : (i + 1) * rb], o)

    def map_write(rows: np.ndarray, drop_pages: bool = False) -> None:
        m, t = fresh_map()
        t.index_copy_(0, torch.from_numpy(rows), torch.ones(len(rows), words, dtype=torch.int64))
        if drop_pages:
            m._mmap.madvise(mmap.MADV_DONTNEED)

    log = WriteLog(path.with_suffix(".log"), path, rb, rows_n, fraction=1.0)
    log.half = max(log.half, 4 * args.repeats * n)  # the appends measured stay in one half

    def append(rows: np.ndarray) -> None:
        log.append(torch.from_numpy(rows), torch.ones(len(rows), words, dtype=torch.int64))

    def fold_per_record() -> float:
        """us of folding per record appended: a half of the log (rows / 2 records) folds every window
        of the file once, so a window's fold (best of --repeats, after appends put rows in it) times
        windows / half."""
        windows = -(-rows_n // log._window_rows)
        times = []
        for w in range(args.repeats):
            append(next(batch_iter))  # logged rows in every window
            start = (w * 7) % windows * log._window_rows
            began = time.perf_counter()
            log.fold(start, min(start + log._window_rows, rows_n))
            times.append(time.perf_counter() - began)
        return min(times) * windows / (rows_n // 2) * 1e6

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

    layout = RecordLayout([("weight", rb // 4, torch.float32)])
    backing = SsdBacking(path, layout, rows_n, 256 << 20, "map", log_fraction=0)

    def backing_read(rows: np.ndarray, ascending: bool = True) -> None:
        index = torch.from_numpy(rows if ascending else rows[::-1].copy())
        backing._gather(backing._words, fd, index)

    cases = [
        ("read", "os.pread per row, 1 thread", lambda r: pread(r, 1)),
        ("read", "os.pread per row, 16 threads", lambda r: pread(r, 16)),
        ("read", "map gather (index_select), 1 thread", lambda r: map_read(r, 1)),
        ("read", "map gather (index_select), 16 threads", lambda r: map_read(r, 16)),
        ("read", "map gather, MADV_HUGEPAGE, 1 thread", lambda r: map_read(r, 1, True)),
        ("read", "SsdBacking read: pieces by 2 MiB region, release 256 MiB", backing_read),
        (
            "read",
            "SsdBacking read: pieces of 64 rows, RSS checked after each (rows in any order)",
            lambda r: backing_read(r, ascending=False),
        ),  # fmt: skip
        ("write", "os.pwrite per row, 1 thread", pwrite),
        ("write", "map stores (index_copy_), 1 thread", map_write),
        ("write", "map stores, then its pages dropped, 1 thread", lambda r: map_write(r, True)),
        ("write", "append to the write log (SsdBacking)", append),
    ]
    table = []
    for kind, name, fn in cases:
        warm = best(fn, cold=False)
        cold = best(fn, cold=True) if kind == "read" else float("nan")
        table.append([kind, name, f"{warm:.2f}", "-" if kind == "write" else f"{cold:.2f}"])
        print(table[-1], flush=True)
    table.append(
        ["write", "fold the log into the file, per record appended", f"{fold_per_record():.2f}", "-"]
    )
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
    backing.close()
    log.close()
    os.close(fd)
    path.unlink()
    path.with_suffix(".log").unlink()
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
