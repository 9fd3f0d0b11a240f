"""Where this process sits: world size, ranks per node, node rank; read from torchrun's environment.

torchrun numbers ranks node by node, so rank = node_rank * local_world_size + local_rank; every node
runs the same number of processes. Hierarchical sharding (TWRW, TWCW) keeps a table inside one node
and uses this to tell intra-node peers from other nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from neorec.errors import ConfigError

# A rank that waits this long on a peer in a collective (gloo, or shared memory: shm.py) gives up
# with an error. A peer whose process died is noticed sooner: within about a second.
PEER_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True)
class Topology:
    world_size: int = 1
    rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size % self.local_world_size:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of the ranks per node {self.local_world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world size {self.world_size}")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    @staticmethod
    def from_env() -> Topology:
        """torchrun's WORLD_SIZE / RANK / LOCAL_WORLD_SIZE (a single process when they are unset)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        return Topology(world, rank, local)


def choose_backend(requested: str, device_type: str, ranks_per_node: int, num_gpus: int) -> str:
    """The process group's backend (distributed.backend): NCCL where every rank of a node has a GPU
    of its own, gloo otherwise (CPU training, or ranks that share GPUs: the exchanges then stage
    device tensors through pinned host memory, neorec/distributed/staging.py). NCCL cannot run two
    ranks on one device, so asking for it then is an error that names the fix."""
    if requested not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"distributed.backend must be auto, nccl or gloo, got {requested!r}")
    if device_type != "cuda":
        if requested == "nccl":
            raise ConfigError("distributed.backend: nccl needs train.device: cuda; CPU ranks use gloo")
        return "gloo"
    if requested == "auto":
        return "nccl" if ranks_per_node <= num_gpus else "gloo"
    if requested == "nccl" and ranks_per_node > num_gpus:
        raise ConfigError(
            f"distributed.backend: nccl needs a GPU per rank, but {ranks_per_node} ranks on this node share "
            f"{num_gpus} GPU(s) and NCCL cannot run two ranks on one device: set distributed.backend: gloo "
            f"(the ranks then share the GPUs), or start at most {num_gpus} process(es) per node"
        )
    return requested


def rank_device(device_type: str, local_rank: int, num_gpus: int) -> torch.device:
    """This rank's device: GPU local_rank (ranks beyond the node's GPUs share them round-robin), or
    the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    if num_gpus < 1:
        raise ConfigError(
            f"train.device is cuda but this PyTorch ({torch.__version__}) sees no GPU "
            "(a CPU build, or no device); use train.device: cpu"
        )
    return torch.device("cuda", local_rank % num_gpus)


def init_distributed(device: torch.device, backend: str = "auto") -> Topology:
    """Join the process group torchrun set up (a no-op for one process). `backend` as
    choose_backend; on CUDA the rank's GPU becomes the current device first."""
    topo = Topology.from_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if topo.world_size > 1 and not dist.is_initialized():
        num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        chosen = choose_backend(backend, device.type, topo.local_world_size, num_gpus)
        store = _restart_store(topo)
        kwargs = {"device_id": device} if chosen == "nccl" else {}
        dist.init_process_group(
            backend=chosen, rank=topo.rank, world_size=topo.world_size, store=store,
            timeout=timedelta(seconds=PEER_TIMEOUT_SECONDS), **kwargs,
        )  # fmt: skip
    return topo


def _restart_store(topo: Topology) -> dist.Store | None:
    """Under torchrun's agent store, a view of it with a key prefix per restart attempt; else None
    (init_process_group reads MASTER_ADDR/PORT itself).

    torchrun (torch >= 2.4) hands its workers the rendezvous TCPStore, which outlives a restart, and
    torch connects to it without a per-attempt prefix: the restarted workers then find the dead
    workers' gloo addresses under the same keys and fail in connectFullMesh. A prefix per
    TORCHELASTIC_RESTART_COUNT gives every attempt keys of its own (what
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 achieved with a new store per attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.constants import default_pg_timeout

    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topo.world_size, is_master=False,
        timeout=default_pg_timeout,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"neorec/attempt-{attempt}/", client)
