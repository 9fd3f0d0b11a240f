"""Preemption and failures of real processes: SIGTERM/SIGINT stop `neorec train` at a step boundary
with a checkpoint and the command that resumes (1 process and `--nproc 2`), the resumed run ends
exactly where an uninterrupted one does; a second signal ends a process at once; a rank that dies
makes the others stop with an error naming it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import textwrap
import time

import pytest
import torch
from dist_helpers import fit_rank, spawn
from forked import Started, context, run_neorec, run_python, start_neorec
from test_checkpoint import _children, _metrics

from neorec.checkpoint import list_checkpoints
from neorec.config.load import load_config
from neorec.train.signals import StopSignals, TrainingStopped
from neorec.train.trainer import Trainer

RUN = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=20000", "data.synthetic.eval_samples=500", "data.batch_size=64",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=1",
    "train.max_steps=300", "train.threads=1", "embedding.optimizer.name=adam", "embedding.optimizer.lr=0.01",
    "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
]  # fmt: skip


def _sets(extra: list[str] = ()) -> list[str]:
    return [x for kv in [*RUN, *extra] for x in ("--set", kv)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _start(out, nproc: int = 1, extra: list[str] = (), env: dict | None = None) -> Started:
    """`neorec train` in the background, in a process of its own (tests/forked.py) that the test signals."""
    argv = ["train", "--output-dir", str(out), *_sets(extra)]
    if nproc > 1:
        argv[1:1] = ["--nproc", str(nproc)]
    return start_neorec(argv, env=env or _env())


def _wait_for_steps(run: Started, out, steps: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
    while run.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run logged fewer than {steps} steps: {run.communicate(timeout=60)}")


def _stopped(run: Started, code: int) -> tuple[int, list[str]]:
    """The stopped run's step and the command its message says resumes it (its arguments after
    `neorec`)."""
    _, err = run.communicate(timeout=240)
    assert run.returncode == code, err
    assert "Traceback" not in err, err
    line = next(x for x in err.splitlines() if x.startswith("neorec: stopped by"))
    step = int(line.split(" after step ")[1].split(";")[0])
    command = shlex.split(line.split("Resume with: ")[1])
    assert command[:2] == ["neorec", "train"] and command[-1] == "--resume"
    return step, command[1:]


def _resume(argv: list[str]) -> None:
    p = run_neorec(argv, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr  # a log line (console messages go to stderr)


def _same_run(a, b) -> None:
    assert _metrics(a) == _metrics(b)  # every step's loss, and the evaluation
    want = torch.load(a / "model.pt", weights_only=True)
    got = torch.load(b / "model.pt", weights_only=True)
    for key, value in want.items():
        assert torch.equal(value, got[key]), key


def test_second_signal_ends_the_process_at_once():
    script = textwrap.dedent("""
        import os, signal, time
        from neorec.train.signals import StopSignals
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            print("asked to stop by", stop.agreed(), flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            print("still running", flush=True)
    """)
    p = run_python(["-c", script], timeout=60)  # a process of its own (tests/forked.py)
    assert p.returncode == -signal.SIGINT, p.stderr
    assert p.stdout == f"asked to stop by {int(signal.SIGTERM)}\n" and "Traceback" not in p.stderr


def test_sigint_saves_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """No periodic checkpoints: the signal's checkpoint is the only one."""
    Trainer(load_config("default", RUN), tmp_path / "whole").fit()
    run = _start(tmp_path / "run")
    _wait_for_steps(run, tmp_path / "run", 3)
    run.send_signal(signal.SIGINT)
    step, command = _stopped(run, 128 + signal.SIGINT)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [f"step-{step:08d}"]
    assert 3 <= step < 300
    _resume(command)
    _same_run(tmp_path / "whole", tmp_path / "run")


def test_a_stop_on_an_evaluation_step_keeps_its_evaluation(tmp_path, monkeypatch):
    """A stop agreed after a step with a mid-run evaluation (every 4 steps here: the 8th) comes after
    that evaluation, as the uninterrupted run has it, so the resumed run's metrics and model are those
    of the uninterrupted one (stopped before it, neither the stopped run nor the resumed one ran it)."""
    run = [*RUN, "train.max_steps=12", "train.eval_every=4", "train.log_every=4"]
    Trainer(load_config("default", run), tmp_path / "whole").fit()
    _stop_at(monkeypatch, 8, in_evaluation=False)
    with pytest.raises(TrainingStopped, match="after step 8"):
        Trainer(load_config("default", run), tmp_path / "run").fit()
    monkeypatch.undo()
    Trainer(load_config("default", run), tmp_path / "run", resume=True).fit()
    _same_run(tmp_path / "whole", tmp_path / "run")


def _stop_at(monkeypatch, step: int, in_evaluation: bool) -> None:
    """The flags every rank agrees on (StopSignals.agreed, called after each step and before each
    batch of an evaluation) ask for a stop after step `step`, or during the evaluation after it."""
    import inspect

    steps, train_step = [0], Trainer.train_step

    def counted(self, *args, **kwargs):
        steps[0] += 1
        return train_step(self, *args, **kwargs)

    def agreed(self) -> int:
        during = inspect.stack()[1].function == "evaluate"
        return signal.SIGTERM if steps[0] == step and during == in_evaluation else 0

    monkeypatch.setattr(Trainer, "train_step", counted)
    monkeypatch.setattr(StopSignals, "agreed", agreed)


@pytest.mark.parametrize("when", [8, 12], ids=["mid_run", "final"])
def test_a_stop_during_an_evaluation_ends_it_and_the_resumed_run_does_it(tmp_path, monkeypatch, when):
    """A stop asked for during an evaluation waited for its end (the whole held-out set at the end of a
    run: longer than a scheduler's grace, whose SIGKILL then lost the run). It ends the evaluation at
    once with a checkpoint of that step; the resumed run evaluates first (the final evaluation: as it
    ends), so its metrics and model are the uninterrupted run's."""
    run = [*RUN, "train.max_steps=12", "train.eval_every=4", "train.log_every=4", "data.eval_batch_size=100"]
    Trainer(load_config("default", run), tmp_path / "whole").fit()
    _stop_at(monkeypatch, when, in_evaluation=True)
    with pytest.raises(TrainingStopped, match=f"after step {when}"):
        Trainer(load_config("default", run), tmp_path / "run").fit()
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [f"step-{when:08d}"]
    assert not (tmp_path / "run" / "model.pt").exists()
    Trainer(load_config("default", run), tmp_path / "run", resume=True).fit()
    _same_run(tmp_path / "whole", tmp_path / "run")


def test_a_stop_during_the_evaluation_after_an_epoch_resumes_at_the_next_epoch(tmp_path, monkeypatch):
    """An evaluation after each epoch (eval_every null), stopped: the resumed run does it, then trains
    the next epoch; the epoch's end is logged and evaluated once, as in the uninterrupted run."""
    run = [*RUN, "data.synthetic.train_samples=640", "train.epochs=2", "train.eval_every=null",
           "data.eval_batch_size=100"]  # fmt: skip
    Trainer(load_config("default", run), tmp_path / "whole").fit()  # 10 steps an epoch
    _stop_at(monkeypatch, 10, in_evaluation=True)
    with pytest.raises(TrainingStopped, match="after step 10"):
        Trainer(load_config("default", run), tmp_path / "run").fit()
    monkeypatch.undo()
    Trainer(load_config("default", run), tmp_path / "run", resume=True).fit()
    _same_run(tmp_path / "whole", tmp_path / "run")


def _worker(launcher: int, rank: int) -> int:
    for pid in _children(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def _pending(pid: int, sig: int) -> bool:
    """`sig` waits to be delivered to the process `pid` (one that is stopped: /proc's SigPnd, ShdPnd)."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(x.split()[1], 16) for x in f if x.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m >> (sig - 1) & 1 for m in masks)


def _stopped_still(pid: int) -> bool:
    """Every thread of `pid` is stopped (by SIGSTOP): a signal sent now stays pending until SIGCONT."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that has ended
            continue
    return all(s == "T" for s in states)


def _until(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# in each worker (RANK set) when NEOREC_TEST_HOLD_AFTER=N: after its N-th training step the process
# stops itself (SIGSTOP) until the test has sent its signal; so the signal lands after the same step
# however loaded the machine is (the steps take milliseconds: a test that waited for a step in the
# log and then stopped the workers found them many steps on, at times past the end of the run)
HOLD = """
import os, signal
if "RANK" in os.environ and os.environ.get("NEOREC_TEST_HOLD_AFTER"):
    from neorec.train.trainer import Trainer
    step, calls = Trainer.train_step, [0]
    def held(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == int(os.environ["NEOREC_TEST_HOLD_AFTER"]):
            os.kill(os.getpid(), signal.SIGSTOP)
        return out
    Trainer.train_step = held
"""


def _held_env(tmp_path, after: int) -> dict[str, str]:
    site = tmp_path / "hold_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HOLD)
    path = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**_env(), "PYTHONPATH": path, "NEOREC_TEST_HOLD_AFTER": str(after)}


def _sigterm_held_workers(run: Started, rank: int | None = None) -> None:
    """Once both workers hold themselves still (HOLD), send SIGTERM to the launcher (rank None:
    torchrun's agent forwards it to every worker) or to the worker of `rank` alone, wait until it is
    pending in the worker(s) it is for, and let them go on (SIGCONT)."""
    workers: list[int] = []

    def held() -> bool:
        assert run.poll() is None, run.communicate(timeout=60)
        try:
            workers[:] = [_worker(run.pid, r) for r in (0, 1)]
            return all(_stopped_still(w) for w in workers)
        except (AssertionError, FileNotFoundError):  # not started yet, or a thread ended meanwhile
            return False

    _until(held, "the workers did not hold after their steps", seconds=240)
    try:
        if rank is None:
            run.send_signal(signal.SIGTERM)
        else:
            os.kill(workers[rank], signal.SIGTERM)
        reached = workers if rank is None else [workers[rank]]
        _until(lambda: all(_pending(w, signal.SIGTERM) for w in reached), "SIGTERM did not reach the workers")
    finally:
        for w in workers:
            os.kill(w, signal.SIGCONT)


STEPS_2 = 40


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_step_and_resumes_exactly(tmp_path):
    """`neorec train --nproc 2`, twice interrupted: SIGTERM to the launcher (torchrun's agent
    forwards it), then SIGTERM to rank 1 alone (the ranks agree through their flags). Both times
    every rank stops after the same step with one checkpoint; resumed, the run ends bitwise like an
    uninterrupted one (the same config trained by the same Trainer on 2 gloo processes)."""
    extra = [f"train.max_steps={STEPS_2}"]
    spawn(2, fit_rank, ([*RUN, *extra], str(tmp_path / "whole")), tmp_path=tmp_path / "pg")
    env = _held_env(tmp_path, 3)  # each worker holds still after its third step
    run = _start(tmp_path / "run", nproc=2, extra=extra, env=env)
    _sigterm_held_workers(run)  # to the launcher
    first, command = _stopped(run, 128 + signal.SIGTERM)
    assert "--nproc" in command and first == 4  # the flags sent after step 3 are read after step 4
    again = start_neorec(command, env=env)
    _sigterm_held_workers(again, rank=1)
    second, command_again = _stopped(again, 128 + signal.SIGTERM)
    assert second == first + 4 and command_again == command  # a resumed run resumes the same way
    manifest = json.loads(
        (tmp_path / "run" / "checkpoints" / f"step-{second:08d}" / "manifest.json").read_text()
    )
    assert manifest["world_size"] == 2 and len(manifest["files"]) == 2  # both ranks wrote their part
    # the launcher's resume ran above; the rest of the run on the workers' Trainer, in spawned ranks
    spawn(2, fit_rank, ([*RUN, *extra], str(tmp_path / "run"), True), tmp_path=tmp_path / "pg2")
    _same_run(tmp_path / "whole", tmp_path / "run")


# ---- a rank that fails ---------------------------------------------------------------------------------
def _die_in_collective(rank: int, init_file: str, out) -> None:
    import torch.distributed as dist

    from neorec.distributed.shm import ShmGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = ShmGroup([0, 1], rank, None, capacity=1024)
    group.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(3)  # dies without a word while rank 0 waits for the next exchange
    try:
        group.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(f"{type(e).__name__}: {e}")


def test_a_rank_dead_in_a_shared_memory_collective_stops_its_peer(tmp_path):
    ctx = context()  # processes forked from a server that has imported torch (tests/forked.py)
    out = ctx.Queue()
    procs = [ctx.Process(target=_die_in_collective, args=(r, str(tmp_path / "init"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        message = out.get(timeout=120)  # the bound is about a second (shm.PEER_CHECK_SECONDS)
    finally:
        for p in procs:
            p.join(timeout=30)
    assert message.startswith("DistributedError: rank 1 (pid ") and "exited during a shared-memory" in message


SITE = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("NEOREC_TEST_FAIL"):
    from neorec.train.trainer import Trainer
    step, calls = Trainer.train_step, [0]
    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("rank 1 cannot go on (injected)")
        return step(self, *args, **kwargs)
    Trainer.train_step = failing
"""


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["raises", "sigkill"])
def test_a_failing_rank_stops_the_run_and_is_reported_first(tmp_path, how):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = {**_env(), "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if how == "raises":
        env["NEOREC_TEST_FAIL"] = "1"
    run = _start(tmp_path / "run", nproc=2, env=env)
    if how == "sigkill":
        _wait_for_steps(run, tmp_path / "run", 3)
        os.kill(_worker(run.pid, 1), signal.SIGKILL)
    _, err = run.communicate(timeout=180)  # the bound: torchrun's agent ends the survivors in <= 30 s
    # the launcher's report (log lines of the run, "neorec: step ...", come before it)
    lines = [x for x in err.splitlines() if x.startswith(("neorec: error: ", "neorec: rank "))]
    assert run.returncode == 1, err
    want = "RuntimeError: rank 1 cannot go on (injected)" if how == "raises" else "killed by SIGKILL"
    assert lines[0] == f"neorec: error: rank 1 failed first: {want}", err
    assert lines[1].startswith("neorec: rank 0 stopped after it: "), err
