"""Where this process sits: world size, ranks per node, node rank; read from torchrun's environment.

torchrun numbers ranks node by node, so rank = node_rank * local_world_size + local_rank; every node
runs the same number of processes. Hierarchical sharding (TWRW, TWCW) keeps a table inside one node
and uses this to tell intra-node peers from other nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from neorec.errors import ConfigError


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


def init_distributed(device: torch.device) -> Topology:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); a no-op for one process."""
    topo = Topology.from_env()
    if topo.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, rank=topo.rank, world_size=topo.world_size)
    return topo
