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
arguments, redoes only the shards that were not renamed, and yields the same bytes. Lines are parsed by
neorec/data/criteo.py (same preprocessing, same bad-line policy: stop with file:line, or skip and count
per reason); categorical values are hashed into `table_rows` (modulo or splitmix64, as the TSV reader
does) or mapped through a vocabulary built in a counting pass over the training lines, with a frequency
threshold (facebookresearch/dlrm, MLPerf), stored in `vocab/`.
"""

from __future__ import annotations

import gzip
import itertools
import json
import multiprocessing
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from neorec.data import vocab as vocab_io
from neorec.data.criteo import (
    CATEGORICAL_NAMES,
    DEFAULT_MAX_LINE_BYTES,
    DENSE_NAMES,
    NUM_DENSE,
    CriteoTSVReader,
    check_tsv_file,
    map_categorical,
    read_lines,
    resolve_table_rows,
)
from neorec.data.manifest import (  # preprocess_parquet and tests import some from here
    SPLITS,
    ShardPlan,
    complete_manifest,
    publish_shard,
    write_columns,
)
from neorec.data.manifest import load_manifest as load_manifest
from neorec.data.manifest import resume_or_start as _resume_or_start
from neorec.data.manifest import shard_name as shard_name
from neorec.data.manifest import start_manifest as _start_manifest
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import ConfigError, DataError

CHUNK_LINES = 16384
_RAW_ROWS = 1 << 32  # "modulo 2^32" leaves the parsed hex value (at most 8 digits) unchanged
_INDEX_BLOCK = 1 << 24

PathLike = str | Path


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
    for p in train + evals:
        check_tsv_file(p)
    CriteoTSVReader([], _RAW_ROWS, hashing, bad_lines, max_line_bytes=max_line_bytes)  # checks its arguments now
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
        raise ConfigError("raw_features keep raw hash values: they take neither a vocabulary nor a Parquet copy")
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
    manifest = _resume_or_start(out, settings)
    if manifest is None:
        roles = [(p, "split" if not evals else "train") for p in train] + [(p, "eval") for p in evals]
        lines = list(_map(_index_job, [(p, shard_lines) for p, _ in roles], workers, progress, "indexing"))
        for path, num_lines, _ in lines:
            if num_lines == 0:  # e.g. a .gz file of nothing: no shard would be written for it
                raise DataError(f"{path}: no lines; expected Criteo TSV lines (label, I1..I13, C1..C26)")
        plan = _criteo_plan(roles, lines, shard_lines)
        if vocab_threshold:
            if vocab_io.saved_settings(out / "vocab") != settings:  # counted by an interrupted run: reuse
                _build_vocab(out, settings, plan, vocab_threshold, workers, progress)
            sizes = [v.size + 1 for v in vocab_io.load_vocabs(out / "vocab", CATEGORICAL_NAMES)]
        else:
            sizes = rows
        features = [{"name": n, "num_ids": int(r), "multi_hot": False, "weighted": False}
                    for n, r in zip(CATEGORICAL_NAMES, sizes, strict=True)]  # fmt: skip
        manifest = _start_manifest(out, settings, plan, NUM_DENSE, features, {"dense": DENSE_NAMES})
    return _some_training_samples(_write_shards(out, manifest, workers, progress, max_shards))


def _some_training_samples(result: PreprocessResult) -> PreprocessResult:
    """A finished preprocessing with no training sample is a failure, not a folder to train on."""
    if result.complete and not result.num_samples.get("train"):
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items()))
        why = f"every line was skipped as malformed ({skipped})" if skipped else "the input has no training lines"
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
    out: Path, manifest: dict, workers: int, progress: bool, max_shards: int | None
) -> PreprocessResult:
    """Write the shards that are not done yet (grouped into jobs), then complete the manifest."""
    if manifest["complete"]:
        result = PreprocessResult(out, len(manifest["shards"]), 0, True, manifest["num_samples"])
        result.skipped.update(manifest["skipped"])
        return result
    plan = [ShardPlan(**s) for s in manifest["shards"]]
    todo = [s for s in plan if not (out / "shards" / s.name).is_dir()]
    if max_shards is not None:
        todo = todo[:max_shards]
    jobs = [(str(out), manifest["settings"], manifest["features"], group) for group in _group_jobs(todo)]
    written = 0
    for metas in _map(_shard_job, jobs, workers, progress, "shards", total=len(todo), unit_size=len):
        written += len(metas)
    if not all((out / "shards" / s.name).is_dir() for s in plan):
        return PreprocessResult(out, len(plan), written, False)
    num_samples, skipped = complete_manifest(out, manifest, [s.name for s in plan])
    return PreprocessResult(out, len(plan), written, True, num_samples, Counter(skipped))


def _group_jobs(todo: list[ShardPlan]) -> list[list[ShardPlan]]:
    """One job per shard, except that the shards of one .gz file form one job (gzip cannot seek)."""
    jobs: list[list[ShardPlan]] = []
    for s in todo:
        if jobs and s.file.endswith(".gz") and jobs[-1][-1].file == s.file:
            jobs[-1].append(s)
        else:
            jobs.append([s])
    return jobs


def _map(
    fn: Callable, jobs: list, workers: int, progress: bool, desc: str,
    total: int | None = None, unit_size: Callable[[Any], int] | None = None,
) -> Iterator[Any]:  # fmt: skip
    """fn over jobs, in `workers` processes (in this one for 1), with a progress bar; results unordered."""
    from tqdm import tqdm

    bar = tqdm(total=total if total is not None else len(jobs), desc=desc, disable=not progress, leave=False)
    try:
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                result = fn(job)
                bar.update(unit_size(result) if unit_size else 1)
                yield result
            return
        # spawn: workers must not inherit the parent's torch/OpenMP thread pools
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=_worker_init) as pool:
            futures = [pool.submit(fn, job) for job in jobs]
            try:
                for fut in as_completed(futures):
                    result = fut.result()
                    bar.update(unit_size(result) if unit_size else 1)
                    yield result
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        bar.close()


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


# ---- criteo: indexing, counting, parsing -------------------------------------------------------------
def index_lines(path: PathLike, shard_lines: int) -> tuple[int, list[int]]:
    """(lines up to the last non-blank one, byte offsets of lines 1, 1 + shard_lines, ...) of a file.
    Offsets of a .gz file are positions in the decompressed stream (kept for the record only)."""
    path = Path(path)
    num_newlines, pos, last_line, offsets = 0, 0, 0, [0]
    with _open(path) as f:
        try:
            while block := f.read(_INDEX_BLOCK):
                count = block.count(b"\n")
                # newline number j * shard_lines ends the line before a shard's first line
                targets = range(
                    (num_newlines // shard_lines + 1) * shard_lines, num_newlines + count + 1, shard_lines
                )
                if targets:
                    nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                    offsets += [pos + int(nl[t - num_newlines - 1]) + 1 for t in targets]
                filled = len(block.rstrip())  # bytes.rstrip drops what bytes.strip calls blank
                if filled:
                    last_line = num_newlines + block.count(b"\n", 0, filled - 1) + 1
                num_newlines += count
                pos += len(block)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read after byte {pos} of its content: {e}") from e
    return last_line, [o for i, o in enumerate(offsets) if i * shard_lines < last_line]


def _index_job(job: tuple[str, int]) -> tuple[str, int, list[int]]:
    path, shard_lines = job
    return (path, *index_lines(path, shard_lines))


def _criteo_plan(
    roles: list[tuple[str, str]], index: list[tuple[str, int, list[int]]], shard_lines: int
) -> list[ShardPlan]:
    by_path = {p: (n, offs) for p, n, offs in index}
    plan: list[ShardPlan] = []
    for path, role in roles:
        num_lines, offsets = by_path[path]
        gz = path.endswith(".gz")
        for k, off in enumerate(offsets):
            first = k * shard_lines + 1
            count = min(shard_lines, num_lines - first + 1)
            plan.append(ShardPlan(len(plan), path, role, first, count, -1 if gz else off))
    return plan


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _parsed_chunks(
    shards: list[ShardPlan], reader: CriteoTSVReader, eval_every: int | None
) -> Iterator[tuple[ShardPlan, str | None, tuple[np.ndarray, np.ndarray, np.ndarray] | None]]:
    """(shard, split, (labels, dense, raw hash values [n, 26] int64)) per chunk of lines, in file order,
    and (shard, None, None) when a shard's lines are all read."""
    path = Path(shards[0].file)
    with _open(path) as f:
        line = 1
        if shards[0].offset >= 0:
            f.seek(shards[0].offset)
            line = shards[0].first
        lines = read_lines(f, reader.max_line_bytes)
        try:
            for shard in shards:
                skip = shard.first - line  # lines of shards done before (.gz only)
                numbered = enumerate(itertools.islice(lines, skip, skip + shard.count), shard.first)
                line = shard.first + shard.count
                while chunk := list(itertools.islice(numbered, CHUNK_LINES)):
                    if shard.role == "split":
                        assert eval_every is not None
                        k = -chunk[0][0] % eval_every  # chunk lines are consecutive: every k-th is held out
                        yield shard, "eval", reader._parse_chunk(path, chunk[k::eval_every])
                        del chunk[k::eval_every]
                    yield shard, "train" if shard.role != "eval" else "eval", reader._parse_chunk(path, chunk)
                yield shard, None, None
        except (OSError, EOFError) as e:  # truncated or corrupt gzip
            raise DataError(f"{path}: cannot read near line {line}: {e}") from e


def _raw_reader(settings: dict) -> CriteoTSVReader:
    return CriteoTSVReader([], _RAW_ROWS, "modulo", settings["bad_lines"], max_line_bytes=settings.get("max_line_bytes", DEFAULT_MAX_LINE_BYTES))


def _count_job(job: tuple[dict, list[ShardPlan]]) -> list[vocab_io.Counts]:
    """Per feature: distinct raw values of the training lines of these shards and their counts."""
    settings, shards = job
    parts: list[list[vocab_io.Counts]] = [[] for _ in CATEGORICAL_NAMES]
    for _, split, parsed in _parsed_chunks(shards, _raw_reader(settings), settings["eval_every"]):
        if split == "train" and parsed is not None and len(parsed[2]):
            for f in range(parsed[2].shape[1]):
                parts[f].append(vocab_io.count_values(parsed[2][:, f]))
        if sum(len(p) for p in parts) > 64 * len(parts):  # bound memory: fold the parts
            parts = [[vocab_io.merge_counts(p)] for p in parts]
    return [vocab_io.merge_counts(p) for p in parts]


def _build_vocab(
    out: Path, settings: dict, plan: list[ShardPlan], threshold: int, workers: int, progress: bool
) -> None:
    train = [s for s in plan if s.role != "eval"]
    jobs = [(settings, group) for group in _group_jobs(train)]
    per_feature: list[list[vocab_io.Counts]] = [[] for _ in CATEGORICAL_NAMES]
    for counts in _map(_count_job, jobs, workers, progress, "counting"):
        for f, c in enumerate(counts):
            per_feature[f].append(c)
    vocabs = [vocab_io.build_vocab(vocab_io.merge_counts(p), threshold) for p in per_feature]
    vocab_io.save_vocabs(out / "vocab", CATEGORICAL_NAMES, vocabs, settings)


_VOCABS: dict[str, list[np.ndarray]] = {}  # per worker process: loaded once


def _map_ids(out: Path, settings: dict, raw: np.ndarray) -> list[np.ndarray]:
    """Raw hash values [n, 26] -> per feature int64 ids, by the hashing or the vocabulary of `settings`."""
    cat = settings["categorical"]
    if "vocab_threshold" in cat:
        key = str(out)
        if key not in _VOCABS:
            _VOCABS[key] = vocab_io.load_vocabs(out / "vocab", CATEGORICAL_NAMES)
        return [vocab_io.apply_vocab(raw[:, f], v) for f, v in enumerate(_VOCABS[key])]
    keep_raw = np.array([n in cat.get("raw_features", ()) for n in CATEGORICAL_NAMES])
    ids = map_categorical(raw.astype(np.uint64), np.asarray(cat["table_rows"], np.int64), cat["hashing"], keep_raw)
    return [ids[:, f] for f in range(ids.shape[1])]


# ---- writing shards ----------------------------------------------------------------------------------
Columns = dict[str, np.ndarray]


def _shard_job(job: tuple[str, dict, list[dict], list[ShardPlan]]) -> list[dict]:
    """Write the shards of one job; returns their meta dicts."""
    out_str, settings, features, shards = job
    out = Path(out_str)
    if settings["input"] == "synthetic":
        return [_write_shard(out, s, features, _synthetic_columns(settings, s), Counter(), settings) for s in shards]
    if settings["input"] == "parquet":
        from neorec.data.parquet_shards import parquet_shard_columns

        return [_write_shard(out, s, features, parquet_shard_columns(settings, s), Counter(), settings) for s in shards]
    reader = _raw_reader(settings)
    metas, pending = [], {split: [] for split in SPLITS}
    skipped_before: Counter[str] = Counter()
    for shard, split, parsed in _parsed_chunks(shards, reader, settings["eval_every"]):
        if split is not None:
            if len(parsed[0]):
                pending[split].append(parsed)
            continue
        columns = {sp: _criteo_columns(out, settings, parts) for sp, parts in pending.items() if parts}
        metas.append(_write_shard(out, shard, features, columns, reader.skipped - skipped_before, settings))
        skipped_before = Counter(reader.skipped)
        pending = {sp: [] for sp in SPLITS}
    return metas


def _criteo_columns(out: Path, settings: dict, parts: list) -> Columns:
    labels, dense, raw = (np.concatenate(p) for p in zip(*parts, strict=True))
    columns = {"dense": dense, "labels": labels}
    for name, ids in zip(CATEGORICAL_NAMES, _map_ids(out, settings, raw), strict=True):
        columns[f"ids_{name}"] = ids
    return columns


_SOURCES: dict[str, SyntheticSource] = {}  # per worker process: the teacher is calibrated once


def _synthetic_columns(settings: dict, shard: ShardPlan) -> dict[str, Columns]:
    from neorec.data.blocks import Block

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
    out: Path, shard: ShardPlan, features: list[dict], columns: dict[str, Columns], skipped: Counter, settings: dict
) -> dict:
    """Write one shard under a temporary name and rename it: a shard folder exists only when complete
    (its Parquet copies, when asked for, are renamed into place before it)."""
    final = out / "shards" / shard.name
    tmp = out / "shards" / f".tmp-{shard.name}"
    if tmp.exists():  # left by an interrupted run
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    raw = set(settings.get("categorical", {}).get("raw_features", ()))
    id_types = {f["name"]: np.int32 if f["num_ids"] < 2**31 and f["name"] not in raw else np.int64 for f in features}
    meta = write_columns(tmp, columns, id_types, skipped)  # .npy files and meta.json, with sizes and crc32s
    if settings.get("parquet_output"):
        from neorec.data.parquet_output import write_parquet_copy

        for split, cols in columns.items():
            write_parquet_copy(out / "parquet" / split / f"{shard.name}.parquet", cols, features, settings)
    publish_shard(tmp, final)
    return meta
