"""What the planner plans: the tables, how often their rows are read, the batch and the precisions.

`TableLoad` is one table plus its access statistics: ids per sample for each of its features, and
optionally a sample of the ids themselves (measured from a few training batches). The sample is
what makes row splits and deduplication realistic: `share(lo, hi)` is the fraction of the table's
ids that fall in rows [lo, hi) (a row-wise shard's share of the lookups), `unique(lo, hi, part)` the
expected number of distinct rows touched in that range by `part` of a global batch (what the
fused update reads and writes). Without a sample, ids are assumed spread evenly over the rows:
shares are proportional to rows and distinct rows follow the uniform-draw formula, an upper bound
for skewed (Zipf) data. `hit_rate(lo, hi, capacity)` estimates how many of a batch's distinct rows a
row cache of `capacity` rows finds resident (tiers.py uses it for cached tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from neorec.embedding.id_map import BYTES_PER_ROW as ID_MAP_BYTES_PER_ROW
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError

WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def state_bytes_per_row(optimizer: str, width: int) -> int:
    """Optimizer state of one row (of `width` columns), fp32: see embedding/fused/optimizers.py."""
    per_element = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 0, "adam": 2}[optimizer]
    per_row = 1 if optimizer == "rowwise_adagrad" else 0
    return 4 * (per_element * width + per_row)


@dataclass
class TableLoad:
    """One table and how a batch uses it."""

    table: TableConfig
    optimizer: str  # the update rule (the table's override or the default)
    ids_per_feature: dict[str, float]  # mean ids per sample, per feature of the table
    # measured access: per sampled global batch, per feature of the table, its ids in sample order
    id_sample: list[list[np.ndarray]] | None = None
    _sorted: list[np.ndarray] = field(default_factory=list, repr=False)
    _unique_cache: dict[float, list[np.ndarray]] = field(default_factory=dict, repr=False)
    _batch_rows: np.ndarray | None = field(default=None, repr=False)  # distinct rows of every sampled batch

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def ids_per_sample(self) -> float:
        return sum(self.ids_per_feature.values())

    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES[self.table.dtype]

    def row_bytes(self, width: int | None = None) -> int:
        """Weights plus optimizer state of one row of `width` columns, plus its id map's entry
        (managed-collision tables: key, last use, count and the sorted index; id_map.BYTES_PER_ROW)."""
        w = self.table.dim if width is None else width
        id_map = ID_MAP_BYTES_PER_ROW if self.table.managed_collision is not None else 0
        return w * self.weight_bytes + state_bytes_per_row(self.optimizer, w) + id_map

    def share(self, lo: int, hi: int) -> float:
        """Fraction of the table's ids in rows [lo, hi)."""
        rows = self.table.rows
        if lo <= 0 and hi >= rows:
            return 1.0
        if not self.id_sample:
            return (hi - lo) / rows
        if not self._sorted:
            self._sorted = [np.sort(np.concatenate(per_feature)) for per_feature in self.id_sample]
        inside = sum(int(np.searchsorted(s, hi) - np.searchsorted(s, lo)) for s in self._sorted)
        total = sum(s.size for s in self._sorted)
        return inside / total if total else (hi - lo) / rows

    def unique(self, lo: int, hi: int, num_ids: float, part: float = 1.0) -> float:
        """Expected distinct rows in [lo, hi) among the ids of `part` of a global batch; `num_ids`
        is how many ids that is (used without a sample)."""
        if self.id_sample:
            if part not in self._unique_cache:
                self._unique_cache[part] = [  # the first `part` of the samples of every feature
                    np.unique(np.concatenate([ids[: int(round(ids.size * part))] for ids in per_feature]))
                    for per_feature in self.id_sample
                ]
            per_batch = [
                int(np.searchsorted(u, hi) - np.searchsorted(u, lo)) for u in self._unique_cache[part]
            ]
            return float(np.mean(per_batch))
        rows = hi - lo
        if rows <= 0 or num_ids <= 0:
            return 0.0
        return rows * -math.expm1(-num_ids / rows)  # uniform draws: R (1 - (1 - 1/R)^n)

    def hit_rate(self, lo: int, hi: int, capacity: int) -> float:
        """Expected share of a batch's distinct rows in [lo, hi) that a cache of `capacity` of those
        rows holds, in steady state. Without an id sample: ids uniform over the rows, capacity / rows.
        With one, from the distinct rows of each sampled batch (the cache's unit: duplicates in a
        batch are one lookup): a row seen in c of the batches has weight c; rows seen in one batch
        only stand for the chance that a batch's row was never seen (Good-Turing: their number over
        all the sampled lookups), spread evenly over the unseen rows. The cache holds the heaviest
        rows (what LFU keeps; LRU does somewhat worse): the seen rows first, then unseen ones."""
        rows = hi - lo
        if rows <= 0:
            return 1.0
        capacity = min(capacity, rows)
        if not self.id_sample:
            return capacity / rows
        if self._batch_rows is None:
            self._batch_rows = np.concatenate(
                [np.unique(np.concatenate(per_feature)) for per_feature in self.id_sample]
            )
        looked_up = self._batch_rows[(self._batch_rows >= lo) & (self._batch_rows < hi)]
        if looked_up.size == 0:
            return capacity / rows
        counts = np.sort(np.unique(looked_up, return_counts=True)[1])[::-1]  # batches per distinct row
        unseen = float(np.count_nonzero(counts == 1)) / looked_up.size  # Good-Turing unseen mass
        seen = float(counts[:capacity].sum()) / looked_up.size
        spare = max(0, capacity - counts.size) / max(1, rows - counts.size)
        return min(1.0, (1.0 - unseen) * seen + unseen * spare)


@dataclass
class Workload:
    """Everything about the model and the data that the cost depends on."""

    tables: list[TableLoad]
    batch_size: int  # the global batch
    forward_precision: str = "fp16"  # pooled embeddings on the wire
    backward_precision: str = "bf16"  # their gradients
    weighted: bool = False  # batches carry per-id weights
    cache_fraction: float = 0.2  # share of a cached table's rows its row cache holds (embedding.cache.fraction)
    ssd_log: float = 1.0  # ssd tables' write log, a share of their rows (embedding.cache.ssd_log; 0: none)
    cache_policy: str = "lru"  # embedding.cache.policy (lfu keeps a use count per row: 1 byte)
    # tables whose cache holds another share of their rows (constraints.py: cache_fraction; with
    # cache_mib, the planner's guess from its previous plan: planner.plan_sharding)
    cache_fractions: dict[str, float] = field(default_factory=dict)
    # embedding.cache.size_mib: MiB of row cache per rank, which its cached shards share in proportion
    # to their rows (cost.cache_mib_fractions); None: caches of `fraction` of their rows
    cache_mib: float | None = None

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tables}

    def fraction(self, table: str) -> float:
        """The share of the table's rows its row cache holds, when it is cached."""
        return self.cache_fractions.get(table, self.cache_fraction)

    @property
    def table_configs(self) -> list[TableConfig]:
        return [t.table for t in self.tables]


def build_workload(
    tables: list[TableConfig],
    optimizer: EmbeddingOptimizerConfig | str,
    batch_size: int,
    ids_per_feature: dict[str, float] | None = None,
    id_samples: dict[str, list[list[np.ndarray]]] | None = None,
    forward_precision: str = "fp16",
    backward_precision: str = "bf16",
    weighted: bool = False,
    cache_fraction: float = 0.2,
    ssd_log: float = 1.0,
    cache_policy: str = "lru",
    cache_mib: float | None = None,
) -> Workload:
    """Tables with their access statistics (defaults: one id per sample and feature, no sample);
    cache_fraction: the share of rows a cached table's cache holds (the planner's cache size); ssd_log:
    the size of an ssd table's write log, a share of its rows; cache_policy: the row caches' policy;
    cache_mib: instead of fractions, MiB of cache per rank shared by its cached shards (size_mib)."""
    if not 0 < cache_fraction <= 1:
        raise ConfigError(f"planner: the cache fraction must be in (0, 1], got {cache_fraction}")
    if cache_mib is not None and not cache_mib > 0:
        raise ConfigError(f"planner: the cache size must be a positive number of MiB, got {cache_mib}")
    default = optimizer if isinstance(optimizer, str) else optimizer.name
    ids = ids_per_feature or {}
    samples = id_samples or {}
    loads = [
        TableLoad(
            table=t,
            optimizer=t.optimizer.name if t.optimizer else default,
            ids_per_feature={f: float(ids.get(f, 1.0)) for f in t.features},
            id_sample=samples.get(t.name),
        )
        for t in tables
    ]
    return Workload(
        loads,
        batch_size,
        forward_precision,
        backward_precision,
        weighted,
        cache_fraction,
        ssd_log,
        cache_policy,
        cache_mib=cache_mib,
    )


def measure_access(
    tables: list[TableConfig], batches: list
) -> tuple[dict[str, float], dict[str, list[list[np.ndarray]]], bool]:
    """From a few global batches: mean ids per sample of every feature, each table's ids per batch,
    and whether the batches carry per-id weights."""
    counts: dict[str, float] = {}
    samples: dict[str, list[list[np.ndarray]]] = {t.name: [] for t in tables}
    weighted = False
    for batch in batches:
        sparse = batch.sparse if hasattr(batch, "sparse") else batch
        weighted = weighted or sparse.weights is not None
        for t in tables:
            parts = []
            for f in t.features:
                ids, lengths, _ = sparse.feature(f)
                counts[f] = counts.get(f, 0.0) + ids.numel() / max(1, lengths.numel())
                parts.append(ids.numpy())
            samples[t.name].append(parts)
    n = max(1, len(batches))
    return {f: c / n for f, c in counts.items()}, samples, weighted
