"""One run per folder: `neorec train` holds a lock on its run folder (and on checkpoint.dir where that
lies outside it) for its whole life, so that a second run, `--resume` or `--overwrite` on the folder
is refused at once, before it touches anything, with one error that names the process holding it.

The lock is fcntl.flock on the file `neorec.lock` inside the folder. The kernel releases it when the
last descriptor of the processes that hold it closes, also when they are killed by SIGKILL: no stale
lock is ever left behind, and the file, which stays, only says who held it last.

A run of several processes holds it together. The first takes the lock exclusively, writes its PID,
host and a key of its run (its job) into the file, and turns the lock into a shared one; every other
process of the same job (the workers of `neorec train --nproc N`, which find the key in NEOREC_RUN_LOCK,
the ranks of one torchrun job, keyed by its run id and master address, or ranks started by hand, keyed
by their MASTER_ADDR:MASTER_PORT and WORLD_SIZE) then takes a shared lock of
its own and adds a line with its PID. A process of any other job finds the lock held and the file
naming another job, and is refused. So is a process of the same job whose rank a live process of the
job already holds (a hand-started rank started again with the same variables, say with --overwrite:
it would clear the running run's folder, then fail on the rendezvous' port). torchrun starts workers
with Popen, which closes the descriptors a worker would inherit, so the workers cannot share the
launcher's: each holds its own, and under `--nproc N` the folder stays locked while the launcher or any
of its workers lives.

A filesystem without flock (some network filesystems) gets a warning and no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from neorec.errors import ConfigError, NeorecError, naming

log = logging.getLogger(__name__)

LOCK_FILE = "neorec.lock"
JOB_ENV = "NEOREC_RUN_LOCK"  # the launcher's job key, for its workers
SETTLE_SECONDS = 2.0  # how long a process waits for another of its job that is taking the lock
OTHER_JOB_SECONDS = 0.1  # ... and re-reads a file that names another job (it may be being rewritten)
_POLL_SECONDS = 0.02


class RunFolderInUse(NeorecError):
    """Another run holds the folder; the message names its processes."""


def job_key() -> str:
    """This process's run: the one its launcher named, the torchrun job it is a rank of, the ranks
    started by hand that meet at one address, or its own."""
    e = os.environ
    if e.get(JOB_ENV):
        return e[JOB_ENV]
    if e.get("TORCHELASTIC_RUN_ID"):  # every rank of one torchrun job, on every node
        return f"torchrun {e['TORCHELASTIC_RUN_ID']} {e.get('MASTER_ADDR', '')}:{e.get('MASTER_PORT', '')}"
    if "RANK" in e and e.get("WORLD_SIZE", "1") != "1":  # ranks started by hand, meeting at MASTER_ADDR:PORT
        return f"ranks {e.get('MASTER_ADDR', '')}:{e.get('MASTER_PORT', '')} of {e.get('WORLD_SIZE', '1')}"
    return f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"


class RunLock:
    """The locks of one run on its folders: released by `release()` (or leaving the `with` block),
    and by the kernel when the process ends however it ends. `folders`: those it locked, the run
    folder first; `holder`: the first line of the run folder's lock file (the process that took it
    first for this job: the same for every process of the run, on every node), None without a lock."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._fds: list[int] = []
        self.folders: list[Path] = []
        self.holder: str | None = None

    def worker_env(self) -> dict[str, str]:
        """What the processes this one starts need in their environment to share its locks."""
        return {JOB_ENV: self.job}

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # the last descriptor of the open file closes: the lock goes with it
        self._fds.clear()
        if self in _HELD:
            _HELD.remove(self)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_HELD: list[RunLock] = []  # the locks this process holds, the newest last


def hold_run_folders(folders: list[Path], job: str | None = None) -> RunLock:
    """Lock `folders` (created where missing) for this process's run (`job`, default job_key()).
    Raises RunFolderInUse, naming the holder's PID and host, when another run holds one of them."""
    lock = RunLock(job or job_key())
    try:
        for folder in folders:
            fd = _lock_folder(Path(folder), lock.job)
            if fd is not None:
                lock._fds.append(fd)
                if not lock.folders:
                    holders = read_holders(Path(folder) / LOCK_FILE)
                    lock.holder = json.dumps(holders[0], sort_keys=True) if holders else None
            lock.folders.append(Path(folder))
    except BaseException:
        lock.release()
        raise
    _HELD.append(lock)
    return lock


def run_identity() -> tuple[str, str | None] | None:
    """The run folder this process holds (its newest lock's), resolved, and the first holder of its
    lock (RunLock.holder); None when it holds none. The processes of one run compare them
    (neorec/train/same_config.py)."""
    if not _HELD or not _HELD[-1].folders:
        return None
    lock = _HELD[-1]
    return str(lock.folders[0].resolve()), lock.holder


def _lock_folder(folder: Path, job: str) -> int | None:
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder}: is a file; a run folder must be a folder")
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"{path}: cannot open the run folder's lock file ({e.strerror})") from e
    try:
        if _acquire(fd, path, job):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _acquire(fd: int, path: Path, job: str) -> bool:
    """Take the lock of `path` (open as `fd`) for `job`; False where the filesystem has no locks."""
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning(
                    f"cannot lock {path} ({e.strerror}): a second run in {path.parent} would not be refused"
                )
                return False
        else:  # the first of its run: say who holds it, then let the rest of the run join
            _write_record(fd, path, job, first=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:  # another run took it as ours was being shared: it decides below
                pass
        holders = read_holders(path)
        ours = bool(holders) and holders[0].get("job") == job
        if ours and (twin := _same_rank(holders, job)) is not None:
            raise RunFolderInUse(twin_message(path.parent, twin))
        if ours:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # the first process of this run is between taking the lock and sharing it
            else:
                _write_record(fd, path, job)
                return True
        if time.monotonic() - start >= (SETTLE_SECONDS if ours or not holders else OTHER_JOB_SECONDS):
            raise RunFolderInUse(in_use_message(path.parent, holders))
        time.sleep(_POLL_SECONDS)


def _write_record(fd: int, path: Path, job: str, first: bool = False) -> None:
    """Add this process to the lock file (`first`: in place of the last run's processes); a failed
    write (a full disk) names the file."""
    try:
        if first:
            os.ftruncate(fd, 0)
        os.write(fd, _record(job))
    except OSError as e:
        raise naming(e, path) from e


def _record(job: str) -> bytes:
    entry = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
             "job": job, "rank": os.environ.get("RANK"), "started": _start_ticks(os.getpid())}  # fmt: skip
    return (json.dumps(entry) + "\n").encode()


def _same_rank(holders: list[dict], job: str) -> dict | None:
    """The holder of `job` that is this process's rank and may still live: on this host, a process
    alive (the same PID and start time); on another, any of ranks started by hand (whose ranks are
    fixed; torchrun may restart a rank elsewhere under its job). None: this rank is free."""
    rank = os.environ.get("RANK")
    if rank is None:
        return None
    for h in holders:
        if h.get("job") != job or h.get("rank") != rank or h.get("pid") == os.getpid():
            continue
        if h.get("host") != socket.gethostname():
            if job.startswith("ranks "):
                return h
        elif _alive(h["pid"]) and h.get("started") in (None, _start_ticks(h["pid"])):
            return h
    return None


def twin_message(folder: Path, holder: dict) -> str:
    """The refusal of a process whose rank `holder` already is, in the job that holds `folder`."""
    rank = holder["rank"]
    return (
        f"{folder} is in use by another run: pid {holder['pid']} (rank {rank}) on host {holder.get('host')} "
        f"since {holder.get('since')}, of the job this process joins ({holder.get('job')}), in which it "
        f"would be a second rank {rank}. A folder holds one run at a time: wait for that run to end (or "
        "stop it), or give this one another folder and MASTER_PORT"
    )


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot; None where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def read_holders(path: Path) -> list[dict]:
    """The processes a lock file names, its first holder first (the last run's, once it ended)."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 16).decode(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int):
            out.append(entry)
    return out


def in_use_message(folder: Path, holders: list[dict]) -> str:
    def who(h: dict) -> str:
        gone = h.get("host") == socket.gethostname() and not _alive(h["pid"])
        rank = f" (rank {h['rank']})" if h.get("rank") is not None else ""
        return f"pid {h['pid']}{rank} on host {h.get('host')}{' (exited)' if gone else ''}"

    if not holders:
        holder = "a process that has not said who it is"
    else:
        holder = f"{who(holders[0])} since {holders[0].get('since')}"
        if len(holders) > 1:
            holder += ", with " + ", ".join(who(h) for h in holders[1:])
    return (
        f"{folder} is in use by another run: {holder}. A folder holds one run at a time: wait for that "
        "run to end (or stop it), or give this one another folder"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
