"""A worker of `neorec train --nproc N`, or of torchrun, ends with its launcher, whatever ends the launcher.
(It lives outside neorec/distributed, whose package imports torch, so that importing it costs nothing.)

torchrun's agent runs inside the launcher (neorec/distributed/launch.py) and starts each worker with
Popen in a process group of its own (setsid). A launcher killed by SIGKILL can pass nothing on, and its workers would
train on, writing checkpoints and model.pt into a folder that a restarted run may be using. So each
worker, first thing, asks the kernel to send it SIGKILL when its parent goes: prctl(PR_SET_PDEATHSIG)
through ctypes, on Linux. The kernel sends it when the *thread* that started the worker ends; the agent
starts workers with Popen on the thread that called torchrun's `run()` (launch_torchrun's caller: the
launcher's main thread), and `run()` returns only after every worker has ended, so the signal comes
exactly when the launcher process is gone. The worker then checks that its parent is still the
launcher (NEOREC_LAUNCHER_PID), so that a launcher that died before the signal was armed is not
missed. Where prctl is missing (macOS), a daemon thread polls the parent's PID every POLL_SECONDS.

SIGKILL rather than SIGTERM: a clean stop saves a checkpoint at the next step boundary, which may take
longer than a restart takes to begin, with nobody left to report it; checkpoints are published
atomically, so a kill leaves the newest complete one to resume from. The workers hold the run
folder's lock themselves (neorec/train/run_lock.py): a run started before they are gone is refused.

Under torchrun itself (`torchrun ... -m neorec train`: TORCHELASTIC_RUN_ID set, no launcher of ours) the
parent is torchrun's agent, and the worker ends with it by SIGTERM instead: torchrun's user chose
torchrun's way of stopping, which forwards SIGTERM to the workers, so an agent killed by SIGKILL (or lost
otherwise) ends them as a SIGTERM to the agent would: every rank stops after the same step with a
checkpoint (neorec/train/signals.py; the ranks agree through their own process group, not the agent's
store), rank 0 prints the command that resumes, and they exit 143; one that has not started training
has no handler yet and ends at once. Until they are gone they hold the folder's lock. That SIGTERM comes
from the watch thread, once, not from the kernel: the kernel sends the death signal again each time
the orphan passes to another thread of the dying agent (which has several), and a second SIGTERM ends
a stopping worker at once (signals.py), before its checkpoint is written.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "NEOREC_LAUNCHER_PID"
_REPORT_ENV = "NEOREC_REPORT_DIR"  # launch.REPORT_DIR: launch_torchrun's workers watch LAUNCHER_ENV alone
POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launcher_env() -> dict[str, str]:
    """In the launcher: what its workers need in their environment to end with it."""
    return {LAUNCHER_ENV: str(os.getpid())}


def die_with_launcher() -> str | None:
    """In a worker started by launch_torchrun: be killed by SIGKILL as soon as the launcher is gone; in a
    worker of torchrun's agent, get one SIGTERM within POLL_SECONDS of the agent's end. Returns how the
    worker watches ("death signal" or "watch thread"); None outside such a worker."""
    value = os.environ.pop(LAUNCHER_ENV, None)  # not for the processes this one starts
    if value:
        launcher, signum = int(value), signal.SIGKILL
        how = "death signal" if _death_signal(signum) else _watch(launcher, signum)
    elif os.environ.get("TORCHELASTIC_RUN_ID") and "RANK" in os.environ and _REPORT_ENV not in os.environ:
        launcher, signum = os.getppid(), signal.SIGTERM  # a worker of torchrun's own agent: its parent
        how = _watch(launcher, signum)  # one SIGTERM (see above)
    else:
        return None
    if os.getppid() != launcher:  # it died before the signal was armed: this one is an orphan already
        os.kill(os.getpid(), signum)
    return how


def _death_signal(signum: int) -> bool:
    """Linux: the kernel sends `signum` to this process when its parent thread ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signum), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0)) == 0  # fmt: skip


def _watch(launcher: int, signum: int) -> str:
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(POLL_SECONDS)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="neorec-launcher-watch", daemon=True).start()
    return "watch thread"
