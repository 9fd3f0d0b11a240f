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
prints the command that resumes; the launcher exits with 128 + the signal's number, as they do.

A launcher that ends without a word (SIGKILL, a crash) takes its workers with it: each asks the kernel
for SIGKILL when its parent goes (neorec/utils/parent_watch.py). The run folder's lock is held by
the launcher and by every worker (neorec/train/run_lock.py: `env` passes the run's key to them), so
the folder stays locked until the last of them is gone.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPORT_DIR = "NEOREC_REPORT_DIR"
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def launch_torchrun(nproc: int, argv: list[str], user_argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run `neorec <argv>` on `nproc` processes of this machine under torchrun's agent (as
    `torchrun --standalone --nproc-per-node N -m neorec ...`). `user_argv`: the command as the
    user typed it (with --nproc), for the resume line; `env`: more for the workers' environment.
    Returns the exit code. Call it on a thread that lives until it returns (the workers' death
    signal follows the thread that started them: parent_watch.py)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from neorec.utils.parent_watch import launcher_env

    cmd = ["--standalone", f"--nproc-per-node={nproc}", "-m", "neorec", *argv]
    logging.getLogger("neorec").info("launching: torchrun " + shlex.join(cmd))
    # the agent's own log lines (closing signals, "failed (exitcode: ...)") would bury the report
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # the agent installs handlers for these signals (to forward them to the workers) and leaves them
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    # and sets variables for the workers in this process's environment (OMP_NUM_THREADS=1 among them)
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="neorec-launch-") as reports:
        workers_env = {REPORT_DIR: reports, "NEOREC_ARGV": shlex.join(user_argv), **launcher_env(), **(env or {})}
        os.environ.update(workers_env)  # the agent starts the workers with a copy of this environment
        try:
            run(parse_args(cmd))
            return 0
        except SignalException as e:
            sig = int(e.sigval)
            if not any(r.get("stopped") for r in _reports(reports).values()):
                print(f"neorec: stopped by {signal.Signals(sig).name} before a checkpoint of the current "
                      "step was written; `neorec train ... --resume` continues from the newest one",
                      file=sys.stderr)  # fmt: skip
            return 128 + sig
        except ChildFailedError as e:
            return _report_failures(e.failures, _reports(reports))
        finally:
            if dict(os.environ) != environment:
                os.environ.clear()
                os.environ.update(environment)
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


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
