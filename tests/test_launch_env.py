"""What `neorec train` reads from torchrun's environment is checked before any work: `--nproc` under
torchrun, and a RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_RANK, MASTER_ADDR or MASTER_PORT that is missing
or not a number in its range, are one `neorec: error:` line naming the variable, exit 2, before the run
folder is made (neorec/distributed/topology.py: check_rank_environment). And how a rank that stops because
another one failed ends: one line, exit 1 (neorec/errors.py: failure, peer_gone)."""

from __future__ import annotations

import json

import pytest

from neorec.cli import main
from neorec.errors import ConfigError, DistributedError, MachineError, NeorecError, failure

RANK_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "NEOREC_REPORT_DIR"]  # fmt: skip
TINY = ["--set", "train.max_steps=2", "--set", "train.progress=false", "--set", "logging.plot=false"]


@pytest.fixture
def env(monkeypatch):
    """A process outside any torchrun job; the test sets what it needs."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("neorec: error: "), err
    return err


UNDER_TORCHRUN = [{"RANK": "0"}, {"TORCHELASTIC_RUN_ID": "x"}, {"RANK": "1", "WORLD_SIZE": "2"}]


@pytest.mark.parametrize("variables", UNDER_TORCHRUN)
def test_nproc_under_torchrun_is_refused_before_anything(tmp_path, env, capsys, variables):
    """A wrapper script run by torchrun that says `neorec train --nproc 2`: every outer rank would start
    a job of its own, all of them in one folder."""
    import neorec.distributed.launch as launch

    started = []
    env.setattr(launch, "launch_torchrun", lambda *a, **k: started.append(a) or 0)
    for name, value in variables.items():
        env.setenv(name, value)
    out = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--output-dir", str(out), *TINY]) == 2
    assert _one_line(capsys) == (
        "neorec: error: --nproc starts torchrun itself; under torchrun (RANK set) leave it out\n"
    )
    assert not started and not out.exists()


BAD = [
    ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc': expected a whole number >= 1"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE='0': expected a whole number >= 1"),
    ({"LOCAL_WORLD_SIZE": "0"}, "environment variable LOCAL_WORLD_SIZE='0': expected a whole number >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "environment variable RANK='-1': expected a whole number >= 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "environment variable RANK=2 with WORLD_SIZE=2: a rank is 0 to 1"),
    ({"WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 without RANK: give each process its RANK"),
    ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"},
     "WORLD_SIZE must be a multiple of LOCAL_WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 but environment variable MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
     "environment variable MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     "environment variable MASTER_PORT is 99999, not a port (1 to 65535)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x1"},
     "environment variable MASTER_PORT='x1': expected a whole number >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("variables", "says"), BAD)
def test_a_bad_rank_environment_is_one_line_before_the_folder_is_made(tmp_path, env, capsys, variables, says):
    for name, value in variables.items():
        env.setenv(name, value)
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), *TINY]) == 2
    assert says in _one_line(capsys)
    assert not out.exists()  # nothing was made or locked


def test_local_rank_is_checked_where_it_matters(env):
    from neorec.distributed.topology import check_rank_environment

    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", "29500")
    for value, says in (("abc", "LOCAL_RANK='abc': expected a whole number >= 0"),
                        ("2", "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2: a local rank is 0 to 1")):  # fmt: skip
        env.setenv("LOCAL_RANK", value)
        with pytest.raises(ConfigError, match=says):
            check_rank_environment()
    env.setenv("LOCAL_RANK", "1")
    topo = check_rank_environment()
    assert (topo.rank, topo.world_size, topo.local_world_size) == (1, 2, 2)


# ---- a rank whose peer failed -------------------------------------------------------------------------
GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection reset by peer "
    "[127.0.0.1]:20378. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error. GLHF!"
)


def _train_raising(env, error: BaseException):
    import neorec.cli

    def cmd_train(args):
        raise error

    env.setattr(neorec.cli, "cmd_train", cmd_train)


def test_a_peer_gone_under_plain_torchrun_is_one_line_and_exit_1(tmp_path, env, capsys):
    """torchrun without --nproc (no report folder): gloo's error of a peer that died was a traceback."""
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    _train_raising(env, RuntimeError(GLOO))
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 1
    assert _one_line(capsys) == (
        "neorec: error: rank 1: a peer rank's process is gone (Connection reset by peer [127.0.0.1]:20378); "
        "this rank stops too: the rank that failed first says why in its own output\n"
    )


def test_a_distributed_error_exits_1_and_a_mistake_still_2(tmp_path, env, capsys):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "2")
    _train_raising(env, DistributedError("rank 1 (pid 7) exited during a shared-memory collective"))
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 1
    assert "neorec: error: rank 0: rank 1 (pid 7) exited during" in _one_line(capsys)
    _train_raising(env, ConfigError("model.dim must be positive"))
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 2
    assert _one_line(capsys) == "neorec: error: model.dim must be positive\n"
    assert failure(DistributedError("x"))[0] == 1 and failure(MachineError("x"))[0] == 1
    assert failure(NeorecError("x"))[0] == 2 and failure(ConfigError("x"))[0] == 2
    assert failure(RuntimeError("some bug")) is None  # a bug keeps its traceback


def test_a_worker_of_the_launcher_reports_a_peer_gone_as_following_with_code_1(tmp_path, env, capsys):
    """Under --nproc the worker prints nothing: the launcher names the rank that failed first."""
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    env.setenv("NEOREC_REPORT_DIR", str(tmp_path))
    _train_raising(env, RuntimeError(GLOO))
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == ""
    report = json.loads((tmp_path / "rank-1.json").read_text())
    assert report["follows"] is True and report["code"] == 1
    assert report["error"].startswith("a peer rank's process is gone (Connection reset by peer")


# ---- ranks started by hand share their run folder ----------------------------------------------------
def test_ranks_started_by_hand_hold_their_folder_together_and_other_jobs_are_refused(tmp_path, env):
    """RANK, WORLD_SIZE, MASTER_ADDR/PORT set by hand, no torchrun run id: the ranks of one rendezvous are
    one job; rank 0 was refused as "in use by another run" by rank 1, which then waited for ever."""
    from neorec.train.run_lock import RunFolderInUse, hold_run_folders

    out = tmp_path / "run"
    for name, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        env.setenv(name, value)
    env.setenv("RANK", "1")
    rank1 = hold_run_folders([out])  # each call opens the lock file anew: as another process would
    env.setenv("RANK", "0")
    try:
        hold_run_folders([out]).release()  # the same job: the folder is shared
        env.setenv("MASTER_PORT", "29512")  # another job of hand-started ranks
        with pytest.raises(RunFolderInUse, match="in use by another run"):
            hold_run_folders([out])
        env.setenv("WORLD_SIZE", "1")  # RANK=0 of a single process: a run of its own
        env.setenv("MASTER_PORT", "29511")
        with pytest.raises(RunFolderInUse):
            hold_run_folders([out])
    finally:
        rank1.release()
