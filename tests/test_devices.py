"""Which device and backend each rank gets, and the staging of tensors for the transport.

Runs without a GPU: the choices are pure functions of the device count, and the staging path is
exercised with CPU tensors standing in for GPU ones (Comms(stage=True) copies every tensor through
a separate wire buffer, as a GPU tensor is copied through pinned host memory for gloo)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import spawn
from test_distributed import PLANS_2, check_against_single, sharded_run

from neorec.config.load import load_config
from neorec.distributed.staging import Staging
from neorec.distributed.topology import choose_backend, rank_device
from neorec.errors import ConfigError


def test_backend_is_nccl_only_where_every_rank_has_a_gpu():
    assert choose_backend("auto", "cpu", 4, 0) == "gloo"
    assert choose_backend("auto", "cuda", 8, 8) == "nccl"
    assert choose_backend("auto", "cuda", 2, 1) == "gloo"  # ranks share the GPU
    assert choose_backend("gloo", "cuda", 2, 2) == "gloo"
    assert choose_backend("nccl", "cuda", 2, 4) == "nccl"


def test_nccl_with_two_ranks_on_one_gpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"2 ranks on this node share 1 GPU.*distributed.backend: gloo"):
        choose_backend("nccl", "cuda", 2, 1)
    with pytest.raises(ConfigError, match="nccl needs train.device: cuda"):
        choose_backend("nccl", "cpu", 2, 0)


def test_ranks_take_their_local_gpu_and_share_round_robin():
    assert rank_device("cpu", 3, 0) == torch.device("cpu")
    assert rank_device("cuda", 1, 8) == torch.device("cuda", 1)
    assert [rank_device("cuda", r, 2).index for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match="sees no GPU"):
        rank_device("cuda", 0, 0)


def test_multi_process_cuda_config_is_checked_before_any_work(monkeypatch, tmp_path):
    """Under torchrun with 2 ranks on a 1-GPU machine: nccl is refused before the process group or
    any table exists; auto and gloo put both ranks on GPU 0."""
    from neorec.train import trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    nccl = load_config("default", ["train.device=cuda", "distributed.backend=nccl"])
    with pytest.raises(ConfigError, match="set distributed.backend: gloo"):
        trainer.Trainer(nccl, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    for backend in ("auto", "gloo"):
        cfg = load_config("default", ["train.device=cuda", f"distributed.backend={backend}"])
        assert trainer._training_device(cfg) == torch.device("cuda", 0)


def test_staging_copies_through_a_wire_buffer_of_its_own():
    x = torch.arange(12.0).view(3, 4)
    staging = Staging("gloo", force=True)
    assert staging.needed(x)
    wire = staging.down(x)
    assert torch.equal(wire, x) and wire.data_ptr() != x.data_ptr()
    back = staging.up(wire, x.device)
    assert torch.equal(back, x) and back.data_ptr() != wire.data_ptr()
    plain = Staging("gloo")  # host tensors go to gloo as they are
    assert not plain.needed(x) and plain.up(wire, x.device) is wire


def staged_run(topo, plan, optimizer_name, transport):
    """sharded_run with every exchange of the step staged (Comms(stage=True))."""
    return sharded_run(topo, plan, optimizer_name, transport=transport, stage=True)


@pytest.mark.distributed
@pytest.mark.parametrize("transport", ["shm", "backend"])
def test_staged_exchanges_train_like_one_process(transport, tmp_path):
    """A mixed plan (tw, rw, cw, dp with owner updates, twrw) with every id, pooled, gradient,
    replica and dense exchange staged: the same losses and tables as one process."""
    results = spawn(2, staged_run, (PLANS_2["mixed"], "adagrad", transport), tmp_path=tmp_path)
    check_against_single(results, "adagrad")


def gather_run(topo):
    from neorec.distributed.comms import Comms

    comms = Comms(topo, transport="backend", stage=True)
    mine = torch.full((3, 2), float(topo.rank))
    value = torch.tensor([5.0 + topo.rank])
    comms.broadcast(value, src=1)
    return comms.all_gather(mine, "eval"), value


@pytest.mark.distributed
def test_all_gather_and_broadcast_through_staging(tmp_path):
    results = spawn(2, gather_run, tmp_path=tmp_path)
    for rank in (0, 1):
        gathered, value = results[rank]
        assert gathered.tolist() == [[0.0, 0.0]] * 3 + [[1.0, 1.0]] * 3
        assert value.tolist() == [6.0]


def test_gpu_runs_plan_against_the_gpus_free_memory(monkeypatch):
    """A cuda run's planner cluster is this machine's GPUs (torch.cuda.mem_get_info): ranks that
    share a GPU split its memory and exchange through host memory over gloo; ranks with GPUs of
    their own get all of theirs and NVLink."""
    from neorec.planner import hardware
    from neorec.train.run_plan import cluster_for_run

    gib = 2**30
    monkeypatch.setattr(hardware, "load_calibration", lambda: {})  # this VM's figures, not a file's
    shared = hardware.gpu_machine(2, 2, "NVIDIA H100 80GB HBM3", 78 * gib, 1, 128 * gib)
    own = hardware.gpu_machine(2, 2, "NVIDIA H100 80GB HBM3", 78 * gib, 2, 128 * gib)
    assert shared.tiers[0].capacity == pytest.approx(0.9 * 78 * gib / 2, rel=1e-6)
    assert own.tiers[0].capacity == pytest.approx(0.9 * 78 * gib, rel=1e-6)
    assert shared.intra_node_bandwidth < own.intra_node_bandwidth
    # ranks sharing a GPU exchange over gloo between processes: its calibrated link and latency
    assert shared.intra_node_bandwidth == hardware.CALIBRATED_CPU["link_bandwidth"]
    assert shared.latency == hardware.CALIBRATED_CPU["latency"] > own.latency
    assert shared.tiers[1].name == "host" and shared.tiers[1].capacity == pytest.approx(0.9 * 64 * gib, rel=1e-6)
    assert hardware.gpu_kind("NVIDIA A100-SXM4-80GB") == "a100" and hardware.gpu_kind("NVIDIA H200") == "h200"

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cluster = cluster_for_run(load_config("default", ["train.device=cuda"]), 2, 2)
    assert cluster.tiers[0].capacity == pytest.approx(0.9 * 40 * gib / 2, rel=1e-6)
    assert cluster_for_run(load_config("default"), 2, 2).name == "this machine (CPU)"
