"""One run per folder (neorec/train/run_lock.py): a second `neorec train`, `--resume` or `--overwrite`
on a folder that a run holds is refused at once with one error naming the holder's PID and host, and
the first run ends intact; a run killed by SIGKILL leaves no lock behind; readers do not disturb it.
A run is held still with SIGSTOP while the second one tries, so that nothing depends on timing."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest
import torch
from forked import Started, run_neorec, start_neorec, start_python

from neorec.checkpoint import list_checkpoints
from neorec.cli import main
from neorec.config.load import load_config
from neorec.train.run_lock import LOCK_FILE, RunFolderInUse, hold_run_folders, read_holders

RUN = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=64",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=1",
    "train.threads=1", "train.epochs=100",
]  # fmt: skip


def _args(out: Path, sets: list[str], *more: str) -> list[str]:
    return ["train", "--output-dir", str(out), *[x for kv in [*RUN, *sets] for x in ("--set", kv)], *more]


def _start(out: Path, sets: list[str], *more: str) -> Started:
    """`neorec train` in the background, in a process of its own forked from one that has imported
    neorec (tests/forked.py); its console output goes to a file (a pipe could fill up)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return start_neorec(_args(out, sets, *more), env=env, merge=True)


def _output(run: Started) -> str:
    return run.output()[0]


def _finish(run: Started) -> str:
    run.wait(timeout=120)
    out = _output(run)
    assert run.returncode == 0, out[-3000:]
    return out


def _wait_for_step(run: Started, out: Path, step: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while run.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and any(x.endswith("}") and json.loads(x)["step"] >= step
                                     for x in metrics.read_text().splitlines()[-1:]):  # fmt: skip
            return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} logged: {_output(run)[-3000:]}")


def _wait_for_lock(run: Started, out: Path) -> None:
    """Until `run` holds the folder (its PID heads the lock file)."""
    deadline = time.monotonic() + 120
    while run.poll() is None and time.monotonic() < deadline:
        if [h["pid"] for h in read_holders(out / LOCK_FILE)[:1]] == [run.pid]:
            return
        time.sleep(0.01)
    raise AssertionError(f"{out} was not locked by {run.pid}: {_output(run)[-3000:]}")


def _refused(argv: list[str], holder: int) -> str:
    """`neorec <argv>` in a process of its own: refused with one error line naming `holder` and this host."""
    p = run_neorec(argv, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.startswith("neorec: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert f"is in use by another run: pid {holder} on host {socket.gethostname()} since " in p.stderr
    return p.stderr


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # every line parses


def _train_steps(out: Path) -> list[int]:
    return [x["step"] for x in _metrics(out) if x["split"] == "train"]


def test_processes_racing_for_one_folder_one_run_wins(tmp_path):
    """8 processes try to lock one folder at the same moment: one run gets it; where the 8 are two
    runs' processes (a launcher's key), the processes of one run share it and the other is refused."""
    script = textwrap.dedent("""
        import os, sys, time
        from neorec.train.run_lock import RunFolderInUse, hold_run_folders
        print("ready", flush=True)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.001)
        try:
            lock = hold_run_folders([sys.argv[1]], job=sys.argv[3] or None)
        except RunFolderInUse as e:
            print("refused", e, flush=True)
        else:
            print("holds", flush=True)
            time.sleep(2.0)  # until the others have tried
    """)
    for jobs in (["", ""] * 4, ["a", "b"] * 4):
        go = tmp_path / f"go-{jobs[0]}"
        # processes of their own, forked from one that has imported neorec (tests/forked.py)
        procs = [start_python(["-c", script, str(tmp_path / f"run-{jobs[0]}"), str(go), job]) for job in jobs]
        deadline = time.monotonic() + 60
        while not all(p.output()[0] == "ready\n" for p in procs):  # all of them waiting for the start
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.output() for p in procs]
            time.sleep(0.01)
        go.touch()
        said = [(job, p.communicate(timeout=60)[0].removeprefix("ready\n")) for job, p in zip(jobs, procs, strict=True)]
        holders = [job for job, out in said if out.startswith("holds")]
        if jobs[0] == "":
            assert len(holders) == 1, said
        else:
            assert len(holders) == 4 and len(set(holders)) == 1, said
        assert all(out.startswith(("holds", "refused")) for _, out in said), said


def test_a_second_run_on_a_folder_is_refused_and_the_first_finishes_intact(tmp_path, capsys):
    out = tmp_path / "run"
    first = _start(out, ["train.max_steps=60", "model.bottom_mlp=[24, 16]"])
    _wait_for_step(first, out, 2)
    first.send_signal(signal.SIGSTOP)  # holds the folder while the others try
    try:
        config, lines = (out / "config.yaml").read_bytes(), len(_metrics(out))
        err = _refused(_args(out, ["train.max_steps=40", "model.bottom_mlp=[32, 16]"]), first.pid)
        assert (
            str(out) in err
            and "wait for that run to end (or stop it), or give this one another folder" in err
        )
        capsys.readouterr()
        for more in (["--overwrite"], ["--resume"]):  # in this process: the same answer
            assert main(_args(out, ["model.bottom_mlp=[32, 16]"], *more)) == 2
            err = capsys.readouterr().err
            assert err.startswith(
                f"neorec: error: {out} is in use by another run: pid {first.pid} on host "
            ), err
        assert (out / "config.yaml").read_bytes() == config and len(_metrics(out)) == lines  # untouched
        assert sorted(p.name for p in out.iterdir()) == sorted(["config.yaml", LOCK_FILE, "metrics.jsonl"])
    finally:
        first.send_signal(signal.SIGCONT)
    _finish(first)
    assert _train_steps(out) == list(range(1, 61))  # every line parses; each step once, in order
    assert load_config(str(out / "config.yaml")).model.bottom_mlp == [24, 16]
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["bottom.0.weight"].shape[0] == 24  # the model of the run config.yaml describes
    capsys.readouterr()
    assert main(_args(out, [])) == 2  # the folder is free again: the next run gets its usual answer
    assert "holds a run already" in capsys.readouterr().err


def test_a_killed_run_leaves_no_lock_and_two_resumes_at_once_are_one(tmp_path, capsys):
    """kill -9 mid-run: the lock goes with the process; of two resumes, the second is refused while the
    first trains, and the first ends with every step logged once."""
    out = tmp_path / "run"
    killed = _start(out, ["train.max_steps=100000", "checkpoint.every_steps=5"])
    deadline = time.monotonic() + 120
    while not list_checkpoints(out / "checkpoints") and time.monotonic() < deadline and killed.poll() is None:
        time.sleep(0.01)
    _wait_for_step(killed, out, 12)
    killed.kill()
    killed.wait(timeout=30)
    saved = int(list_checkpoints(out / "checkpoints")[-1].name[5:])
    sets = [f"train.max_steps={saved + 20}", "checkpoint.every_steps=5"]
    resumed = _start(out, sets, "--resume")
    _wait_for_lock(resumed, out)  # (a resume that found the killed run's lock would have been refused)
    resumed.send_signal(signal.SIGSTOP)
    try:
        capsys.readouterr()
        assert main(_args(out, sets, "--resume")) == 2  # (in this process: no second interpreter to start)
        assert f"is in use by another run: pid {resumed.pid} on host " in capsys.readouterr().err
    finally:
        resumed.send_signal(signal.SIGCONT)
    assert "resumed from" in _finish(resumed)
    assert _train_steps(out) == list(range(1, saved + 21))
    assert json.loads((out / "summary.json").read_text())["steps"] == saved + 20


def test_readers_of_a_held_folder_leave_its_lock_alone(tmp_path, capsys):
    """eval and export read a finished run whose folder another process holds; it stays held."""
    out = tmp_path / "run"
    assert main(_args(out, ["train.max_steps=4", "train.epochs=1"])) == 0
    with hold_run_folders([out]):
        assert main(["eval", str(out)]) == 0
        assert main(["export", str(out), "--out", str(tmp_path / "model.nrx"), "--no-eval"]) == 0
        with pytest.raises(RunFolderInUse, match=f"pid {os.getpid()} on host"):
            hold_run_folders([out])
        capsys.readouterr()
        assert main(_args(out, [], "--overwrite")) == 2
        assert f"is in use by another run: pid {os.getpid()}" in capsys.readouterr().err
    assert (tmp_path / "model.nrx").is_file()
    hold_run_folders([out]).release()  # free once its holder let go


@pytest.mark.parametrize(
    "key, sets",
    [
        ("checkpoint.dir", ["checkpoint.every_steps=5"]),
        ("snapshot.dir", ["snapshot.every_steps=5"]),
        # two runs with one cache folder created the same table files afresh: each would train on rows
        # the other wrote (or fault on a file cut short under its map)
        ("embedding.cache.directory", ["embedding.tier=ssd"]),
    ],
)
def test_a_folder_of_the_run_outside_its_run_folder_is_locked_too(tmp_path, key, sets):
    from neorec.train.run_folder import run_folders

    shared = tmp_path / "shared"
    cfg = load_config("default", [*RUN, f"{key}={shared}", *sets])
    assert run_folders(cfg, tmp_path / "a") == [tmp_path / "a", shared]
    with hold_run_folders(run_folders(cfg, tmp_path / "a")):
        with pytest.raises(RunFolderInUse, match=f"{shared} is in use by another run"):
            hold_run_folders(run_folders(cfg, tmp_path / "b"))
    inside = load_config("default", [*RUN, f"{key}={tmp_path / 'a' / 's'}", *sets])
    assert run_folders(inside, tmp_path / "a") == [tmp_path / "a"]
    assert run_folders(load_config("default", RUN), tmp_path / "a") == [tmp_path / "a"]


def test_a_new_run_never_publishes_into_another_runs_snapshots(tmp_path, capsys):
    """A second run given the same snapshot.dir (another --output-dir) replaced the first run's
    snapshot of the same step and moved LATEST, which serving follows, to its own early model."""
    shared = tmp_path / "snapshots"
    sets = [f"snapshot.dir={shared}", "snapshot.every_steps=2", "train.max_steps=4", "train.epochs=1"]
    assert main(_args(tmp_path / "a", sets)) == 0

    def published() -> dict:
        files = [p for p in shared.rglob("*") if p.is_file() and p.name != LOCK_FILE]
        return {p.relative_to(shared): p.read_bytes() for p in files}

    before = published()
    capsys.readouterr()
    assert main(_args(tmp_path / "b", sets)) == 2
    err = capsys.readouterr().err
    assert f"this run's folders hold a run already (snapshots in {shared}): pass --overwrite" in err, err
    assert "new folders (--output-dir, checkpoint.dir, snapshot.dir)" in err
    assert published() == before and not (tmp_path / "b" / "model.pt").exists()
    assert main(_args(tmp_path / "b", sets, "--overwrite")) == 0  # the user's choice: snapshots start anew


@pytest.mark.parametrize("key", ["checkpoint.dir", "snapshot.dir", "embedding.cache.directory"])
def test_a_file_where_a_folder_of_the_run_goes_is_named_by_its_key(tmp_path, capsys, key):
    file = tmp_path / "file"
    file.write_text("mine\n")
    sets = ["checkpoint.every_steps=1", "snapshot.every_steps=1", "embedding.tier=ssd"]
    sets += [f"embedding.cache.directory={tmp_path / 'cache'}", f"{key}={file}"]
    assert main(_args(tmp_path / "run", sets)) == 2
    assert capsys.readouterr().err == f"neorec: error: {key} {file}: is a file; give a folder\n"
    assert file.read_text() == "mine\n" and not (tmp_path / "run").exists()


def test_a_run_is_never_placed_where_another_run_keeps_its_files(tmp_path, capsys):
    """A run in another run's tensorboard or checkpoints folder was accepted, and the outer run's
    --overwrite then removed it; a checkpoint.dir in another run's checkpoints mixed their steps."""
    run = tmp_path / "run"
    assert main(_args(run, ["train.max_steps=2", "checkpoint.every_steps=1"])) == 0
    capsys.readouterr()
    for folder, sets, words in (
        (run / "tensorboard", [], f"--output-dir {run / 'tensorboard'}: is where the run in {run} keeps its"),
        (run / "checkpoints" / "x", [], "is inside where the run in"),
        (tmp_path / "b", [f"checkpoint.dir={run / 'checkpoints'}"], "checkpoint.dir"),
    ):
        assert main(_args(folder, ["train.max_steps=2", *sets])) == 2
        err = capsys.readouterr().err
        assert err.startswith("neorec: error: ") and words in err, err
        assert not folder.exists()
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000001", "step-00000002"]


def test_a_new_run_where_one_was_killed_before_its_first_checkpoint_drops_its_events(tmp_path):
    """A run killed before its first checkpoint leaves no run (check_run_folder): the next one there
    replaced its metrics.jsonl but kept its TensorBoard events beside its own, drawn as one run."""
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.1.killed").write_bytes(b"old")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    assert main(_args(run, ["train.max_steps=2", "train.epochs=1", "logging.tensorboard=true"])) == 0
    events = sorted(p.name for p in (run / "tensorboard").iterdir())
    assert events and "events.out.tfevents.1.killed" not in events
    saved = ["train.epochs=1", "checkpoint.every_steps=1"]
    assert main(_args(run, ["train.max_steps=3", *saved], "--overwrite")) == 0
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.2.mine").write_bytes(b"kept")  # a resume keeps them
    assert main(_args(run, ["train.max_steps=4", *saved], "--resume")) == 0
    assert (run / "tensorboard" / "events.out.tfevents.2.mine").is_file()


def test_a_lock_file_that_cannot_be_written_is_named(tmp_path, capsys, monkeypatch):
    """A full disk when the run writes who holds its folder: one line naming the lock file, exit 1."""
    write = os.write

    def full_for_locks(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_for_locks)
    assert main(_args(tmp_path / "run", [])) == 1
    lock = tmp_path / "run" / LOCK_FILE
    assert capsys.readouterr().err.startswith(f"neorec: error: {lock}: No space left on device (ENOSPC); ")


def test_reading_a_run_leaves_the_ssd_tables_of_a_run_training_there_alone(tmp_path):
    """`neorec eval` and `checkpoint export-dcp` of a run with ssd tables built its tables in
    embedding.cache.directory afresh, under the names a run training there maps (tested: that run's
    rows were replaced mid-training). They now build them in a folder of their own, removed after."""
    cache = tmp_path / "nvme"
    sets = ["embedding.tier=ssd", f"embedding.cache.directory={cache}", "train.max_steps=2", "train.epochs=1",
            "checkpoint.every_steps=2"]  # fmt: skip
    assert main(_args(tmp_path / "run", sets)) == 0
    theirs = {p.name: p.read_bytes() for p in cache.iterdir() if p.is_file() and p.name != LOCK_FILE}
    assert any(name.endswith(".rows.bin") for name in theirs)
    for name in theirs:  # what a run training there now holds
        (cache / name).write_bytes(b"another run's rows")
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert main(["checkpoint", "export-dcp", str(tmp_path / "run"), "--out", str(tmp_path / "dcp")]) == 0
    assert {p.name: p.read_bytes() for p in cache.iterdir() if p.name != LOCK_FILE} == {
        name: b"another run's rows" for name in theirs
    }


def test_reading_a_run_without_ssd_tables_leaves_the_cache_folder_alone(tmp_path):
    from neorec.errors import ConfigError
    from neorec.train.run_folder import private_cache_directory

    cfg = load_config("default", [*RUN, f"embedding.cache.directory={tmp_path / 'nvme'}"])  # tier memory
    with private_cache_directory(cfg) as same:
        assert same is cfg and not (tmp_path / "nvme").exists()
    (tmp_path / "file").write_text("")
    ssd = load_config("default", [*RUN, "embedding.tier=ssd", f"embedding.cache.directory={tmp_path}/file"])
    with pytest.raises(ConfigError, match="embedding.cache.directory .*file: cannot hold the ssd tables"):
        with private_cache_directory(ssd):
            pass
