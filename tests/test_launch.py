"""`neorec train` under real torchrun: one node with --nproc (the command of docs/sharding.md that
places tables by hand), and 2 nodes x 2 processes on localhost (two torchrun invocations with
different --node-rank) with hierarchical tables, compared with one process on the same global
batches."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess

import pytest
import torch
from forked import run_python, start_python
from test_docs import by_hand_command

pytestmark = pytest.mark.distributed

SMALL = [
    "train.max_steps=12", "train.progress=false", "train.log_every=4", "logging.plot=false",
    "logging.tensorboard=false", "data.batch_size=128", "data.eval_batch_size=1000",
    "data.synthetic.train_samples=4096", "data.synthetic.eval_samples=1000", "data.synthetic.max_rows=500",
    "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
    # plain SGD: adagrad/adam divide by tiny accumulators on a row's first touches, which turns
    # float-order noise into visible differences after a few steps (the gloo tests cover them exactly)
    "embedding.optimizer={name: sgd, lr: 0.5}", "train.dense_optimizer={name: sgd, lr: 0.05}",
]  # fmt: skip
HIERARCHICAL = (
    "distributed.sharding={C1: {kind: twrw, node: 1}, C2: {kind: twcw, node: 0}, C3: {kind: twrw, node: 0},"
    " C4: {kind: twcw, node: 1}, C5: {kind: rw, ranks: [3, 0]}, C6: {kind: cw, ranks: [2, 1]}, C7: {kind: dp}}"
)


def _sets(extra: list[str]) -> list[str]:
    return [a for s in SMALL + extra for a in ("--set", s)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tables(run_dir) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "model.pt", weights_only=True)
    return {k: v for k, v in state.items() if not k.endswith(".step")}


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python *args` ("-m neorec ...", "-m torch.distributed.run ...") in a process of its own, forked
    from one that has imported torch and neorec (tests/forked.py); not checked."""
    return run_python(args, timeout=timeout)


def test_two_nodes_of_two_processes_match_one_process(tmp_path):
    single = tmp_path / "single"
    p = _run(["-m", "neorec", "train", "--output-dir", str(single), *_sets([])])
    assert p.returncode == 0, p.stderr[-3000:]
    port = _free_port()
    multi = tmp_path / "multi"
    procs = []
    for node in (0, 1):
        args = ["-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                f"--log-dir={tmp_path / f'agent{node}'}",  # not a /tmp/torchelastic_* of its own
                "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
                "-m", "neorec", "train", "--output-dir", str(multi), *_sets([HIERARCHICAL])]  # fmt: skip
        procs.append(start_python(args))  # torchrun's agent; its workers are real `python -m neorec`
    outs = [pr.communicate(timeout=300) for pr in procs]
    for pr, (_out, err) in zip(procs, outs, strict=True):
        assert pr.returncode == 0, err[-3000:]
    assert "MiB sent per step" in outs[0][0]  # node 0 holds global rank 0, which prints the summary
    a, b = _tables(single), _tables(multi)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    # the logged training loss is the global batch's, as one process logs it (all ranks' mean)
    assert _train_losses(multi) == pytest.approx(_train_losses(single), rel=1e-5)


def _train_losses(run_dir) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["split"] == "train"]


def test_nproc_convenience_flag_and_bad_plan(tmp_path):
    """docs/sharding.md's command that places tables by hand (test_docs leaves it to this test), with
    small overrides; then a placement on a rank that does not exist."""
    out = tmp_path / "run"
    argv = shlex.split(by_hand_command())[1:]
    assert argv[:3] == ["train", "--nproc", "2"] and "C2: {kind: cw, ranks: [1, 0]}" in argv[4]
    p = _run(["-m", "neorec", *argv, "--output-dir", str(out), *_sets([])])
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "summary.json").is_file() and (out / "model.pt").is_file()
    planned = json.loads((out / "summary.json").read_text())["planned_device_mib_per_rank"]
    assert len(planned) == 2 and all(mib > 0 for mib in planned)  # the planner's estimate, per rank
    # rank 0 logs progress, prefixed with its rank; rank 1 only warnings (neorec/utils/logging.py)
    assert "[rank 0] neorec: step 4/12 | loss " in p.stderr, p.stderr[-3000:]
    assert "[rank 1] neorec: step" not in p.stderr
    bad = _run(["-m", "neorec", "train", "--nproc", "2", "--output-dir", str(tmp_path / "bad"),
                *_sets(["distributed.sharding={C3: {kind: tw, ranks: [5]}}"])])  # fmt: skip
    assert bad.returncode != 0
    assert "C3" in bad.stderr and "rank(s) [5] do not exist" in bad.stderr


def test_exit_code_is_the_first_failing_rank_s_own_even_when_the_agent_ended_it(capsys):
    """A rank that failed on bad input (code 2) and wrote its report, but got the agent's SIGTERM
    before it exited (exit code -15), still makes the launcher exit 2, naming that rank first."""
    from types import SimpleNamespace

    from neorec.distributed.launch import _report_failures

    reports = {
        1: {"time": 10.0, "error": "checkpoint x: bad --nproc", "follows": False, "code": 2},
        0: {"time": 10.5, "error": "checkpoint x: bad --nproc", "follows": False, "code": 2},
    }
    failures = {0: SimpleNamespace(exitcode=2, timestamp=10.6), 1: SimpleNamespace(exitcode=-15, timestamp=10.7)}
    assert _report_failures(failures, reports) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "neorec: error: rank 1 failed first: checkpoint x: bad --nproc"
    # a rank killed without a report: the code is 1, never a negative number
    assert _report_failures({0: SimpleNamespace(exitcode=-9, timestamp=1.0)}, {}) == 1
    assert "killed by SIGKILL" in capsys.readouterr().err


def test_a_rank_killed_by_the_agent_s_sigterm_follows_the_one_that_died(capsys):
    """A worker SIGKILLed during start-up (before either wrote a report): torch's timestamps of the two
    ranks it reaped together tie, and the rank the agent then ended with SIGTERM is not the first."""
    from types import SimpleNamespace

    from neorec.distributed.launch import _report_failures

    ended = SimpleNamespace
    failures = {0: ended(exitcode=-15, timestamp=7.0), 1: ended(exitcode=-9, timestamp=7.0)}
    assert _report_failures(failures, {}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "neorec: error: rank 1 failed first: killed by SIGKILL",
        "neorec: rank 0 stopped after it: killed by SIGTERM",
    ]
    # a rank that reported its own failure still comes first, whatever the killed one's time
    error = "cannot write x: No space left on device"
    reports = {1: {"time": 9.0, "error": error, "follows": False, "code": 1}}
    failures = {0: ended(exitcode=-15, timestamp=8.0), 1: ended(exitcode=1, timestamp=9.5)}
    assert _report_failures(failures, reports) == 1
    assert capsys.readouterr().err.splitlines()[0] == f"neorec: error: rank 1 failed first: {error}"
