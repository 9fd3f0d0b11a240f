"""Runs that last for days: saves killed at any moment, a full disk, `--resume PATH`, and
`checkpoint inspect --verify` on bad files. Kills are real (SIGKILL of a forked process at each
filesystem operation of a save); file-size limits are real (RLIMIT_FSIZE in a process of its own)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import textwrap

import pytest
import torch
from forked import run_python
from test_checkpoint import TINY, trained_engine

from neorec.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from neorec.checkpoint.inspect import inspect_checkpoint
from neorec.cli import main
from neorec.config.load import load_config
from neorec.train.trainer import Trainer

# filesystem operations a save makes (audit events): a kill lands before each of them in turn
FS_EVENTS = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.scandir")


def _save_killed_at(k: int, root, emb, model, opts, steps, keep: int) -> bool:
    """Save `steps` in a forked child that SIGKILLs itself at its k-th filesystem operation under
    `root`; True when the child was killed (False: it finished)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        count = [0]

        def hook(event: str, args: tuple) -> None:
            if event in FS_EVENTS and str(args[0] if args else "").startswith(str(root)):
                count[0] += 1
                if count[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)

        try:
            sys.addaudithook(hook)
            for step in steps:
                save_checkpoint(root, step, emb, model, opts, keep=keep)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == -signal.SIGKILL


@pytest.fixture
def one_thread():
    """torch on one thread for the test, the process's thread count back after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_keep_holds_when_saves_are_killed_at_any_moment(tmp_path, one_thread):
    """keep=2, saves of steps 1-4, killed at each filesystem operation in turn. After any kill:
    every visible step-* folder is a complete checkpoint that verifies, the newest published one
    is what --resume finds, and at most one beyond `keep` is visible (killed between publishing a
    checkpoint and pruning). The next save then leaves exactly the newest two and nothing else."""
    emb, model, opts = trained_engine()
    kills, k = 0, 0
    while True:
        k += 1
        root = tmp_path / f"kill-{k}"
        root.mkdir()
        if not _save_killed_at(k, root, emb, model, opts, (1, 2, 3, 4), keep=2):
            break
        kills += 1
        visible = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        listed = [p.name for p in list_checkpoints(root)]
        assert visible == listed, f"kill {k}: {visible}"
        assert len(listed) <= 3, f"kill {k}: {listed}"
        for path in list_checkpoints(root):
            assert inspect_checkpoint(path, verify=True)[1] == [], f"kill {k}: {path}"
        newest = int(listed[-1][5:]) if listed else 0
        save_checkpoint(root, newest + 1, emb, model, opts, keep=2)  # the resumed run's next save
        want = [f"step-{s:08d}" for s in range(max(1, newest), newest + 2)]
        assert sorted(p.name for p in root.iterdir()) == want, f"kill {k}"
    assert kills > 30  # every stage of four saves was hit
    assert [p.name for p in root.iterdir()] and [p.name for p in list_checkpoints(root)] == [
        "step-00000003",
        "step-00000004",
    ]


def test_resuming_an_older_checkpoint_replaces_the_newer_ones_at_its_first_save(tmp_path):
    emb, model, opts = trained_engine()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, emb, model, opts, keep=3)
    save_checkpoint(tmp_path, 3, emb, model, opts, keep=3)  # resumed from step 2
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    save_checkpoint(tmp_path, 3, emb, model, opts, keep=3)  # the same step again: replaced in place
    assert [p.name for p in tmp_path.iterdir() if p.name != "step-00000002"] == ["step-00000003"]


def test_full_disk_keeps_the_previous_checkpoint_and_names_the_file(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG) while the second
    checkpoint is written: a clear error naming the file; the first checkpoint loads."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import trained_engine
        from neorec.checkpoint import save_checkpoint
        from neorec.errors import NeorecError
        emb, model, opts = trained_engine()
        first = save_checkpoint({str(tmp_path)!r}, 3, emb, model, opts)
        size = (first / "rank-00000.bin").stat().st_size
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.RLIM_INFINITY))
        try:
            save_checkpoint({str(tmp_path)!r}, 4, emb, model, opts)
        except NeorecError as e:
            print("neorec: error:", e)
            sys.exit(2)
    """)
    p = run_python(["-c", script], timeout=120)  # a process of its own (tests/forked.py)
    assert p.returncode == 2, p.stderr
    assert "cannot write checkpoint file" in p.stdout and "step-00000004.tmp/rank-00000.bin" in p.stdout
    assert "File too large" in p.stdout and "Traceback" not in p.stderr
    assert [x.name for x in list_checkpoints(tmp_path)] == ["step-00000003"]
    assert not (tmp_path / ".step-00000004.tmp" / "rank-00000.bin.tmp").exists()  # the space is given back
    load_checkpoint(latest_checkpoint(tmp_path), *trained_engine(1))


def test_inspect_verify_fails_on_a_bad_file(tmp_path, capsys):
    emb, model, opts = trained_engine()
    path = save_checkpoint(tmp_path, 3, emb, model, opts)
    assert main(["checkpoint", "inspect", "--verify", str(path)]) == 0
    shard = path / "rank-00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    assert main(["checkpoint", "inspect", "--verify", str(path)]) == 2
    assert "rank-00000.bin: checksum mismatch" in capsys.readouterr().err
    shard.write_bytes(good[:-8])
    assert main(["checkpoint", "inspect", "--verify", str(path)]) == 2
    assert "truncated" in capsys.readouterr().err
    shard.unlink()
    (path / "dense.pt").write_bytes(b"")
    assert main(["checkpoint", "inspect", "--verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 bad file(s)" in err and "rank-00000.bin: cannot read" in err and "dense.pt: has 0 bytes" in err
    assert main(["checkpoint", "inspect", str(path)]) == 0  # without --verify: the manifest alone


def test_resume_from_a_given_checkpoint_folder(tmp_path, capsys):
    cfg = load_config("default", TINY)
    whole = Trainer(cfg, tmp_path / "run").fit()  # saves 14 and 20 (keep 2)
    root = tmp_path / "run" / "checkpoints"
    resumed = Trainer(cfg, tmp_path / "again", resume=root / "step-00000014").fit()
    assert resumed.losses == whole.losses[14:]
    with pytest.raises(CheckpointError, match=r"--resume .*checkpoints: is not a checkpoint \(no manifest\.json\)"):
        Trainer(cfg, tmp_path / "x", resume=root).fit()
    args = ["train", "--output-dir", str(tmp_path / "y"), "--resume", str(tmp_path / "nowhere")]
    assert main([*args, *[x for kv in TINY for x in ("--set", kv)]]) == 2
    assert "nowhere: does not exist" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()  # refused before anything runs


def _file_size_limit(limit: int) -> None:
    """In the command's process, before it starts (as a preexec_fn before exec)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def test_neorec_train_stops_with_one_line_naming_the_file_it_cannot_write(tmp_path):
    sets = [x for kv in [*TINY, "checkpoint.every_steps=5"] for x in ("--set", kv)]
    args = ["-m", "neorec", "train", "--output-dir", str(tmp_path / "run"), *sets]
    # `python -m neorec train ...` in a process of its own (tests/forked.py) under a file-size limit
    p = run_python(args, timeout=120, preexec=functools.partial(_file_size_limit, 64 << 10))
    assert p.returncode == 1, p.stderr  # a failure of the machine (a file-size limit), not of the input
    last = p.stderr.splitlines()[-1]  # after the run's log lines, the error is the last line
    assert last.startswith("neorec: error: cannot write checkpoint file ") and "Traceback" not in p.stderr
    assert "step-00000005.tmp/rank-00000.bin: File too large" in p.stderr
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []
