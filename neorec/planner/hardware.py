"""What the planner plans for: ranks, nodes, memory tiers, links, and how fast each does our work.

A `Cluster` is the machine side of the cost model. Every speed is an *effective* rate of the
operation neorec runs, not a data-sheet peak: `lookup_bandwidth` is the bytes of embedding rows a
fused lookup reads per second from that tier, `update_bandwidth` the same for the fused
backward+update, `stream_bandwidth` the rate of the elementwise work on exchange buffers (codecs,
id routing, column assembly), link bandwidths count bytes sent plus bytes received per rank.

Presets:
- `this_machine`: the CPU box we run on. Its speeds come from `neorec plan --calibrate`
  (micro-benchmarks with one process per core, saved as JSON) or, without a calibration file, from
  the values measured on this project's 2-core VM (CALIBRATED_CPU below). Memory: the host's RAM,
  and, when given a folder for table files (embedding.cache.directory), an SSD tier: the free space
  of that folder's filesystem, at the calibrated random-page speeds of calibrate.measure_ssd.
- `gpu_node("a100" | "h100" | "h200")`: one 8-GPU node (80 GB per GPU, NVLink inside the node).
- `paper_cluster`: 16 nodes x 8 A100 80 GB with 200 Gb/s RDMA per GPU and 2 TB of host DRAM per
  node, the cluster of Mudigere et al. GPU speeds are data-sheet figures times the share of them
  neorec's work reaches (GPU_EFFICIENCY): measured on an H100 and an H200 for the embedding kernels
  and the row cache, stated assumptions for the links.

Memory tiers, fastest first: "device" (memory next to the compute: GPU HBM, or DRAM for a CPU),
"host" (host DRAM read by a GPU over PCIe) and "ssd" (files on a local SSD, read and written in
pages). Where a table's rows go among them, directly or behind a row cache in device memory, is the
plan tier of tiers.py.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from neorec.distributed.topology import Topology
from neorec.errors import ConfigError
from neorec.utils.files import read_json

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class MemoryTier:
    name: str  # "device" | "host" | "ssd"
    capacity: int  # bytes per rank
    lookup_bandwidth: float  # bytes of rows read per second by the fused lookup (ssd: by a cache's misses)
    update_bandwidth: float  # bytes of rows/state/gradients moved per second by the fused backward+update
    # (ssd: written back by a cache)
    access_bytes: int = 0  # bytes one random row access moves at least (a page on SSD); 0: the row's bytes


@dataclass(frozen=True)
class Cluster:
    name: str
    world_size: int
    ranks_per_node: int
    tiers: tuple[MemoryTier, ...]
    intra_node_bandwidth: float  # bytes/s a rank sends + receives to/from ranks of its own node
    inter_node_bandwidth: float  # bytes/s a rank sends + receives to/from other nodes
    latency: float  # seconds per collective call
    stream_bandwidth: float  # bytes/s of elementwise work on exchange buffers
    lookup_per_id: float  # seconds per id looked up (bag bookkeeping, index arithmetic)
    update_per_id: float  # seconds per id in backward (sort, segment sums)
    op_overhead: float = 0.0  # seconds of fixed cost per small tensor op on the host (routing ids)
    reserved: int = 0  # device bytes per rank kept for the runtime, the dense model and activations
    staged: bool = False  # ranks share GPUs: every exchange goes through host memory over gloo
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"cluster {self.name!r}: world size {self.world_size} must be a positive multiple of the "
                f"ranks per node {self.ranks_per_node}"
            )
        if not self.tiers or self.tiers[0].name != "device":
            raise ConfigError(f"cluster {self.name!r}: the first memory tier must be 'device'")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def has_host_tier(self) -> bool:
        """False on a CPU machine, whose "device" tier is the host's RAM."""
        return any(t.name == "host" for t in self.tiers)

    def topology(self) -> Topology:
        return Topology(self.world_size, 0, self.ranks_per_node)

    def tier(self, name: str) -> MemoryTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ConfigError(
            f"cluster {self.name!r} has no memory tier {name!r}; tiers: {[t.name for t in self.tiers]}"
        )

    def with_ranks(self, world_size: int, ranks_per_node: int | None = None) -> Cluster:
        return replace(self, world_size=world_size, ranks_per_node=ranks_per_node or self.ranks_per_node)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- this machine ---------------------------------------------------------------------------------
# Measured on this project's 2-core VM with `neorec plan --calibrate` (2 processes x 1 thread, gloo);
# used when no calibration file exists. Re-measure with `neorec plan --calibrate` on another machine.
CALIBRATED_CPU = {
    "lookup_bandwidth": 0.55e9,
    "update_bandwidth": 0.9e9,
    "lookup_per_id": 60e-9,
    "update_per_id": 250e-9,
    "stream_bandwidth": 1.5e9,
    "link_bandwidth": 1.0e9,
    "latency": 150e-6,
    "op_overhead": 12e-6,
    # calibrate.measure_ssd on the VM's virtual disk (bytes of 4 KiB pages; 16 threads; file not cached;
    # a 512-byte write-back into an uncached page reads the page first): 107-118 and 36-50 MB/s
    "ssd_read_bandwidth": 1.1e8,
    "ssd_write_bandwidth": 0.45e8,
}
CALIBRATION_KEYS = tuple(CALIBRATED_CPU)
SSD_PAGE = 4096  # a random access to a file moves at least a page
# Resident memory a training process adds besides its tables and embedding buffers (the dense model
# and its optimizer, gloo's buffers, the trainer's objects): the growth of a rank holding no table
# in the Kaggle-like model on this machine (benchmarks/planner_validation.py, RESULTS.md).
CPU_RUNTIME_BYTES = 64 * 2**20


def calibration_path() -> Path:
    """Where `neorec plan --calibrate` writes and the planner reads this machine's speeds."""
    env = os.environ.get("NEOREC_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "neorec" / "calibration.json"


def load_calibration(path: str | Path | None = None) -> dict[str, float]:
    """The saved calibration, or CALIBRATED_CPU when there is none."""
    p = Path(path) if path else calibration_path()
    if not p.is_file():
        if path:
            raise ConfigError(f"calibration file {p} does not exist; run `neorec plan --calibrate` first")
        return dict(CALIBRATED_CPU)
    hint = "run `neorec plan --calibrate` again"  # its "crc32" checked; one written by hand may have none
    data = read_json(p, "calibration file", hint, ConfigError, keys=(*CALIBRATION_KEYS, "measured"))
    return calibration_values(data, f"calibration file {p}")


def calibration_values(data: dict, where: str) -> dict[str, float]:
    """The speeds of a parsed calibration (`where` names it in errors): each a finite number > 0, not a
    boolean, and "measured" a mapping when present; a key a file from an older neorec lacks keeps the
    built-in value. ConfigError naming the keys otherwise, before any plan uses them."""
    data = {**CALIBRATED_CPU, **data}
    bad = [k for k in CALIBRATION_KEYS if not _positive_number(data[k])]
    if bad:
        got = ", ".join(f"{k} {data[k]!r}" for k in bad)
        raise ConfigError(f"{where}: {got}: expected finite numbers > 0; rerun `neorec plan --calibrate`")
    if not isinstance(data.get("measured", {}), dict):
        raise ConfigError(f"{where}: 'measured' is {type(data['measured']).__name__}, expected a mapping")
    return {k: float(data[k]) for k in CALIBRATION_KEYS}


def _positive_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an integer beyond float
        return False


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GIB


def disk_free_bytes(directory: str | Path) -> int:
    """Free bytes of the filesystem that holds `directory` (or would: its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def this_machine(
    world_size: int = 1,
    ranks_per_node: int | None = None,
    calibration: dict[str, float] | None = None,
    memory: int | None = None,
    ssd_directory: str | Path | None = None,
    disk: int | None = None,
) -> Cluster:
    """This CPU box with `world_size` processes; each gets an equal share of the RAM (90% of it) and,
    with `ssd_directory` (where cached tables' files go) or `disk` (bytes, overriding the free space
    measured there; 0: none), of the disk (90% of the free space) as an SSD tier."""
    c = {**CALIBRATED_CPU, **(calibration or load_calibration())}
    per_node = ranks_per_node or world_size
    per_rank = int(0.9 * (memory or host_memory_bytes()) / per_node)
    tiers = [MemoryTier("device", per_rank, c["lookup_bandwidth"], c["update_bandwidth"])]
    if disk is None and ssd_directory is not None:
        disk = disk_free_bytes(ssd_directory)
    if disk:
        tiers.append(
            MemoryTier(
                "ssd", int(0.9 * disk / per_node), c["ssd_read_bandwidth"], c["ssd_write_bandwidth"], SSD_PAGE
            )
        )
    return Cluster(
        name="this machine (CPU)",
        world_size=world_size,
        ranks_per_node=per_node,
        tiers=tuple(tiers),
        intra_node_bandwidth=c["link_bandwidth"],
        inter_node_bandwidth=c["link_bandwidth"],
        latency=c["latency"],
        stream_bandwidth=c["stream_bandwidth"],
        lookup_per_id=c["lookup_per_id"],
        update_per_id=c["update_per_id"],
        op_overhead=c["op_overhead"],
        reserved=CPU_RUNTIME_BYTES,
        notes={"speeds": "calibrated (neorec plan --calibrate)"},
    )


# ---- GPUs -----------------------------------------------------------------------------------------
# Share of the data-sheet rate that neorec's work reaches. Measured (benchmarks/RESULTS.md,
# 2026-11-26 and 2026-11-28; 26 tables of 1M rows, Zipf 1.05):
# - hbm_lookup: the Triton pooling kernel, multi-hot batch 16,384, dim 128, on an H100: 0.95 ms for
#   2.0 GB of rows read and output written, 2.1 TB/s of 3.35 (benchmarks/embedding_ops_gpu.py --profile);
#   on an H200 (2026-11-28, benchmarks/embedding_stages.py, the lookup's device time): 0.69 ms, 2.98
#   TB/s of 4.8 (0.62).
# - hbm_update: the fused backward+update (sort, gradient sums, row-wise AdaGrad) on an H200, timed
#   from the host: 4.2 ms for 1.07 GB of gradient, rows and state, 252 GB/s of 4.8 TB/s.
# - host_cache: a row cache in GPU memory over host memory, 20% of rows cached, batch 2,048, dim 64,
#   AdaGrad, on an H200 (benchmarks/cache.py --device cuda --tier dram, 2026-11-28): 3.83 ms more
#   per step than the tables in GPU memory (10.46 against 6.63 ms) for 5.08 MiB of records brought
#   in and as much written back (2.55 ms on 2026-11-26, the cached groups then on the torch path).
#   Costed as the host tier's lookup rate L and update rate L / 2 (tiers.cache_traffic: 3 x 5.33 MB
#   / L = 3.83 ms), L = 4.2 GB/s of the 64 GB/s of PCIe 5 x16. At this batch both runs are bound by
#   host time, so this is mostly the cache's bookkeeping, not the link.
# Assumed (not measured here: the lent machines have one GPU): nvlink, rdma, and pcie for ranks that
# share a GPU and exchange through pinned host memory.
GPU_EFFICIENCY = {
    "hbm_lookup": 0.63,
    "hbm_update": 0.053,
    "host_cache": 0.065,
    "pcie": 0.5,
    "nvlink": 0.7,
    "rdma": 0.8,
}

_GPUS = {
    # HBM bytes/s, NVLink bytes/s (both directions), PCIe bytes/s (one direction), host DRAM per node
    "a100": {"hbm": 2.039e12, "nvlink": 600e9, "pcie": 32e9, "host": 2 * 10**12},
    "h100": {"hbm": 3.35e12, "nvlink": 900e9, "pcie": 64e9, "host": 2 * 10**12},
    "h200": {"hbm": 4.8e12, "nvlink": 900e9, "pcie": 64e9, "host": 2 * 10**12},
}


def _gpu_cluster(
    gpu: str,
    nodes: int,
    ranks_per_node: int,
    inter_gbit_per_gpu: float,
    device_gb: float = 80.0,
    name: str = "",
) -> Cluster:
    if gpu not in _GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}; known: {sorted(_GPUS)}")
    g, e = _GPUS[gpu], GPU_EFFICIENCY
    device = MemoryTier("device", int(device_gb * GB), g["hbm"] * e["hbm_lookup"], g["hbm"] * e["hbm_update"])
    # host DRAM behind a row cache in GPU memory: records cross PCIe once for the lookup, twice
    # (read + write back) for the update, at the measured rate of the cache's transfers
    host = MemoryTier(
        "host", int(g["host"] / ranks_per_node), g["pcie"] * e["host_cache"], g["pcie"] * e["host_cache"] / 2
    )
    return Cluster(
        name=name or f"{nodes} x {ranks_per_node} {gpu.upper()}",
        world_size=nodes * ranks_per_node,
        ranks_per_node=ranks_per_node,
        tiers=(device, host),
        intra_node_bandwidth=g["nvlink"] * e["nvlink"],
        inter_node_bandwidth=2 * inter_gbit_per_gpu / 8 * 1e9 * e["rdma"],  # both directions
        latency=30e-6,
        stream_bandwidth=g["hbm"] * 0.5,
        lookup_per_id=2e-12,
        update_per_id=1e-11,
        reserved=8 * GB,  # CUDA context, NCCL buffers, dense model and optimizer, activations
        notes={"speeds": f"data sheet x efficiency {GPU_EFFICIENCY} (links assumed)"},
    )


def gpu_kind(device_name: str) -> str:
    """The _GPUS entry for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100"); an unknown GPU
    is costed as an A100, the slowest of them."""
    name = device_name.lower()
    return next((kind for kind in ("h200", "h100") if kind in name), "a100")


def gpu_machine(
    world_size: int,
    ranks_per_node: int,
    device_name: str,
    device_free_bytes: int,
    num_gpus: int,
    host_bytes: int,
) -> Cluster:
    """One node of `num_gpus` GPUs and `ranks_per_node` ranks: each rank's device tier is its share of
    the GPU memory free now (ranks that share a GPU split it), its host tier its share of the RAM.
    Ranks on GPUs of their own exchange over NVLink; ranks that share a GPU through pinned host
    memory and gloo between processes, costed at the slower of PCIe and this machine's gloo link
    (its `neorec plan --calibrate` figures, else CALIBRATED_CPU's), with gloo's latency."""
    if num_gpus < 1:
        raise ConfigError("a GPU machine needs at least one GPU")
    gpu = gpu_kind(device_name)
    per_gpu = -(-ranks_per_node // num_gpus)  # ranks on the busiest GPU
    device_gb = 0.9 * device_free_bytes / per_gpu / GB
    nodes = max(1, world_size // ranks_per_node)
    c = _gpu_cluster(gpu, nodes, ranks_per_node, 200.0, device_gb, name=f"this machine ({device_name})")
    host = replace(c.tiers[1], capacity=int(0.9 * host_bytes / ranks_per_node))
    link, latency = c.intra_node_bandwidth, c.latency
    if per_gpu > 1:
        gloo = {**CALIBRATED_CPU, **load_calibration()}
        link = min(_GPUS[gpu]["pcie"] * GPU_EFFICIENCY["pcie"], gloo["link_bandwidth"])
        latency = max(latency, gloo["latency"])
    reserved = min(c.reserved, device_free_bytes // (4 * per_gpu))  # a shared GPU holds each rank's runtime
    return replace(
        c, tiers=(c.tiers[0], host), intra_node_bandwidth=link, latency=latency, reserved=reserved, staged=per_gpu > 1
    )


def this_gpu_machine(world_size: int, ranks_per_node: int | None = None) -> Cluster:
    """This machine's GPUs as torch sees them: device name, free memory (torch.cuda.mem_get_info)."""
    import torch

    free, _total = torch.cuda.mem_get_info()
    return gpu_machine(
        world_size, ranks_per_node or world_size, torch.cuda.get_device_name(), free, torch.cuda.device_count(),
        host_memory_bytes(),
    )  # fmt: skip


def gpu_node(gpu: str = "a100") -> Cluster:
    """One 8-GPU node (DGX-like): 80 GB per GPU, NVLink, 2 TB host DRAM."""
    return _gpu_cluster(gpu, 1, 8, 200.0, name=f"8 x {gpu.upper()} node")


def paper_cluster(gpu: str = "a100") -> Cluster:
    """16 nodes x 8 GPUs, 80 GB each, 200 Gb/s RDMA per GPU, 2 TB host DRAM per node."""
    return _gpu_cluster(gpu, 16, 8, 200.0, name=f"16 x 8 {gpu.upper()} 80GB, 200 Gb/s RDMA per GPU")


PRESETS = ("this", "a100-node", "h100-node", "paper")


def preset(
    name: str,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    ssd_directory: str | Path | None = None,
) -> Cluster:
    """A cluster by name (PRESETS); `world_size` overrides the number of ranks where it makes sense;
    `ssd_directory` gives this machine an SSD tier (see this_machine)."""
    if name == "this":
        return this_machine(world_size or 2, ranks_per_node, ssd_directory=ssd_directory)
    if name in ("a100-node", "h100-node"):
        c = gpu_node(name.split("-")[0])
    elif name == "paper":
        c = paper_cluster()
    else:
        raise ConfigError(f"unknown cluster preset {name!r}; choose one of {list(PRESETS)}")
    return c.with_ranks(world_size, ranks_per_node) if world_size else c
