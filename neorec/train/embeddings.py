"""The embedding collection of a run: the fused engine, the sharded collection over the run's plan
(neorec/train/run_plan.py) when several processes train, or the reference engine; and where each
table's rows live (memory, or a cache over DRAM or SSD: neorec/embedding/cache).
"""

from __future__ import annotations

from pathlib import Path

import torch

from neorec.config.schema import RunConfig
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.train.build import run_wire_precisions
from neorec.train.run_plan import build_plan


def build_embeddings(
    cfg: RunConfig, tables: list[TableConfig], comms=None, device: torch.device | str | None = None
) -> EmbeddingCollection:
    """The fused engine; over several processes (comms given, world > 1) the sharded collection,
    on `device` (default train.device). Cached tables (neorec/embedding/cache) get their tier from
    `embedding.tables.<name>.tier`, else from the sharding plan (tier cached or ssd), else from
    `embedding.tier`."""
    e = cfg.embedding
    device = device if device is not None else cfg.train.device
    sharded = comms is not None and comms.topo.world_size > 1
    progress = cfg.train.progress and (comms is None or comms.topo.rank == 0)  # bars of the rows filled
    plan = build_plan(cfg, tables, comms.topo) if sharded and e.engine == "fused" else None
    tiers = storage_tiers(cfg, tables, plan)
    cached = sorted(n for n, tier in tiers.items() if tier != "memory")
    if cached and e.engine != "fused":
        raise ConfigError(
            f"embedding.tier: tables {cached} are cached (tier dram/ssd), which only the fused engine supports; "
            "set embedding.engine: fused, or their tier to memory"
        )
    from neorec.embedding.cache import CacheSettings

    c = e.cache
    if "ssd" in tiers.values() and c.directory is not None and Path(c.directory).exists():
        if not Path(c.directory).is_dir():
            raise ConfigError(f"embedding.cache.directory {c.directory}: is a file; give a folder for the ssd tables")
    settings = CacheSettings(
        c.policy, c.fraction, c.size_mib, c.directory, c.release_mib, c.ssd_reads, c.ssd_log, c.io_thread
    )
    if sharded:  # distributed.sharding's cache fractions (one process trains without a plan)
        from neorec.train.run_constraints import cache_fractions

        settings.fractions = cache_fractions(cfg)
        if e.engine != "fused":
            raise ConfigError("embedding.engine: multi-process training needs the fused engine, got 'reference'")
        from neorec.distributed.sharded import ShardedEmbeddingCollection

        forward, backward = run_wire_precisions(cfg, one_machine=comms.topo.num_nodes == 1)
        return ShardedEmbeddingCollection(
            tables, e.optimizer, plan, comms, seed=cfg.seed, forward_precision=forward, backward_precision=backward,
            device=device, stochastic_rounding=e.stochastic_rounding, tiers=tiers, cache=settings, progress=progress,
            bounds_check=e.bounds_check,
        )  # fmt: skip
    if e.engine == "reference":
        from neorec.embedding.reference import ReferenceEmbeddingCollection

        return ReferenceEmbeddingCollection(tables, e.optimizer, seed=cfg.seed, bounds_check=e.bounds_check)
    from neorec.embedding.fused import FusedEmbeddingCollection

    factory = None
    if cached:  # a RAM cache over host memory or files (neorec/embedding/cache)
        from neorec.embedding.cache import cached_storage_factory

        total = sum(t.rows for t in tables if t.name in cached)
        factory = cached_storage_factory(tiers, settings, total)
    return FusedEmbeddingCollection(
        tables, e.optimizer, seed=cfg.seed, stochastic_rounding=e.stochastic_rounding,
        group_storage_factory=factory, table_tiers=tiers, device=device, progress=progress,
        bounds_check=e.bounds_check,
    )  # fmt: skip


def storage_tiers(cfg: RunConfig, tables: list[TableConfig], plan=None) -> dict[str, str]:
    """Where each table's rows live in training (memory, dram or ssd: neorec/embedding/cache): the
    table's own `tier`, else the plan's cached/ssd tier (distributed.plan.STORAGE_TIERS), else
    `embedding.tier`. A plan tier of ssd needs embedding.cache.directory; the error names the table."""
    from neorec.distributed.plan import STORAGE_TIERS

    e = cfg.embedding
    out = {}
    for t in tables:
        own = e.tables[t.name].tier if t.name in e.tables else None
        planned = STORAGE_TIERS[(plan.tables[t.name].tier or "device")] if plan is not None else "memory"
        out[t.name] = own or (planned if planned != "memory" else e.tier)
        if out[t.name] == "ssd" and e.cache.directory is None:
            raise ConfigError(
                f"the sharding plan puts table {t.name!r} in tier ssd: set embedding.cache.directory to a folder "
                f"for its files, or embedding.tables.{t.name}.tier"
            )
    return out
