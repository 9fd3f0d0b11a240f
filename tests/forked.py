"""Processes for tests, forked from one server that has imported torch and neorec once.

A test that needs a fresh process (a rank of a gloo group, a `neorec` command with its own exit
code, output and working folder) would otherwise pay Python's and torch's imports again each time:
seconds per process on a small machine. The server (multiprocessing's forkserver, one per pytest
process) imports them once and holds no threads and no test's state; each process forked from it
is a fresh copy, as a spawned one would be.

`run_neorec(argv, ...)` is `subprocess.run([python, "-m", "neorec", *argv], capture_output=True,
text=True)` on such a process: the same `neorec.cli.main`, exit code, stdout and stderr (an uncaught
exception prints its traceback and exits 1, as the interpreter does). Tests that signal a command
or look at its process use a real subprocess instead.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# what the processes import: loaded once by the server
PRELOAD = [
    "torch",
    "torch.distributed",
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


def _main(argv: list[str], cwd: str | None, env: dict[str, str] | None, out: str, err: str) -> None:
    """In the forked process: `python -m neorec *argv` with stdout and stderr in the files `out`, `err`."""
    import atexit
    import traceback

    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    sys.argv = [str(Path(sys.executable)), *argv]
    code = 1
    try:
        from neorec.cli import main

        code = main(list(argv))
    except SystemExit as e:  # argparse's errors and --help
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


def run_neorec(
    argv: list[str],
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = 300,
) -> subprocess.CompletedProcess:
    """`python -m neorec *argv` in a forked process: a CompletedProcess with text stdout and stderr,
    not checked; subprocess.TimeoutExpired after `timeout` seconds (the process is killed)."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory(prefix="neorec-run-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            Path(path).touch()
        env = None if env is None else {k: str(v) for k, v in env.items()}
        process = context().Process(target=_main, args=(argv, None if cwd is None else str(cwd), env, out, err))
        process.start()
        process.join(timeout)
        command = [sys.executable, "-m", "neorec", *argv]
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout, Path(out).read_text(), Path(err).read_text())
        code = process.exitcode
        stdout = Path(out).read_text(errors="replace")
        stderr = Path(err).read_text(errors="replace")
    return subprocess.CompletedProcess(command, code, stdout, stderr)
