"""`neorec data preprocess` with Parquet input: the Parquet files of a `data.parquet` section -> .npy
shards (planned here, their samples read by neorec/data/parquet_shards.py).

Input: a shard is a run of consecutive row groups of one file holding at least `shard_rows` rows (or the
rest of the file), so that the plan depends on the files alone, whatever the number of workers. Rows
become samples exactly as the Parquet source reads them (neorec/data/parquet_columns.py: the same id
mapping, held-out files or the held-out column), written with the same shard writer, manifest and resume
as Criteo input (neorec/data/preprocess.py). A feature with `hashing: vocab` uses the vocabulary files of
`vocab_dir`; with `vocab_threshold`, a first pass counts them from the training rows (values seen at least
that often get ids 1..V, neorec/data/vocab.py) into `<out>/vocab`, which `vocab_dir` must then name, so
that a `data.parquet` section reading the same files trains with the same ids.

Parquet copies of the shards (`parquet_output`, for any input): neorec/data/parquet_output.py.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from neorec.config.schema import ParquetConfig
from neorec.data import vocab as vocab_io
from neorec.data.manifest import ShardPlan, resume_or_start, start_manifest
from neorec.data.parquet import column_map, file_uri, listed_files, open_parquet, open_uri
from neorec.data.parquet_columns import held_out, raw_ids, same_lists
from neorec.data.preprocess import PreprocessResult, _map, _write_shards
from neorec.data.workers import shared_pool
from neorec.errors import ConfigError

PathLike = str | Path
_READ_ONLY = ("shuffle", "prefetch")  # settings of reading only, not of the samples


def preprocess_parquet(
    config: ParquetConfig,
    out: PathLike,
    *,
    shard_rows: int = 1_000_000,
    workers: int = 1,
    progress: bool = True,
    max_shards: int | None = None,
    parquet_output: bool = False,
    vocab_threshold: int | None = None,
) -> PreprocessResult:
    """The Parquet files of `config` (paths and eval_paths) -> shards of at least `shard_rows` rows."""
    if shard_rows < 1:
        raise ConfigError(f"shard_rows must be >= 1, got {shard_rows}")
    out = Path(out)
    counted = _vocab_features(config, out, vocab_threshold)
    cmap = column_map(config, with_vocabs=False)
    plan: list[ShardPlan] = []
    sizes: list[int] = []
    multi_hot: list[bool] = []
    first_file = ""  # the first file, whose list columns every other file has
    for key, fs, name in listed_files(config):
        role = "eval" if key == "eval_paths" else "column" if config.eval_column else "train"
        pf = open_parquet(fs, name)
        hot = cmap.check_schema(name, pf.schema_arrow, with_eval_column=role == "column")
        if first_file:
            same_lists(cmap, name, hot, first_file, multi_hot)
        else:
            first_file, multi_hot = name, hot
        sizes.append(fs.get_file_info(name).size)
        first, rows = 0, 0
        for g in range(pf.num_row_groups):
            rows += pf.metadata.row_group(g).num_rows
            if rows >= shard_rows or g == pf.num_row_groups - 1:
                plan.append(ShardPlan(len(plan), file_uri(fs, name), role, first, g + 1 - first))
                first, rows = g + 1, 0
    parquet = config.model_dump(mode="json", exclude=set(_READ_ONLY))
    settings: dict = {"input": "parquet", "parquet": parquet, "sizes": sizes, "shard_rows": shard_rows}
    if parquet_output:
        settings["parquet_output"] = True
    if counted:
        settings["vocab_threshold"] = vocab_threshold
    manifest = resume_or_start(out, settings)
    with shared_pool(workers):  # workers start once, for the counting and the writing
        if counted and vocab_io.saved_settings(out / "vocab") != settings:  # else counted before
            _count_vocabs(out, settings, [s for s in plan if s.role != "eval"], counted, workers, progress)
        cmap = column_map(config)
        if manifest is None:
            features = [
                {"name": f.name, "num_ids": int(f.rows if v is None else v.size + 1), "multi_hot": hot,
                 "weighted": f.weights is not None}
                for f, v, hot in zip(cmap.features, cmap.vocabs, multi_hot, strict=True)
            ]  # fmt: skip
            dense = {"dense": list(config.dense)}
            manifest = start_manifest(out, settings, plan, len(config.dense), features, dense)
        return _write_shards(out, manifest, workers, progress, max_shards)


def _vocab_features(config: ParquetConfig, out: Path, threshold: int | None) -> list[str]:
    """The features whose vocabularies this run counts (none without a threshold), after checking that
    the config reads them where they will be written."""
    if threshold is None:
        return []
    if threshold < 1:
        raise ConfigError(f"vocab_threshold must be >= 1, got {threshold}")
    names = [f.name for f in config.feature_configs() if f.hashing == "vocab"]
    if not names:
        raise ConfigError("--vocab-threshold counts vocabularies of features with hashing vocab; data.parquet has none")
    if config.vocab_dir is None or Path(config.vocab_dir).resolve() != (out / "vocab").resolve():
        raise ConfigError(
            f"--vocab-threshold writes the vocabularies to {out / 'vocab'}; set data.parquet.vocab_dir to that "
            f"folder (it is {config.vocab_dir})"
        )
    return names


def _count_job(job: tuple[dict, ShardPlan]) -> list[vocab_io.Counts]:
    """Per counted feature: the distinct raw values of one shard's training rows and their counts."""
    settings, shard = job
    config = ParquetConfig(**settings["parquet"])
    features = [f for f in config.feature_configs() if f.hashing == "vocab"]
    by_column = shard.role == "column"
    columns = [f.column for f in features] + ([config.eval_column] if by_column else [])
    pf = open_uri(shard.file)
    parts: list[list[vocab_io.Counts]] = [[] for _ in features]
    for g in range(shard.first, shard.first + shard.count):
        table = pf.read_row_group(g, columns=list(dict.fromkeys(columns)), use_threads=False)
        where = f"{shard.file}, row group {g}"
        flag = config.eval_column
        keep = None if flag is None or not by_column else ~held_out(table.column(flag), where, flag)
        for f, part in zip(features, parts, strict=True):
            column = table.column(f.column)
            if keep is not None:
                column = column.filter(pa.array(keep))
            part.append(vocab_io.count_values(raw_ids(column, where, f)))
    return [vocab_io.merge_counts(p) for p in parts]


def _count_vocabs(
    out: Path, settings: dict, train: list[ShardPlan], names: list[str], workers: int, progress: bool
) -> None:
    per_feature: list[list[vocab_io.Counts]] = [[] for _ in names]
    for counts in _map(_count_job, [(settings, s) for s in train], workers, progress, "counting"):
        for f, c in enumerate(counts):
            per_feature[f].append(c)
            if len(per_feature[f]) > 64:  # bound memory: fold the parts
                per_feature[f] = [vocab_io.merge_counts(per_feature[f])]
    vocabs = [vocab_io.build_vocab(vocab_io.merge_counts(p), settings["vocab_threshold"]) for p in per_feature]
    vocab_io.save_vocabs(out / "vocab", names, vocabs, settings)
