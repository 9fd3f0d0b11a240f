"""Processes for tests, forked from one server that has imported torch and neorec once.

A test that needs a fresh process (a rank of a gloo group, a `neorec` command with its own exit
code, output and working folder) would otherwise pay Python's and torch's imports again each time:
seconds per process on a small machine. The server (multiprocessing's forkserver, one per pytest
process) imports them once and holds no threads and no test's state; each process forked from it
is a fresh copy, as a spawned one would be.

`run_neorec(argv, ...)` is `subprocess.run([python, "-m", "neorec", *argv], capture_output=True,
text=True)` on such a process: the same `neorec.cli.main`, exit code, stdout and stderr (an uncaught
exception prints its traceback and exits 1, as the interpreter does). `run_python(args, ...)` is the
same for `python *args`, where args start with "-m MODULE", "-c CODE" or a script's path (torchrun
as `-m torch.distributed.run`, an example script). `start_neorec` / `start_python` start the command
in the background and return a Started, the part of subprocess.Popen the tests use (pid, poll, wait,
send_signal, kill, communicate): the process is a real one of its own, with its own PID, signal
handlers and exit code, which a test can signal, stop or kill; only its parent is the server, not
the test. What such a command starts itself (torchrun's workers) are real subprocesses.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# what the processes import: loaded once by the server
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # imported by torch.optim's first optimizer: seconds in every rank otherwise
    "matplotlib.pyplot",  # curves.png and the plan's chart (neorec asks for the Agg backend before a figure)
    "torch.utils.tensorboard",
    "numpy",
    "neorec.cli",
    "neorec.train.trainer",
    "neorec.distributed.sharded",
    "neorec.model.dlrm",
    "dist_helpers",
    "forked",
]


def context():
    """The multiprocessing context whose processes fork from the preloaded server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _main(
    args: list[str], cwd: str | None, env: dict[str, str] | None, out: str, err: str | None, preexec=None
) -> None:
    """In the forked process: `python *args` with stdout and stderr in the files `out`, `err` (None:
    both in `out`)."""
    import atexit
    import builtins
    import runpy
    import traceback

    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # read by torch's import, in the server: as a fresh one
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for path, fd in ((out, 1), (err or out, 2)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    code = 1
    try:
        if preexec is not None:
            preexec()
        if args[0] == "-m":  # as `python -m MODULE`: sys.argv[0] becomes the module's file
            sys.argv = [str(Path(sys.executable)), *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path.insert(0, "")
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        else:  # a script: its folder first on sys.path
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # sys.exit(main()), argparse's errors and --help
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


class Started:
    """`python *args` running in a forked process (start_python): the part of subprocess.Popen that
    the tests use. stdout and stderr go to files, so that a chatty process never blocks on a pipe."""

    def __init__(self, args: list[str], cwd=None, env=None, merge: bool = False, preexec=None) -> None:
        self.args = [sys.executable, *args]
        self._folder = tempfile.TemporaryDirectory(prefix="neorec-run-")
        self._out = os.path.join(self._folder.name, "stdout")
        self._err = None if merge else os.path.join(self._folder.name, "stderr")
        for path in (self._out, self._err):
            if path is not None:
                Path(path).touch()
        env = None if env is None else {k: str(v) for k, v in env.items()}
        cwd = None if cwd is None else str(cwd)
        self._process = context().Process(
            target=_main, args=(list(args), cwd, env, self._out, self._err, preexec)
        )
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout, *self.output())
        self.returncode = self._process.exitcode
        return self.returncode

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far; with merge, stderr is in stdout and this stderr is ""."""
        read = lambda path: Path(path).read_text(errors="replace") if path else ""  # noqa: E731
        return read(self._out), read(self._err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended; on a timeout it is killed."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return self.output()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_python(
    args: list[str], cwd=None, env: dict[str, str] | None = None, merge: bool = False, preexec=None
) -> Started:
    """`python *args` in the background (args: "-m MODULE ...", "-c CODE ...", or "SCRIPT ...").
    merge: stderr into stdout, as stderr=subprocess.STDOUT. preexec: a picklable callable that the
    process runs first (as Popen's preexec_fn)."""
    return Started([str(a) for a in args], cwd, env, merge, preexec)


def start_neorec(
    argv: list[str], cwd=None, env: dict[str, str] | None = None, merge: bool = False
) -> Started:
    """`python -m neorec *argv` in the background."""
    return start_python(["-m", "neorec", *argv], cwd, env, merge)


def run_python(
    args: list[str], cwd=None, env: dict[str, str] | None = None, timeout: float | None = 300, preexec=None
) -> subprocess.CompletedProcess:
    """`python *args` in a forked process: a CompletedProcess with text stdout and stderr, not checked;
    subprocess.TimeoutExpired after `timeout` seconds (the process is killed)."""
    started = start_python(args, cwd, env, preexec=preexec)
    stdout, stderr = started.communicate(timeout)
    return subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)


def run_neorec(
    argv: list[str],
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = 300,
) -> subprocess.CompletedProcess:
    """`python -m neorec *argv` in a forked process: a CompletedProcess with text stdout and stderr,
    not checked; subprocess.TimeoutExpired after `timeout` seconds (the process is killed)."""
    return run_python(["-m", "neorec", *argv], cwd, env, timeout)
