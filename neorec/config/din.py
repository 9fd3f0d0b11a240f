"""model.arch din's settings, and what din needs of the data and the tables (said in the keys to set)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from neorec.config import limits
from neorec.config.base import Strict
from neorec.config.data import DataConfig


class DINConfig(Strict):
    """model.arch din: the target's embedding attends over a history feature (neorec/model/din.py)."""

    target: str = Field(
        "movie", min_length=1, description="pooled feature whose embedding queries the history"
    )
    history: str = Field(
        "history",
        min_length=1,
        description="sequence feature (its table has pooling none) of the user's past items",
    )
    history_side: list[str] = Field(
        default_factory=lambda: ["history_liked"],
        description="sequence features aligned with history whose rows are added to its rows position by "
        "position",
    )
    max_len: int = Field(50, gt=0, description="history positions the attention reads (the most recent ones)")
    attention_mlp: list[int] = Field([64, 16], description="hidden sizes of the attention unit's MLP")
    cross_layers: int = Field(
        0,
        ge=0,
        le=limits.MAX_LAYERS,
        description="DCNv2 cross layers over [dense, pooled, interest] before the top MLP",
    )

    @model_validator(mode="after")
    def _sizes(self) -> DINConfig:
        if any(not 0 < s <= limits.MAX_WIDTH for s in self.attention_mlp):
            raise ValueError(f"attention_mlp sizes must be in [1, {limits.MAX_WIDTH}]")
        return self

    @property
    def sequence_features(self) -> list[str]:
        return [self.history, *self.history_side]


def check_din(din: DINConfig, data: DataConfig, embedding: Any) -> None:
    """Refuse (ValueError, in the config keys to set) a din run whose data has no history, whose history
    tables are pooled, whose target is not, with a sequence table din would not read, or whose id check
    drops ids (`embedding`: the run's EmbeddingConfig)."""
    if data.source in ("synthetic", "shards", "criteo_tsv"):  # one-hot and multi-hot ids, no sequences
        raise ValueError(
            f"model.arch din needs a history feature, and data.source {data.source} has none: din reads "
            "MovieLens (data.movielens.history), or a list column of Parquet data or of data preprocessed "
            "from it (embedding.tables.<name>.pooling: none)"
        )
    if data.source == "movielens" and data.movielens.history == 0:
        raise ValueError(
            "model.arch din needs a history feature: set data.movielens.history to the number of past "
            "ratings per sample (e.g. 50)"
        )

    tables = embedding.tables

    def pooling(name: str) -> str:
        override = tables.get(name)
        return override.pooling if override and override.pooling else embedding.pooling

    for name in din.sequence_features:
        if pooling(name) != "none":
            raise ValueError(
                f"model.arch din reads feature {name!r} as a sequence (model.din), but its table has "
                f"pooling {pooling(name)}: set embedding.tables.{name}.pooling: none"
            )
    if pooling(din.target) == "none":
        raise ValueError(
            f"model.din.target {din.target!r} is the query and must be pooled: set "
            f"embedding.tables.{din.target}.pooling to sum or mean"
        )
    for name in tables:
        if pooling(name) == "none" and name not in din.sequence_features:
            raise ValueError(
                f"embedding.tables.{name}.pooling is none, but model.arch din reads only model.din.history "
                f"and history_side as sequences, so {name!r} would be looked up for nothing: pool it "
                "(sum or mean) or add it to model.din.history_side"
            )
    if embedding.bounds_check == "warn":
        raise ValueError(
            "embedding.bounds_check warn drops an out-of-range id from its own feature only, which would "
            f"shift model.din.history_side against {din.history!r} position by position: use error (or off)"
        )
