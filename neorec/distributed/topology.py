"""Where this process sits: world size, ranks per node, node rank; read from torchrun's environment.

torchrun numbers ranks node by node, so rank = node_rank * local_world_size + local_rank; every node
runs the same number of processes. Hierarchical sharding (TWRW, TWCW) keeps a table inside one node
and uses this to tell intra-node peers from other nodes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from neorec.errors import PEER_GONE, ConfigError, DistributedError

# A rank that waits this long on a peer in a collective (gloo, or shared memory: shm.py) gives up
# with an error. A peer whose process died is noticed sooner: within about a second.
PEER_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True)
class Topology:
    world_size: int = 1
    rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise ConfigError(
                f"world size {self.world_size}, ranks per node {self.local_world_size}: each must be >= 1"
            )
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
        """torchrun's WORLD_SIZE / RANK / LOCAL_WORLD_SIZE (a single process when they are unset); a
        value that is not a whole number in its range is a ConfigError naming the variable."""
        world = _env_number("WORLD_SIZE", 1, 1, "the number of processes of the run")
        rank = _env_number("RANK", 0, 0, "this process's rank, 0 to WORLD_SIZE - 1")
        local = _env_number("LOCAL_WORLD_SIZE", world, 1, "the number of processes on this machine")
        if rank >= world:
            raise ConfigError(
                f"environment variable RANK={rank} with WORLD_SIZE={world}: a rank is 0 to {world - 1}"
            )
        if world % local:
            raise ConfigError(
                f"environment variables WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}: every machine runs the "
                "same number of processes, so WORLD_SIZE must be a multiple of LOCAL_WORLD_SIZE"
            )
        return Topology(world, rank, local)


def _env_number(name: str, default: int, low: int, meaning: str) -> int:
    """The whole number in environment variable `name` (`default` when unset), at least `low`."""
    text = os.environ.get(name)
    if text is None:
        return default
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdecimal() and len(digits) <= 9 else None
    if value is None or value < low:
        raise ConfigError(
            f"environment variable {name}={text[:40]!r}: expected a whole number >= {low} ({meaning}); "
            "torchrun sets it for each process it starts, or `neorec train --nproc N` starts them for you"
        )
    return value


def check_rank_environment() -> Topology:
    """This process's place in its run, from the variables torchrun sets (or a user who starts the ranks
    by hand: WORLD_SIZE, RANK, LOCAL_WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), checked before
    any work: a missing or wrong value is a ConfigError naming the variable, instead of torch's
    traceback after the run folder was taken."""
    topo = Topology.from_env()
    if topo.world_size == 1:
        return topo
    env = os.environ
    if "RANK" not in env:
        raise ConfigError(
            f"environment variable WORLD_SIZE={topo.world_size} without RANK: give each process its RANK "
            f"(0 to {topo.world_size - 1}), or unset WORLD_SIZE and start them with `neorec train --nproc N`"
        )
    if "LOCAL_RANK" in env:
        local = _env_number("LOCAL_RANK", 0, 0, "this process's rank on its machine")
        if local >= topo.local_world_size:
            raise ConfigError(
                f"environment variable LOCAL_RANK={local} with LOCAL_WORLD_SIZE={topo.local_world_size}: "
                f"a local rank is 0 to {topo.local_world_size - 1}"
            )
    if not env.get("MASTER_ADDR", "").strip():
        raise ConfigError(
            f"WORLD_SIZE={topo.world_size} but environment variable MASTER_ADDR is not set: set it to the "
            "host of rank 0 (127.0.0.1 on one machine), and MASTER_PORT to a free port there"
        )
    port = _env_number("MASTER_PORT", 0, 1, "the port rank 0 listens on, 1 to 65535")
    if port == 0 or port > 65535:
        what = "is not set" if port == 0 else f"is {port}, not a port (1 to 65535)"
        raise ConfigError(
            f"WORLD_SIZE={topo.world_size} but environment variable MASTER_PORT {what}: set it to a free "
            "port on the host of rank 0 (MASTER_ADDR), the same for every rank"
        )
    return topo


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
    choose_backend; on CUDA the rank's GPU becomes the current device first. A rank that does not
    join within PEER_TIMEOUT_SECONDS, or a rendezvous that never answers, is a DistributedError
    naming the ranks that never joined (ranks started by hand, or a node whose worker failed early:
    under one torchrun agent, the agent ends the others itself)."""
    topo = Topology.from_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if topo.world_size > 1 and not dist.is_initialized():
        num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        chosen = choose_backend(backend, device.type, topo.local_world_size, num_gpus)
        store = _rendezvous_store(topo)
        _say_joined(store, topo)
        kwargs = {"device_id": device} if chosen == "nccl" else {}
        try:
            dist.init_process_group(
                backend=chosen, rank=topo.rank, world_size=topo.world_size, store=store,
                timeout=timedelta(seconds=PEER_TIMEOUT_SECONDS), **kwargs,
            )  # fmt: skip
        except RuntimeError as e:  # torch's DistError among them
            missing = _never_joined(store, topo)
            if not missing and _peer_left(e):  # all came, and one went before the connections were made
                raise DistributedError(
                    f"rank {topo.rank}: a peer's process went away while the ranks were connecting "
                    f"({_first_line(e)}); this rank stops too: the rank that failed first says why"
                ) from e
            if not missing:
                raise
            raise DistributedError(
                f"rank {topo.rank}: rank(s) {missing} of {topo.world_size} never joined the run in "
                f"{PEER_TIMEOUT_SECONDS:.0f} s (the ranks meet at MASTER_ADDR:MASTER_PORT {_address()}): "
                f"see the output of rank(s) {missing} for why they stopped; ranks started by hand need "
                f"WORLD_SIZE={topo.world_size} and the same MASTER_ADDR and MASTER_PORT each"
            ) from e
    return topo


_JOINED = "neorec/joined/"  # a key per rank in the rendezvous store, set before it joins


def _say_joined(store: dist.Store, topo: Topology) -> None:
    """Count this rank in as joining (for the message of init_distributed, should a peer never come);
    a ConfigError when another process joined as this rank first: a second launch meeting a running
    run at its address, which gloo would leave waiting for a connection no one makes."""
    if store.add(f"{_JOINED}{topo.rank}", 1) > 1:
        raise ConfigError(
            f"rank {topo.rank}: another process already joined the run at MASTER_ADDR:MASTER_PORT "
            f"{_address()} as rank {topo.rank}: two runs meet at one address, or this rank was started "
            "twice; give each run its own MASTER_PORT"
        )


def _peer_left(error: BaseException) -> bool:
    """gloo's error of a peer gone while the ranks connect: refused, closed, or reset."""
    text = str(error)
    return "connectFullMesh" in text or any(s in text for s in ("Connection refused", *PEER_GONE))


def _first_line(error: BaseException) -> str:
    """The first line of torch's message, without gloo's source location, at most 200 characters."""
    text = " ".join(str(error).split("\n", 1)[0].split())
    return re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)[:200].rstrip(".")


def _address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def _never_joined(store: dist.Store, topo: Topology) -> list[int]:
    """The ranks that have not said they were joining (none when the store cannot tell)."""
    try:
        return [r for r in range(topo.world_size) if not store.check([f"{_JOINED}{r}"])]
    except dist.DistError:  # the store's host is gone: then rank 0 left, and its output says why
        return []


def _rendezvous_store(topo: Topology) -> dist.Store:
    """The store the ranks meet in: under torchrun's agent store, a view of it with a key prefix per
    restart attempt; otherwise (ranks started by hand) a TCPStore at MASTER_ADDR:MASTER_PORT that rank 0
    hosts, as init_process_group's env:// would make. A rendezvous that cannot be reached is one line.

    torchrun (torch >= 2.4) hands its workers the rendezvous TCPStore, which outlives a restart, and
    torch connects to it without a per-attempt prefix: the restarted workers then find the dead
    workers' gloo addresses under the same keys and fail in connectFullMesh. A prefix per
    TORCHELASTIC_RESTART_COUNT gives every attempt keys of its own (what
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 achieved with a new store per attempt)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = not agent and topo.rank == 0
    try:
        if agent:
            from torch.distributed.constants import default_pg_timeout

            client = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topo.world_size, is_master=False,
                timeout=default_pg_timeout,
            )  # fmt: skip
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return dist.PrefixStore(f"neorec/attempt-{attempt}/", client)
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topo.world_size, is_master=host,
            timeout=timedelta(seconds=PEER_TIMEOUT_SECONDS), wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
    except dist.DistError as e:
        reason = _first_line(e)
        if host:
            raise ConfigError(
                f"rank 0 cannot host the rendezvous at MASTER_ADDR:MASTER_PORT {_address()} ({reason}): "
                "give MASTER_PORT a free port of this machine (the same for every rank); another run's "
                "rank 0 may be using this one"
            ) from e
        who = "torchrun's agent of the first node" if agent else "rank 0"
        raise DistributedError(
            f"rank {topo.rank}: no rendezvous answered at MASTER_ADDR:MASTER_PORT {_address()} ({reason}): "
            f"{who} hosts it; see its output for why it stopped, and check that every rank has the same "
            "MASTER_ADDR and MASTER_PORT"
        ) from e
