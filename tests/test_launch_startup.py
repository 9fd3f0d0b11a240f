"""How the ranks' start-up ends when it cannot complete: a rank that never joins, or a rendezvous that
never answers, is one DistributedError naming them after the wait (neorec/distributed/topology.py:
init_distributed), not torch's DistStoreError traceback; a shared-memory group whose segment cannot be
made names the file and leaves nothing in /dev/shm (neorec/distributed/shm.py). Each rank is a process
forked from the test server (tests/forked.py), with a wait of a second or two."""

from __future__ import annotations

import errno
import glob
import os
import socket
import uuid

import pytest
from forked import context

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int, seconds: float, out) -> None:
    """One rank started by hand (WORLD_SIZE=2), joining with a wait of `seconds`."""
    import torch

    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)
    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    from neorec.distributed import topology

    topology.PEER_TIMEOUT_SECONDS = seconds
    try:
        topology.init_distributed(torch.device("cpu"))
        torch.distributed.barrier()  # both connected: neither leaves while the other still connects
        out.put((port, rank, "joined"))
        torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((port, rank, f"{type(e).__name__}: {' '.join(str(e).split())}"))


def test_ranks_that_never_join_are_named_in_one_line():
    ctx = context()
    out = ctx.Queue()
    alone0, alone1, both = _free_port(), _free_port(), _free_port()
    runs = [(0, alone0, 2.0), (1, alone1, 1.0), (0, both, 60.0), (1, both, 60.0)]
    procs = [ctx.Process(target=_join, args=(rank, port, seconds, out)) for rank, port, seconds in runs]
    for p in procs:
        p.start()
    try:
        got = {(port, rank): said for port, rank, said in (out.get(timeout=120) for _ in runs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[(alone0, 0)] == (
        f"DistributedError: rank 0: rank(s) [1] of 2 never joined the run in 2 s (the ranks meet at "
        f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{alone0}): see the output of rank(s) [1] for why they stopped; "
        "ranks started by hand need WORLD_SIZE=2 and the same MASTER_ADDR and MASTER_PORT each"
    )
    assert got[(alone1, 1)].startswith(
        f"DistributedError: rank 1: no rendezvous answered at MASTER_ADDR:MASTER_PORT 127.0.0.1:{alone1} ("
    ), got[(alone1, 1)]
    assert "rank 0 hosts it; see its output for why it stopped" in got[(alone1, 1)]
    assert got[(both, 0)] == got[(both, 1)] == "joined"  # ranks started by hand still meet


def _shm_rank(rank: int, init_file: str, name: str, out) -> None:
    """A rank of a 2-rank shared-memory group whose first rank may not write files over 16 KiB."""
    import resource
    import signal

    import torch.distributed as dist

    from neorec.distributed import shm

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python has it: the write fails with EFBIG instead
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    shm.uuid.uuid4 = lambda: uuid.UUID(name)  # the segment's name, known to the test
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        shm.ShmGroup([0, 1], rank, None, capacity=1 << 20)
        out.put((rank, "built", None, None))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, type(e).__name__, getattr(e, "errno", None), getattr(e, "filename", None)))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_shared_memory_group_that_cannot_be_made_names_its_file_and_leaves_nothing(tmp_path):
    from neorec.errors import failure

    name = uuid.uuid4().hex
    pattern = f"/dev/shm/neorec-*-{name}"  # neorec-<the first rank's pid>-<name>
    ctx = context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_shm_rank, args=(r, str(tmp_path / "init"), name, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {rank: rest for rank, *rest in (out.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(timeout=30)
        path = f"/dev/shm/neorec-{procs[0].pid}-{name}"
        assert got[0] == ["OSError", errno.EFBIG, path]  # the segment, named
        assert got[1][0] != "built"  # its peer stopped: the group is never made
        assert failure(OSError(errno.EFBIG, os.strerror(errno.EFBIG), path)) == (
            1, f"{path}: File too large (EFBIG); a file-size limit (ulimit -f) or the filesystem's largest "
            "file was reached",
        )  # fmt: skip
        assert glob.glob(f"{pattern}*") == []  # neither the segment nor either rank's wake-up pipe
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for leftover in glob.glob(f"{pattern}*"):
            os.unlink(leftover)


def test_a_peer_that_leaves_while_the_ranks_connect_is_one_line(monkeypatch):
    """Every rank said it was joining, then one died before gloo's connections were made (a worker
    SIGKILLed at start-up): its peer's RuntimeError from connectFullMesh was a traceback."""
    import torch
    import torch.distributed as dist

    from neorec.distributed import topology
    from neorec.errors import DistributedError

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    raised = RuntimeError(
        "Gloo connectFullMesh failed with [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
        "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:40750"
    )

    def init_process_group(store, **kwargs):
        store.set("neorec/joined/1", "1")  # rank 1 came, and went
        raise raised

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(DistributedError) as stopped:
        topology.init_distributed(torch.device("cpu"))
    assert str(stopped.value) == (
        "rank 0: a peer's process went away while the ranks were connecting (Gloo connectFullMesh failed "
        "with timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:40750); this rank stops "
        "too: the rank that failed first says why"
    )
    raised = RuntimeError("something else")  # not a peer's doing: kept as it is, a bug's traceback
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(RuntimeError, match="^something else$"):
        topology.init_distributed(torch.device("cpu"))
