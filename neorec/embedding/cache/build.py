"""Build cached storage for the fused engine: which tables are cached, over which tier, how big.

`cached_storage_factory(...)` returns the GroupStorageFactory the fused engine calls once per group
of tables (see neorec/embedding/fused/storage.py); a group whose tables are all in tier "memory"
gets plain tensors, as without a cache. Tiers:
- memory: a plain tensor in RAM, no cache (the default);
- dram: every row in a host-memory tensor behind a cache: in GPU memory when the engine runs on a
  GPU (the paper's device-memory cache over host DRAM; coming batches' misses are read ahead on the
  worker thread), else in RAM (mostly useful for tests);
- ssd: every row in a file under `directory`, created window by window (never whole in RAM), behind
  a cache in RAM, or in GPU memory when the engine runs on a GPU.

Each group gets one backing store of records (a row's weights and optimizer state side by side,
records.py): for ssd, one file `<first table>.rows.bin` per group, and its write log
`<first table>.rows.log` (write_log.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neorec.embedding.cache import device_io
from neorec.embedding.cache.backing import DramBacking, SsdBacking, create_ssd_file
from neorec.embedding.cache.cache import POLICIES, RowCache
from neorec.embedding.cache.cached_storage import CachedStorage
from neorec.embedding.cache.records import RecordLayout, rows_in_mib
from neorec.embedding.fused.storage import GroupStorageFactory, RowStorage, StorageSpec, build_tensor_storage
from neorec.errors import ConfigError
from neorec.utils.cores import processes_on_node, usable_cores

TIERS = ("memory", "dram", "ssd")


@dataclass
class CacheSettings:
    """How cached tables are stored; see neorec/config/schema.py CacheConfig for each field."""

    policy: str = "lru"
    fraction: float | None = 0.2  # share of each cached group's rows kept in the cache
    size_mib: float | None = None  # or: MiB of cache (rows + optimizer state) shared by all groups
    directory: str | Path | None = None  # where ssd tables' files go
    release_mib: float | str = "auto"  # ssd: drop the maps' resident pages after this many MiB
    ssd_reads: str = "map"  # ssd: "map" (gather from the file's map) or "pread" (I/O threads)
    ssd_log: float = 1.0  # ssd: write log as a share of the rows (write_log.py); 0: writes in place
    io_thread: bool | str = "auto"  # ssd: reads ahead and write-backs on a worker thread: True, False, "auto"
    # tables whose group's cache holds another share of its rows than `fraction` (distributed.sharding
    # cache_fraction); the fused engine puts tables of different fractions in different groups
    fractions: dict[str, float] = field(default_factory=dict)


def cached_storage_factory(
    tiers: dict[str, str], settings: CacheSettings, total_cached_rows: int = 0
) -> GroupStorageFactory:
    """tiers: table name -> tier (missing = memory). total_cached_rows: rows of all cached tables,
    to split settings.size_mib between groups in proportion to their rows."""
    if settings.policy not in POLICIES:
        raise ConfigError(f"embedding.cache.policy must be one of {POLICIES}, got {settings.policy!r}")
    for name, tier in tiers.items():
        if tier not in TIERS:
            raise ConfigError(f"embedding.tables.{name}.tier must be one of {TIERS}, got {tier!r}")
    if "ssd" in tiers.values() and settings.directory is None:
        raise ConfigError("tables with tier ssd need embedding.cache.directory (a folder for their files)")

    def build(
        tables: list[tuple[str, int, int]], specs: dict[str, StorageSpec], device: torch.device
    ) -> dict[str, RowStorage]:
        names = [t[0] for t in tables]
        group_tiers = {tiers.get(n, "memory") for n in names}
        if group_tiers == {"memory"}:
            return {
                n: build_tensor_storage(s.num_rows, s.width, s.dtype, device, s.init)
                for n, s in specs.items()
            }
        if len(group_tiers) > 1:
            by_tier = {
                tier: [n for n in names if tiers.get(n, "memory") == tier] for tier in sorted(group_tiers)
            }
            raise ConfigError(
                f"tables {names} share one buffer (same dim, dtype and optimizer) but have different tiers "
                f"{by_tier}; give them the same embedding.tables.<name>.tier, or another dtype/optimizer"
            )
        tier = group_tiers.pop()
        backing = _backing(tier, names[0], specs, settings)
        capacity = _capacity(names, specs, settings, total_cached_rows)
        # a cache in RAM over RAM reads nothing ahead (the worker would only add a hand-over); one in
        # device memory reads ahead so that the copies to and from the host overlap the step
        ahead = tier != "dram" or device_io.stages_through_host(device)
        io_thread = ahead and use_io_thread(settings.io_thread, device)
        cache = RowCache(tables, backing, capacity, settings.policy, device=device, io_thread=io_thread)
        return {name: CachedStorage(cache, name) for name in specs}

    return build


def use_io_thread(setting: bool | str, device: torch.device | str = "cpu") -> bool:
    """embedding.cache.io_thread: True, False, or "auto": on a CPU, on when a core is left once
    torch's intra-op threads of every process on this node (torchrun's LOCAL_WORLD_SIZE) have theirs.
    On a machine they fill, the worker's reads and writes displace an intra-op thread, and each
    parallel operator waits for the thread it displaced: measured on 2 cores, that costs more than the
    reads it hides (benchmarks/history/design_choices.md). With the cache on a
    GPU (`device`) the step's operators run there, not on the intra-op threads, so auto is on."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ConfigError(f"embedding.cache.io_thread must be true, false or auto, got {setting!r}")
    if torch.device(device).type != "cpu":
        return True
    return usable_cores() > torch.get_num_threads() * processes_on_node()


def _backing(tier: str, table: str, specs: dict[str, StorageSpec], settings: CacheSettings):
    layout = RecordLayout([(name, spec.width, spec.dtype) for name, spec in specs.items()])
    num_rows = specs["weight"].num_rows
    inits = {name: spec.init for name, spec in specs.items()}
    if tier == "dram":
        return DramBacking.create(layout, num_rows, inits)
    assert settings.directory is not None  # checked when the factory was made
    path = Path(settings.directory) / f"{table}.rows.bin"
    create_ssd_file(path, layout, num_rows, inits, settings.ssd_log)
    return SsdBacking(
        path, layout, num_rows, release_bytes(settings.release_mib), settings.ssd_reads, settings.ssd_log
    )


def release_bytes(setting: float | str) -> int:
    """embedding.cache.release_mib in bytes; "auto": a quarter of the machine's memory over the
    processes on this node (torchrun's LOCAL_WORLD_SIZE). The mapped pages are page-cache pages the
    kernel keeps (and may reclaim) whether the process maps them or not: dropping them changes what
    RSS counts, not what memory is used, and costs a fault per page-cache folio when the rows are read
    again. With scattered misses, a step's reads touch most of a file's 2 MiB folios, so a bound below
    the files drops the maps several times a step (256 MiB: 3.7 drops a step and 3.8 ms of faults in
    the 20% cached sweep, benchmarks/history/design_choices.md). A number bounds RSS under a budget."""
    if setting == "auto":
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * page // 4 // processes_on_node()
    if isinstance(setting, str) or not setting > 0:
        raise ConfigError(
            f"embedding.cache.release_mib must be a positive number of MiB or auto, got {setting!r}"
        )
    return int(setting * 2**20)


def _capacity(
    names: list[str], specs: dict[str, StorageSpec], settings: CacheSettings, total_rows: int
) -> int:
    num_rows = specs["weight"].num_rows
    own = {settings.fractions.get(n) for n in names}  # None: embedding.cache.fraction
    if len(own) > 1:  # the fused engine's layout keeps them apart (layout.build_layout)
        raise ConfigError(f"tables {names} share one cache but have different cache fractions; give them the same")
    fraction = own.pop()
    if fraction is not None and settings.size_mib is not None:
        raise ConfigError(
            f"tables {names} have a cache fraction of their own, which embedding.cache.size_mib (one size shared "
            "by all cached tables) cannot honour: use embedding.cache.fraction"
        )
    if settings.size_mib is None:
        return max(1, math.ceil((fraction or settings.fraction or 0.2) * num_rows))
    row_bytes = RecordLayout([(n, s.width, s.dtype) for n, s in specs.items()]).record_bytes
    share = num_rows / total_rows if total_rows else 1.0
    capacity = rows_in_mib(settings.size_mib, share, row_bytes)
    if capacity < 1:
        raise ConfigError(
            f"embedding.cache.size_mib {settings.size_mib} leaves no room for rows of tables {names}"
        )
    return capacity
