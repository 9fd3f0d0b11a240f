"""Embedding table and embedding optimizer settings (validated; shared by every embedding engine)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from neorec.config.base import NumbersNotBool


class EmbeddingOptimizerConfig(NumbersNotBool):
    """Optimizer applied to embedding rows (fused into the backward pass by the fused engine)."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = Field("sgd", description="update rule")
    lr: float = Field(0.1, gt=0, description="learning rate (scaled by the trainer's schedule)")
    eps: float = Field(1e-8, gt=0, description="added to the denominator of adagrad/adam")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty added to the gradient of touched rows")
    beta1: float = Field(0.9, ge=0, lt=1, description="adam first-moment decay")
    beta2: float = Field(0.999, ge=0, lt=1, description="adam second-moment decay")
    initial_accumulator: float = Field(0.0, ge=0, description="starting value of adagrad state")

    def over(self, base: EmbeddingOptimizerConfig) -> EmbeddingOptimizerConfig:
        """This per-table section merged over the optimizer of all tables, key by key (as TorchRec's
        per-table fused params override the global ones): the keys it was given are its own, the others
        `base`'s. A section given every key (a run's config.yaml) is itself."""
        own = self.model_dump(include=self.model_fields_set)
        return EmbeddingOptimizerConfig.model_validate({**base.model_dump(), **own})


class ManagedCollisionConfig(NumbersNotBool):
    """A table whose rows are handed out to raw ids by an id map (neorec/embedding/id_map.py)."""

    model_config = ConfigDict(extra="forbid")

    eviction: Literal["lru", "lfu"] = Field(
        "lru", description="which id a full bucket gives up: least recently used, or least frequently used"
    )
    buckets: int = Field(
        1, gt=0, description="the map is cut into this many equal parts by a hash of the id (row-wise "
        "sharding over N ranks needs a multiple of N); each part evicts on its own"
    )


class TableConfig(BaseModel):
    """One embedding table; several features may look it up."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="table name, unique in the model")
    rows: int = Field(gt=0, description="number of rows (ids lie in [0, rows))")
    dim: int = Field(gt=0, description="embedding dimension")
    features: list[str] = Field(min_length=1, description="features that look up this table")
    pooling: Literal["sum", "mean", "none"] = Field(
        "sum", description="how the ids of one bag are combined; none: one row per id (a sequence feature)"
    )
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="storage type of the weights")
    optimizer: EmbeddingOptimizerConfig | None = Field(
        None,
        description="this table's optimizer in full, in place of the collection's (a config's per-table "
        "section comes merged over embedding.optimizer: EmbeddingOptimizerConfig.over)",
    )
    managed_collision: ManagedCollisionConfig | None = Field(
        None, description="ids are raw 63-bit ids mapped to rows by an id map of `rows` capacity (no collisions)"
    )

    @model_validator(mode="after")
    def _unique_features(self) -> TableConfig:
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"table {self.name!r} lists a feature twice: {self.features}")
        return self


def feature_order(tables: list[TableConfig]) -> list[str]:
    """The order in which features come out of an embedding collection: table by table."""
    return [f for t in tables for f in t.features]


def pooled_tables(tables: list[TableConfig]) -> list[TableConfig]:
    """The tables whose features are pooled into bags (the collection's `feature_names`)."""
    return [t for t in tables if t.pooling != "none"]


def sequence_tables(tables: list[TableConfig]) -> list[TableConfig]:
    """The tables with pooling none: one row per id (the collection's `sequence_names`)."""
    return [t for t in tables if t.pooling == "none"]


def check_tables(tables: list[TableConfig]) -> None:
    """Unique table names, each feature served by exactly one table, managed collision where it applies."""
    from neorec.errors import ConfigError

    names = [t.name for t in tables]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"duplicate table names: {sorted(dup)}")
    seen: dict[str, str] = {}
    for t in tables:
        for f in t.features:
            if f in seen:
                raise ConfigError(f"feature {f!r} is looked up by both table {seen[f]!r} and table {t.name!r}")
            seen[f] = t.name
        mc = t.managed_collision
        if mc is not None and t.pooling == "none":
            raise ConfigError(
                f"table {t.name!r}: managed_collision is for pooled tables (an id its map drops would vanish "
                "from a sequence); set pooling to sum or mean, or drop managed_collision"
            )
        if mc is not None and t.rows % mc.buckets:
            raise ConfigError(
                f"table {t.name!r}: managed_collision.buckets {mc.buckets} must divide its {t.rows} rows "
                "(every bucket holds rows / buckets rows)"
            )


def lookups(tables: list[TableConfig], weighted: Collection[str] | None = None) -> dict[str, tuple]:
    """How each table looks up its rows: the features it serves, in order, and their pooling; with
    `weighted` (the features whose ids come with per-id weights), also those of its features that
    pool weighted ids, in order."""
    out: dict[str, tuple] = {t.name: (list(t.features), t.pooling) for t in tables}
    if weighted is not None:
        out = {t.name: (*out[t.name], [f for f in t.features if f in weighted]) for t in tables}
    return out


def lookup_difference(
    trained: dict[str, tuple], now: list[TableConfig], weighted: Collection[str] | None = None
) -> str | None:
    """How tables of the same name look up their rows differently in `now` than when `trained`
    (`lookups` of the trained tables): trained rows loaded under another lookup score another model
    without any shape telling. `weighted`: the features of `now` whose ids come with per-id weights,
    compared with the trained ones where `trained` records them. A text with {trained} and {now} to
    fill in; None when none differs."""
    for t in now:
        if t.name not in trained:
            continue
        features, pooling, *was_weighted = trained[t.name]
        if features != t.features:
            return f"table {t.name!r} serves features {features} in {{trained}} but {t.features} in {{now}}"
        if pooling != t.pooling:
            return f"table {t.name!r} has pooling {pooling} in {{trained}} but {t.pooling} in {{now}}"
        if not was_weighted or weighted is None:
            continue
        for f in t.features:
            was, is_ = f in was_weighted[0], f in weighted
            if was != is_:
                return (
                    f"feature {f!r} (table {t.name!r}) pools its ids {'with' if was else 'without'} per-id "
                    f"weights in {{trained}} but {'with' if is_ else 'without'} them in {{now}}"
                )
    return None
