"""Collectives through shared memory for ranks on the same machine (CPU tensors).

gloo moves every byte between two processes of one machine through TCP on the loopback interface:
about 1 GB/s and 1 ms per collective here, and the kernel's copies take CPU time from training.
Ranks of one node can instead write their send buffers into a shared-memory segment and read what
is theirs straight from their peers' buffers: one memcpy each way.

The segment (a file in /dev/shm, unlinked once every rank has mapped it) holds, per rank, two
buffers of `capacity` bytes and two small headers (a sequence number and the byte offset of each
destination's part). An exchange goes in rounds of at most `capacity` bytes per rank:

    write my chunk into my buffer [round parity] → publish header (offsets, total, then sequence)
    → wait until every peer published this sequence → copy my parts out of every peer's buffer

A rank writes the buffer of parity p again only two rounds later, after every peer announced the
round in between, which each does only after it finished reading: so no lock is needed. Stores
become visible to other processes in program order on x86-64 (total store order), which the header
relies on; on other architectures `available()` says no and the backend's collectives are used.
A waiting rank spins, then sleeps on a named pipe that each peer writes one byte to when it
publishes, so an idle waiter takes no CPU from the computing threads. Where every rank of the group
has cores of its own for its threads, it spins for up to SPIN_SECONDS first: a core that goes idle
(on a VM, a virtual CPU handed back to the host) comes back slowly and cold: on this 2-core VM
2 processes x 1 thread (AdaGrad, 4 interleaved runs) trained at 76-88 ms a step spinning against
88-93 ms sleeping after 200 checks (benchmarks/history/design_choices.md). With more threads than
cores, a spinning rank would take the core its peer needs, so it checks only SPIN_CHECKS times before
sleeping.

A waiting rank also checks, every PEER_CHECK_SECONDS while it sleeps, that its peers' processes
still live (each rank's pid and start time, from /proc, are exchanged when the group is built): a
peer that died makes it raise DistributedError naming that rank within about a second, instead of
waiting PEER_TIMEOUT_SECONDS (topology.py), the bound for a peer that lives but stopped answering.

Files of ranks killed while the group is built (SIGKILL: nothing of theirs runs) go with the next
group built here (sweep_stale): its first rank creates the segment, neorec-<pid>-<random>, before any
pipe, and holds an flock on it until it unlinks it; a segment whose lock is free is no live group's.
Under `neorec train --nproc N` the launcher removes its workers' segments too (remove_noted).

Results equal the backend's: all_to_all moves the same bytes; all_reduce adds the ranks' tensors in
rank order on every rank (so every rank holds identical sums).
"""

from __future__ import annotations

import errno
import fcntl
import os
import platform
import re
import select
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from neorec.distributed.topology import PEER_TIMEOUT_SECONDS
from neorec.errors import DistributedError, naming
from neorec.utils.cores import processes_on_node, usable_cores

HEADER_SLOTS = 64  # int64 per header: sequence, total bytes, then offsets (max 61 ranks per node)
SPIN_CHECKS = 200  # busy checks before sleeping on the pipe
SPIN_SECONDS = 0.02  # and then busy-waiting this long, where each rank has cores of its own
PEER_CHECK_SECONDS = 0.5  # how often a sleeping waiter checks that its peers' processes live
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"neorec-(\d+-)?[0-9a-f]{32}")  # a segment: neorec-<pid>-<hex>; older: neorec-<hex>
NOTE_PREFIX = "shm-"  # a note in the launcher's report folder (NEOREC_REPORT_DIR) naming a segment
FRESH_SECONDS = 10.0  # a segment younger than this may be between its creation and its lock


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmGroup:
    """Shared-memory collectives among `ranks` (global ranks, all on this machine). Construction is
    collective over `pg` (the process group of exactly these ranks)."""

    def __init__(self, ranks: list[int], my_rank: int, pg, capacity: int = 16 << 20) -> None:
        self.ranks, self.size, self.index = ranks, len(ranks), ranks.index(my_rank)
        if self.size > HEADER_SLOTS - 3:
            raise ValueError(f"shared-memory group of {self.size} ranks; at most {HEADER_SLOTS - 3}")
        self.capacity = capacity
        self.seq = 0
        header_bytes = 2 * HEADER_SLOTS * 8
        self._stride = header_bytes + 2 * capacity  # per rank: 2 headers, then 2 buffers
        self._peers = _live_peers(ranks, self.index, pg)
        self._wake_read, self._wake_write, self._segment = -1, [], -1
        path = None
        try:
            if self.index == 0:  # the segment first, then the name: a pipe is never older than it
                sweep_stale()  # what killed groups left behind
                path = f"{SHM_DIR}/neorec-{os.getpid()}-{uuid.uuid4().hex}"
                self._create(path)
            name = [path]
            dist.broadcast_object_list(name, src=ranks[0], group=pg)
            path = name[0]
            self._attach(path, pg)
        except BaseException:  # a full /dev/shm, a file-size limit, a peer gone: leave nothing behind
            self.close()
            if path is not None:
                remove_group(path, self.size)  # the peers' files too: the group is never made
            raise
        made = [f"{path}.{self.index}", path] if self.index == 0 else [f"{path}.{self.index}"]
        for f in made:
            _unlink(f)  # the mappings stay; nothing is left behind when the processes end
        self._close_segment()
        self._headers = [
            [self._region(k, p * HEADER_SLOTS * 8, HEADER_SLOTS * 8).view(torch.int64) for p in (0, 1)]
            for k in range(self.size)
        ]
        # the sequence words as numpy views: a waiting rank reads them in a loop, and a numpy read
        # costs a tenth of a tensor element read (select + item)
        self._sequences = [[h.numpy()[:1] for h in pair] for pair in self._headers]
        self._buffers = [
            [self._region(k, header_bytes + p * capacity, capacity) for p in (0, 1)] for k in range(self.size)
        ]
        self.bytes_copied = 0
        self.spin_seconds = spin_seconds(max(self.size, processes_on_node()))

    def _create(self, path: str) -> None:
        """On the group's first rank: the segment, locked from its creation to its unlink (a sweep then
        sees that a live group holds it: sweep_stale), named in the launcher's report folder. A failure
        names the file."""
        _note(path)
        self._segment = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._segment, fcntl.LOCK_EX)
        try:
            os.ftruncate(self._segment, self.size * self._stride)
        except OSError as e:  # EFBIG (ulimit -f), ENOSPC: the call on a descriptor names no file
            raise naming(e, path) from e

    def _attach(self, path: str, pg) -> None:
        """Create this rank's wake-up pipe, then map the segment and open the peers' pipes (collective
        over `pg`)."""
        size = self.size * self._stride
        fifo = f"{path}.{self.index}"
        os.mkfifo(fifo, 0o600)
        self._wake_read = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        dist.barrier(group=pg)
        self._mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for k in range(self.size):  # one at a time: a failed open leaves the others to close
            fd = os.open(f"{path}.{k}", os.O_WRONLY | os.O_NONBLOCK) if k != self.index else -1
            self._wake_write.append(fd)
        dist.barrier(group=pg)

    def _region(self, rank: int, offset: int, size: int) -> torch.Tensor:
        start = rank * self._stride + offset
        return self._mem[start : start + size]

    # ---- publishing and waiting ------------------------------------------------------------------
    def _publish(self, parity: int, offsets: list[int]) -> None:
        self.seq += 1
        header = self._headers[self.index][parity]
        header[2 : 2 + len(offsets)] = torch.tensor(offsets, dtype=torch.int64)
        header[0] = self.seq  # last: a peer that sees the sequence sees the offsets and the data
        for fd in self._wake_write:
            if fd >= 0:
                try:
                    os.write(fd, b"\0")
                except OSError as e:
                    # EAGAIN: a full pipe already wakes its reader. EPIPE: the peer saw the sequence
                    # number by spinning, finished and exited before this wake-up byte was written;
                    # nobody is left to wake.
                    if e.errno not in (errno.EAGAIN, errno.EPIPE):
                        raise

    def _all_published(self, parity: int) -> bool:
        seq = self.seq
        return all(pair[parity][0] >= seq for pair in self._sequences)

    def _wait(self, parity: int) -> None:
        for _ in range(SPIN_CHECKS):
            if self._all_published(parity):
                return
        if self.spin_seconds:
            end = time.perf_counter() + self.spin_seconds
            while time.perf_counter() < end:
                for _ in range(SPIN_CHECKS):
                    if self._all_published(parity):
                        return
        start = time.monotonic()
        deadline, next_check = start + PEER_TIMEOUT_SECONDS, start + PEER_CHECK_SECONDS
        while not self._all_published(parity):
            select.select([self._wake_read], [], [], 0.005)
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now > next_check:
                next_check = now + PEER_CHECK_SECONDS
                self._check_peers()
            if now > deadline:
                raise DistributedError(
                    f"shared-memory collective among ranks {self.ranks}: no word from a peer in "
                    f"{PEER_TIMEOUT_SECONDS:.0f} s (a rank hangs); stopping"
                )

    def _check_peers(self) -> None:
        for rank, pid, started in self._peers:
            if _start_time(pid) != started:
                raise DistributedError(
                    f"rank {rank} (pid {pid}) exited during a shared-memory collective among ranks "
                    f"{self.ranks}; this rank stops too (the rank that failed first reports why)"
                )

    # ---- collectives -----------------------------------------------------------------------------
    def all_to_all(
        self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> None:
        """As dist.all_to_all_single: rows of `send` in `send_splits` go to the group's ranks in order;
        `recv` gets `recv_splits` rows from each."""
        dst = _bytes(recv)
        row_bytes = send.shape[1:].numel() * send.element_size()
        recv_off = _prefix([s * row_bytes for s in recv_splits])

        def place(k: int, n: int) -> torch.Tensor:
            return dst[recv_off[k] : recv_off[k] + n]

        self._all_to_all(_bytes(send), [s * row_bytes for s in send_splits], place)

    def all_to_all_bytes(self, send: torch.Tensor, send_sizes: list[int]) -> list[torch.Tensor]:
        """Parts of `send` (1-D uint8) of `send_sizes` bytes go to the group's ranks in order; returns
        the part every rank sent here, in group order. The sizes need not be exchanged first: each
        rank's offsets travel in its header."""
        parts: list[torch.Tensor] = []

        def place(k: int, n: int) -> torch.Tensor:
            parts.append(torch.empty(n, dtype=torch.uint8))
            return parts[-1]

        self._all_to_all(_bytes(send), send_sizes, place)
        return parts

    def _all_to_all(self, src: torch.Tensor, send_sizes: list[int], place) -> None:
        """place(k, n): where the n bytes from group rank k go (called once per rank, in order)."""
        W, me = self.size, self.index
        send_off = _prefix(send_sizes)
        total = send_off[-1]
        C = self.capacity
        rnd, rounds = 0, 1
        theirs: list[tuple[int, int]] = []  # (start, end) in peer k's send bytes of our part
        outs: list[torch.Tensor] = []
        while rnd < rounds:
            parity = (self.seq + 1) % 2
            lo = rnd * C
            chunk = src[lo : min(lo + C, total)]
            self._buffers[me][parity][: chunk.numel()].copy_(chunk)
            self._publish(parity, [total, *send_off])
            self._wait(parity)
            if rnd == 0:
                theirs = []
                most = 0
                for k in range(W):
                    h = self._headers[k][parity]
                    most = max(most, int(h[2]))
                    theirs.append((int(h[3 + me]), int(h[4 + me])))
                    outs.append(place(k, theirs[k][1] - theirs[k][0]))
                rounds = max(1, -(-most // C))
            for k in range(W):
                a, b = theirs[k]
                a, b = max(a, lo), min(b, lo + C)
                if a >= b:
                    continue
                out = outs[k][a - theirs[k][0] : b - theirs[k][0]]
                if k == me:
                    out.copy_(src[a:b])
                else:
                    out.copy_(self._buffers[k][parity][a - lo : b - lo])
                    self.bytes_copied += b - a
            rnd += 1

    def all_gather_bytes(self, send: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `send` (1-D uint8, sizes may differ), in group order. No sizes need to be
        exchanged first: each rank's total travels in its header."""
        W, me = self.size, self.index
        src = _bytes(send)
        total = src.numel()
        C = self.capacity
        rnd, rounds = 0, 1
        outs: list[torch.Tensor] = []
        totals: list[int] = []
        while rnd < rounds:
            parity = (self.seq + 1) % 2
            lo = rnd * C
            chunk = src[lo : min(lo + C, total)]
            self._buffers[me][parity][: chunk.numel()].copy_(chunk)
            self._publish(parity, [total])
            self._wait(parity)
            if rnd == 0:
                totals = [int(self._headers[k][parity][2]) for k in range(W)]
                outs = [torch.empty(t, dtype=torch.uint8) for t in totals]
                rounds = max(1, -(-max(totals) // C))
            for k in range(W):
                a, b = lo, min(totals[k], lo + C)
                if a < b:
                    outs[k][a:b].copy_(src[a:b] if k == me else self._buffers[k][parity][: b - a])
            rnd += 1
        return outs

    def all_reduce(self, flat: torch.Tensor) -> None:
        """In place: flat (1-D, contiguous) becomes the sum over the group, added in rank order."""
        n_bytes = flat.numel() * flat.element_size()
        C = self.capacity - self.capacity % flat.element_size()
        mine = _bytes(flat)
        for lo in range(0, max(n_bytes, 1), C):
            parity = (self.seq + 1) % 2
            hi = min(lo + C, n_bytes)
            self._buffers[self.index][parity][: hi - lo].copy_(mine[lo:hi])
            self._publish(parity, [n_bytes])
            self._wait(parity)
            bufs = [self._buffers[k][parity][: hi - lo].view(flat.dtype) for k in range(self.size)]
            out = mine[lo:hi].view(flat.dtype)
            _sum_in_order(bufs, out)

    def sum_parts(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The sum over the group of torch.cat(parts) (1-D tensors of one dtype), as a new tensor,
        added in rank order as all_reduce does. When they fit in one buffer, the parts are
        concatenated straight into it (one pass fewer than concatenating, then copying in)."""
        dtype = parts[0].dtype
        n_bytes = sum(p.numel() for p in parts) * parts[0].element_size()
        if n_bytes > self.capacity or n_bytes == 0:
            flat = torch.cat(parts)
            self.all_reduce(flat)
            return flat
        parity = (self.seq + 1) % 2
        torch.cat(parts, out=self._buffers[self.index][parity][:n_bytes].view(dtype))
        self._publish(parity, [n_bytes])
        self._wait(parity)
        bufs = [self._buffers[k][parity][:n_bytes].view(dtype) for k in range(self.size)]
        return _sum_in_order(bufs, None)

    def close(self) -> None:
        for fd in [self._wake_read, *self._wake_write]:
            if fd >= 0:
                os.close(fd)
        self._wake_read, self._wake_write = -1, []
        self._close_segment()

    def _close_segment(self) -> None:
        if self._segment >= 0:
            os.close(self._segment)  # its lock goes with it
            self._segment = -1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # a peer's failure, or a sweep, removed it first
        pass


def remove_group(path: str, size: int = HEADER_SLOTS) -> None:
    """Remove segment `path` and its ranks' wake-up pipes (path.0, path.1, ...: `size` at most)."""
    for f in [path, *(f"{path}.{k}" for k in range(size))]:
        _unlink(f)


def _note(path: str) -> None:
    """Under `neorec train --nproc N`: name the segment in the launcher's report folder, which removes
    it once its workers have ended (remove_noted), however they ended."""
    reports = os.environ.get("NEOREC_REPORT_DIR")
    if reports:
        try:
            (Path(reports) / f"{NOTE_PREFIX}{os.path.basename(path)}").write_text(path)
        except OSError:
            pass  # the sweep of a later group removes it instead


def remove_noted(reports: str | Path) -> None:
    """In the launcher, its workers gone: remove the segments they named in `reports` (_note) and left
    (a worker killed while its group was being built); one whose lock is held stays."""
    for note in Path(reports).glob(f"{NOTE_PREFIX}*"):
        path = os.path.join(SHM_DIR, note.name[len(NOTE_PREFIX) :])
        if _NAME.fullmatch(os.path.basename(path)) and _lock_is_free(path):
            remove_group(path)


def _lock_is_free(path: str) -> bool:
    """Whether no process holds segment `path`'s lock (False: it is held, or cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_stale(folder: str = SHM_DIR, now: float | None = None) -> list[str]:
    """Remove this user's segments in `folder` that no live group holds, with their pipes (and pipes
    whose segment is gone): of this version's naming, once its lock is free (FRESH_SECONDS after its
    creation, before which it may not be locked yet); of an older version's, once older than the
    longest a group's setup waits. Returns the names of the segments and lone pipes removed."""
    now = time.time() if now is None else now
    try:
        names = set(os.listdir(folder))
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        base, _, rank = name.partition(".")
        if not _NAME.fullmatch(base) or (rank and (not rank.isdigit() or base in names)):
            continue  # not ours, or a pipe whose segment decides
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        new = "-" in base[len("neorec-") :]
        wait = FRESH_SECONDS if new else PEER_TIMEOUT_SECONDS
        if info.st_uid != os.getuid() or now - info.st_mtime < wait:
            continue
        if rank:
            _unlink(path)
        elif not new or _lock_is_free(path):
            remove_group(path)
        else:
            continue
        removed.append(name)
    return removed


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _live_peers(ranks: list[int], index: int, pg) -> list[tuple[int, int, int]]:
    """(rank, pid, start time) of the peers whose processes this one can see (collective over `pg`).
    A peer in another pid namespace is left out: only the timeout bounds a wait on it."""
    mine = (os.getpid(), _start_time(os.getpid()))
    everyone: list = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=pg)
    return [
        (ranks[k], pid, started)
        for k, (pid, started) in enumerate(everyone)
        if k != index and started is not None and _start_time(pid) == started
    ]


def spin_seconds(ranks_here: int) -> float:
    """How long a waiting rank busy-waits before sleeping: SPIN_SECONDS where the `ranks_here`
    processes of this machine x torch's intra-op threads each fit on the cores this process may use,
    else 0 (only SPIN_CHECKS checks)."""
    return SPIN_SECONDS if ranks_here * torch.get_num_threads() <= usable_cores() else 0.0


def _sum_in_order(bufs: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """bufs[0] + bufs[1] + ... (rank order), into `out` (or a new tensor): the first add reads two
    buffers and writes once."""
    if len(bufs) == 1:
        return bufs[0].clone() if out is None else out.copy_(bufs[0])
    out = torch.add(bufs[0], bufs[1], out=out)
    for b in bufs[2:]:
        out += b
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("shared-memory collectives need contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def _prefix(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out
