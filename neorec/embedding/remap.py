"""Raw ids of managed-collision tables -> their rows, inside an embedding collection before the lookup.

Every engine (reference, fused, and the fused engine of each rank under sharding) calls
`remap_batch` first thing in forward: the ids of each managed-collision table's features are
mapped by the table's IdMap (id_map.py), the rows whose ids were evicted are handed to the engine
to re-initialise (weights and optimizer state), and ids that got no row are left out of their
bags (lengths shrink). A mean-pooled bag still divides by the number of ids it was given: the
ids that remain carry the weight (kept / given), which the engine's 1 / kept then turns into
1 / given. That is what a row-wise shard computes too (its ids carry 1 / given, input_dist.py), so
sharded and single-process training agree when ids are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from neorec.embedding.id_map import FREE, STAT_FIELDS, IdMap
from neorec.errors import DataError
from neorec.sparse import SparseBatch


@dataclass
class MappedTable:
    """One managed-collision table of an engine: its map, its features, and what resets evicted rows."""

    name: str
    id_map: IdMap
    features: list[str]
    reset_rows: Callable[[torch.Tensor], None]  # rows of the table (0-based) whose id was evicted
    mean: bool = False  # mean pooling: a bag's mean still divides by all its ids, those left out too


def remap_batch(sparse: SparseBatch, tables: list[MappedTable], step: int, train: bool) -> SparseBatch:
    """`sparse` with the ids of `tables`' features replaced by rows (train: the maps learn the batch)."""
    if not tables or sparse.values.numel() == 0:
        return sparse
    bounds = sparse.offset_per_key()
    position = {k: i for i, k in enumerate(sparse.keys)}
    values = sparse.values.clone()
    for t in tables:
        spans = [(bounds[position[f]], bounds[position[f] + 1]) for f in t.features if f in position]
        ids = torch.cat([sparse.values[a:b] for a, b in spans]) if spans else sparse.values[:0]
        if ids.numel() and bool((ids < 0).any()):
            raise DataError(
                f"table {t.name!r} has managed collision and takes raw ids in [0, 2^63); the batch has a "
                f"negative id ({int(ids.min())})"
            )
        rows, evicted = t.id_map.remap(ids, step, train)
        if evicted.numel():
            t.reset_rows(evicted)
        at = 0
        for a, b in spans:
            values[a:b] = rows[at : at + b - a]
            at += b - a
    keep = values != FREE
    if bool(keep.all()):
        return SparseBatch(sparse.keys, values, sparse.lengths, sparse.weights)
    bags = torch.arange(sparse.lengths.numel(), device=values.device).repeat_interleave(sparse.lengths)
    lengths = torch.bincount(bags[keep], minlength=sparse.lengths.numel()).to(sparse.lengths.dtype)
    weights = sparse.weights
    mean_features = [position[f] for t in tables if t.mean for f in t.features if f in position]
    if mean_features:
        b = sparse.batch_size
        of_mean = torch.zeros(sparse.num_features, dtype=torch.bool, device=values.device)
        of_mean[mean_features] = True
        ratio = lengths.to(torch.float32) / sparse.lengths.clamp(min=1).to(torch.float32)
        ratio = torch.where(of_mean.repeat_interleave(b), ratio, 1.0).index_select(0, bags)
        weights = ratio if weights is None else weights * ratio
    weights = weights[keep] if weights is not None else None
    return SparseBatch(sparse.keys, values[keep], lengths, weights)


def expire_ids(tables: list[MappedTable], before: int) -> dict[str, int]:
    """Free, in every table of `tables`, the rows of ids last seen before map step `before`, their
    weights and optimizer state back to their initial values; the number freed per table."""
    out = {}
    for t in tables:
        rows = t.id_map.expire(before)
        if rows.numel():
            t.reset_rows(rows)
        out[t.name] = int(rows.numel())
    return out


def map_stats(tables: list[MappedTable]) -> dict[str, dict[str, float]]:
    """Per table (cumulative): hits, misses, inserts, evictions, dropped, occupied rows, capacity."""
    return {
        t.name: {**t.id_map.stats, "occupied": t.id_map.occupied, "capacity": t.id_map.capacity} for t in tables
    }


def with_earlier_counts(
    per_table: dict[str, dict[str, float]], earlier: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """map_stats with the counters (STAT_FIELDS) of a run before its resume added: cumulative over
    the whole run, as an uninterrupted run counts them (occupied rows and capacity are as they are)."""
    return {
        table: {k: v + earlier.get(table, {}).get(k, 0) if k in STAT_FIELDS else v for k, v in stats.items()}
        for table, stats in per_table.items()
    }


def counters(per_table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The cumulative counters (STAT_FIELDS) of map_stats alone: what a checkpoint keeps for the resume."""
    return {table: {k: v for k, v in stats.items() if k in STAT_FIELDS} for table, stats in per_table.items()}


def map_log_values(per_table: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flat values for the training log (cumulative): totals, then `<table>/<stat>` per table."""
    out: dict[str, float] = {}
    for table, stats in per_table.items():
        for k, v in stats.items():
            out[k] = out.get(k, 0) + v
            out[f"{table}/{k}"] = v
    return out
