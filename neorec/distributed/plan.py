"""A sharding plan is data: for every table, how it is split and where the pieces live.

    {"tables": {"t0": {"kind": "rw", "ranks": [0, 1]}, "t1": {"kind": "twcw", "node": 1}, ...}}

Kinds (see DESIGN.md): tw (whole table on ranks[0]), rw (contiguous row ranges over `ranks`),
cw (the dim cut into len(ranks) equal column slices, slice i on ranks[i]; a rank may repeat),
twrw / twcw (the table belongs to `node` and is cut by rows / columns over all of that node's ranks),
dp (a full replica on every rank, gradients summed over ranks). `shards()` turns a plan into
explicit row and column ranges; `validate` checks it against the tables and the topology before
any work starts, naming the table at fault. An optional `tier` says which memory the table's rows
live in (every shard of the table alike):
- "device" (the default): memory next to the compute (RAM on a CPU);
- "host": host DRAM read by a GPU (on a CPU, the same RAM as "device");
- "cached": a row cache in device memory over all rows (and their optimizer state) in host DRAM;
- "ssd": a row cache in device memory over all rows in files on SSD (embedding.cache.directory).
Training stores each tier as STORAGE_TIERS says (the tiers of neorec/embedding/cache); the cache's
size and policy come from embedding.cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neorec.distributed.topology import Topology
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.utils.files import CHECKSUM_KEY, check_json, load_json, write_json

KINDS = ("tw", "rw", "cw", "twrw", "twcw", "dp")
MANAGED_COLLISION_KINDS = ("tw", "rw")  # the kinds that keep an id map with its rows
TIERS = ("device", "host", "cached", "ssd")
# plan tier -> how training stores the rows (neorec/embedding/cache TIERS): a plain tensor, or a
# row cache over a host-memory tensor ("dram") or over files ("ssd")
STORAGE_TIERS = {"device": "memory", "host": "memory", "cached": "dram", "ssd": "ssd"}


@dataclass(frozen=True)
class Shard:
    rank: int
    rows: tuple[int, int]  # [start, end) of the table's rows
    cols: tuple[int, int]  # [start, end) of the table's columns


@dataclass
class TablePlan:
    kind: str
    ranks: list[int] = field(default_factory=list)
    node: int | None = None
    tier: str | None = None  # memory tier of the rows (TIERS; None: device)

    def to_dict(self) -> dict:
        out: dict = {"kind": self.kind}
        if self.ranks:
            out["ranks"] = list(self.ranks)
        if self.node is not None:
            out["node"] = self.node
        if self.tier is not None:
            out["tier"] = self.tier
        return out


@dataclass
class ShardingPlan:
    tables: dict[str, TablePlan]
    # the planner's estimate of each rank's device memory at its peak (weights, optimizer state, row
    # caches, step buffers and the runtime it sets aside), in bytes; None for a plan from a file.
    # Training reports it next to the measured peaks (summary.json); plan files do not hold it.
    device_bytes: list[int] | None = field(default=None, compare=False)

    # ---- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"tables": {name: p.to_dict() for name, p in self.tables.items()}}

    def save(self, path: str | Path) -> None:
        """The plan file, with a "crc32" of its content, written atomically (neorec/utils/files.py)."""
        write_json(path, self.to_dict(), "plan file", indent=2)

    @staticmethod
    def from_dict(data: object, source: str = "plan") -> ShardingPlan:
        """The plan of parsed JSON, its structure and types checked (a table's kind and tier among the
        known ones, ranks a list of whole numbers, node a whole number): ConfigError naming `source`
        and the table otherwise. Ranks and nodes are checked against a topology by `validate`."""
        if not isinstance(data, dict) or not isinstance(data.get("tables"), dict):
            raise ConfigError(f"{source}: expected {{'tables': {{name: {{'kind': ..., 'ranks': [...]}}}}}}")
        tables = {}
        for name, entry in data["tables"].items():
            where = f"{source}: table {_short(name)}"
            if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str) or entry["kind"] not in KINDS:
                got = _short(entry.get("kind") if isinstance(entry, dict) else entry)
                raise ConfigError(f"{where}: 'kind' must be one of {list(KINDS)}, got {got}")
            unknown = set(entry) - {"kind", "ranks", "node", "tier"}
            if unknown:
                raise ConfigError(f"{where}: unknown key(s) {_short(sorted(unknown))}; allowed: kind, ranks, node, tier")
            tier = entry.get("tier")
            if tier is not None and (not isinstance(tier, str) or tier not in TIERS):
                raise ConfigError(f"{where}: 'tier' must be one of {list(TIERS)}, got {_short(tier)}")
            ranks = entry.get("ranks", [])
            if not isinstance(ranks, list) or not all(_whole(r) for r in ranks):
                raise ConfigError(f"{where}: 'ranks' must be a list of whole numbers, got {_short(ranks)}")
            node = entry.get("node")
            if node is not None and not _whole(node):
                raise ConfigError(f"{where}: 'node' must be a whole number, got {_short(node)}")
            tables[name] = TablePlan(entry["kind"], list(ranks), node, tier)
        return ShardingPlan(tables)

    @staticmethod
    def load(path: str | Path) -> ShardingPlan:
        """A plan file: its "crc32" checked when it has one (one written by hand may have none, so a
        checksum that fails, the only error of a file with one, also says how to keep an edit)."""
        hint = "write it again (`neorec plan`), or give another distributed.plan"
        data = load_json(path, "sharding plan", hint, ConfigError)
        if CHECKSUM_KEY in data:
            hint += (
                f"; a plan file edited by hand is accepted once its {CHECKSUM_KEY!r} key is deleted (a file "
                "without one is read as written by hand)"
            )
        data = check_json(data, path, "sharding plan", hint, ConfigError, keys=("tables",))
        return ShardingPlan.from_dict(data, f"sharding plan {path}")

    # ---- meaning ---------------------------------------------------------------------------------------
    def shards(self, table: TableConfig, topo: Topology) -> list[Shard]:
        """The table's pieces, in the order their outputs are combined (rank order for row splits)."""
        p = self.tables[table.name]
        full_rows, full_cols = (0, table.rows), (0, table.dim)
        if p.kind == "tw":
            return [Shard(p.ranks[0], full_rows, full_cols)]
        if p.kind == "dp":
            return [Shard(r, full_rows, full_cols) for r in range(topo.world_size)]
        ranks = topo.node_ranks(p.node) if p.kind in ("twrw", "twcw") else p.ranks  # type: ignore[arg-type]
        if p.kind in ("rw", "twrw"):
            bounds = even_splits(table.rows, len(ranks))
            return [Shard(r, (bounds[i], bounds[i + 1]), full_cols) for i, r in enumerate(ranks)]
        width = table.dim // len(ranks)
        return [Shard(r, full_rows, (i * width, (i + 1) * width)) for i, r in enumerate(ranks)]

    def validate(self, tables: list[TableConfig], topo: Topology) -> None:
        names = {t.name for t in tables}
        extra = sorted(set(self.tables) - names)
        if extra:
            raise ConfigError(f"sharding plan names table(s) {extra} that the model does not have; tables: {sorted(names)}")
        for t in tables:
            p = self.tables.get(t.name)
            if p is None:
                raise ConfigError(f"sharding plan has no entry for table {t.name!r}")
            where = f"sharding plan, table {t.name!r} ({p.kind})"
            if p.kind in ("twrw", "twcw") and p.ranks:
                raise ConfigError(
                    f"{where}: twrw and twcw take 'node' (the table is cut over all the ranks of that node), "
                    f"not 'ranks'; drop 'ranks' {p.ranks}"
                )
            bad = [r for r in p.ranks if not 0 <= r < topo.world_size]
            if bad:
                raise ConfigError(f"{where}: rank(s) {bad} do not exist; world size is {topo.world_size}")
            if p.kind in ("tw", "rw", "cw") and not p.ranks:
                raise ConfigError(f"{where}: needs 'ranks'")
            if p.kind == "tw" and len(p.ranks) != 1:
                raise ConfigError(f"{where}: table-wise takes exactly one rank, got {p.ranks}")
            if p.kind == "rw" and len(set(p.ranks)) != len(p.ranks):
                raise ConfigError(f"{where}: a rank appears twice in {p.ranks}")
            if p.kind in ("twrw", "twcw"):
                if p.node is None or not 0 <= p.node < topo.num_nodes:
                    raise ConfigError(f"{where}: 'node' must be in [0, {topo.num_nodes}), got {p.node}")
            elif p.node is not None:
                raise ConfigError(f"{where}: 'node' only applies to twrw and twcw")
            if t.pooling == "none" and p.kind in ("twrw", "twcw"):
                raise ConfigError(
                    f"{where}: a table with pooling none (rows per id) is sharded tw, rw, cw or dp, not {p.kind}"
                )
            if p.kind in ("dp",) and p.ranks:
                raise ConfigError(f"{where}: data-parallel tables live on every rank; drop 'ranks'")
            n = topo.local_world_size if p.kind in ("twrw", "twcw") else len(p.ranks)
            if p.kind in ("rw", "twrw") and n > t.rows:
                raise ConfigError(f"{where}: {n} row shards but the table has only {t.rows} rows")
            if p.kind in ("cw", "twcw") and t.dim % n:
                raise ConfigError(f"{where}: {n} column shards do not divide the dim {t.dim}")
            mc = t.managed_collision
            if mc is not None and p.kind not in MANAGED_COLLISION_KINDS:
                raise ConfigError(
                    f"{where}: a managed-collision table is sharded tw or rw only (its id map lives with its rows); "
                    "give it kind tw or rw"
                )
            if mc is not None and p.kind == "rw" and mc.buckets % n:
                raise ConfigError(
                    f"{where}: {n} row shards need managed_collision.buckets to be a multiple of {n}, got "
                    f"{mc.buckets}; set embedding.tables.{t.name}.managed_collision.buckets (each rank owns whole buckets)"
                )


def _whole(value: object) -> bool:
    """A whole number as JSON gives it (not a boolean, nor a float such as NaN or 1.0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters for an error line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def even_splits(total: int, parts: int) -> list[int]:
    """Boundaries of `parts` contiguous ranges covering [0, total), sizes differing by at most one."""
    base, extra = divmod(total, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


def default_plan(tables: list[TableConfig], topo: Topology, ids_per_sample: dict[str, float] | None = None) -> ShardingPlan:
    """Table-wise, longest-processing-time first: tables by lookup cost (ids per sample x dim,
    then size) onto the least loaded rank. The planner issue replaces this."""
    ids = ids_per_sample or {}

    def cost(t: TableConfig) -> float:
        return sum(ids.get(f, 1.0) for f in t.features) * t.dim

    load = [0.0] * topo.world_size
    plan = {}
    for t in sorted(tables, key=lambda t: (-cost(t), -t.rows * t.dim, t.name)):
        r = min(range(topo.world_size), key=lambda k: (load[k], k))
        load[r] += cost(t)
        plan[t.name] = TablePlan("tw", [r])
    return ShardingPlan({t.name: plan[t.name] for t in tables})
