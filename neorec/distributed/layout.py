"""Who holds what: a plan turned into the shards ("units") on every rank, in a fixed order.

Every rank builds the same ShardLayout from the same plan, so each knows, without asking, what any
other rank sends and receives. On a rank, units come in three runs, each in table order:
flat (tw, cw, rw: exchanged with one all-to-all), twrw, twcw (exchanged in two hops); replicated
(dp) tables are kept apart. A unit is looked up by the rank's local fused engine as a table of its
own, named `<table>#<shard index>`, with features `<feature>#<shard index>`.

Sequence tables (pooling none) fill no columns of the pooled output: their units' rows travel one
per id (`sequences`, `sequence_features`), in tw, rw, cw or dp tables only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.distributed.plan import Shard, ShardingPlan
from neorec.distributed.topology import Topology
from neorec.embedding.id_map import MapShard
from neorec.embedding.tables import TableConfig, feature_order, pooled_tables

ROW_SPLIT = ("rw", "twrw")


@dataclass(frozen=True)
class Unit:
    table: TableConfig  # the unsharded table
    shard: Shard
    kind: str
    index: int  # position among the table's shards (rank order for row splits: the order of summing)

    @property
    def width(self) -> int:
        return self.shard.cols[1] - self.shard.cols[0]

    @property
    def features(self) -> list[str]:
        return [f"{f}#{self.index}" for f in self.table.features]

    @property
    def sequence(self) -> bool:
        """A shard of a table with pooling none: rows per id, no pooled columns."""
        return self.table.pooling == "none"

    def local_table(self) -> TableConfig:
        """The shard as a table of the local engine. Row-split shards pool by sum: mean pooling is
        turned into per-id weights 1/(whole bag length) before the ids are split (input_dist)."""
        t = self.table
        return TableConfig(
            name=f"{t.name}#{self.index}",
            rows=self.shard.rows[1] - self.shard.rows[0],
            dim=self.width,
            features=self.features,
            pooling="sum" if self.kind in ROW_SPLIT and t.pooling == "mean" else t.pooling,
            dtype=t.dtype,
            optimizer=t.optimizer,
            managed_collision=self.map_shard().config() if t.managed_collision is not None else None,
        )

    def map_shard(self) -> MapShard:
        """The buckets of a managed-collision table this shard holds: rw shards hold equal runs of
        buckets (plan.validate checks that the shards divide them), tw the whole map."""
        mc = self.table.managed_collision
        assert mc is not None and self.kind in ("tw", "rw")
        rows = self.shard.rows[1] - self.shard.rows[0]
        per_bucket = self.table.rows // mc.buckets
        first, count = self.shard.rows[0] // per_bucket, rows // per_bucket
        return MapShard(first, count, mc.buckets, self.table, self.shard.rows[0], mc.eviction)


class ShardLayout:
    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, topo: Topology) -> None:
        plan.validate(tables, topo)
        self.tables, self.plan, self.topo = tables, plan, topo
        W, L = topo.world_size, topo.local_world_size
        self.flat: list[list[Unit]] = [[] for _ in range(W)]
        self.twrw: list[list[Unit]] = [[] for _ in range(W)]
        self.twcw: list[list[Unit]] = [[] for _ in range(W)]
        self.dp_tables: list[TableConfig] = []
        for t in tables:
            kind = plan.tables[t.name].kind
            if kind == "dp":
                self.dp_tables.append(t)
                continue
            for i, shard in enumerate(plan.shards(t, topo)):
                runs = {"twrw": self.twrw, "twcw": self.twcw}.get(kind, self.flat)
                runs[shard.rank].append(Unit(t, shard, kind, i))
        self.units = [self.flat[r] + self.twrw[r] + self.twcw[r] for r in range(W)]

        def width(units: list[Unit]) -> int:
            return sum(u.width * len(u.table.features) for u in units if not u.sequence)

        self.flat_width = [width(self.flat[r]) for r in range(W)]
        # per node: the width of a twrw block (same on all its ranks) and of a combined twcw block
        self.twrw_width = [width(self.twrw[topo.node_ranks(n)[0]]) for n in range(topo.num_nodes)]
        self.twcw_width = [L * width(self.twcw[topo.node_ranks(n)[0]]) for n in range(topo.num_nodes)]
        self.has_twrw = any(self.twrw_width)
        self.has_twcw = any(self.twcw_width)
        self.dp_width = sum(t.dim * len(t.features) for t in self.dp_tables if t.pooling != "none")
        # per rank: the (unit, feature) pairs of its sequence shards, in its local order; their rows
        # go back to the samples' ranks in the same exchange as the pooled blocks
        self.sequences = [[(u, f) for u in self.flat[r] if u.sequence for f in u.table.features] for r in range(W)]
        self.has_sequences = any(self.sequences)
        self._row_bounds: dict[tuple[str, torch.device], torch.Tensor] = {}

    def row_shard(self, table: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        """The row shard of a row-split table that holds each row in `ids` (its position among the
        table's shards). The shards' first rows go to the ids' device once per table: a copy from
        host memory waits for the device."""
        key = (table.name, ids.device)
        bounds = self._row_bounds.get(key)
        if bounds is None:
            starts = [s.rows[0] for s in self.plan.shards(table, self.topo)]
            bounds = self._row_bounds[key] = torch.tensor(starts[1:], dtype=torch.int64, device=ids.device)
        return torch.bucketize(ids, bounds, right=True)

    def sequence_features(self) -> list[str]:
        """The sequence features that go through the exchange (those of dp tables do not), in the
        collection's sequence order."""
        return [f for t in self.tables if t.pooling == "none" and self.plan.tables[t.name].kind != "dp"
                for f in t.features]  # fmt: skip

    def local_tables(self, rank: int) -> list[TableConfig]:
        return [u.local_table() for u in self.units[rank]]

    def send_features(self, rank: int) -> list[tuple[Unit, str]]:
        """(unit, original feature) pairs that `rank` looks up, in its local engine's feature order."""
        return [(u, f) for u in self.units[rank] for f in u.table.features]

    def assembly(self) -> list[tuple[list[int], list[int]]]:
        """How to build the output [B, sum of feature dims] (feature_order of the tables) from the
        received columns [flat blocks by owner | twrw blocks by node | twcw blocks by node | dp]:
        a list of terms (dst columns, src columns). Term 0 covers every output column once; term k
        adds the k-th row shard of row-split tables (partial sums, added in shard order)."""
        topo, L = self.topo, self.topo.local_world_size
        out_off, off = {}, 0
        pooled = pooled_tables(self.tables)
        for table in pooled:
            for f in table.features:
                out_off[f], off = off, off + table.dim
        assert list(out_off) == feature_order(pooled)
        terms: dict[int, tuple[list[int], list[int]]] = {}

        def add(term: int, dst: int, src: int, n: int) -> None:
            d, s = terms.setdefault(term, ([], []))
            d.extend(range(dst, dst + n))
            s.extend(range(src, src + n))

        base = 0
        for r in range(topo.world_size):
            col = base
            for u in self.flat[r]:
                if u.sequence:
                    continue
                for f in u.table.features:
                    add(u.index if u.kind == "rw" else 0, out_off[f] + u.shard.cols[0], col, u.width)
                    col += u.width
            base += self.flat_width[r]
        for n in range(topo.num_nodes):
            col = base
            for u in self.twrw[topo.node_ranks(n)[0]]:
                for f in u.table.features:
                    add(0, out_off[f], col, u.width)
                    col += u.width
            base += self.twrw_width[n]
        for n in range(topo.num_nodes):
            slice_width = self.twcw_width[n] // L
            for local, r in enumerate(topo.node_ranks(n)):
                col = base + local * slice_width
                for u in self.twcw[r]:
                    for f in u.table.features:
                        add(0, out_off[f] + u.shard.cols[0], col, u.width)
                        col += u.width
            base += self.twcw_width[n]
        for t in pooled_tables(self.dp_tables):
            for f in t.features:
                add(0, out_off[f], base, t.dim)
                base += t.dim
        return [terms[k] for k in sorted(terms)]
