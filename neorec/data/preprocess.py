"""`neorec data preprocess`: raw Criteo TSV files (or synthetic data, or Parquet files:
neorec/data/preprocess_parquet.py) -> sharded columnar training files, optionally with a Parquet copy.

Output folder (its manifest, meta.json files and checksums: neorec/data/manifest.py):
    manifest.json            settings, features, and per shard: source lines, samples per split, skipped
                             lines, size and crc32 of every .npy file
    vocab/<feature>.npy      vocabulary mode only: sorted raw values that get ids 1..V (neorec/data/vocab.py)
    shards/<00000>/meta.json samples per split, skipped lines and file checksums of the shard
    shards/<00000>/<split>/  split = train or eval, one .npy file per column:
        dense.npy [n, num_dense] float32, labels.npy [n] float32,
        ids_<feature>.npy      int32 (int64 when the feature's table has 2^31 rows or more),
        lengths_<feature>.npy  int32, multi-hot features only (ids of sample i follow those of i - 1),
        weights_<feature>.npy  float32, weighted features only.

Why memory-mappable .npy columns rather than Parquet: the reader must cut any sample range out of a
shard (its rank's part, a resume position, a shuffle window). `np.load(mmap_mode="r")` maps a column and
a slice reads just those bytes, already in the dtype the batch needs; Parquet would read and decode
whole column chunks of a row group for every range and convert them. `np.save` writes the same bytes for
the same array, so reruns are byte-identical without care, and numpy is the only dependency. The price is
size (no compression: 160 bytes per one-hot Criteo sample with int32 ids, against about 200 bytes of
TSV text), which matters less than read speed for a training input.

How the work is cut: a first pass indexes every input file (line count, and for plain files the byte
offset of every `shard_lines`-th line), so that shard k of a file is lines [k * shard_lines + 1, ...] of
it, whatever the number of workers. Plain files give one job per shard (a worker seeks to its offset);
.gz files cannot seek, so one job reads a whole .gz file and writes its shards in order. Jobs run in
`workers` processes. Every file is written by neorec.utils.files.write_atomic (temporary name, fsync,
rename), every shard into `shards/.tmp-<k>` and renamed when complete; the manifest is written before
the first shard and marked complete after the last, so an interrupted run, restarted with the same
arguments, redoes only the shards that were not renamed, and yields the same bytes. A rerun first checks
the shards written before against their records (manifest.damaged_shards: meta.json, each file's size and
crc32): a missing or damaged one is written again, with a warning. Lines are parsed by
neorec/data/criteo.py (same preprocessing, same bad-line policy: stop with file:line, or skip and count
per reason); categorical values are hashed into `table_rows` (modulo or splitmix64, as the TSV reader
does) or mapped through a vocabulary built in a counting pass over the training lines, with a frequency
threshold (facebookresearch/dlrm, MLPerf), stored in `vocab/`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from neorec.data import vocab as vocab_io
from neorec.data.criteo_lines import (
    CATEGORICAL_NAMES,
    DEFAULT_MAX_LINE_BYTES,
    DENSE_NAMES,
    NUM_DENSE,
    check_reader_options,
    check_tsv_file,
    resolve_table_rows,
)
from neorec.data.file_roles import FileRoles
from neorec.data.manifest import (  # preprocess_parquet and tests import some from here
    SPLITS,
    ShardPlan,
    complete_manifest,
    damaged_shards,
    publish_shard,
    reopen,
    write_columns,
)
from neorec.data.manifest import load_manifest as load_manifest
from neorec.data.manifest import resume_or_start as _resume_or_start
from neorec.data.manifest import shard_name as shard_name
from neorec.data.manifest import start_manifest as _start_manifest
from neorec.data.preprocess_tsv import build_vocab, criteo_plan, index_files, write_criteo_shards
from neorec.data.tsv_index import index_file
from neorec.data.workers import run_jobs as _map
from neorec.data.workers import shared_pool
from neorec.errors import ConfigError, DataError
from neorec.utils.malloc import keep_freed_memory

if TYPE_CHECKING:
    from neorec.data.synthetic import SyntheticSource, SyntheticSpec

PathLike = str | Path
log = logging.getLogger(__name__)
_SHOWN = 5  # damaged shards a rerun names one by one


@dataclass
class PreprocessResult:
    out: Path
    num_shards: int
    written: int  # shards written by this call (the others were done before, or are left for later)
    complete: bool
    num_samples: dict[str, int] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)


# ---- entry points ----------------------------------------------------------------------------------
def preprocess_criteo(
    paths: Sequence[PathLike],
    out: PathLike,
    *,
    eval_paths: Sequence[PathLike] | None = None,
    eval_every: int = 10,
    hashing: str = "modulo",
    table_rows: int | Sequence[int] = 100_000,
    vocab_threshold: int | None = None,
    bad_lines: str = "fail",
    shard_lines: int = 1_000_000,
    workers: int = 1,
    progress: bool = True,
    max_shards: int | None = None,
    parquet_output: bool = False,
    raw_features: Sequence[str] = (),
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> PreprocessResult:
    """Criteo TSV files (plain or .gz) -> shards. Held-out set: `eval_paths`, or every `eval_every`-th
    line of each file. `vocab_threshold` set: vocabulary ids (table_rows and hashing are not used).
    `raw_features`: features stored as the raw hash value (int64), for managed-collision tables.
    `max_shards`: write at most this many shards, then stop (a later call resumes). `parquet_output`:
    also write the samples as Parquet files (neorec/data/parquet_output.py). `max_line_bytes`: longer
    lines are bad lines (as `bad_lines` says), never held whole."""
    train = [str(p) for p in paths]
    evals = [str(p) for p in eval_paths] if eval_paths else []
    if not train:
        raise ConfigError("paths is empty: give at least one Criteo TSV file")
    once = FileRoles()
    for role, named, files in (("train", "the training inputs", train), ("eval", "--eval-paths", evals)):
        for p in files:
            check_tsv_file(p)
            once.add(p, role, named)
    check_reader_options(hashing, bad_lines, max_line_bytes)
    if not evals and eval_every < 2:
        raise ConfigError(f"eval_every must be >= 2 when no eval_paths are given, got {eval_every}")
    if shard_lines < 1:
        raise ConfigError(f"shard_lines must be >= 1, got {shard_lines}")
    if vocab_threshold is not None and vocab_threshold < 1:
        raise ConfigError(f"vocab_threshold must be >= 1, got {vocab_threshold}")
    rows = resolve_table_rows(table_rows).tolist()
    unknown = sorted(set(raw_features) - set(CATEGORICAL_NAMES))
    if unknown:
        raise ConfigError(f"raw_features {unknown} are not Criteo features {CATEGORICAL_NAMES}")
    if raw_features and (vocab_threshold or parquet_output):
        raise ConfigError(
            "raw_features keep raw hash values: they take neither a vocabulary nor a Parquet copy"
        )
    settings = {
        "input": "criteo",
        "paths": train,
        "eval_paths": evals,
        "eval_every": eval_every if not evals else None,
        "sizes": [os.path.getsize(p) for p in train + evals],
        "categorical": {"vocab_threshold": vocab_threshold}
        if vocab_threshold
        else {"hashing": hashing, "table_rows": rows},
        "bad_lines": bad_lines,
        "max_line_bytes": max_line_bytes,
        "shard_lines": shard_lines,
    }
    if parquet_output:
        settings["parquet_output"] = True
    if raw_features:  # only when set: settings of earlier outputs stay equal, so they resume
        settings["categorical"]["raw_features"] = sorted(raw_features)
    out = Path(out)
    with shared_pool(workers, initializer=keep_freed_memory):  # workers start once for every phase
        manifest = _resume_or_start(out, settings)
        if manifest is None:
            roles = [(p, "split" if not evals else "train") for p in train] + [(p, "eval") for p in evals]
            index = index_files([p for p, _ in roles], shard_lines, workers, progress)
            for path, _ in roles:
                if index[path].num_lines == 0:  # e.g. an empty .gz file: no shard would be written for it
                    raise DataError(f"{path}: no lines; expected Criteo TSV lines (label, I1..I13, C1..C26)")
            plan = criteo_plan(roles, index, shard_lines)
            if vocab_threshold:
                if vocab_io.saved_settings(out / "vocab") != settings:  # else counted by an interrupted run
                    build_vocab(out, settings, plan, index, vocab_threshold, workers, progress)
                sizes = [v.size + 1 for v in vocab_io.load_vocabs(out / "vocab", CATEGORICAL_NAMES)]
            else:
                sizes = rows
            features = [{"name": n, "num_ids": int(r), "multi_hot": False, "weighted": False}
                        for n, r in zip(CATEGORICAL_NAMES, sizes, strict=True)]  # fmt: skip
            manifest = _start_manifest(out, settings, plan, NUM_DENSE, features, {"dense": DENSE_NAMES})
            return _some_training_samples(_write_shards(out, manifest, workers, progress, max_shards, index))
        return _some_training_samples(_write_shards(out, manifest, workers, progress, max_shards))


def _some_training_samples(result: PreprocessResult) -> PreprocessResult:
    """A finished preprocessing with no training sample is a failure, not a folder to train on."""
    if result.complete and not result.num_samples.get("train"):
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items()))
        why = (
            f"every line was skipped as malformed ({skipped})"
            if skipped
            else "the input has no training lines"
        )
        raise DataError(f"{result.out}: no training samples: {why}")
    return result


def preprocess_synthetic(
    spec: SyntheticSpec,
    out: PathLike,
    *,
    blocks_per_shard: int = 4,
    workers: int = 1,
    progress: bool = True,
    max_shards: int | None = None,
    parquet_output: bool = False,
) -> PreprocessResult:
    """The synthetic generator's train and eval sets -> shards of `blocks_per_shard` generator blocks
    (`parquet_output`: also as Parquet files)."""
    if blocks_per_shard < 1:
        raise ConfigError(f"blocks_per_shard must be >= 1, got {blocks_per_shard}")
    spec_dict = asdict(spec)
    spec_dict["part_weights"] = list(spec.part_weights)
    settings = {"input": "synthetic", "spec": spec_dict, "blocks_per_shard": blocks_per_shard}
    if parquet_output:
        settings["parquet_output"] = True
    out = Path(out)
    manifest = _resume_or_start(out, settings)
    if manifest is None:
        from neorec.data.synthetic import SyntheticSource

        source = SyntheticSource(spec, cache=False)
        plan: list[ShardPlan] = []
        for split in SPLITS:
            n = source.num_blocks(split)
            for first in range(0, n, blocks_per_shard):
                plan.append(ShardPlan(len(plan), "", split, first, min(blocks_per_shard, n - first)))
        features = [asdict(f) for f in source.info.features]
        manifest = _start_manifest(out, settings, plan, spec.num_dense, features, {})
    return _write_shards(out, manifest, workers, progress, max_shards)


# ---- writing the shards -------------------------------------------------------------------------------
def _write_shards(
    out: Path, manifest: dict, workers: int, progress: bool, max_shards: int | None, index: dict | None = None
) -> PreprocessResult:
    """Write the shards that are not done yet, then complete the manifest (`index`: of the Criteo files,
    when this run has just indexed them). Shards written before are checked first (damaged_shards): a
    missing or damaged one is written again, with a warning saying why."""
    damaged = damaged_shards(out, manifest, threads=max(4, 2 * workers))  # mostly waits for reads
    if damaged:
        for shard, why in list(damaged.items())[:_SHOWN]:
            log.warning("shard %s is written again: %s", shard_name(shard), why)
        more = f" ({len(damaged) - _SHOWN} not shown)" if len(damaged) > _SHOWN else ""
        log.warning("%s: writing again %d shard(s) found missing or damaged%s", out, len(damaged), more)
        manifest = reopen(out, manifest, list(damaged))
    if manifest["complete"]:
        result = PreprocessResult(out, len(manifest["shards"]), 0, True, manifest["num_samples"])
        result.skipped.update(manifest["skipped"])
        return result
    plan = [ShardPlan(**s) for s in manifest["shards"]]
    todo = [s for s in plan if not (out / "shards" / s.name).is_dir()]
    if max_shards is not None:
        todo = todo[:max_shards]
    if manifest["settings"]["input"] == "criteo":
        written = write_criteo_shards(out, manifest, todo, workers, progress, index)
        return _completed(out, manifest, plan, written)
    jobs = [(str(out), manifest["settings"], manifest["features"], [s]) for s in todo]
    written = 0
    for metas in _map(_shard_job, jobs, workers, progress, "shards", total=len(todo), unit_size=len):
        written += len(metas)
    return _completed(out, manifest, plan, written)


def _completed(out: Path, manifest: dict, plan: list[ShardPlan], written: int) -> PreprocessResult:
    """Complete the manifest when every shard is written."""
    if not all((out / "shards" / s.name).is_dir() for s in plan):
        return PreprocessResult(out, len(plan), written, False)
    num_samples, skipped = complete_manifest(out, manifest, [s.name for s in plan])
    return PreprocessResult(out, len(plan), written, True, num_samples, Counter(skipped))


# ---- criteo: see neorec/data/preprocess_tsv.py ------------------------------------------------------
def index_lines(path: PathLike, shard_lines: int) -> tuple[int, list[int]]:
    """(lines up to the last non-blank one, byte offsets of lines 1, 1 + shard_lines, ...) of a file.
    Offsets of a .gz file are positions in the decompressed stream (kept for the record only)."""
    index = index_file(path, shard_lines)
    return index.num_lines, index.shard_offsets


# ---- writing shards ----------------------------------------------------------------------------------
Columns = dict[str, np.ndarray]


def _shard_job(job: tuple[str, dict, list[dict], list[ShardPlan]]) -> list[dict]:
    """Write the shards of one job; returns their meta dicts."""
    out_str, settings, features, shards = job
    out = Path(out_str)
    if settings["input"] == "synthetic":
        return [
            _write_shard(out, s, features, _synthetic_columns(settings, s), Counter(), settings)
            for s in shards
        ]
    if settings["input"] == "parquet":
        from neorec.data.parquet_shards import parquet_shard_columns

        return [
            _write_shard(out, s, features, parquet_shard_columns(settings, s), Counter(), settings)
            for s in shards
        ]
    raise AssertionError(f"criteo shards are written by preprocess_tsv, not {settings['input']!r} jobs")


_SOURCES: dict[str, SyntheticSource] = {}  # per worker process: the teacher is calibrated once


def _synthetic_columns(settings: dict, shard: ShardPlan) -> dict[str, Columns]:
    from neorec.data.blocks import Block
    from neorec.data.synthetic import SyntheticSource, SyntheticSpec

    key = json.dumps(settings["spec"], sort_keys=True)
    if key not in _SOURCES:
        spec = dict(settings["spec"])
        spec["part_weights"] = tuple(spec["part_weights"])
        _SOURCES[key] = SyntheticSource(SyntheticSpec(**spec), cache=False)
    source = _SOURCES[key]
    block = Block.cat([source.block(shard.role, i) for i in range(shard.first, shard.first + shard.count)])
    columns = {"dense": block.dense.numpy(), "labels": block.labels.numpy()}
    for f, name in enumerate(source.keys):
        columns[f"ids_{name}"] = block.values[f].numpy()
        if source.info.features[f].multi_hot:
            columns[f"lengths_{name}"] = block.lengths[f].numpy()
        if block.weights is not None:
            columns[f"weights_{name}"] = block.weights[f].numpy()
    return {shard.role: columns}


def _write_shard(
    out: Path,
    shard: ShardPlan,
    features: list[dict],
    columns: dict[str, Columns],
    skipped: Counter,
    settings: dict,
) -> dict:
    """Write one shard under a temporary name and rename it: a shard folder exists only when complete
    (its Parquet copies, when asked for, are renamed into place before it)."""
    final = out / "shards" / shard.name
    tmp = out / "shards" / f".tmp-{shard.name}"
    if tmp.exists():  # left by an interrupted run
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    raw = set(settings.get("categorical", {}).get("raw_features", ()))
    id_types = {
        f["name"]: np.int32 if f["num_ids"] < 2**31 and f["name"] not in raw else np.int64 for f in features
    }
    meta = write_columns(tmp, columns, id_types, skipped)  # .npy files and meta.json, with sizes and crc32s
    if settings.get("parquet_output"):
        from neorec.data.parquet_output import write_parquet_copy

        for split, cols in columns.items():
            write_parquet_copy(out / "parquet" / split / f"{shard.name}.parquet", cols, features, settings)
    publish_shard(tmp, final)
    return meta
