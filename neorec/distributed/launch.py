"""`neorec train --nproc N`: torchrun's elastic agent, run in this process, and one clear report.

The agent starts N workers (`python -m neorec train ...`, each detached from the terminal by setsid) and watches
them. When one fails, the agent sends the others SIGTERM and, 30 s later (its shutdown timeout),
SIGKILL; a rank that loses a peer also stops by itself: within about a second when the peer's
process is gone (neorec/distributed/shm.py checks that its peers live; gloo sees their sockets
close), and after PEER_TIMEOUT_SECONDS (topology.py) when a peer hangs. Every worker writes what
stopped it into a report folder (NEOREC_REPORT_DIR): its one-line error, the time, and whether it
failed because another rank did. The launcher then prints the rank that failed first with its own
message, instead of torchrun's traceback of the agent.

A SIGTERM or SIGINT sent to the launcher reaches the agent, which forwards it to every worker once:
the workers stop at the same step boundary with a checkpoint (neorec/train/signals.py) and rank 0
prints the command that resumes; the launcher exits with 128 + the signal's number, as they do. One
that comes before training (the workers stay quiet) is one line of the launcher's, whose advice
depends on whether a checkpoint is there to resume; one that comes once rank 0 wrote the run's
results (report_finished) changes nothing: the run finished, and the launcher exits 0.

The launcher's folder (the workers' reports, the agent's logs) is removed when it returns; one left by
a launcher killed by SIGKILL goes with the next launch (the folder's lock file is then free).

A launcher that ends without a word (SIGKILL, a crash) takes its workers with it: each asks the kernel
for SIGKILL when its parent goes (neorec/utils/parent_watch.py). The run folder's lock is held by
the launcher and by every worker (neorec/train/run_lock.py: `env` passes the run's key to them), so
the folder stays locked until the last of them is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPORT_DIR = "NEOREC_REPORT_DIR"
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_PREFIX = "neorec-launch-"
_OWNER = "launcher.lock"  # in the launcher's folder, locked while the launcher lives
_FINISHED = "finished.json"  # in the report folder: rank 0 wrote the run's results
_FRESH_SECONDS = 10.0  # a folder younger than this may be between its creation and its lock


def launch_torchrun(
    nproc: int, argv: list[str], user_argv: list[str], env: dict[str, str] | None = None,
    checkpoints: Path | None = None,
) -> int:  # fmt: skip
    """Run `neorec <argv>` on `nproc` processes of this machine under torchrun's agent (as
    `torchrun --standalone --nproc-per-node N -m neorec ...`). `user_argv`: the command as the
    user typed it (with --nproc), for the resume line; `env`: more for the workers' environment;
    `checkpoints`: the run's checkpoint folder, for the advice of a stop before any was written.
    Returns the exit code. Call it on a thread that lives until it returns (the workers' death
    signal follows the thread that started them: parent_watch.py)."""
    sweep_launch_folders()  # of launchers killed by SIGKILL
    reports, owner = _own_folder()
    try:
        return _launch(nproc, argv, user_argv, env, checkpoints, reports)
    finally:
        from neorec.distributed.shm import remove_noted

        remove_noted(reports)  # segments of workers killed while they were built
        shutil.rmtree(reports, ignore_errors=True)
        os.close(owner)


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without --nproc N / --nproc=N: the workers' command."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _launch(
    nproc: int, argv: list[str], user_argv: list[str], env: dict[str, str] | None, checkpoints: Path | None,
    reports: str,
) -> int:  # fmt: skip
    """launch_torchrun with the workers' reports and the agent's logs in folder `reports`."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from neorec.utils.parent_watch import launcher_env

    # the agent's logs (empty: no --redirects) in this folder, not in a /tmp/torchelastic_* of their own
    logs = f"--log-dir={Path(reports) / 'agent'}"
    cmd = ["--standalone", f"--nproc-per-node={nproc}", logs, "-m", "neorec", *argv]
    logging.getLogger("neorec").info("launching: torchrun " + shlex.join(cmd))
    # the agent's own log lines (closing signals, "failed (exitcode: ...)") would bury the report
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # the agent installs handlers for these signals (to forward them to the workers) and leaves them
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    # and sets variables for the workers in this process's environment (OMP_NUM_THREADS=1 among them)
    environment = dict(os.environ)
    workers_env = {REPORT_DIR: reports, "NEOREC_ARGV": shlex.join(user_argv), **launcher_env(),
                   **(env or {})}  # fmt: skip
    os.environ.update(workers_env)  # the agent starts the workers with a copy of this environment
    try:
        run(parse_args(cmd))
        return 0
    except SignalException as e:
        sig = int(e.sigval)
        if _finished(reports, signal.Signals(sig).name):
            return 0
        if not any(r.get("stopped") for r in _reports(reports).values()):
            print(stopped_early(signal.Signals(sig).name, checkpoints, user_argv), file=sys.stderr)
        return 128 + sig
    except ChildFailedError as e:
        if _finished(reports, None):  # a worker ended by a signal after the results were written
            return 0
        return _report_failures(e.failures, _reports(reports))
    finally:
        if dict(os.environ) != environment:
            os.environ.clear()
            os.environ.update(environment)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stopped_early(name: str, checkpoints: Path | None, user_argv: list[str]) -> str:
    """The launcher's line for a run stopped by signal `name` before its workers stopped cleanly (at
    their start, or a second signal): how to go on, by whether `checkpoints` holds one to resume."""
    from neorec.train.signals import resume_command

    if checkpoints is None:
        return (f"neorec: stopped by {name} before a checkpoint of the current step was written; "
                "`neorec train ... --resume` continues from the newest one, if there is one")  # fmt: skip
    from neorec.checkpoint.load import latest_checkpoint

    newest = latest_checkpoint(checkpoints) if checkpoints.is_dir() else None
    if newest is None:
        return (f"neorec: stopped by {name} before the run saved a checkpoint (none in {checkpoints}): "
                "nothing to resume; the same command starts it again from step 0")  # fmt: skip
    return (f"neorec: stopped by {name} before a checkpoint of the current step was written; the newest is "
            f"{newest}. Resume with: {resume_command(user_argv)}")  # fmt: skip


def _finished(reports: str, name: str | None) -> bool:
    """Whether rank 0 wrote the run's results (report_finished); said, for a signal `name`."""
    path = Path(reports) / _FINISHED
    try:
        where = json.loads(path.read_text()).get("out_dir")
    except (OSError, ValueError, AttributeError):
        return False
    if name is not None:
        print(f"neorec: {name} came after the run finished; its results are in {where}", file=sys.stderr)
    return True


def _own_folder() -> tuple[str, int]:
    """A new folder for this launcher, and the descriptor of its lock file, locked until it is closed."""
    folder = tempfile.mkdtemp(prefix=_PREFIX)
    fd = os.open(os.path.join(folder, _OWNER), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd


def sweep_launch_folders(folder: str | None = None, now: float | None = None) -> list[str]:
    """Remove this user's launcher folders in `folder` (the temporary folder) whose launcher is gone
    (killed by SIGKILL: it removes its own otherwise): those whose lock file nobody holds. A folder
    without one (of an older version) is left alone. Returns the folders removed."""
    folder = folder or tempfile.gettempdir()
    now = time.time() if now is None else now
    removed = []
    for path in Path(folder).glob(f"{_PREFIX}*"):
        owner = path / _OWNER
        try:
            info = owner.lstat()
            fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if info.st_uid != os.getuid() or now - info.st_mtime < _FRESH_SECONDS or path.is_symlink():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its launcher lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    return removed


def _reports(folder: str) -> dict[int, dict]:
    out = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            out[int(path.stem[5:])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def _report_failures(failures: dict, reports: dict[int, dict]) -> int:
    """Print the rank that failed first with its own error, then how the others ended."""
    stops = [r for r in reports.values() if r.get("stopped")]
    if stops:  # the workers were signalled directly and stopped cleanly; rank 0 printed how to resume
        return max(128 + int(r["signal"]) for r in stops)
    ranks = sorted(set(failures) | set(reports))

    def what(rank: int) -> str:
        if rank in reports:
            return reports[rank]["error"]
        code = failures[rank].exitcode if rank in failures else None
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code} without a report"

    def when(rank: int) -> tuple[bool, float]:
        r = reports.get(rank)
        if r is not None:
            return bool(r.get("follows")), r["time"]
        # a killed rank: no report, and torch's timestamps of ranks it reaped together tie; the agent
        # ends the other workers with SIGTERM once one has failed, so a rank killed by SIGTERM follows
        failure = failures.get(rank)
        by_agent = getattr(failure, "exitcode", None) == -signal.SIGTERM
        return by_agent, float(getattr(failure, "timestamp", time.time()))

    first = min(ranks, key=when)
    print(f"neorec: error: rank {first} failed first: {what(first)}", file=sys.stderr)
    for rank in ranks:
        if rank != first:
            after = "stopped after it" if when(rank)[0] else "also failed"
            print(f"neorec: rank {rank} {after}: {what(rank)}", file=sys.stderr)
    # the code the worker chose (2: bad input) even when the agent's SIGTERM ended it before it exited
    code = reports.get(first, {}).get("code") or (failures[first].exitcode if first in failures else 1)
    return code if isinstance(code, int) and code > 0 else 1


def _write_report(entry: dict) -> None:
    folder = os.environ.get(REPORT_DIR)
    if not folder:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(folder) / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"time": time.time(), **entry}))
        os.replace(tmp, path)
    except OSError:
        pass  # the report is a courtesy; the exit code still tells the launcher


def report_failure(error: BaseException, code: int = 1) -> bool:
    """In a worker started by launch_torchrun: record `error` and the exit `code` the worker ends
    with (the launcher exits with it) for the launcher's report. True when
    the launcher will print it in full (a NeorecError, or a failure caused by another rank's): the
    worker then prints nothing itself. Other errors are bugs; their traceback stays useful."""
    from neorec.errors import PEER_GONE, NeorecError, peer_gone

    if not os.environ.get(REPORT_DIR):
        return False
    text = str(error) if isinstance(error, NeorecError) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    follows = peer_gone(error) or any(s in text for s in PEER_GONE)
    _write_report({"error": text, "follows": follows, "code": code})
    return follows or isinstance(error, NeorecError)


def report_stop(message: str, signum: int) -> None:
    """In a worker started by launch_torchrun: training stopped cleanly on `signum`."""
    _write_report({"stopped": True, "signal": signum, "error": message})


def report_finished(out_dir: Path) -> None:
    """In rank 0 of a worker started by launch_torchrun: the run's results are written (a signal that
    comes now changes nothing: the launcher exits 0)."""
    folder = os.environ.get(REPORT_DIR)
    if folder:
        from neorec.utils.files import FileWriteError, write_text

        try:  # atomic: the launcher never reads half a note
            write_text(Path(folder) / _FINISHED, json.dumps({"out_dir": str(out_dir)}), "launcher note")
        except FileWriteError:
            pass  # the launcher then reports the signal as it would without the note
