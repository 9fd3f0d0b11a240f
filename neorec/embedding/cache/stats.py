"""What a row cache counts, per table: lookups, misses, evictions, write-backs, bytes per tier.

Definitions (rows are counted once per call, duplicates in a batch count once):
- lookups: unique rows of each batch, counted once per batch (at its prefetch, or at its lookup
  when it was not prefetched);
- misses: rows brought from the backing tier into the cache (by a prefetch or a lookup), plus the
  rows of a batch that did not fit in the cache at all (read from the backing tier directly);
- hit rate: 1 - misses / lookups, the share of looked-up rows that cost no transfer. A cache that
  cannot hold two batches may evict rows prefetched for the next batch before it runs; they are
  brought in twice, and the hit rate (clamped at 0) says so;
- evictions: rows dropped from the cache; writebacks: those of them that were updated, so their
  weights and optimizer state were written back; write_through: updates written straight to the
  backing tier because their row was not cached;
- bytes: rows x (weight + optimizer state bytes per row), from and to the backing tier.
"""

from __future__ import annotations

import torch

FIELDS = ("lookups", "misses", "evictions", "writebacks", "write_through")


class CacheStats:
    """Counters of one cache (one group of tables), kept per table, on the cache's device: counting
    never reads anything back to the host (a cache in GPU memory counts without a sync); the
    counters cross once, when they are reported."""

    def __init__(
        self,
        tables: list[str],
        starts: list[int],
        row_bytes: int,
        tier: str,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tables = tables
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.row_bytes = row_bytes
        self.tier = tier
        self.counts = torch.zeros(len(FIELDS), len(tables), dtype=torch.int64, device=device)

    def add(
        self, field: str, rows: torch.Tensor, ascending: bool = False, where: torch.Tensor | None = None
    ) -> None:
        """Count global `rows` under `field`, each for the table that holds it (ascending: `rows` are
        sorted, so the tables' first rows split them: a few binary searches instead of one per row).
        where: a bool mask of the rows that count (the others may be anything, e.g. -1)."""
        if rows.numel() == 0:
            return
        i = FIELDS.index(field)
        if where is not None:
            table = self._table_of(rows).clamp_(min=0)
            self.counts[i].index_add_(0, table, where.to(torch.int64))
        elif len(self.tables) == 1:
            self.counts[i, 0] += rows.numel()
        elif ascending:
            bounds = torch.searchsorted(rows, self.starts)
            end = torch.full(
                (1,), rows.numel(), dtype=bounds.dtype, device=bounds.device
            )  # no copy from the host
            self.counts[i] += torch.diff(bounds, append=end)
        else:
            table = self._table_of(rows)
            self.counts[i].index_add_(0, table, torch.ones_like(table))

    def _table_of(self, rows: torch.Tensor) -> torch.Tensor:
        if len(self.tables) == 1:
            return torch.zeros_like(rows)
        return torch.searchsorted(self.starts, rows, right=True) - 1

    def by_table(self) -> dict[str, dict[str, float]]:
        out = {}
        counts = self.counts.cpu()
        for t, name in enumerate(self.tables):
            c = {f: int(counts[i, t]) for i, f in enumerate(FIELDS)}
            hit_rate = max(0.0, 1.0 - c["misses"] / c["lookups"]) if c["lookups"] else float("nan")
            out[name] = {
                **c,
                "hit_rate": hit_rate,
                f"mib_from_{self.tier}": c["misses"] * self.row_bytes / 2**20,
                f"mib_to_{self.tier}": (c["writebacks"] + c["write_through"]) * self.row_bytes / 2**20,
            }
        return out

    def reset(self) -> None:
        self.counts.zero_()


def summarize(per_table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Totals over tables: lookups, misses, hit rate, evictions and MiB moved per tier."""
    out: dict[str, float] = {}
    for stats in per_table.values():
        for k, v in stats.items():
            if k != "hit_rate":
                out[k] = out.get(k, 0) + v
    if out.get("lookups"):
        out["hit_rate"] = max(0.0, 1.0 - out["misses"] / out["lookups"])
    return out


def log_values(per_table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flat values for the training log (cumulative): totals, then `<table>/<stat>` per table."""
    keep = ("hit_rate", "misses", "evictions")
    out = {k: v for k, v in summarize(per_table).items() if k in keep or k.startswith("mib_")}
    for table, stats in per_table.items():
        out.update({f"{table}/{k}": v for k, v in stats.items() if k in keep or k.startswith("mib_")})
    return out
