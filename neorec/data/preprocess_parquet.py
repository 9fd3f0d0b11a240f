"""`neorec data preprocess` with Parquet: Parquet files in (the columns of a `data.parquet` section), and
Parquet files out next to the .npy shards.

Input: a shard is a run of consecutive row groups of one file holding at least `shard_rows` rows (or the
rest of the file), so that the plan depends on the files alone, whatever the number of workers. Rows
become samples exactly as the Parquet source reads them (neorec/data/parquet_columns.py: the same id
mapping, held-out files or the held-out column), written with the same shard writer, manifest and resume
as Criteo input (neorec/data/preprocess.py). A feature with `hashing: vocab` uses the vocabulary files of
`vocab_dir`; with `vocab_threshold`, a first pass counts them from the training rows (values seen at least
that often get ids 1..V, neorec/data/vocab.py) into `<out>/vocab`, which `vocab_dir` must then name, so
that a `data.parquet` section reading the same files trains with the same ids.

Output (`parquet_output`): each shard's samples of a split are also written to
`<out>/parquet/<split>/<shard>.parquet`: `label`, the dense columns (Criteo's I1..I13, the input's dense
names, else d0, d1, ...), one ids column per feature (int32, int64 for tables of 2^31 rows or more, a list
of them for multi-hot features) and `w_<feature>` weights (float32, or lists). Files sort in shard order,
so a `data.parquet` section with `paths: [<out>/parquet/train]`, `eval_paths: [<out>/parquet/eval]`,
`hashing: none` and `shuffle: false` reads the samples the shards hold, in the same order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.config.schema import ParquetConfig
from neorec.data import vocab as vocab_io
from neorec.data.columns import Columns
from neorec.data.parquet import column_map, file_uri, list_files, open_parquet, open_uri
from neorec.data.parquet_columns import held_out, raw_ids
from neorec.data.preprocess import (
    SPLITS,
    PreprocessResult,
    ShardPlan,
    _map,
    _resume_or_start,
    _start_manifest,
    _write_shards,
)
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
    roles = [(p, "column" if config.eval_column else "train") for p in config.paths]
    for path, role in roles + [(p, "eval") for p in config.eval_paths or []]:
        fs, files = list_files(path)
        for name in files:
            pf = open_parquet(fs, name)
            multi_hot = cmap.check_schema(name, pf.schema_arrow, with_eval_column=role == "column")
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
    manifest = _resume_or_start(out, settings)
    if counted and vocab_io.saved_settings(out / "vocab") != settings:  # else counted by an interrupted run
        _count_vocabs(out, settings, [s for s in plan if s.role != "eval"], counted, workers, progress)
    cmap = column_map(config)
    if manifest is None:
        features = [
            {"name": f.name, "num_ids": int(f.rows if v is None else v.size + 1), "multi_hot": hot,
             "weighted": f.weights is not None}
            for f, v, hot in zip(cmap.features, cmap.vocabs, multi_hot, strict=True)
        ]  # fmt: skip
        manifest = _start_manifest(out, settings, plan, len(config.dense), features, {"dense": list(config.dense)})
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
        keep = None if not by_column else ~held_out(table.column(config.eval_column))
        for f, part in zip(features, parts, strict=True):
            where = f"{shard.file}, row group {g}"
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


def parquet_shard_columns(settings: dict, shard: ShardPlan) -> dict[str, dict[str, np.ndarray]]:
    """{split: {column file name: array}} of one shard of Parquet input."""
    config = ParquetConfig(**settings["parquet"])
    cmap = column_map(config)
    pf = open_uri(shard.file)
    by_column = shard.role == "column"
    parts: dict[str, list[Columns]] = {split: [] for split in SPLITS}
    for g in range(shard.first, shard.first + shard.count):
        table = pf.read_row_group(g, columns=cmap.columns(by_column), use_threads=False)
        cols = cmap.to_columns(table, f"{shard.file}, row group {g}")
        if by_column:
            mask = held_out(table.column(cmap.eval_column))
            parts["train"].append(cols.take(np.flatnonzero(~mask)))
            parts["eval"].append(cols.take(np.flatnonzero(mask)))
        else:
            parts[shard.role].append(cols)
    out = {}
    for split, pieces in parts.items():
        pieces = [p for p in pieces if len(p)]
        if pieces:
            cols = Columns.cat(pieces)
            arrays = {"dense": cols.dense, "labels": cols.labels}
            for f, ids, ln, w in zip(cmap.features, cols.values, cols.lengths, cols.weights, strict=True):
                arrays[f"ids_{f.name}"] = ids
                if ln is not None:
                    arrays[f"lengths_{f.name}"] = ln
                if w is not None:
                    arrays[f"weights_{f.name}"] = w
            out[split] = arrays
    return out


def parquet_dense_names(settings: dict, num_dense: int) -> list[str]:
    """Names of the dense columns in Parquet output."""
    if settings["input"] == "criteo":
        from neorec.data.criteo import DENSE_NAMES

        return DENSE_NAMES
    if settings["input"] == "parquet":
        return list(settings["parquet"]["dense"])
    return [f"d{j}" for j in range(num_dense)]


def write_parquet_copy(path: Path, columns: dict[str, np.ndarray], features: list[dict], settings: dict) -> None:
    """One split of one shard as a Parquet file (written under a temporary name, then renamed)."""
    dense = np.asarray(columns["dense"], np.float32)
    table = {"label": np.asarray(columns["labels"], np.float32)}
    for j, name in enumerate(parquet_dense_names(settings, dense.shape[1])):
        table[name] = dense[:, j]
    for f in features:
        name = f["name"]
        ids = np.asarray(columns[f"ids_{name}"], np.int32 if f["num_ids"] < 2**31 else np.int64)
        lengths = columns.get(f"lengths_{name}")
        offsets = None if lengths is None else np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        table[name] = ids if offsets is None else pa.LargeListArray.from_arrays(offsets, ids)
        if f"weights_{name}" in columns:
            w = np.asarray(columns[f"weights_{name}"], np.float32)
            table[f"w_{name}"] = w if offsets is None else pa.LargeListArray.from_arrays(offsets, w)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # a dot: readers of the folder skip it
    pq.write_table(pa.table(table), tmp)
    tmp.replace(path)
