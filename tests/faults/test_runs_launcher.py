"""`neorec train --nproc 2` and its launcher: workers die with a launcher killed by SIGKILL (within
5 s; neorec/utils/parent_watch.py), they hold the run folder's lock themselves, so a run or resume
started before they are gone is refused; model.pt of a run whose tables are all replicated (dp) holds
the embedding optimizer's true step (the workers' Trainer, on spawned ranks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import fit_rank, spawn

from neorec.cli import main
from neorec.train.run_lock import LOCK_FILE, RunFolderInUse, hold_run_folders, read_holders

pytestmark = pytest.mark.distributed

RUN = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=64",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=1",
    "train.threads=1", "embedding.optimizer.name=adam", "embedding.optimizer.lr=0.01",
]  # fmt: skip
ALL_DP = "distributed.sharding={C1: {kind: dp}, C2: {kind: dp}, C3: {kind: dp}, C4: {kind: dp}}"


def _running(pid: int) -> bool:
    """Some thread of the process has not exited. The group leader turns zombie as soon as it exits,
    while its other threads may still be exiting and holding the process's descriptors (and locks):
    only when every thread is gone is the process."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def _wait_gone(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    while any(_running(p) for p in pids) and time.monotonic() - start < seconds:
        time.sleep(0.01)
    return time.monotonic() - start


# ---- the watch itself -------------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import sys, time
    from neorec.utils import parent_watch
    if sys.argv[1] == "watch thread":
        parent_watch._death_signal = lambda signum: False  # as where prctl is missing
    print(parent_watch.die_with_launcher(), flush=True)
    time.sleep(60)
""")
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {**os.environ, "NEOREC_LAUNCHER_PID": str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # as torchrun starts its workers
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["death signal", "watch thread"])
def test_a_worker_dies_with_its_launcher(how):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER, how], stdout=subprocess.PIPE, text=True
    )
    try:
        pid, said = launcher.stdout.readline().split(" ", 1)
        assert said.strip() == how and _running(int(pid))
        launcher.kill()
        assert _wait_gone([int(pid)], 10) < 5  # the death signal: at once; the thread: within POLL_SECONDS
    finally:
        launcher.kill()
        launcher.wait(timeout=30)


def test_a_worker_whose_launcher_is_gone_already_ends_at_once():
    env = {**os.environ, "NEOREC_LAUNCHER_PID": "1"}  # not its parent: its launcher died before it armed
    p = subprocess.run(
        [sys.executable, "-c", WORKER, "death signal"], env=env, capture_output=True, timeout=60
    )
    assert p.returncode == -signal.SIGKILL and p.stdout == b""


# ---- a real launcher ----------------------------------------------------------------------------------
def _launch(out: Path, env: dict | None = None) -> subprocess.Popen:
    """`neorec train --nproc 2` for longer than the test lasts; output to a file (a pipe could fill)."""
    cmd = [sys.executable, "-m", "neorec", "train", "--nproc", "2", "--output-dir", str(out)]
    cmd += [x for kv in [*RUN, "train.max_steps=100000", "train.epochs=1000", "checkpoint.every_steps=2"]
            for x in ("--set", kv)]  # fmt: skip
    log = open(f"{out}.log", "w+")  # noqa: SIM115 - closed with the test's tmp_path
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def _workers_at_step(launcher: subprocess.Popen, out: Path, step: int) -> list[int]:
    """The workers' PIDs (from the lock file, which all three processes hold) once `step` is logged."""
    deadline = time.monotonic() + 180
    while launcher.poll() is None and time.monotonic() < deadline:
        holders = read_holders(out / LOCK_FILE)
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").is_file() else []
        if len(holders) == 3 and lines and lines[-1].endswith("}") and json.loads(lines[-1])["step"] >= step:
            assert holders[0]["pid"] == launcher.pid and sorted(h["rank"] for h in holders[1:]) == ["0", "1"]
            return [h["pid"] for h in holders[1:]]
        time.sleep(0.01)
    raise AssertionError(f"no step {step}: {Path(f'{out}.log').read_text()[-3000:]}")


def test_a_launcher_killed_by_sigkill_takes_its_workers_along(tmp_path):
    out = tmp_path / "run"
    launcher = _launch(out)
    workers = _workers_at_step(launcher, out, 3)
    launcher.kill()
    launcher.wait(timeout=30)
    assert _wait_gone(workers, 30) < 5
    hold_run_folders([out]).release()  # and the folder is free: the lock went with the last of them


SITE = """
import os
if os.environ.get("RANK"):  # a worker that does not watch its launcher, as before
    os.environ.pop("NEOREC_LAUNCHER_PID", None)
"""


def test_workers_hold_the_folder_while_they_live(tmp_path, capsys):
    """Workers that outlive their launcher (here by not watching it) keep its folder locked: a resume
    is refused naming them, until the last of them is gone."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    out = tmp_path / "run"
    launcher = _launch(
        out, {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    )
    workers = _workers_at_step(launcher, out, 3)
    try:
        launcher.kill()
        launcher.wait(timeout=30)
        with pytest.raises(RunFolderInUse) as refused:
            hold_run_folders([out])
        host = socket.gethostname()
        assert f"pid {launcher.pid} on host {host} (exited) since " in str(refused.value)
        assert all(f"pid {w} (rank " in str(refused.value) for w in workers)
        capsys.readouterr()
        sets = [x for kv in RUN for x in ("--set", kv)]
        for nproc in ([], ["--nproc", "2"]):  # `neorec train --resume`, here in this process
            assert main(["train", *nproc, "--output-dir", str(out), "--resume", *sets]) == 2
            err = capsys.readouterr().err
            assert err.startswith(
                f"neorec: error: {out} is in use by another run: pid {launcher.pid} on host "
            )
            assert err.count("\n") == 1, err
        assert all(_running(w) for w in workers)  # still training: the refusal was theirs
    finally:
        for w in workers:
            os.kill(w, signal.SIGKILL)
    _wait_gone(workers, 30)
    hold_run_folders([out]).release()


def test_model_of_an_all_replicated_run_holds_the_optimizer_step(tmp_path):
    """Every table dp over 2 gloo processes, adam: model.pt's tables.<name>.step is the number of
    updates (Adam's bias correction goes on from it), as in the checkpoint of the same step."""
    out = tmp_path / "run"
    sets = [*RUN, ALL_DP, "train.max_steps=6", "checkpoint.every_steps=3"]
    spawn(2, fit_rank, (sets, str(out)), tmp_path=tmp_path / "pg")  # the workers' Trainer, on spawned ranks
    state = torch.load(out / "model.pt", weights_only=True)
    steps = {k.split(".")[2]: int(v) for k, v in state.items() if k.endswith(".step")}
    assert steps == {"C1": 6, "C2": 6, "C3": 6, "C4": 6}
    manifest = json.loads((out / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert manifest["embedding_steps"] == steps
