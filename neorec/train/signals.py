"""Stopping a run cleanly on SIGTERM (preemption) and SIGINT (Ctrl-C).

The first signal only raises a flag. After every step the ranks start adding up their flags (an
all-reduce of two int64 on a communicator of its own, in the backend's thread: Comms.sum_flags) and
read the sum after the next step, so none waits for it; all of them see a request after the same
step, one step after it arrived, even when the signal reached one rank only or reached them at
different moments. The trainer then saves a checkpoint of that step on every rank
and raises TrainingStopped; `neorec train` prints one line with the command that resumes and exits
with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's code for a process
ended by that signal, so schedulers and scripts can tell a stop from a failure (exit code 1 or 2).

The handler puts the signals' default action back at once: a second SIGTERM or SIGINT ends the
process immediately, also while it waits inside a collective, where no Python handler would run.
torchrun detaches every worker from the terminal (setsid) and forwards a signal it receives once, so a
Ctrl-C in the terminal reaches each worker once.
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
from pathlib import Path

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):  # noqa: N818 - a requested stop, not an error
    """Training stopped at a step boundary on a signal; `checkpoint` holds that step."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def message(self, resume: str) -> str:
        return f"neorec: {self}; checkpoint saved in {self.checkpoint}. Resume with: {resume}"


class StopSignals:
    """While entered (in the main thread): SIGTERM and SIGINT ask for a stop at the next step
    boundary instead of ending the process. Elsewhere (another thread) it installs nothing. On
    leaving, the handlers it replaced are back; with keep_on_stop, leaving by TrainingStopped keeps
    its handlers instead (see __exit__)."""

    def __init__(self, comms=None, keep_on_stop: bool = False) -> None:
        self.comms = comms
        self.keep_on_stop = keep_on_stop
        self.received = 0  # the first signal's number, 0 before one arrives
        self._previous: dict[int, object] = {}
        self._pending = None  # the flags summed since the last call

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.keep_on_stop and exc_type is not None and issubclass(exc_type, TrainingStopped):
            # the process is on its way out: a signal now (torchrun's agent sends the other workers
            # SIGTERM when one exits) must not cut short the resume message; the handler stays
            return
        if exc_type is None and self._pending is not None:
            self._pending.wait()  # the last flags every rank sent: leave nothing in flight
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signum
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)  # a second signal ends the process at once

    def agreed(self) -> int:
        """Collective, after every step: the signal to stop on (0: go on). Over several ranks, the
        flags sent by the previous call decide (SIGTERM wins over SIGINT when ranks received
        different ones), so every rank answers the same after the same step."""
        if self.comms is None:
            return self.received
        total = self._pending.wait() if self._pending is not None else None
        flags = torch.tensor([self.received == signal.SIGTERM, self.received == signal.SIGINT], dtype=torch.int64)
        self._pending = self.comms.sum_flags(flags)
        if total is None or not total.any():
            return 0
        self._pending.wait()  # every rank started it: nothing is left in flight
        return signal.SIGTERM if total[0] else signal.SIGINT


def resume_command(argv: list[str]) -> str:
    """The command that continues the run `neorec <argv>` from its newest checkpoint: the same
    arguments with --resume (any --resume PATH replaced, --overwrite dropped). The launcher of `neorec train --nproc N`
    passes the user's own arguments to its workers in NEOREC_ARGV."""
    if os.environ.get("NEOREC_ARGV"):
        argv = shlex.split(os.environ["NEOREC_ARGV"])
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--resume":
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("-") else 1
            continue
        if not a.startswith("--resume=") and a != "--overwrite":  # resuming keeps the run folder
            out.append(a)
        i += 1
    prefix = "neorec"
    if "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get("NEOREC_ARGV"):
        prefix = "torchrun <the same options> -m neorec"  # torchrun's own arguments are not visible here
    return f"{prefix} {shlex.join([*out, '--resume'])}"
