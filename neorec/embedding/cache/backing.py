"""Backing stores: where every row of a cached group of tables lives, behind the RAM cache (cache.py).

Both tiers hold one record per row, the row's weights and optimizer state side by side
(records.py), and move whole records:
- `DramBacking`: records in one host-memory tensor (on a GPU machine, the tier behind device memory);
- `SsdBacking`: records in one file per group, row r at byte r * record_bytes.

Interface: `read(rows)` / `write(rows, records)` for rows sorted ascending and unique (a batch's
misses, its evicted rows); `read_range(name, start, end)` / `write_range(name, start, end, values)`
for one field of a range of rows (checkpoints), and `view_range` where a field can be seen without
reading it (state_dict of a file-backed table).

How the file is read and written (measured in benchmarks/RESULTS.md, "SSD backing" and "Row cache"):
- reads (`reads="map"`, the default): one gather (index_select, no Python per row, the GIL released)
  from a shared memory map of the file per piece of rows. A fault maps at most one page-cache folio,
  and folios lie in aligned 2 MiB regions, so a piece of ascending rows is sized by the regions it
  touches to the room left under `release_bytes` (usually one piece per read; pieces of 64 rows
  checked one by one cost 2.5-3.5x the CPU: benchmarks/history/design_choices.md). Where the page
  cache holds the rows this costs about 0.2 us of CPU per row against about 1 us for a pread from
  Python (the 12 GiB demo: 15.5k against 11.6k samples/s through pread);
- reads (`reads="pread"`): positioned reads (os.pread), one per run of consecutive rows, on 16 I/O
  threads when there are many. More CPU per row, but a read the page cache cannot serve blocks
  only its own thread, so the disk sees many requests at once: the choice for files much larger
  than the machine's memory on a disk that wants a deep queue;
- writes: stores into a shared memory map of the file (one vectorised index_copy_, no Python per
  row and no GIL held); per-row pwrite calls cost several times more CPU here (Python per call, the
  GIL shared with the training thread). Written pages count in resident memory, so the map's pages
  are dropped (madvise MADV_DONTNEED; they stay dirty in the page cache, nothing is lost) whenever
  the process's resident file pages (/proc/self/statm) have grown by `release_bytes` since the last
  drop (measured rather than estimated: a write fault maps its own page, 4 KiB, or a larger folio
  where the page cache holds one, about 6 KiB per random row written here). The kernel's read-ahead
  is left on: scattered rows gain nothing from it at first, but it warms the page cache for later
  misses, and measured faster here than POSIX_FADV_RANDOM on a cold file;
- nothing else of the file is ever resident: memory is the cache, the rows in flight and at most
  about `release_bytes` (plus one piece of rows) of mapped pages, read or written. The kernel's
  page cache keeps recently used pages (clean or dirty, reclaimable, not in the process's RSS).
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from neorec.embedding.cache.file_io import allocate, transfer
from neorec.embedding.cache.records import RecordLayout
from neorec.embedding.cache.write_log import WriteLog, log_records
from neorec.embedding.fused.storage import RowInit
from neorec.errors import MachineError, naming
from neorec.utils import index_ops

_WINDOW_BYTES = 16 << 20  # records per piece of a range read/write or of creating a file
_RUNS_PER_TASK = 256  # runs of rows one I/O thread handles at a time
_IO_THREADS = 16
READS = ("map", "pread")  # how SsdBacking reads missed rows
_FOLIO_BYTES = 2 << 20  # what one row read or written through a map may make resident, at most (a huge folio)
_MAX_PIECE_ROWS = 4096


class DramBacking:
    """All records in one host-memory tensor [num_rows, record_bytes]."""

    tier = "dram"

    def __init__(self, layout: RecordLayout, records: torch.Tensor) -> None:
        self.layout, self.records, self.num_rows = layout, records, records.shape[0]

    @classmethod
    def create(cls, layout: RecordLayout, num_rows: int, inits: dict[str, RowInit]) -> DramBacking:
        records = layout.empty(num_rows)
        for start, end in _windows(num_rows, layout.record_bytes):
            records[start:end] = layout.pack({n: init(start, end) for n, init in inits.items()})
        return cls(layout, records)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> DramBacking:
        """Records holding these tensors' rows (tests and small tables)."""
        layout = RecordLayout([(n, t.shape[1] if t.dim() == 2 else 0, t.dtype) for n, t in tensors.items()])
        return cls(layout, layout.pack(tensors))

    def field(self, name: str) -> torch.Tensor:
        """Field `name` of every row, a view of the records."""
        return self.layout.view(self.records, name)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return _words(self.records).index_select(0, rows).view(torch.uint8)

    def read_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Records of `rows` into buffer[slots] (in order if slots is None)."""
        source = _words(self.records).index_select(0, rows)
        if slots is None:
            _words(buffer).copy_(source)
        else:
            _words(buffer).index_copy_(0, slots, source)

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        _words(self.records).index_copy_(0, rows, _words(records))

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.layout.view(self.records[start:end], name).clone()

    def write_range(self, name: str, start: int, end: int, values: torch.Tensor) -> None:
        self.layout.view(self.records[start:end], name).copy_(values)

    def close(self) -> None:
        """Nothing to close: the records are memory."""


class SsdBacking:
    """All records in one file, read from and written through a shared map of it (or read with
    pread; see the module doc)."""

    tier = "ssd"

    def __init__(
        self,
        path: str | Path,
        layout: RecordLayout,
        num_rows: int,
        release_bytes: int = 256 << 20,
        reads: str = "map",
        log_fraction: float = 1.0,
    ) -> None:
        """log_fraction: size of the write log (write_log.py) as a share of the rows; 0 writes rows
        in place through the map instead."""
        if reads not in READS:
            raise ValueError(f"ssd reads must be one of {READS}, got {reads!r}")
        self.path, self.layout, self.num_rows, self.reads = Path(path), layout, num_rows, reads
        expected = num_rows * layout.record_bytes
        if not self.path.exists() or self.path.stat().st_size != expected:
            raise FileNotFoundError(f"{self.path}: expected a table file of {expected} bytes")
        self.fd = os.open(self.path, os.O_RDWR)
        self._close = weakref.finalize(self, os.close, self.fd)  # also at exit, before modules go
        self._map = np.memmap(
            self.path, dtype=np.int64, mode="r+", shape=(num_rows, layout.record_bytes // 8)
        )
        if hasattr(mmap, "MADV_HUGEPAGE"):  # large page-cache folios: far fewer, cheaper faults
            self._map._mmap.madvise(mmap.MADV_HUGEPAGE)
        self._words = torch.from_numpy(self._map)  # records as int64 words, the map's memory
        self.release_bytes = release_bytes
        self.log = (
            WriteLog(
                self.path.with_suffix(".log"),
                self.path,
                layout.record_bytes,
                num_rows,
                log_fraction,
                self._words,
                lambda places: self._gather(self.log.records, self.log.fd, places),
                self._make_room,
            )
            if log_fraction > 0
            else None
        )
        # writes in place (no log) and reads of rows not in ascending order: rows between two checks
        # of resident memory, so a piece adds at most half of release_bytes even if every row maps a
        # huge folio of its own (ascending reads are cut by region instead, see _pieces)
        self.piece_rows = max(1, min(_MAX_PIECE_ROWS, release_bytes // 2 // _FOLIO_BYTES))
        self._baseline = _resident_file_bytes()
        # CPU time of the threads that read and wrote rows (write includes folding the log in)
        self.cpu_seconds = {"read": 0.0, "write": 0.0}

    # ---- rows of a batch ---------------------------------------------------------------------------
    def read(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.layout.empty(rows.numel())
        self.read_into(rows, out, None)
        return out

    def read_into(self, rows: torch.Tensor, buffer: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Records of `rows` (sorted, unique) into buffer[slots] (a cache's records), or into buffer
        in order (slots None): gathered straight there, one copy less than read() then a scatter."""
        start = time.thread_time()
        try:
            self._read_into(rows, _words(buffer), slots)
        finally:
            self.cpu_seconds["read"] += time.thread_time() - start

    def write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        start = time.thread_time()
        try:
            self._write(rows, records)
        finally:
            self.cpu_seconds["write"] += time.thread_time() - start

    def _read_into(self, rows: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor | None) -> None:
        """dest[slots[i]] (int64 words; dest[i] if slots is None) = the record of rows[i], from the
        table file or, for rows written back since the last compaction, from the write log.
        reads="map": gathered from the maps in pieces, their pages dropped whenever resident memory
        has grown by release_bytes; "pread": one positioned read per run of consecutive records, on
        I/O threads (see the module doc)."""

        def put(at: torch.Tensor | None, source: torch.Tensor, fd: int, index: torch.Tensor) -> None:
            """The records source[index] to the places of rows `at` (None: all rows, in order)."""
            if at is None and slots is None:
                self._gather(source, fd, index, dest)
                return
            if slots is not None:
                at = slots if at is None else slots.index_select(0, at)
            dest.index_copy_(0, at, self._gather(source, fd, index))

        if self.log is None:
            put(None, self._words, self.fd, rows)
            return
        with self.log.lock:  # appends wait: the log's records stay where `where` says
            where = self.log.where.index_select(0, rows)
            logged = where >= 0
            if not bool(logged.any()):
                put(None, self._words, self.fd, rows)
                return
            at, rest = index_ops.split(logged)
            places, order = index_ops.sort(where.index_select(0, at).long())  # ascending: pieces by region
            put(at.index_select(0, order), self.log.records, self.log.fd, places)
            put(rest, self._words, self.fd, rows.index_select(0, rest))

    def _gather(
        self, source: torch.Tensor, fd: int, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Records source[index] (int64 words) into `out` (new if None), by map or by pread."""
        if out is None:
            out = torch.empty((index.numel(), source.shape[1]), dtype=torch.int64)
        if self.reads == "pread":
            if index.numel():
                _read_runs(fd, _runs(index, self.layout.record_bytes), out.view(torch.uint8))
            return out
        for a, b in self._pieces(index, source.shape[1] * 8):
            torch.index_select(source, 0, index[a:b], out=out[a:b])
        return out

    def _pieces(self, index: torch.Tensor, record_bytes: int):
        """Pieces [a, b) of `index` (rows of a map) to gather one at a time, so that resident memory
        stays within release_bytes of the last drop of the maps' pages. A read fault maps at most one
        huge folio, and folios lie in aligned 2 MiB regions, so a piece can add at most 2 MiB per
        region its records touch: for ascending rows, the regions are counted and each piece takes as
        many as the room left (one `index_select` of thousands of rows); the pages are dropped when
        no room is left. Rows in any other order go in pieces of piece_rows, each checked after."""
        n = index.numel()
        starts = index.numpy().astype(np.int64) * record_bytes
        first, last = starts // _FOLIO_BYTES, (starts + record_bytes - 1) // _FOLIO_BYTES
        if n > 1 and not bool(np.all(first[1:] >= last[:-1])):
            for a in range(0, n, self.piece_rows):
                yield a, min(a + self.piece_rows, n)
                self._release_if_grown()
            return
        touched = (last != first).astype(np.int64) + 1  # regions of each row's record...
        touched[1:] -= first[1:] == last[:-1]  # ...less the one it shares with the row before
        touched = np.cumsum(touched)  # regions touched by rows [0, i]
        a = 0
        while a < n:
            room = (self.release_bytes - (_resident_file_bytes() - self._baseline)) // _FOLIO_BYTES - 1
            if room < 2:  # (-1: the region row a shares with row a - 1 may have been dropped since)
                self.release()
                room = self.release_bytes // _FOLIO_BYTES - 1
            done = int(touched[a - 1]) if a else 0
            b = max(a + 1, int(np.searchsorted(touched, done + room, side="right")))
            yield a, b
            a = b

    def _write(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Write `records` of `rows` (sorted, unique): appended to the write log, or (no log) stored
        into the map in pieces, dropping the map's pages whenever resident memory has grown by
        release_bytes (see the module doc)."""
        words = _words(records.contiguous())
        if self.log is not None:
            self.log.append(rows, words)
            return
        a = 0
        while a < rows.numel():
            b = min(a + self.piece_rows, rows.numel())
            self._words.index_copy_(0, rows[a:b], words[a:b])
            self._release_if_grown()
            a = b

    def _make_room(self, nbytes: int) -> None:
        """Drop the maps' pages first if `nbytes` more of them would pass release_bytes."""
        if _resident_file_bytes() - self._baseline + nbytes > self.release_bytes:
            self.release()

    def _release_if_grown(self) -> None:
        """Drop the maps' pages if resident memory has grown by release_bytes since the last drop."""
        if _resident_file_bytes() - self._baseline >= self.release_bytes:
            self.release()

    def release(self) -> None:
        """Drop the maps' resident pages (they stay in the page cache, dirty ones until the kernel writes them)."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)
        if self.log is not None:
            self.log.release()
        self._baseline = _resident_file_bytes()

    # ---- ranges: checkpoints -----------------------------------------------------------------------
    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Field `name` of rows [start, end), a copy, read in windows of records (so memory holds the
        result and one window, never the table)."""
        field = self.layout.fields[name]
        out = torch.empty(field.shape(end - start), dtype=field.dtype)
        for a, b in _windows(end - start, self.layout.record_bytes):
            records = self._read_span(start + a, start + b)
            out[a:b] = self.layout.view(records, name)
        return out

    def write_range(self, name: str, start: int, end: int, values: torch.Tensor) -> None:
        """Overwrite field `name` of rows [start, end), window by window (the other fields are kept;
        rows in the write log move back into the table file)."""
        for a, b in _windows(end - start, self.layout.record_bytes):
            records = self._read_span(start + a, start + b)
            self.layout.view(records, name).copy_(values[a:b])
            transfer(self.fd, records, (start + a) * self.layout.record_bytes, True, self.path)
            if self.log is not None:
                with self.log.lock:
                    self.log.where[start + a : start + b] = -1

    def view_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Field `name` of rows [start, end) as a view of the file (memory-mapped copy-on-write): nothing
        is read until someone reads it, and changing it does not change the table. For state_dict;
        checkpoints stream with read_range instead, since reading a map keeps its pages resident."""
        if end == start:
            return torch.empty(self.layout.fields[name].shape(0), dtype=self.layout.fields[name].dtype)
        if self.log is not None:
            self.log.fold_range(start, end)  # the file itself must hold the rows' current records
        r = self.layout.record_bytes
        part = np.memmap(self.path, dtype=np.uint8, mode="c", offset=start * r, shape=(end - start, r))
        return self.layout.view(torch.from_numpy(part), name)

    def _read_span(self, start: int, end: int) -> torch.Tensor:
        """Current records of rows [start, end): the table file's, with the write log's rows laid over."""
        records = self.layout.empty(end - start)
        transfer(self.fd, records, start * self.layout.record_bytes, False, self.path)
        if self.log is not None:
            with self.log.lock:
                self.log.overlay(start, _words(records))
        return records

    def flush(self) -> None:
        """Make written rows durable (the end of a run; checkpoints copy them elsewhere anyway)."""
        self._map.flush()
        os.fsync(self.fd)
        if self.log is not None:
            self.log.flush()

    def close(self) -> None:
        """Close the file (the map stays until the object goes)."""
        self._close()
        self.fd = -1
        if self.log is not None:
            self.log.close()


def create_ssd_file(
    path: str | Path,
    layout: RecordLayout,
    num_rows: int,
    inits: dict[str, RowInit],
    log_fraction: float = 0.0,
) -> None:
    """Write a group's file window by window with plain writes (the table is never whole in memory),
    then drop its pages from the page cache, so that training starts from the disk, as after a
    restart, and the benchmarks measure that. A disk without room for the file and for the write
    log of `log_fraction` that SsdBacking creates next is refused before either is written; a file
    not written whole is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = num_rows * layout.record_bytes
    log_bytes = log_records(num_rows, log_fraction) * layout.record_bytes if log_fraction > 0 else 0
    _check_room(path, size, log_bytes)
    try:
        with path.open("wb") as f:
            allocate(f.fileno(), size, path, f"the weights and optimizer state of {num_rows:,} rows")
            for start, end in _windows(num_rows, layout.record_bytes):
                records = layout.pack({n: init(start, end) for n, init in inits.items()})
                f.write(memoryview(records.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException as e:
        path.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # name the file
            raise naming(e, path) from e
        raise


def _check_room(path: Path, size: int, log_bytes: int) -> None:
    """MachineError naming the folder when its disk has less room than a table file of `size` bytes
    and its write log need (files of theirs left by an earlier run are replaced, so their room counts)."""
    free = shutil.disk_usage(path.parent).free
    for old in (path, path.with_suffix(".log")):
        if old.is_file():
            free += old.stat().st_size
    if size + log_bytes <= free:
        return
    log = (
        f" and {_mib(log_bytes)} for its write log (embedding.cache.ssd_log sets its share)"
        if log_bytes
        else ""
    )
    raise MachineError(
        f"embedding.cache.directory {path.parent}: the disk has {_mib(free)} free, but table file "
        f"{path.name} needs {_mib(size)} for its rows' weights and optimizer state{log}; free some "
        "space there, or set embedding.cache.directory to a folder on a larger disk"
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


# ---- runs of rows, moved by I/O threads ------------------------------------------------------------
def _runs(rows: torch.Tensor, record_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """(file offset, offset in the buffer, bytes) of each run of consecutive rows."""
    starts = torch.ones(rows.numel(), dtype=torch.bool)
    starts[1:] = rows[1:] != rows[:-1] + 1
    first = starts.nonzero().flatten()
    lengths = torch.diff(first, append=torch.tensor([rows.numel()]))
    return (
        (rows[first] * record_bytes).tolist(),
        (first * record_bytes).tolist(),
        (lengths * record_bytes).tolist(),
    )


def _read_runs(fd: int, runs: tuple[list[int], list[int], list[int]], buffer: torch.Tensor) -> None:
    """Read every run into `buffer`; several I/O threads when there are many runs (a read that
    misses the page cache blocks its thread on the disk)."""
    file_offsets, offsets, sizes = runs
    view = memoryview(buffer.numpy()).cast("B")

    def work(lo: int, hi: int) -> None:
        # runs lo..hi fill one contiguous part of the buffer: read each into bytes, copy them once
        data = b"".join(
            [os.pread(fd, n, where) for n, where in zip(sizes[lo:hi], file_offsets[lo:hi], strict=True)]
        )
        at, end = offsets[lo], offsets[hi - 1] + sizes[hi - 1]
        if len(data) == end - at:
            view[at:end] = data
        else:  # a short read (interrupted, or the file was truncated): run by run, in full
            for i in range(lo, hi):
                transfer(fd, view[offsets[i] : offsets[i] + sizes[i]], file_offsets[i], False, "table file")

    n = len(sizes)
    if n <= _RUNS_PER_TASK:
        work(0, n)
        return
    tasks = max(1, min(_IO_THREADS, n // _RUNS_PER_TASK))
    step = -(-n // tasks)
    for future in [_io_pool().submit(work, a, min(a + step, n)) for a in range(0, n, step)]:
        future.result()


def _windows(num_rows: int, record_bytes: int) -> list[tuple[int, int]]:
    step = max(1, _WINDOW_BYTES // record_bytes)
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


_STATM: dict[int, int] = {}  # pid -> an open /proc/self/statm (a pread of it: ~2 us, an open: ~15 us)


def _resident_file_bytes() -> int:
    """Resident pages of file (and shared) mappings of this process, in bytes."""
    fd = _STATM.get(os.getpid())
    if fd is None:  # first call in this process (a fork does not share the parent's /proc/self)
        fd = _STATM[os.getpid()] = os.open("/proc/self/statm", os.O_RDONLY)
    return int(os.pread(fd, 256, 0).split()[2]) * mmap.PAGESIZE


def _words(records: torch.Tensor) -> torch.Tensor:
    """Records seen as int64 words: torch copies whole rows of those several times faster than bytes."""
    return records.view(torch.int64)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _io_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="neorec-ssd")
        return _POOL
