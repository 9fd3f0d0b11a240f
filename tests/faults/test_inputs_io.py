"""Files that cannot be read or written, through the real command line: a folder the user may not write
(or on a read-only filesystem) and a TSV the user may not read are bad input (exit 2); a full disk, a
file-size limit (ulimit -f), an I/O error or too little memory are a failure of the machine (exit 1).
Either is one `neorec: error:` line naming the file or what to lower, never a traceback.

Limits that only a process can have (RLIMIT_FSIZE, a small filesystem of its own, no right to bypass
file permissions as root) run the commands in a child process; the rest run in this one."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neorec.cli import main
from tests.tiny_cli import TINY, criteo_lines, sets

REPO = Path(__file__).parents[2]
# runs each [argv, file-size limit or null] of argv[1] (JSON) through neorec.cli.main in this process;
# prints [[exit code, stderr], ...]
RUNNER = """
import contextlib, io, json, resource, sys, traceback
from neorec.cli import main
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
results = []
for argv, fsize in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if fsize is None else fsize, hard))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except BaseException:
            traceback.print_exc()
            code = -1
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def one_line(code: int, err: str, want: int, *words: str) -> None:
    """Exit `want`, one error line, no traceback; each of `words` ("a|b": either) in the message. The
    log lines of steps trained before a failure at the end of a run are no part of it."""
    assert code == want and "Traceback" not in err, err
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("neorec: step "))
    lines = [line for line in err.splitlines() if line.startswith("neorec: error:")]
    assert len(lines) == 1 and err.startswith("neorec: error: "), err
    for w in words:
        assert any(alternative in err for alternative in w.split("|")), err


def criteo_tsv(path: Path, lines: int) -> Path:
    path.write_text("".join(criteo_lines(lines)))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A finished tiny run (to export) and a Criteo TSV whose shards are a few hundred KiB."""
    root = tmp_path_factory.mktemp("inputs")
    os.chmod(root, 0o755)
    assert main(["train", *sets(TINY), "--output-dir", str(root / "run")]) == 0
    return {"run": root / "run", "tsv": criteo_tsv(root / "day.tsv", 3000)}


def commands(inputs: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """Training, preprocessing, planning and exporting, each writing under `out`."""
    return {
        "train": ["train", *sets(TINY), "--output-dir", str(out / "run")],
        "preprocess": [
            "data",
            "preprocess",
            str(inputs["tsv"]),
            "--out",
            str(out / "pre"),
            "--no-progress",
            "--table-rows",
            "1000",
        ],  # fmt: skip
        "plan": [
            "plan",
            *sets(TINY),
            "--output-dir",
            str(out / "plan"),
            "--batches",
            "0",
            "--time-budget",
            "1",
        ],
        "export": ["export", str(inputs["run"]), "--out", str(out / "model.nrx"), "--no-eval"],
    }


def _drop_file_permission_bypass() -> None:
    """In the child, before exec: as root, give up CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (from the
    bounding set, so the exec'd process never has them): file permissions then apply to it as to a user."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def child(inputs, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every case below run in one child process (one start of Python and torch), without root's right
    to bypass file permissions, and where it may mount, with a 32 KiB tmpfs on full/ and a read-only one
    on ro/ (in a mount namespace of its own: nothing stays mounted). Results by case name."""
    root = tmp_path_factory.mktemp("child")
    os.chmod(root, 0o755)
    for name in ("locked", "full", "ro", "fsize"):
        (root / name).mkdir()
    secret = shutil.copy(inputs["tsv"], root / "secret.tsv")
    os.chmod(secret, 0o000)
    cases: dict[str, tuple[list[str], int | None]] = {}
    for folder in ("locked", "fsize") + (("full", "ro") if _can_mount() else ()):
        for name, argv in commands(inputs, root / folder).items():
            cases[f"{folder}_{name}"] = (argv, 32 << 10 if folder == "fsize" else None)
    cases["read_tsv"] = (
        ["data", "preprocess", str(secret), "--out", str(root / "pre"), "--no-progress"],
        None,
    )
    criteo = sets(["data.source=criteo_tsv", f"data.criteo.train_paths=[{secret}]", "train.progress=false"])
    cases["train_tsv"] = (["train", *criteo, "--output-dir", str(root / "run")], None)
    os.chmod(root / "locked", 0o555)
    script = 'mount -t tmpfs -o size=32k tmpfs "$1" && mount -t tmpfs -o ro,size=4k tmpfs "$2" && shift 2 && exec "$@"'
    prefix = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(root / "full"),
        str(root / "ro"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        *(prefix if "full_train" in cases else []),
        sys.executable,
        "-c",
        RUNNER,
        json.dumps(list(cases.values())),
    ]
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=_drop_file_permission_bypass
        )
    finally:
        os.chmod(root / "locked", 0o755)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(zip(cases, (tuple(r) for r in json.loads(p.stdout.strip().splitlines()[-1])), strict=True))


def result(child: dict[str, tuple[int, str]], case: str) -> tuple[int, str]:
    if case not in child:
        pytest.skip("needs unshare and the right to mount a tmpfs (root in a mount namespace)")
    return child[case]


# ---- bad input: exit 2 ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "preprocess", "plan", "export"])
def test_an_output_folder_without_write_permission(child, command):
    one_line(*result(child, f"locked_{command}"), 2, "locked", "not writable|Permission denied")


@pytest.mark.parametrize("command", ["read_tsv", "train_tsv"])
def test_a_tsv_without_read_permission(child, command):
    one_line(*result(child, command), 2, "secret.tsv")


@pytest.mark.parametrize("command", ["train", "preprocess", "plan", "export"])
def test_an_output_folder_on_a_read_only_filesystem(child, command):
    one_line(*result(child, f"ro_{command}"), 2, "read-only file system|Read-only file system")


# ---- a failing machine: exit 1 ------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "preprocess", "plan", "export"])
def test_disk_full_while_writing(child, command):
    one_line(
        *result(child, f"full_{command}"), 1, "No space left on device|is the disk full"
    )  # torch.save: no errno


@pytest.mark.parametrize("command", ["train", "preprocess", "plan", "export"])
def test_a_file_size_limit_while_writing(child, command):
    one_line(*result(child, f"fsize_{command}"), 1, "File too large|is the disk full")


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "No space left"), (errno.EIO, "Input/output error")])
def test_a_disk_that_fails_to_sync(tmp_path, capsys, monkeypatch, code, words):
    """fsync reports a full disk (delayed allocation, NFS) or an I/O error: the write fails late."""

    def failing_fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    assert (
        main(
            [
                "plan",
                *sets(TINY),
                "--output-dir",
                str(tmp_path / "plan"),
                "--batches",
                "0",
                "--time-budget",
                "1",
            ]
        )
        == 1
    )
    one_line(1, capsys.readouterr().err, 1, words)


@pytest.mark.parametrize("engine", ["fused", "reference"])
def test_out_of_memory_names_what_to_lower(tmp_path, capsys, monkeypatch, engine):
    """A table of 2^34 rows (1 TiB) past the memory estimate (switched off here): the allocator's
    failure is one line, exit 1, naming what to lower. The allocation fails at once, touching nothing."""
    monkeypatch.setattr("neorec.config.limits.machine_memory_bytes", lambda: 0)
    huge = [*TINY, "data.synthetic.rows=[50, 300, 7, 17179869184]", "data.synthetic.max_rows=null",
            f"embedding.engine={engine}"]  # fmt: skip
    assert main(["train", *sets(huge), "--output-dir", str(tmp_path / "run")]) == 1
    one_line(1, capsys.readouterr().err, 1, "out of memory", "lower data.batch_size, embedding.dim")
