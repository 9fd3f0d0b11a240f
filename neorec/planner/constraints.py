"""Per-table constraints on the planner (what TorchRec's ParameterConstraints says): the sharding
kinds a table may take, the kind, ranks or node it is pinned to, its plan tier and its cache's size.

The planner honours them in three places:
- options: `table_options_for` enumerates only the options that satisfy a table's constraint (its
  allowed kinds; with ranks, options of exactly that many pieces; with a tier, that tier only);
- placement: the pieces of a table pinned to ranks (or a node) are put there before any other
  piece (partition.py), and every other piece is balanced around them;
- checks: `check` names the table and the constraint that cannot hold before any planning (a kind
  outside its allowed kinds, ranks or a node that do not exist, a tier the cluster does not offer, a
  managed-collision table asked for anything but tw/rw in plain memory), `no_option` says why a
  table's constraint leaves it no option, `check_pinned_memory` finds a rank whose pinned pieces
  alone overfill it, and `violations` checks a finished plan (the planner's or a plan file).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from neorec.distributed.plan import KINDS, MANAGED_COLLISION_KINDS, ShardingPlan
from neorec.errors import ConfigError
from neorec.planner.hardware import Cluster
from neorec.planner.options import Option, split_counts, table_options
from neorec.planner.tiers import PLACEMENTS, placements
from neorec.planner.workload import TableLoad, Workload

NODE_KINDS = ("twrw", "twcw")
RANK_KINDS = ("tw", "rw", "cw")


@dataclass(frozen=True)
class TableConstraint:
    """What one table's sharding must satisfy; None (or empty) leaves that choice to the planner."""

    kinds: tuple[str, ...] | None = None  # the kinds it may take (None: the planner's list)
    kind: str | None = None  # the kind it must take (whatever the planner's list)
    ranks: tuple[int, ...] = ()  # the ranks of its pieces, in order (tw: one; rw, cw: one per shard)
    node: int | None = None  # twrw / twcw: the node that holds it
    tier: str | None = None  # its plan tier (tiers.py: device, host, cached, ssd)
    cache_fraction: float | None = None  # cached / ssd: the share of its rows its cache holds
    source: str = ""  # how errors name it (a config key); default "table '<name>'"

    def where(self, name: str) -> str:
        return self.source or f"table {name!r}"

    def allowed_kinds(self, default: tuple[str, ...]) -> tuple[str, ...]:
        """The kinds its options may have: its kind, else its kinds (else `default`), narrowed by
        ranks (tw for one, cw for several, rw for several distinct ones: a row range each) or a node
        (twrw, twcw)."""
        kinds = (self.kind,) if self.kind else self.kinds if self.kinds is not None else default
        if self.ranks:
            one, distinct = len(self.ranks) == 1, len(set(self.ranks)) == len(self.ranks)
            kinds = tuple(
                k for k in kinds if k in RANK_KINDS and (k != "tw" or one) and (k != "rw" or distinct)
            )
        if self.node is not None:
            kinds = tuple(k for k in kinds if k in NODE_KINDS)
        return tuple(kinds)

    @property
    def pinned(self) -> bool:
        return bool(self.ranks) or self.node is not None

    def describe(self, default: tuple[str, ...] | None = None) -> str:
        """Its constraints in words; `default`: the planner's kinds, shown when it has none of its own."""
        parts = [f"kind {self.kind}"] if self.kind else []
        if self.kinds is not None or (default is not None and not self.kind):
            parts.append(f"kinds [{', '.join(self.kinds if self.kinds is not None else default or ())}]")
        parts += [f"ranks {list(self.ranks)}"] if self.ranks else []
        parts += [f"node {self.node}"] if self.node is not None else []
        parts += [f"tier {self.tier}"] if self.tier else []
        parts += [f"cache_fraction {self.cache_fraction}"] if self.cache_fraction is not None else []
        return ", ".join(parts) or "none"


def with_cache_fractions(workload: Workload, constraints: dict[str, TableConstraint]) -> Workload:
    """The workload with the constraints' cache fractions as its tables' own."""
    own = {n: c.cache_fraction for n, c in constraints.items() if c.cache_fraction is not None}
    return replace(workload, cache_fractions={**workload.cache_fractions, **own}) if own else workload


def check(
    constraints: dict[str, TableConstraint],
    workload: Workload,
    kinds: tuple[str, ...],
    world_size: int,
    num_nodes: int,
    cluster: Cluster | None = None,
) -> None:
    """ConfigError naming the table and the constraint that cannot hold on `world_size` ranks in
    `num_nodes` nodes; with `cluster`, also a tier it does not offer."""
    for name, c in constraints.items():
        where = c.where(name)
        if name not in workload.by_name:
            raise ConfigError(f"{where}: no such table; tables: {sorted(workload.by_name)}")
        bad = sorted({*(c.kinds or ()), *([c.kind] if c.kind else [])} - set(KINDS))
        if bad:
            raise ConfigError(f"{where}: unknown sharding kind(s) {bad}; kinds: {list(KINDS)}")
        if c.kind and c.kinds is not None and c.kind not in c.kinds:
            raise ConfigError(f"{where}: kind {c.kind} is not among its kinds [{', '.join(c.kinds)}]")
        check_shapes(name, c, world_size, num_nodes)
        if c.cache_fraction is not None:
            if not 0 < c.cache_fraction <= 1:
                raise ConfigError(f"{where}: cache_fraction must be in (0, 1], got {c.cache_fraction}")
            if c.tier not in ("cached", "ssd"):
                raise ConfigError(f"{where}: cache_fraction sizes the cache of tier cached or ssd: set its tier")
        if cluster is not None:
            _check_tier(name, c, cluster)
        load = workload.by_name[name]
        allowed = c.allowed_kinds(kinds)
        if load.table.managed_collision is not None:
            if not set(allowed) & set(MANAGED_COLLISION_KINDS):
                raise ConfigError(
                    f"{where}: a managed-collision table is sharded tw or rw only (its id map lives with its "
                    f"rows), but its constraints ({c.describe(kinds)}) allow [{', '.join(allowed)}]"
                )
            if c.tier is not None and PLACEMENTS[c.tier].cache_in is not None:
                raise ConfigError(
                    f"{where}: a managed-collision table lives in plain memory (device or host), not tier {c.tier}"
                )
        if load.table.pooling == "none" and allowed and set(allowed) <= set(NODE_KINDS):
            raise ConfigError(
                f"{where}: a table with pooling none (rows per id) is sharded tw, rw, cw or dp, not [{', '.join(allowed)}]"
            )
        if not allowed:
            narrowed = (" (ranks pin tw on one rank, cw on several, rw on several distinct ones; "
                        "a node pins twrw or twcw)")  # fmt: skip
            raise ConfigError(
                f"{where}: its constraints ({c.describe(kinds)}) leave no sharding kind"
                + (narrowed if c.pinned else "")
            )


def check_shapes(name: str, c: TableConstraint, world_size: int, num_nodes: int) -> None:
    """Ranks and node against the world: ConfigError naming the table and the constraint."""
    where = c.where(name)
    out = [r for r in c.ranks if not 0 <= r < world_size]
    if out:
        raise ConfigError(f"{where}: ranks {list(c.ranks)}: rank(s) {out} do not exist; world size is {world_size}")
    if c.node is not None and not 0 <= c.node < num_nodes:
        raise ConfigError(f"{where}: node {c.node} does not exist; nodes: 0 to {num_nodes - 1}")
    if c.ranks and c.kind in (*NODE_KINDS, "dp"):
        raise ConfigError(f"{where}: kind {c.kind} takes no ranks (twrw/twcw: a node; dp: every rank)")
    if c.kind == "tw" and len(c.ranks) > 1:
        raise ConfigError(f"{where}: kind tw takes exactly one rank, got {list(c.ranks)}")
    if c.kind == "rw" and len(set(c.ranks)) != len(c.ranks):
        raise ConfigError(f"{where}: kind rw: a rank appears twice in {list(c.ranks)}")
    if c.node is not None and c.kind not in (None, *NODE_KINDS):
        raise ConfigError(f"{where}: node applies to twrw and twcw, not kind {c.kind}")
    if c.ranks and c.node is not None:
        raise ConfigError(f"{where}: give ranks (tw, rw, cw) or node (twrw, twcw), not both")


def _check_tier(name: str, c: TableConstraint, cluster: Cluster) -> None:
    offered = placements(cluster)
    if c.tier is not None and c.tier not in offered:
        hint = {
            "ssd": "this machine has an SSD tier when embedding.cache.directory is set",
            "host": "host memory is a tier of GPU clusters; on a CPU every row is in RAM: tier device",
            "cached": f"a cache over host memory is a tier of GPU clusters; on a CPU a cache in RAM over RAM "
            f"is embedding.tables.{name}.tier: dram (not planned)",
        }[c.tier]
        where = c.where(name)
        raise ConfigError(f"{where}: tier {c.tier} is not offered by {cluster.name} (tiers: {list(offered)}); {hint}")


def table_options_for(
    load: TableLoad, workload: Workload, cluster: Cluster, kinds: tuple[str, ...], c: TableConstraint | None
) -> list[Option]:
    """The table's options that satisfy its constraint (all options of `kinds` without one);
    ConfigError saying why when there is none."""
    if c is None:
        opts = table_options(load, workload, cluster, kinds)
        c = TableConstraint()
    else:
        tiers = (c.tier,) if c.tier else None
        shards = len(c.ranks) if c.ranks else None
        opts = table_options(load, workload, cluster, c.allowed_kinds(kinds), tiers, shards)
    if not opts:
        raise no_option(load, c, cluster, kinds)
    return opts


def no_option(load: TableLoad, c: TableConstraint, cluster: Cluster, kinds: tuple[str, ...]) -> ConfigError:
    """Why no option of the table satisfies `c`, kind by kind."""
    t, W, L = load.table, cluster.world_size, cluster.ranks_per_node
    buckets = t.managed_collision.buckets if t.managed_collision is not None else None
    k = len(c.ranks) or None
    why = []
    for kind in c.allowed_kinds(kinds):
        counts = [k] if k else split_counts(load, cluster).get(kind, [])
        if buckets is not None and kind not in MANAGED_COLLISION_KINDS:
            why.append(f"{kind}: a managed-collision table is sharded tw or rw only (its id map lives with its rows)")
        elif kind == "rw" and not [n for n in counts if n <= t.rows and (buckets is None or buckets % n == 0)]:
            if not counts:
                why.append(f"rw: {t.rows} row(s) on {W} rank(s) do not split")
            elif k and k > t.rows:
                why.append(f"rw: {k} row shards but {t.rows} row(s)")
            else:
                why.append(f"rw: managed_collision.buckets {buckets} is a multiple of none of {counts} row shards")
        elif kind == "cw" and not [n for n in counts if t.dim % n == 0]:
            if k:
                why.append(f"cw: {k} column slices do not divide the dim {t.dim}")
            else:
                why.append(f"cw: the dim {t.dim} has no split into 2 to {W} equal slices of >= 4 columns")
        elif kind in NODE_KINDS:
            if W == 1 or L == 1:
                why.append(f"{kind}: needs several ranks per node ({W} rank(s), {L} per node)")
            elif t.pooling == "none":
                why.append(f"{kind}: a table with pooling none has no two-hop exchange")
            else:
                why.append(f"{kind}: {L} ranks per node do not split {t.rows} rows x {t.dim} columns")
        elif kind == "dp" and W == 1:
            why.append("dp: one rank has nothing to replicate over")
    under = f"its constraints ({c.describe(kinds)})" if c != TableConstraint() else (
        f"the planner's kinds [{', '.join(kinds)}] (distributed.kinds)"
    )
    return ConfigError(
        f"{c.where(load.name)}: no sharding satisfies {under} on {W} rank(s): "
        + ("; ".join(why) or "no option of these kinds and tier")
    )


def piece_ranks(o: Option, c: TableConstraint, ranks_per_node: int) -> list[int] | None:
    """The rank of each piece of `o` under the pin of `c` (None: not pinned)."""
    if c.ranks and o.placement == "rank":
        return list(c.ranks)
    if c.node is not None and o.placement == "node":
        return [c.node * ranks_per_node + i for i in range(ranks_per_node)]
    return None


def check_pinned_memory(
    feasible: dict[str, list[Option]],
    constraints: dict[str, TableConstraint],
    capacity: dict[str, np.ndarray],
    cluster: Cluster,
    base_device: float = 0.0,
) -> None:
    """ConfigError when the pieces pinned to a rank need more of a memory tier than it has, whichever
    of their tables' options is chosen (per table, the least each option puts there), on top of
    `base_device` bytes of device memory every rank needs anyway."""
    W, L = cluster.world_size, cluster.ranks_per_node
    need = {tier: np.zeros(W) for tier in capacity}
    need["device"] += base_device
    names: dict[int, list[str]] = {}
    for name, c in constraints.items():
        if not c.pinned or name not in feasible:
            continue
        least = {tier: np.full(W, np.inf) for tier in capacity}
        for o in feasible[name]:
            ranks = piece_ranks(o, c, L) or []
            here = {tier: np.zeros(W) for tier in capacity}
            for r, mem in zip(ranks, o.piece_memory, strict=True):
                for tier, nbytes in mem.items():
                    here[tier][r] += nbytes
            for tier in capacity:
                least[tier] = np.minimum(least[tier], here[tier])
        for tier in capacity:
            need[tier] += np.where(np.isfinite(least[tier]), least[tier], 0.0)
        for r in {r for o in feasible[name] for r in piece_ranks(o, c, L) or []}:
            names.setdefault(r, []).append(name)
    for tier, cap in capacity.items():
        for r in sorted(names):
            if need[tier][r] <= cap[r] * (1 + 1e-12):
                continue
            pinned = names[r]
            which = "; ".join(f"{constraints[n].where(n)} ({constraints[n].describe()})" for n in pinned)
            raise ConfigError(
                f"{which}: rank {r} has no room for the pieces pinned to it: {tier} memory needs at least "
                f"{need[tier][r]:,.0f} bytes (with the step's buffers), the rank has {cap[r]:,.0f} "
                f"(shortfall {need[tier][r] - cap[r]:,.0f} bytes)"
            )


def violations(
    plan: ShardingPlan, constraints: dict[str, TableConstraint], kinds: tuple[str, ...] | None = None
) -> list[str]:
    """How `plan` breaks the constraints (empty: it keeps them all); `kinds`: the planner's list,
    checked for tables without kinds or kind of their own (None: not checked)."""
    out = []
    for name, c in constraints.items():
        p = plan.tables.get(name)
        if p is None:
            continue
        where = c.where(name)
        allowed = c.allowed_kinds(kinds) if kinds is not None or c.kind or c.kinds is not None else None
        if allowed is not None and p.kind not in allowed:
            out.append(f"{where}: the plan gives kind {p.kind}, its constraints allow [{', '.join(allowed)}]")
        if c.ranks and list(p.ranks) != list(c.ranks):
            out.append(f"{where}: the plan puts it on ranks {p.ranks}, its constraint says {list(c.ranks)}")
        if c.node is not None and p.node != c.node:
            out.append(f"{where}: the plan puts it on node {p.node}, its constraint says {c.node}")
        if c.tier is not None and (p.tier or "device") != c.tier:
            out.append(f"{where}: the plan gives tier {p.tier or 'device'}, its constraint says {c.tier}")
    return out
