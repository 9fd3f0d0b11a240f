"""Ids checked against their tables before any lookup (FBGEMM's `bounds_check_mode`, with names).

Every embedding engine keeps its tables side by side in shared buffers, so an id outside its own
table would read and train another table's rows, and nothing downstream could tell. Each engine
(reference, fused, sharded before its id exchange, the inference embeddings of an export) therefore
passes every batch through `IdBounds.check` first. Modes (config key `embedding.bounds_check`):

- "error" (default): the first id outside [0, rows) of its table stops the batch with a DataError
  naming the feature, the table, the id, the table's rows and the sample of the batch;
- "warn": every such id is dropped from its bag, as if the data had not held it (a mean-pooled bag
  averages the ids that remain), counted per feature (`dropped`) and logged (the first time and at
  every power of ten of a feature's count);
- "off": no check; an id outside its table is then undefined behaviour.

Tables with managed collision take raw ids: any id >= 0 is theirs (their id maps give the rows).

Cost: the check reads each feature's smallest and largest id (`SparseBatch.id_limits`, a few
reductions per batch, cached on the batch) and compares them with the table's rows on the host;
only a batch with a bad id pays for finding it. A batch whose limits are known already (counted on
the host before its copy to a GPU, or by the generator that drew it) is checked without touching the
device, so a GPU step reads nothing back for it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from neorec.errors import ConfigError, DataError
from neorec.sparse.batch import SparseBatch

log = logging.getLogger(__name__)

BOUNDS_MODES = ("error", "warn", "off")


@dataclass(frozen=True)
class FeatureBound:
    """The table a feature looks up and its rows; rows None: raw ids (managed collision), any id >= 0."""

    table: str
    rows: int | None

    def describe(self) -> str:
        if self.rows is None:
            return f"table {self.table!r}, raw ids >= 0"
        return f"table {self.table!r}, {self.rows:,} rows"

    def accepts(self, low: int, high: int) -> bool:
        """Whether ids within [low, high] all lie in the table."""
        return low >= 0 and (self.rows is None or high < self.rows)

    def outside(self, ids: torch.Tensor) -> torch.Tensor:
        """Mask of the ids outside the table."""
        bad = ids < 0
        return bad if self.rows is None else bad | (ids >= self.rows)


class IdBounds:
    """The check of one engine: its features' tables and rows, and the mode."""

    def __init__(self, features: Mapping[str, FeatureBound], mode: str = "error") -> None:
        if mode not in BOUNDS_MODES:
            raise ConfigError(f"bounds_check must be one of {list(BOUNDS_MODES)}, got {mode!r}")
        self.features = dict(features)
        self.mode = mode
        self.dropped: Counter[str] = Counter()  # warn: ids dropped per feature so far
        self._logged: dict[str, int] = {}  # warn: the count at which each feature was last logged
        self._positions: dict[tuple[str, ...], list[tuple[int, str, FeatureBound]]] = {}
        # warn: the latest batch that lost ids, and what it became, so that checking the same batch
        # again (an engine's stages each check what they are given) neither drops nor counts twice
        self._last: tuple[SparseBatch, tuple, SparseBatch] | None = None  # a batch, its stamp, checked

    @classmethod
    def of_tables(cls, tables: Iterable, mode: str = "error") -> IdBounds:
        """The bounds of TableConfig-like tables (name, rows, features, managed_collision)."""
        features = {}
        for t in tables:
            rows = None if getattr(t, "managed_collision", None) is not None else int(t.rows)
            for f in t.features:
                features[f] = FeatureBound(t.name, rows)
        return cls(features, mode)

    def check(self, sparse: SparseBatch) -> SparseBatch:
        """`sparse` itself when every id of the engine's features lies in its table (or the mode is
        off); in warn mode, else a batch without the ids outside; in error mode, else a DataError."""
        if self.mode == "off" or sparse.values.numel() == 0:
            return sparse
        if self._last is not None and self._last[0] is sparse and sparse.unchanged_since(self._last[1]):
            return self._last[2]
        checked = self._positions_in(sparse.keys)
        if not checked:
            return sparse
        lows, highs = sparse.id_limits()
        bad = [(i, f, b) for i, f, b in checked if not b.accepts(lows[i], highs[i])]
        if bad:  # limits a batch's maker gave may be wider than its ids (a slice keeps its batch's)
            lows, highs = sparse.exact_id_limits()
            bad = [(i, f, b) for i, f, b in checked if not b.accepts(lows[i], highs[i])]
        if not bad:
            return sparse
        if self.mode == "error":
            raise self._error(sparse, *bad[0])
        out = self._drop(sparse, bad)
        self._last = (sparse, sparse.stamp(), out)
        return out

    def _positions_in(self, keys: list[str]) -> list[tuple[int, str, FeatureBound]]:
        """(position in the batch, feature, bound) of the engine's features the batch has (cached per
        key order; a feature the batch lacks is the engine's own error)."""
        key = tuple(keys)
        found = self._positions.get(key)
        if found is None:
            found = [(i, f, self.features[f]) for i, f in enumerate(keys) if f in self.features]
            self._positions[key] = found
        return found

    def _error(self, sparse: SparseBatch, i: int, feature: str, bound: FeatureBound) -> DataError:
        ids, lengths, _ = sparse.feature(feature)
        bad = bound.outside(ids)
        first = int(bad.nonzero()[0, 0])
        value, sample = int(ids[first]), _sample_of(lengths, first)
        count = int(bad.sum())
        more = (
            f"; {count - 1:,} more of its {ids.numel():,} ids in this batch are outside too"
            if count > 1
            else ""
        )
        outside = "negative (raw ids lie in [0, 2^63))" if bound.rows is None else f"outside [0, {bound.rows:,})"
        return DataError(
            f"feature {feature!r} ({bound.describe()}): id {value} of sample {sample} of the batch is {outside}"
            f"{more}. Ids index their own table, so fix the data (or its table sizes), or set "
            "embedding.bounds_check: warn to drop such ids from their bags (counted and logged)"
        )

    def _drop(self, sparse: SparseBatch, bad: list[tuple[int, str, FeatureBound]]) -> SparseBatch:
        """The batch without the ids outside their tables; their bags shrink."""
        b = sparse.batch_size
        keep = torch.ones(sparse.values.numel(), dtype=torch.bool, device=sparse.device)
        lengths = sparse.lengths.clone()
        per_key = list(sparse.length_per_key())
        lows, highs = (list(x) for x in sparse.id_limits())
        starts = sparse.offset_per_key()
        for i, feature, bound in bad:
            ids = sparse.values[starts[i] : starts[i + 1]]
            outside = bound.outside(ids)
            keep[starts[i] : starts[i + 1]] = ~outside
            bags = lengths[i * b : (i + 1) * b]
            bag_of_id = torch.arange(b, device=sparse.device).repeat_interleave(bags, output_size=ids.numel())
            example = int(ids[outside][0])
            bags -= torch.bincount(bag_of_id[outside], minlength=b).to(bags.dtype)
            count = int(outside.sum())
            per_key[i] -= count
            # what remains lies in the table: bounds, not the exact extremes
            lows[i], highs[i] = 0, (bound.rows - 1 if bound.rows is not None else max(highs[i], 0))
            self.dropped[feature] += count
            self._log(feature, bound, count, example)
        weights = sparse.weights[keep] if sparse.weights is not None else None
        return SparseBatch(
            sparse.keys, sparse.values[keep], lengths, weights, per_key, id_limits=(lows, highs)
        )

    def _log(self, feature: str, bound: FeatureBound, count: int, example: int) -> None:
        """A warning for a feature's first dropped ids, then each time its total passes a power of ten."""
        total = self.dropped[feature]
        last = self._logged.get(feature)
        if last is not None and len(str(total)) == len(str(last)):
            return
        self._logged[feature] = total
        log.warning(
            "feature %r (%s): dropped %d id(s) outside the table from their bags (e.g. id %d); %d so far "
            "(embedding.bounds_check: warn)", feature, bound.describe(), count, example, total,
        )  # fmt: skip


def _sample_of(lengths: torch.Tensor, position: int) -> int:
    """The sample (bag) that holds id number `position` of a feature whose bags have `lengths`."""
    ends = torch.cumsum(lengths, 0)
    return int(torch.searchsorted(ends, torch.tensor(position, device=ends.device), right=True))
