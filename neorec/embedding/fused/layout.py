"""How the fused engine packs tables into flat buffers and maps features to output columns.

Tables are grouped by (dim, storage dtype, optimizer name, storage tier, pooled or not); each group's tables are
stacked by row in one [sum of rows, dim] buffer, and a table's id `i` is global row `row_start + i` of its group. Why
this layout rather than one 1-D buffer with per-table element offsets:
- a 2-D buffer per dim is what `torch.nn.functional.embedding_bag` reads, so a whole group (all 26
  tables of a DLRM, usually) is pooled by one vectorised call, on CPU and on GPU, with no C++ of ours;
- a single 1-D buffer would need a gather of `dim` elements per id written in Python ops (an index
  tensor `dim` times larger than the ids) — several times slower on CPU;
- one optimizer per group keeps the state buffers uniform (adam's two moments, rowwise adagrad's
  one value per row), so each group's update is a single call of one pure rule; hyper-parameters
  that differ between tables of a group become per-row tensors.
Mixed dims or overrides only add groups; the common case stays one group and one call. Tables in
different storage tiers (plain memory, or behind a row cache over DRAM or SSD: neorec/embedding/cache)
never share a buffer, since a buffer has one storage. Tables with pooling none (sequence features,
one row per id) have groups of their own, which fill no output columns: their lookup is a gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TableGroup:
    """Tables that share one buffer: same dim, storage dtype, optimizer rule, storage tier and
    whether they pool (`sequence`: pooling none, rows come out one per id, not in output columns)."""

    dim: int
    dtype: torch.dtype
    optimizer: str
    sequence: bool = False
    tables: list[int] = field(default_factory=list)  # indices into the collection's table list
    row_starts: list[int] = field(default_factory=list)  # global first row of each table
    num_rows: int = 0
    features: list[str] = field(default_factory=list)  # in the collection's feature order
    feature_tables: list[int] = field(default_factory=list)  # position in `tables` of each feature's table
    feature_mean: list[bool] = field(default_factory=list)  # mean pooling per feature
    output_columns: list[tuple[int, int]] = field(default_factory=list)  # runs of output columns

    @property
    def feature_row_offsets(self) -> list[int]:
        return [self.row_starts[t] for t in self.feature_tables]

    @property
    def feature_columns(self) -> list[int]:
        """The first output column of each feature, in feature order (pooled groups)."""
        return [c for start, end in self.output_columns for c in range(start, end, self.dim)]


@dataclass
class Layout:
    """All groups, plus where each table lives (group index, position in the group)."""

    groups: list[TableGroup]
    table_slot: dict[str, tuple[int, int]]
    output_dim: int


def build_layout(
    tables: list[TableConfig],
    optimizer: EmbeddingOptimizerConfig,
    tiers: dict[str, str] | None = None,
    cache_fractions: dict[str, float] | None = None,
) -> Layout:
    """Group tables, assign row ranges, and record which output columns each group fills.
    tiers: storage tier by table name (missing: "memory"); only tables of one tier share a group.
    cache_fractions: by table name, the share of rows of its own a cached table's cache holds
    (missing: embedding.cache's); only tables of one fraction share a group, and so a cache."""
    by_key: dict[tuple[int, str, str, str, bool, float | None], TableGroup] = {}
    table_slot: dict[str, tuple[int, int]] = {}
    for ti, t in enumerate(tables):
        name = (t.optimizer or optimizer).name
        sequence = t.pooling == "none"
        fraction = (cache_fractions or {}).get(t.name)
        key = (t.dim, t.dtype, name, (tiers or {}).get(t.name, "memory"), sequence, fraction)
        if key not in by_key:
            by_key[key] = TableGroup(dim=t.dim, dtype=DTYPES[t.dtype], optimizer=name, sequence=sequence)
        g = by_key[key]
        table_slot[t.name] = (list(by_key).index(key), len(g.tables))
        g.tables.append(ti)
        g.row_starts.append(g.num_rows)
        g.num_rows += t.rows
    groups = list(by_key.values())

    # Features come out table by table (feature_order); each group fills runs of columns.
    column = 0
    for t in tables:
        gi, slot = table_slot[t.name]
        g = groups[gi]
        for f in t.features:
            g.features.append(f)
            g.feature_tables.append(slot)
            g.feature_mean.append(t.pooling == "mean")
            if g.sequence:
                continue
            if g.output_columns and g.output_columns[-1][1] == column:
                g.output_columns[-1] = (g.output_columns[-1][0], column + t.dim)
            else:
                g.output_columns.append((column, column + t.dim))
            column += t.dim
    return Layout(groups=groups, table_slot=table_slot, output_dim=column)
