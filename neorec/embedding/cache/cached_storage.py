"""The storage of one tensor of a cached group (its weights or one optimizer state) that the fused
engine reads and writes: a RowStorage (neorec/embedding/fused/storage.py) over the group's RowCache."""

from __future__ import annotations

import torch

from neorec.embedding.cache.cache import RowCache


class CachedStorage:
    """One tensor (the weights, or one optimizer state) of a group, read and written through its cache."""

    def __init__(self, cache: RowCache, name: str) -> None:
        self.cache, self.name = cache, name
        field = cache.layout.fields[name]
        self.num_rows, self.width, self.dtype = cache.num_rows, field.width, field.dtype

    @property
    def view(self) -> torch.Tensor:
        """The field in the cache's records: [slots, width] (or [slots]), a strided view."""
        return self.cache.buffers[self.name]

    def resident_slots(self, rows: torch.Tensor) -> torch.Tensor | None:
        return self.cache.resident_slots(rows)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.cache.read(self.name, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.cache.write(self.name, rows, values)

    def prefetch(self, rows: torch.Tensor, lookup: bool = False, ahead: bool = False) -> None:
        self.cache.prefetch(rows, lookup, ahead)

    def unique_count(self, rows: torch.Tensor) -> int | None:
        return self.cache.unique_count(rows)

    def rows_of(self, batch_rows: torch.Tensor, rows: torch.Tensor) -> None:
        self.cache.rows_of(batch_rows, rows)

    def read_range(self, start: int, end: int) -> torch.Tensor:
        return self.cache.read_range(self.name, start, end)

    def view_range(self, start: int, end: int) -> torch.Tensor:
        return self.cache.view_range(self.name, start, end)

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        self.cache.write_range(self.name, start, end, values)

    def stats_by_table(self) -> dict[str, dict[str, float]]:
        return self.cache.stats.by_table()
