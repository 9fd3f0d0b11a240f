"""The data sections of the run configuration (`data:`): where batches come from and how they are cut.
Re-exported by neorec.config.schema, where the other sections live."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from neorec.config import limits
from neorec.config.base import Strict
from neorec.config.continuous import FollowConfig


class SyntheticConfig(Strict):
    """Synthetic Criteo-like data with a hidden teacher model (neorec.data.synthetic)."""

    preset: Literal["custom", "criteo_kaggle", "mlperf"] = Field(
        "custom", description="table sizes: custom (`rows`), the Criteo Kaggle cardinalities, or MLPerf's Criteo 1TB"
    )
    rows: int | list[int] = Field(10000, description="custom preset: rows of every table, or one entry per table")
    num_sparse: int = Field(26, gt=0, le=limits.MAX_FEATURES, description="custom preset: number of categorical features")
    num_dense: int = Field(13, ge=0, le=limits.MAX_FEATURES, description="number of dense features")
    max_rows: int | None = Field(None, gt=0, le=limits.MAX_ROWS, description="cap every table at this many rows")
    row_scale: float = Field(1.0, gt=0, le=1, description="multiply every table size by this (>= 1 row)")
    zipf_alpha: float = Field(1.05, gt=0, description="power-law exponent of id popularity")
    multi_hot: Literal["none", "mlperf"] | list[int] = Field(
        "none", description="one-hot, MLPerf DCNv2 bag sizes, or a mean bag size per feature"
    )
    variable_bags: bool = Field(False, description="bag sizes ~ Poisson(mean), so empty bags occur")
    weighted: bool = Field(False, description="ids carry weights in (0, 1]")
    latent_dim: int = Field(8, gt=0, le=limits.MAX_DIM, description="teacher: latent vector size per id")
    num_pairs: int = Field(26, ge=0, description="teacher: feature pairs whose latent dot products matter")
    logit_scale: float = Field(2.0, gt=0, description="teacher: std of the logit (larger = easier task)")
    base_ctr: float = Field(0.25, gt=0, lt=1, description="teacher: mean click rate")
    train_samples: int = Field(1_000_000, gt=0, le=limits.MAX_SAMPLES, description="training samples per epoch")
    eval_samples: int = Field(100_000, gt=0, le=limits.MAX_SAMPLES, description="held-out samples")
    on_device: bool = Field(
        True, description="with train.device cuda: keep the drawn samples in GPU memory and cut batches there"
    )
    generator: Literal["auto", "host", "device"] = Field(
        "auto",
        description="where samples are drawn: host (numpy; the same samples on every device), device (torch where "
        "they are kept: the same distribution, another random stream, fast enough to feed a GPU); auto = device "
        "when train.device is cuda and on_device is true, else host",
    )

    @model_validator(mode="after")
    def _lengths(self) -> SyntheticConfig:
        # they choose the tables of preset custom only: changed under another preset, they would do
        # nothing (a saved config holds every key at its value, so a changed value is the mistake)
        fields = type(self).model_fields
        changed = [k for k in ("num_sparse", "rows") if getattr(self, k) != fields[k].default]
        ignored = changed if self.preset != "custom" else []
        if ignored:
            keys = " and ".join(f"data.synthetic.{k}" for k in ignored)
            raise ValueError(
                f"{keys} choose the tables of preset custom; preset {self.preset} has its own 26: set "
                f"data.synthetic.preset: custom to use them, or leave them out"
            )
        if isinstance(self.rows, list) and self.preset == "custom" and len(self.rows) != self.num_sparse:
            raise ValueError(f"rows has {len(self.rows)} entries but num_sparse is {self.num_sparse}")
        if isinstance(self.multi_hot, list) and len(self.multi_hot) != self.num_tables:
            raise ValueError(f"multi_hot has {len(self.multi_hot)} entries for {self.num_tables} features")
        if any(not 0 < r <= limits.MAX_ROWS for r in (self.rows if isinstance(self.rows, list) else [self.rows])):
            raise ValueError(f"rows must be in [1, {limits.MAX_ROWS}] (every entry)")
        if isinstance(self.multi_hot, list) and any(not 0 <= b <= limits.MAX_WIDTH for b in self.multi_hot):
            raise ValueError(f"multi_hot mean bag sizes must be in [0, {limits.MAX_WIDTH}]")
        return self

    @property
    def num_tables(self) -> int:
        return 26 if self.preset != "custom" else self.num_sparse


class CriteoConfig(Strict):
    """Raw Criteo TSV files (label, I1..I13, C1..C26), plain or .gz."""

    train_paths: list[str] = Field(min_length=1, description="training TSV files")
    eval_paths: list[str] | None = Field(None, description="held-out TSV files; default: every eval_every-th line")
    table_rows: int | list[int] = Field(100_000, description="rows per table (one value, or 26)")
    hashing: Literal["modulo", "hash"] = Field("modulo", description="how a hex id maps into its table")
    bad_lines: Literal["fail", "skip"] = Field("fail", description="malformed lines: stop with file:line, or skip and count")
    eval_every: int = Field(10, ge=2, description="without eval_paths, hold out lines whose number is a multiple of this")
    max_line_bytes: int = Field(4096, gt=0, description="longer lines are malformed (bad_lines); a Criteo line is under 500 bytes")


class MovieLensConfig(Strict):
    """MovieLens latest-small: label = rating >= 4."""

    root: str | None = Field(
        None,
        description="folder with ratings.csv and movies.csv; unset: ../shared/data/ml-latest-small if it exists, "
        "else the copy `neorec data download movielens` writes (~/.cache/neorec/data/ml-latest-small: docs/data.md)",
    )
    val_fraction: float = Field(0.1, gt=0, lt=1, description="share of ratings held out")
    split: Literal["user_time", "global_time", "random"] = Field(
        "user_time",
        description="held-out ratings: each user's last ones by time, the last ones of all, or a seeded random "
        "share (leaks each user's future into training)",
    )
    history: int = Field(
        0,
        ge=0,
        description="add features history (the movies of the user's last N earlier ratings) and history_liked "
        "(whether each was rated >= 4), for model.arch din; 0: none",
    )
    history_from: Literal["all", "train"] = Field(
        "all",
        description="ratings that fill histories: all earlier ones (a held-out rating's history includes the "
        "user's earlier held-out ratings, known when serving) or training ratings only (stops at the split)",
    )


class PreprocessedConfig(Strict):
    """Shards written by `neorec data preprocess`, read by neorec/data/sharded_reader.py."""

    path: str | None = Field(None, description="the folder `neorec data preprocess --out` wrote (unset with data.follow)")
    shuffle: bool = Field(True, description="shuffle the shard order and the samples within a window, per epoch")
    shuffle_window: int = Field(131072, gt=0, le=2**31, description="samples permuted together (the shuffle buffer)")
    prefetch: int = Field(4, ge=0, le=1024, description="batches the reader's background threads make ahead")
    threads: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="threads that gather training batches in parallel (the same batches in the same order "
        "whatever their number); auto: one per 4 cores this process may use over the run's processes on "
        "the machine, 1 to 4 (a GPU host's reader must keep up with a GPU step)",
    )


class ParquetFeatureConfig(Strict):
    """One categorical feature of Parquet data: its ids column and how raw values become table rows."""

    name: str = Field(min_length=1, description="feature (and table) name")
    column: str | None = Field(
        None, description="column of ids (default: the name): integers or strings, or lists of them (multi-hot)"
    )
    weights: str | None = Field(
        None, description="column of per-id weights: a float, or a list of floats as long as the ids' list"
    )
    rows: int | None = Field(None, gt=0, le=limits.MAX_ROWS, description="rows of the feature's table (default: data.parquet.table_rows)")
    hashing: Literal["modulo", "hash", "none", "vocab"] | None = Field(
        None, description="raw value -> row (default: data.parquet.hashing)"
    )
    strings: Literal["hex", "fnv1a"] | None = Field(
        None, description="string ids -> raw value (default: data.parquet.strings)"
    )


class ParquetConfig(Strict):
    """Parquet files read by neorec/data/parquet.py: columns mapped to the label, dense and categorical
    features; each rank reads its own row groups."""

    paths: list[str] = Field(
        default_factory=list, description="training files or folders (local, or URIs pyarrow opens); unset with data.follow"
    )
    eval_paths: list[str] | None = Field(None, description="held-out files or folders (or set eval_column)")
    eval_column: str | None = Field(
        None, description="boolean (or 0/1) column of paths' rows: true rows are held out (or set eval_paths)"
    )
    label: str = Field("label", min_length=1, description="label column: 0/1 integers, floats or booleans")
    dense: list[str] = Field(default_factory=list, description="dense feature columns (numbers; null -> 0)")
    dense_log1p: bool = Field(False, description="dense values: negatives -> 0, then log(1 + x), as for Criteo")
    features: list[str | ParquetFeatureConfig] = Field(
        min_length=1,
        description="categorical features: a column name, or a section with name, column, weights, rows, hashing, "
        "strings (the last three default to this section's)",
    )
    table_rows: int = Field(100_000, gt=0, le=limits.MAX_ROWS, description="default rows of every feature's table")
    hashing: Literal["modulo", "hash", "none", "vocab"] = Field(
        "modulo",
        description="raw value -> row: value % rows, splitmix64(value) % rows, the value itself (checked to lie "
        "in [0, rows)), or 1 + its place in a vocabulary of vocab_dir (0 when absent)",
    )
    strings: Literal["hex", "fnv1a"] = Field(
        "fnv1a", description="string ids -> raw value: hex digits (at most 8, as Criteo's), or the FNV-1a hash"
    )
    vocab_dir: str | None = Field(None, description="hashing vocab: folder of <feature>.npy vocabularies")
    shuffle: bool = Field(True, description="shuffle the row-group order and the rows in a row group, per epoch")
    prefetch: int = Field(4, ge=0, le=1024, description="batches the reader's background threads make ahead")

    @model_validator(mode="after")
    def _split_and_names(self) -> ParquetConfig:
        if self.eval_paths is not None and self.eval_column is not None:
            raise ValueError("set one of eval_paths (held-out files) or eval_column (a held-out flag per row), not both")
        names = [f if isinstance(f, str) else f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be unique, got {names}")
        if self.vocab_dir is None and any(h == "vocab" for h in [self.hashing, *self._feature_hashings()]):
            raise ValueError("hashing vocab needs data.parquet.vocab_dir")
        return self

    def _feature_hashings(self) -> list[str | None]:
        return [f.hashing for f in self.features if not isinstance(f, str)]

    def feature_configs(self) -> list[ParquetFeatureConfig]:
        """Every feature with its defaults filled in from this section."""
        out = []
        for f in self.features:
            f = ParquetFeatureConfig(name=f) if isinstance(f, str) else f
            out.append(ParquetFeatureConfig(
                name=f.name, column=f.column or f.name, weights=f.weights, rows=f.rows or self.table_rows,
                hashing=f.hashing or self.hashing, strings=f.strings or self.strings,
            ))  # fmt: skip
        return out


class DataConfig(Strict):
    source: Literal["synthetic", "criteo_tsv", "movielens", "shards", "preprocessed", "parquet"] = Field(
        "synthetic", description="where batches come from"
    )
    shards_dir: str | None = Field(None, description="source shards: a folder written by `neorec data generate`")
    batch_size: int = Field(2048, gt=0, le=limits.MAX_BATCH, description="training samples per step (global)")
    eval_batch_size: int = Field(16384, gt=0, le=limits.MAX_BATCH, description="samples per evaluation batch")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig, description="synthetic data settings")
    criteo: CriteoConfig | None = Field(None, description="Criteo TSV settings (source: criteo_tsv)")
    movielens: MovieLensConfig = Field(default_factory=MovieLensConfig, description="MovieLens settings")
    preprocessed: PreprocessedConfig | None = Field(None, description="preprocessed shards (source: preprocessed)")
    parquet: ParquetConfig | None = Field(None, description="Parquet files (source: parquet)")
    follow: FollowConfig | None = Field(
        None, description="continuous training: the partitions of a folder, in order and as they land (docs/continuous.md)"
    )

    @model_validator(mode="after")
    def _source_settings(self) -> DataConfig:
        if self.follow is not None:
            return self._follow_settings()
        if self.source == "criteo_tsv" and self.criteo is None:
            raise ValueError("source criteo_tsv needs a data.criteo section with train_paths")
        if self.source == "shards" and not self.shards_dir:
            raise ValueError("source shards needs data.shards_dir")
        if self.source == "preprocessed" and (self.preprocessed is None or self.preprocessed.path is None):
            raise ValueError("source preprocessed needs a data.preprocessed section with path")
        if self.source == "parquet" and self.parquet is None:
            raise ValueError("source parquet needs a data.parquet section with paths and features")
        if self.source == "parquet" and self.parquet is not None:
            p = self.parquet
            if not p.paths:
                raise ValueError("source parquet needs data.parquet.paths (or data.follow.dir to follow a folder)")
            if p.eval_paths is None and p.eval_column is None:
                raise ValueError("data.parquet: set one of eval_paths (held-out files) or eval_column (a held-out flag per row)")
        return self

    def _follow_settings(self) -> DataConfig:
        """data.follow reads partitions of Parquet files or of preprocessed shards; the partitions replace
        the paths, and progressive validation replaces the held-out set."""
        if self.source not in ("parquet", "preprocessed"):
            raise ValueError(
                f"data.follow reads partitions of Parquet files or preprocessed shards: set data.source to parquet or "
                f"preprocessed (it is {self.source})"
            )
        if self.source == "parquet" and self.parquet is None:
            raise ValueError("data.follow with source parquet needs a data.parquet section (label, dense, features)")
        p = self.parquet
        if self.source == "parquet" and p is not None and (p.paths or p.eval_paths or p.eval_column):
            raise ValueError(
                "data.follow takes the Parquet files from its partitions: leave out data.parquet.paths, eval_paths and "
                "eval_column (each batch is scored before it trains: docs/continuous.md)"
            )
        if self.source == "preprocessed" and self.preprocessed is not None and self.preprocessed.path is not None:
            raise ValueError("data.follow takes the shards from its partitions: leave out data.preprocessed.path")
        return self
