"""The `distributed` section of the run configuration: sharding (a plan file, per-table constraints,
the planner's kinds) and the exchanges' settings. Re-exported by neorec/config/schema.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from neorec.config.base import Strict

ShardingKind = Literal["tw", "rw", "cw", "twrw", "twcw", "dp"]  # distributed/plan.py KINDS
PlanTier = Literal["device", "host", "cached", "ssd"]  # distributed/plan.py TIERS


class TableShardingConfig(Strict):
    """A table's constraints on its sharding (docs/sharding.md, "Constraints"): the planner plans
    around them; over a plan file (distributed.plan) they are applied to it and checked."""

    kind: ShardingKind | None = Field(None, description="the sharding kind it must take")
    kinds: list[ShardingKind] | None = Field(
        None, min_length=1,
        description="the kinds (tw, rw, cw, twrw, twcw, dp) the planner may choose for it (default: distributed.kinds)",
    )
    ranks: list[int] = Field(
        default_factory=list,
        description="the ranks of its pieces, in order: tw [rank]; rw one per row shard; cw one per column "
        "slice; without kind, the planner chooses tw (one rank) or rw/cw over these ranks",
    )
    node: int | None = Field(None, ge=0, description="twrw/twcw: the node that holds the table")
    tier: PlanTier | None = Field(
        None,
        description="the memory its rows live in: device; host (GPU runs); cached (a cache in device memory "
        "over host memory; GPU runs); ssd (a cache over files in embedding.cache.directory)",
    )
    cache_fraction: float | None = Field(
        None, gt=0, le=1,
        description="tier cached/ssd: share of its rows its cache holds (default embedding.cache.fraction); "
        "it gets a cache of its own unless tables of its dim, dtype, optimizer and tier have the same fraction",
    )  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> TableShardingConfig:
        if not self.model_fields_set:
            raise ValueError("an empty entry: give kind, kinds, ranks, node, tier or cache_fraction")
        if self.kind is not None and self.kinds is not None and self.kind not in self.kinds:
            raise ValueError(f"kind {self.kind} is not among its kinds {self.kinds}")
        if self.ranks and self.node is not None:
            raise ValueError("give ranks (tw, rw, cw) or node (twrw, twcw), not both")
        if self.ranks and self.kind in ("twrw", "twcw", "dp"):
            where = "every rank" if self.kind == "dp" else "the ranks of its node (give node)"
            raise ValueError(f"kind {self.kind} takes no ranks: it lives on {where}")
        if self.kind == "tw" and self.ranks and len(self.ranks) != 1:
            raise ValueError(f"kind tw takes exactly one rank, got {self.ranks}")
        if self.kind == "rw" and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"kind rw: a rank appears twice in {self.ranks}")
        if self.node is not None and self.kind not in (None, "twrw", "twcw"):
            raise ValueError(f"node applies to twrw and twcw, not kind {self.kind}")
        if self.cache_fraction is not None and self.tier not in ("cached", "ssd"):
            raise ValueError("cache_fraction sizes the cache of tier cached or ssd: set tier to one of them")
        return self


class DistributedConfig(Strict):
    plan: str | None = Field(None, description="a sharding plan JSON file (see neorec/distributed/plan.py)")
    sharding: dict[str, TableShardingConfig] = Field(
        default_factory=dict,
        description="several processes: per-table constraints (kind, kinds, ranks, node, tier, cache_fraction) "
        "that the planner plans around, or that are applied to the plan file (docs/sharding.md)",
    )
    kinds: list[ShardingKind] = Field(
        default_factory=lambda: ["tw", "rw", "cw", "twrw", "twcw", "dp"],
        min_length=1,
        description="the sharding kinds the planner may choose (a table's own kinds or kind win; "
        "`neorec plan --kinds` sets it)",
    )
    forward_precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="pooled embeddings all-to-all (auto: fp32 in shared memory, else fp16)"
    )
    backward_precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="embedding gradient all-to-all (auto: fp32 in shared memory, else bf16)"
    )
    dense_precision: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="dense gradient all-reduce")
    dense_bucket_mib: float = Field(
        1.0, ge=0,
        description="dense gradients are averaged in buckets of this many MiB, each starting as backward "
        "completes it (over the process group, fp32); 0 = one all-reduce after backward",
    )
    transport: Literal["shm", "backend"] = Field(
        "shm",
        description="between ranks of one machine: shared memory (CPU tensors) or the process group's own (gloo/NCCL)",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="process group: auto = nccl when train.device is cuda and every rank has a GPU of its own, "
        "else gloo (ranks then share GPUs, device tensors staged through pinned host memory)",
    )
