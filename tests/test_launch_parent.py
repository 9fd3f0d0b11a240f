"""A worker of torchrun's own agent (`torchrun ... -m neorec train`) ends with the agent: an agent killed
by SIGKILL leaves no orphan training on. It gets one SIGTERM (neorec/utils/parent_watch.py), and stops as
on preemption, with a checkpoint: never a second one, which would end it before its checkpoint is
written (the kernel's death signal comes again for every thread of the dying agent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from forked import start_python

from neorec.train.run_lock import LOCK_FILE, hold_run_folders, read_holders

pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from neorec.utils import parent_watch
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(time.monotonic()))
    print(os.getpid(), parent_watch.die_with_launcher(), flush=True)
    end = time.monotonic() + 30
    while time.monotonic() < end and not (received and time.monotonic() > received[0] + 1.5):
        time.sleep(0.01)  # after the first SIGTERM, long enough for any repeat to arrive
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(len(received)))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
""")
AGENT = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    for _ in range(4):  # torchrun's agent has threads of its own: the orphan passes through each
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k != "NEOREC_LAUNCHER_PID"}
    env.update(TORCHELASTIC_RUN_ID="test", RANK="0", WORLD_SIZE="1")
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)  # as torchrun does
    print(child.stdout.readline().strip(), flush=True)
    time.sleep(60)
""")


def test_a_torchrun_worker_gets_one_sigterm_when_its_agent_is_killed(tmp_path):
    result = tmp_path / "signals"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, WORKER, str(result)], stdout=subprocess.PIPE, text=True
    )
    worker = None
    try:
        pid, how = agent.stdout.readline().split(" ", 1)
        worker = int(pid)
        assert how.strip() == "watch thread"
        agent.kill()
        agent.wait(timeout=30)
        deadline = time.monotonic() + 15
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert result.exists(), "the worker did not hear of its agent's end"
        assert Path(result).read_text() == "1"  # one SIGTERM: the stop it starts is not cut short
    finally:
        agent.kill()
        agent.wait(timeout=30)
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_process_outside_torchrun_watches_nothing(monkeypatch):
    from neorec.utils.parent_watch import die_with_launcher

    for name in ("NEOREC_LAUNCHER_PID", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert die_with_launcher() is None


RUN = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=100000000", "data.synthetic.eval_samples=100", "data.batch_size=64",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=1",
    "train.max_steps=1000000", "train.threads=1", "checkpoint.every_steps=100000",
]  # fmt: skip


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_torchrun_killed_by_sigkill_stops_its_workers_with_a_checkpoint(tmp_path):
    """Real torchrun, its agent killed by SIGKILL while its 2 workers train: they stop after the same step
    with a checkpoint (without the agent's store), rank 0 prints the resume line, and the folder is free."""
    out = tmp_path / "run"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            f"--log-dir={tmp_path / 'agent'}",  # not a /tmp/torchelastic_* of its own
            "-m", "neorec", "train", "--output-dir", str(out),
            *[x for kv in RUN for x in ("--set", kv)]]  # fmt: skip
    agent = start_python(args, env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while agent.poll() is None and time.monotonic() < deadline:  # both workers hold the lock, rank 0 logs
            workers = [h["pid"] for h in read_holders(out / LOCK_FILE)]
            if len(workers) == 2 and metrics.is_file() and metrics.stat().st_size:
                break
            time.sleep(0.02)
        assert len(workers) == 2, agent.output()[1][-3000:]
        agent.kill()
        agent.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(_running(w) for w in workers), "orphaned workers train on"
        err = agent.output()[1]
        stops = [x for x in err.splitlines() if x.startswith("neorec: stopped by SIGTERM after step ")]
        assert len(stops) == 1 and "--resume" in stops[0], err[-3000:]
        step = int(stops[0].split("after step ")[1].split(";")[0])
        assert (out / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
        hold_run_folders([out]).release()  # the lock went with them
    finally:
        agent.kill()
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
