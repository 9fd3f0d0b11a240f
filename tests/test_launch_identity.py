"""Which processes make one run, and what a launch leaves behind.

A hand-started rank started again in a running run's folder is refused before it touches the folder
(neorec/train/run_lock.py); hand-started ranks of two runs that meet at one MASTER_PORT refuse, naming
both folders (neorec/train/same_config.py), and a rank that arrives after its rank was taken is refused
at once (neorec/distributed/topology.py). `neorec train --nproc 2`: a signal after the run's results
is no stop, Ctrl-C during start-up is one line of the launcher's, nothing is left in the temporary
folder (neorec/distributed/launch.py); shared-memory files of killed ranks are swept
(neorec/distributed/shm.py); a finished run resumed reports no speed (neorec/train/reporting.py)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest
from forked import context, start_neorec, start_python
from tiny_cli import TINY, sets

from neorec.cli import main
from neorec.train.run_lock import LOCK_FILE, read_holders

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks_env(rank: int, port: int) -> dict[str, str]:
    """A hand-started rank of 2 (the environment of this test, without any torchrun job's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "NEOREC_"))}
    return {**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip


HOLD = textwrap.dedent("""
    import sys, time
    from neorec.train.run_lock import hold_run_folders
    lock = hold_run_folders([sys.argv[1]])
    time.sleep(120)
""")


def test_a_second_rank_0_of_a_running_hand_started_run_is_refused_before_the_folder_is_touched(
    tmp_path, monkeypatch, capsys
):
    """Rank 0 started again with the running run's variables and --overwrite shared its lock and cleared
    its checkpoints, plan.json and tensorboard/ before failing on the port."""
    out = tmp_path / "run"
    kept = [out / "checkpoints" / "step-00000020" / "manifest.json", out / "plan.json",
            out / "tensorboard" / "events", out / "config.yaml", out / "metrics.jsonl"]  # fmt: skip
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    port = _free_port()
    running = start_python(["-c", HOLD, str(out)], env=_ranks_env(0, port))  # the running run's rank 0
    try:
        deadline = time.monotonic() + 60
        while [h["pid"] for h in read_holders(out / LOCK_FILE)] != [running.pid]:
            assert running.poll() is None and time.monotonic() < deadline, running.output()
            time.sleep(0.02)
        for name, value in _ranks_env(0, port).items():
            monkeypatch.setenv(name, value)

        def fit(*args):
            raise AssertionError("the second rank 0 went on to train")

        monkeypatch.setattr("neorec.cli._fit", fit)
        capsys.readouterr()
        for again in (["--overwrite"], []):
            assert main(["train", "--output-dir", str(out), *again, *sets(TINY)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(
                f"neorec: error: {out} is in use by another run: pid {running.pid} (rank 0) on host "
            ), err
            assert "second rank 0" in err
            assert all(path.is_file() for path in kept)
    finally:
        running.kill()
        running.wait(timeout=30)


def test_a_rank_held_on_another_host_is_a_twin_when_started_by_hand(monkeypatch):
    """Ranks started by hand keep their numbers: the same rank of the same job held on another host
    is a second copy of it. torchrun may restart a rank on another host under its job: no twin."""
    from neorec.train.run_lock import _same_rank

    monkeypatch.setenv("RANK", "0")
    elsewhere = {"rank": "0", "pid": os.getpid() + 1, "host": socket.gethostname() + "-elsewhere"}
    by_hand = {**elsewhere, "job": "ranks 10.0.0.1:29500 of 2"}
    assert _same_rank([by_hand], by_hand["job"]) == by_hand
    assert _same_rank([{**by_hand, "rank": "1"}], by_hand["job"]) is None  # another rank
    torchrun = {**elsewhere, "job": "torchrun x 10.0.0.1:29500"}
    assert _same_rank([torchrun], torchrun["job"]) is None


def test_hand_started_ranks_of_two_runs_on_one_port_refuse_naming_both_folders(tmp_path):
    """Rank 0 of a run in `a` and rank 1 of a run in `b` on one MASTER_PORT trained as one run in `a`."""
    port = _free_port()
    a, b = tmp_path / "a", tmp_path / "b"
    ranks = [start_neorec(["train", "--output-dir", str(folder), *sets(TINY)], env=_ranks_env(rank, port))
             for rank, folder in ((0, a), (1, b))]  # fmt: skip
    try:
        outs = [r.communicate(timeout=240) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    for rank, (_, err) in zip(ranks, outs, strict=True):
        assert rank.returncode == 2, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("neorec: error:")]
        assert errors == [
            "neorec: error: the processes of this run train in different run folders: rank 0 in "
            f"{a.resolve()}, rank 1 in {b.resolve()}: two runs that meet at one MASTER_ADDR:MASTER_PORT, or "
            "a rank given another --output-dir. Every process of a run must get the same --output-dir (one "
            "folder that all nodes share); give each run its own MASTER_PORT"
        ], err[-3000:]
    assert not (a / "config.yaml").exists() and not (b / "config.yaml").exists()


def test_the_same_folder_under_other_paths_is_one_run(neorec_warnings):
    from neorec.errors import ConfigError
    from neorec.train.same_config import check_same_folder

    check_same_folder([["/mnt/a/run", "holder"], ["/data/run", "holder"]])  # one folder, mounted elsewhere
    check_same_folder([["/local/run", "x"], ["/local/run", "y"]])  # node-local folders of one path
    check_same_folder([None, None])  # no folder held (a library call)
    with pytest.raises(ConfigError, match="rank 0 in /a, rank 2 in /c: two runs"):
        check_same_folder([["/a", "x"], ["/a", "x"], ["/c", "y"]])
    # no lock (a filesystem without flock): one folder under two mounts cannot be told from two
    # folders, so other paths are warned about, not refused
    check_same_folder([["/a", None], ["/b", None]])
    assert any("rank 0 trains in /a, rank 1 in /b" in m for m in neorec_warnings.messages)


def _rank(rank: int, port: int, seconds: float, out, leave) -> None:
    """A hand-started rank of 2 that joins, says so, and leaves when `leave` is set."""
    import torch

    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)
    os.environ.update(_ranks_env(rank, port))
    from neorec.distributed import topology

    topology.PEER_TIMEOUT_SECONDS = seconds
    try:
        topology.init_distributed(torch.device("cpu"))
        out.put((rank, "joined"))
        leave.wait(120)
        torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {' '.join(str(e).split())}"))


def test_a_rank_that_arrives_after_its_rank_joined_is_refused_at_once():
    """It waited in gloo's connectFullMesh until the timeout (600 s), without a word."""
    ctx = context()
    out, leave = ctx.Queue(), ctx.Event()
    port = _free_port()
    pair = [ctx.Process(target=_rank, args=(rank, port, 60.0, out, leave)) for rank in (0, 1)]
    for p in pair:
        p.start()
    stray = None
    try:
        assert sorted(out.get(timeout=120) for _ in pair) == [(0, "joined"), (1, "joined")]
        stray = ctx.Process(target=_rank, args=(1, port, 8.0, out, leave))
        start = time.monotonic()
        stray.start()
        rank, said = out.get(timeout=120)
        assert said == (
            f"ConfigError: rank 1: another process already joined the run at MASTER_ADDR:MASTER_PORT "
            f"127.0.0.1:{port} as rank 1: two runs meet at one address, or this rank was started twice; give "
            "each run its own MASTER_PORT"
        )
        assert time.monotonic() - start < 8
    finally:
        leave.set()
        for p in [*pair, *([stray] if stray else [])]:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# ---- the launcher ------------------------------------------------------------------------------------
def _fresh_tempdir() -> None:
    """In the launcher's process (forked from a server that may have read it): TMPDIR read anew."""
    import tempfile

    tempfile.tempdir = None


def _launch(out: Path, tmp: Path, extra: list[str]):
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "NEOREC_", "RANK"))}
    argv = ["-m", "neorec", "train", "--nproc", "2", "--output-dir", str(out), *sets([*TINY, *extra])]
    return start_python(argv, env={**env, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}, preexec=_fresh_tempdir)


def _left_in(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "neorec-launch-")))


def test_a_sigterm_after_the_results_is_no_stop(tmp_path):
    """The launcher said "stopped by SIGTERM before a checkpoint ...; --resume continues" and exited 143
    for a run whose summary.json and model.pt were written (rank 0 plots curves.png after them)."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    launcher = _launch(out, tmp, ["logging.plot=true"])
    try:
        deadline = time.monotonic() + 240
        while not (out / "summary.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.output()[1][-3000:]
            time.sleep(0.01)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert f"neorec: SIGTERM came after the run finished; its results are in {out}" in err
    assert "stopped by" not in err and (out / "model.pt").is_file()
    assert _left_in(tmp) == []  # no torchelastic_* of the agent's logs, nor the launcher's own folder


def test_ctrl_c_while_the_workers_start_is_one_line_that_says_there_is_nothing_to_resume(tmp_path):
    """Each worker printed "neorec: interrupted" and the launcher "--resume continues from the newest
    one", though no checkpoint existed."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    launcher = _launch(out, tmp, [])
    try:
        deadline = time.monotonic() + 240
        while len(read_holders(out / LOCK_FILE)) < 3:  # the launcher and both workers, which start
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.output()[1][-3000:]
            time.sleep(0.01)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err[-3000:]
    lines = [x for x in err.splitlines() if "launching: torchrun" not in x]  # the launcher's INFO line
    said = [x for x in lines if x.startswith("neorec: ") or "Traceback" in x]
    assert said == [
        f"neorec: stopped by SIGINT before the run saved a checkpoint (none in {out / 'checkpoints'}): "
        "nothing to resume; the same command starts it again from step 0"
    ], err[-3000:]
    assert _left_in(tmp) == []


def test_the_launcher_s_advice_names_the_newest_checkpoint(tmp_path):
    from neorec.distributed.launch import stopped_early

    root = tmp_path / "checkpoints"
    newest = root / "step-00000004"
    newest.mkdir(parents=True)
    (newest / "manifest.json").write_text('{"step": 4}')
    assert stopped_early("SIGINT", root, ["train", "--nproc", "2", "--output-dir", "r"]) == (
        f"neorec: stopped by SIGINT before a checkpoint of the current step was written; the newest is "
        f"{newest}. Resume with: neorec train --nproc 2 --output-dir r --resume"
    )


def test_launcher_folders_of_dead_launchers_are_swept(tmp_path, monkeypatch):
    """A launcher killed by SIGKILL left its /tmp/neorec-launch-* folder for good."""
    import tempfile

    from neorec.distributed.launch import _own_folder, sweep_launch_folders

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live, live_fd = _own_folder()
    try:
        live = Path(live)
        dead = tmp_path / "neorec-launch-dead"
        dead.mkdir()
        (dead / "launcher.lock").touch()
        (dead / "rank-0.json").write_text("{}")
        older = tmp_path / "neorec-launch-older"  # an older version's: no lock file to tell
        older.mkdir()
        later = time.time() + 60
        assert sweep_launch_folders(str(tmp_path), now=time.time()) == []  # too fresh to tell
        assert sweep_launch_folders(str(tmp_path), now=later) == [str(dead)]
        assert live.is_dir() and older.is_dir() and not dead.exists()
    finally:
        os.close(live_fd)


def _killed_in_setup(rank: int, init_file: str, folder: str, out) -> None:
    """A rank of a 2-rank shared-memory group, SIGKILLed once its files are made."""
    import torch.distributed as dist

    from neorec.distributed import shm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    shm.SHM_DIR = folder
    barrier = dist.barrier

    def killed(*args, **kwargs):
        barrier()  # both ranks' files are made
        out.put(rank)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    shm.dist.barrier = killed
    shm.ShmGroup([0, 1], rank, None, capacity=1 << 16)


def test_shared_memory_files_of_ranks_killed_while_building_their_group_are_swept(tmp_path, monkeypatch):
    """Files of ranks killed by SIGKILL (or of a killed launcher's workers) were left for good, 64 MiB
    a segment: the next group sweeps them; files of a live group, another user's and a young one stay."""
    from neorec.distributed import shm

    folder = tmp_path / "shm"
    folder.mkdir()
    ctx = context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_killed_in_setup, args=(r, str(tmp_path / "init"), str(folder), out))
             for r in (0, 1)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        assert sorted(out.get(timeout=120) for _ in procs) == [0, 1]
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    left = sorted(os.listdir(folder))
    assert len(left) == 3 and left[1:] == [f"{left[0]}.0", f"{left[0]}.1"], left
    live = folder / f"neorec-1-{'a' * 32}"  # a segment whose group is being built: its lock is held
    live.touch()
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    older = folder / f"neorec-{'b' * 32}"  # an older version's, of a setup that may still last
    older.touch()
    try:
        assert shm.sweep_stale(str(folder)) == []  # all of them younger than a setup's first seconds
        assert shm.sweep_stale(str(folder), now=time.time() + 60) == [left[0]]
        assert sorted(os.listdir(folder)) == sorted([live.name, older.name])
        assert shm.sweep_stale(str(folder), now=time.time() + 3600) == [older.name]
    finally:
        os.close(held)
    # the launcher removes the segments its workers named once they have ended
    reports = tmp_path / "reports"
    reports.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", str(folder))
    (reports / f"shm-{live.name}").write_text(str(live))
    (folder / f"{live.name}.0").touch()
    shm.remove_noted(reports)
    assert os.listdir(folder) == []


def test_a_finished_run_resumed_reports_no_speed(tmp_path, capfd):
    """The same command again (`--resume` in a job script) on a finished run evaluates it again; it
    printed "step 2/2 | loss ... | nan samples/s" and a throughput of 0 samples/s."""
    import json

    out = tmp_path / "run"
    extra = ["train.log_every=4", "checkpoint.every_steps=2"]  # the last step's loss is logged after its save
    argv = ["train", "--output-dir", str(out), "--resume", *sets([*TINY, *extra])]
    assert main(argv) == 0
    capfd.readouterr()
    assert main(argv) == 0
    stdout, err = capfd.readouterr()
    assert "step 2/2 | loss " in err and "nan" not in err + stdout, err
    assert "throughput" in stdout and "n/a (no step trained since the resume)" in stdout, stdout
    assert json.loads((out / "summary.json").read_text())["samples_per_s"] is None
