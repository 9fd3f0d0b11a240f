"""`neorec predict`: score a data file with an exported model, in batches, and write the predictions.

Data: by default the held-out set of the model's own config (synthetic, Criteo TSV, MovieLens,
preprocessed shards, Parquet), in the order `neorec eval` reads it; or `data=` other files, mapped to
the model's rows as its training data was:
- a raw Criteo TSV file (plain or .gz), hashed into the model's tables as it was trained (see
  export.tsv_mapping), for a model trained on hashed Criteo data. A file whose first line has 39
  fields is read as lines without labels (Criteo's test files: I1..I13, C1..C26);
- Parquet files (a file or a folder, as data.parquet.paths takes them), for a model trained on
  Parquet (data.source parquet, followed streams included): read in file order with the model's
  column mapping (hashing, vocabularies, raw ids of managed-collision tables). Files without the
  label column, or with nulls only in it, are scored without labels.
Predictions of data without labels come without metrics or labels.

Without `data`, the held-out samples scored are checked against those the export records of its run
(neorec/serving/held_out.py): other ones (the files changed since, a relative path read from another
folder) are refused; an export without the record is scored with a note that they were not checked.

Output (written under a temporary name and renamed, so a reader never sees half a file; gzip-compressed
when its name ends in .gz): one probability per line, or with `with_labels` a CSV with a header
`probability,label`. A multi-task model writes a CSV with one column per task, named by the task
(`click,conversion`), and with `with_labels` one label column per task after them
(`click_label,conversion_label`). Probabilities are written with 9 significant digits, which
round-trips float32 exactly.
"""

from __future__ import annotations

import gzip
import os
import re
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from neorec.config.data import DataConfig
from neorec.config.schema import RunConfig
from neorec.data.batch import Batch
from neorec.data.locations import movielens_root
from neorec.data.sample_digest import SampleDigest
from neorec.errors import ConfigError, DataError, NeorecError, out_of_memory
from neorec.metrics.evaluation import probability_metrics
from neorec.serving.file_format import ExportError, check_output_file, is_export_file
from neorec.serving.held_out import check_predicted, digested, predict_line, predict_record
from neorec.serving.model import ExportedModel, load_export
from neorec.train.run_folder import check_not_a_run_place
from neorec.utils.files import write_atomic


@dataclass
class PredictResult:
    out: Path
    num_samples: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # AUC etc. when the data has labels
    quantized: bool = False
    quantization: str | None = None  # "int8", "int4" or "int2": the model's tables are quantized row-wise
    dropped_ids: dict[str, int] = field(default_factory=dict)  # bounds_check warn: ids outside their tables
    held_out: str = ""  # without --data: whether the held-out data scored was checked to be the run's


def data_batches(
    exported: ExportedModel,
    batch_size: int,
    data: str | Path | None = None,
    bounds_check: str = "error",
    labeled: bool = True,
) -> Iterator[Batch]:
    """Batches to score: the held-out set of the model's config (its readers checking ids as
    `bounds_check` says), or the files `data` (labeled=False: they have no labels)."""
    from neorec.train.build import build_source

    cfg = exported.config.model_copy(deep=True)
    cfg.embedding.bounds_check = bounds_check
    if data is None:
        if cfg.data.follow is not None:  # its source would wait for partitions, and has no held-out set
            raise ExportError(
                f"model {exported.path} was trained on a followed stream (data.follow), which has no "
                "held-out set: give --data (Parquet files) to score"
            )
        source = build_source(cfg)
        _check_vocabularies(exported, source)
        return source.eval_batches(batch_size)
    if cfg.data.source == "parquet":
        return _parquet_batches(exported, cfg, data, batch_size, labeled)
    from neorec.data.criteo import (
        CATEGORICAL_NAMES,
        DEFAULT_MAX_LINE_BYTES,
        NUM_DENSE,
        CriteoTSVReader,
        check_tsv_file,
    )

    info, path = exported.info, exported.path
    if info.num_dense != NUM_DENSE or info.feature_names != CATEGORICAL_NAMES:
        raise ExportError(
            f"model {path} reads {info.num_dense} dense features and {info.feature_names}; --data reads Criteo TSV "
            f"({NUM_DENSE} dense, C1..C26), so score this model on its own data (leave out --data)"
        )
    source = exported.config.data.source
    hashing = exported.header.get("tsv_hashing") if source in ("criteo_tsv", "preprocessed") else None
    if hashing is None:
        trained_on = exported.header.get("training_data") or f"{source} data (data.source: {source})"
        raise ExportError(
            f"model {path} was trained on {trained_on}, not on hashed Criteo TSV or Parquet, so --data "
            "cannot be mapped to its ids; leave out --data to score the model's own held-out data"
        )
    check_tsv_file(data)
    criteo = exported.config.data.criteo
    max_line_bytes = criteo.max_line_bytes if criteo is not None else DEFAULT_MAX_LINE_BYTES
    from neorec.train.build import raw_features

    rows = [f.num_ids for f in info.features]
    # managed-collision tables take the raw hash value, as in training; their id maps give the rows
    raw = sorted(raw_features(exported.config))
    # every line scored, none skipped (whatever data.criteo.bad_lines the model trained with): the
    # predictions' lines are the data's
    reader = CriteoTSVReader(
        [data], rows, hashing, "fail", raw_features=raw, max_line_bytes=max_line_bytes, labeled=labeled,
        fail_hint=f"; {data} is scored line by line, one prediction a line: mend or remove that line",
    )  # fmt: skip
    return reader.batches(batch_size)


@torch.no_grad()
def score(
    exported: ExportedModel,
    batches: Iterator[Batch],
    bounds_check: str = "error",
    data: str | Path | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(click probabilities [B], labels [B]) per batch. Under `bounds_check` "off" nothing looks at
    the ids before the lookups, and an id outside its table stops them (an IndexError or RuntimeError
    of the gather, or a pt2 program's own check): a DataError naming `data` (None: the model's
    held-out data). Caught, not looked for: the batches that score pay for nothing more."""
    for batch in batches:
        try:
            probabilities = exported.probabilities(batch)
        except (IndexError, RuntimeError) as e:
            if bounds_check != "off" or out_of_memory(e):
                raise
            where = data if data is not None else "the model's held-out data"
            reason = " ".join(next((line for line in str(e).splitlines() if line.strip()), "").split())[:200]
            raise DataError(
                f"{where}: an id lies outside its table, which --bounds-check off does not check, so "
                f"model {exported.path} cannot score it ({type(e).__name__}: {reason}); find it with "
                "--bounds-check error (or leave such ids out with --bounds-check warn)"
            ) from None
        yield probabilities, batch.labels


def predict_file(
    model: str | Path,
    out: str | Path,
    data: str | Path | None = None,
    batch_size: int | None = None,
    with_labels: bool = False,
    bounds_check: str = "error",
) -> PredictResult:
    """Score `data` (default: the model's held-out set) with the exported `model`; write to `out`.
    bounds_check: what an id outside its table does: "error", "warn" (dropped from its bag, counted
    in the result) or "off" (neorec/sparse/bounds.py)."""
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    start = time.perf_counter()
    check_output_file(out, "--out")
    _check_not_an_input(Path(out), Path(model), data)
    check_not_a_run_place(out, "--out")
    exported = load_export(model, bounds_check)
    if data is None:
        _check_not_in_data(Path(out), exported.config.data)
    # after the refusals that say more (the model, its data): any other file but earlier predictions
    check_output_file(out, "--out", is_predictions_file, "earlier predictions (lines of probabilities)")
    missing = None if data is None else _missing_labels(exported, Path(data))
    if with_labels and missing:
        raise ConfigError(f"--with-labels: {data} has no labels ({missing})")
    labeled = missing is None
    size = batch_size or exported.config.data.eval_batch_size
    record = predict_record(exported) if data is None else None  # the run's held-out data, as exported
    batches = _read(data_batches(exported, size, data, bounds_check, labeled), data)
    digest = SampleDigest()
    if record is not None:
        batches = digested(batches, digest)
    # kept for the metrics (an exact AUC needs every score): data without labels only counts them
    probs, labels, n = [], [], 0

    tasks = exported.task_names

    def write(f: BinaryIO) -> None:
        nonlocal n
        if header := _header(tasks, with_labels):
            f.write(header)
        for p, y in score(exported, batches, bounds_check, data):
            n += p.shape[0]
            if labeled:
                probs.append(p)
                labels.append(y)
            f.write(_lines(p, y if with_labels else None))
        if record is not None:  # before the file takes its name
            check_predicted(exported, record, digest)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a failure, e.g. a bad line in the data, leaves no file
    write_atomic(out, _gzipped(write) if _is_gz(out) else write, "predictions file")
    metrics = {}
    if n and labeled:  # a multi-task model's are per task, named <task>/<metric> (neorec.model.multitask)
        # of the probabilities as written (neorec/metrics/evaluation.py:probability_metrics)
        if (per_task := getattr(exported.model, "held_out_metrics", None)) is not None:
            metrics = per_task(torch.cat(probs), torch.cat(labels), probability_metrics)
        else:
            metrics = probability_metrics(torch.cat(probs), torch.cat(labels))
    dropped = exported.dropped_ids()
    seconds = time.perf_counter() - start
    held = predict_line(record, exported.path) if data is None else ""
    return PredictResult(out, n, seconds, metrics, exported.quantized, exported.quantization, dropped, held)


def _is_gz(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def _gzipped(write: Callable[[BinaryIO], None]) -> Callable[[BinaryIO], None]:
    """`write`, its bytes gzip-compressed into the file (no name or time in the gzip header: the same
    predictions give the same bytes)."""

    def compressed(f: BinaryIO) -> None:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as z:
            write(z)  # type: ignore[arg-type]

    return compressed


def _parquet_batches(
    exported: ExportedModel, cfg: RunConfig, data: str | Path, batch_size: int, labeled: bool
) -> Iterator[Batch]:
    """The rows of the Parquet files `data`, in file order, read with the column mapping of the model's
    config `cfg` (the source training built, its files replaced)."""
    from neorec.data.parquet import ParquetSource

    assert cfg.data.parquet is not None  # a parquet model's config has its section
    files = {"paths": [str(data)], "eval_paths": None, "eval_column": None, "shuffle": False}
    config = cfg.data.parquet.model_copy(update=files)
    try:
        source = ParquetSource(config, bounds_check=cfg.embedding.bounds_check, labeled=labeled)
    except DataError:
        if _no_rows(data):  # its message names data.parquet.paths and training rows
            raise DataError(f"--data {data}: its Parquet files hold no rows: nothing to score") from None
        raise
    _check_vocabularies(exported, source)
    return source.train_batches(batch_size, 0)


def _check_vocabularies(exported: ExportedModel, source) -> None:
    """Refuse to score with vocabularies (hashing vocab) other than the ones the model was exported
    with: counted again in the same folder, they would give its ids to other values."""
    saved, now = exported.header.get("vocab_crc32"), getattr(source, "vocab_crc32", None)
    if saved is not None and now is not None and saved != now:
        vocab_dir = exported.config.data.parquet.vocab_dir if exported.config.data.parquet else None
        raise ExportError(
            f"model {exported.path}: the vocabularies in {vocab_dir} are not the ones it was exported with "
            f"(checksum {now:#010x}, was {saved:#010x}; counted again?): its ids would mean other values; "
            "score with the vocabularies it was trained on"
        )


def _missing_labels(exported: ExportedModel, data: Path) -> str | None:
    """Why the files `data` have no labels (None: they have): Criteo TSV lines of 39 fields, or Parquet
    files without the label column of the model's config, or whose label column holds only nulls
    (rows not labeled yet); Parquet files of both kinds are a DataError. What cannot be opened is the
    reader's to report (as are some labels missing among others: an error naming the row)."""
    parquet = exported.config.data.parquet
    if exported.config.data.source != "parquet" or parquet is None:
        return "its lines have 39 fields: I1..I13, C1..C26" if _unlabeled_tsv(data) else None
    from neorec.data.parquet import list_files

    try:
        fs, files = list_files(str(data))
        found = [(f, _unlabeled_parquet(fs, f, parquet.label)) for f in files]
    except (OSError, NeorecError, ValueError):  # pyarrow's errors are ValueErrors
        return None
    found = [(f, why) for f, why in found if why != _NO_ROWS]  # an empty file is neither kind
    why = [w for _, w in found]
    if not found:
        return None
    if any(w is None for w in why) and any(w is not None for w in why):  # scored as one or the other
        labeled = found[why.index(None)][0]
        unlabeled = next(w for w in why if w is not None)
        raise DataError(
            f"--data {data}: {unlabeled}, but {labeled} has labels; score labeled and unlabeled files "
            "apart (their predictions would otherwise all go without labels, or stop at the first null)"
        )
    return why[0]


_NO_ROWS = "no rows"


def _no_rows(data: str | Path) -> bool:
    """Whether the Parquet files `data` hold no rows at all (what cannot be opened: False)."""
    from neorec.data.parquet import list_files, open_parquet

    try:
        fs, files = list_files(str(data))
        return all(open_parquet(fs, f).metadata.num_rows == 0 for f in files)
    except (OSError, NeorecError, ValueError):  # pyarrow's errors are ValueErrors
        return False


def _unlabeled_parquet(fs, path: str, label: str) -> str | None:
    """Why Parquet file `path` has no labels (None: it has; _NO_ROWS: a file of no rows has neither)."""
    from neorec.data.parquet import open_parquet

    file = open_parquet(fs, path)
    if file.metadata.num_rows == 0:
        return _NO_ROWS
    if label not in file.schema_arrow.names:
        return f"{path} has no column {label!r}"
    labels = file.read(columns=[label]).column(0)
    if len(labels) and labels.null_count == len(labels):
        return f"{path}: its column {label!r} holds only nulls, rows not labeled yet"
    return None


def _unlabeled_tsv(data: Path) -> bool:
    """Whether `data` (a Criteo TSV file, checked later) is one without labels; a file that cannot be
    opened is the reader's to report."""
    from neorec.data.criteo_lines import is_unlabeled

    try:
        return is_unlabeled(data)
    except (OSError, EOFError, NeorecError):
        return False


def _read(batches: Iterator[Batch], data: str | Path | None) -> Iterator[Batch]:
    """`batches`, a failed read of the data worded as one (naming the file), not as a failed write of
    the predictions, which are written as the batches are read."""
    try:
        yield from batches
    except OSError as e:
        if isinstance(e, NeorecError):  # already worded
            raise
        name = e.filename if e.filename is not None else data or "the model's held-out data"
        raise DataError(f"{name}: cannot be read ({e.strerror or e})") from e


def _check_not_an_input(out: Path, model: Path, data: str | Path | None) -> None:
    """Predictions never replace the model or the data they are made from, nor any model file."""
    inputs = {"the model": model, **({"the data": Path(data)} if data is not None else {})}
    for what, path in inputs.items():
        if out.exists() and path.exists() and os.path.samefile(out, path):
            raise ExportError(
                f"--out {out}: is {what} this command reads; give another path for the predictions"
            )
    if data is not None and Path(data).is_dir() and out.resolve().is_relative_to(Path(data).resolve()):
        raise ExportError(f"--out {out}: is inside the data folder {data}; give a path outside it")
    if out.is_file() and (is_export_file(out) or zipfile.is_zipfile(out)):
        raise ExportError(f"--out {out}: is a model file; predictions never replace one: give another path")


def _check_not_in_data(out: Path, data: DataConfig) -> None:
    """Predictions of a model's own held-out data never replace a file of the data sets its config
    reads (its training or held-out files, or a file inside its data folders)."""
    if not out.exists():
        return
    for path in _data_paths(data):
        if not path.exists():
            continue
        inside = path.is_dir() and out.resolve().is_relative_to(path.resolve())
        if inside or os.path.samefile(out, path):
            raise ExportError(
                f"--out {out}: is {'in ' if inside else ''}the model's data ({path}: data.source {data.source}); "
                "give another path for the predictions"
            )


def _data_paths(data: DataConfig) -> list[Path]:
    """The files and folders `data` reads: those of its source, and a followed folder."""
    paths: list[str | Path] = []
    if data.follow is not None:
        paths.append(data.follow.dir)
    if data.source == "shards" and data.shards_dir:
        paths.append(data.shards_dir)
    if data.source == "criteo_tsv" and data.criteo is not None:
        paths += data.criteo.train_paths + (data.criteo.eval_paths or [])
    if data.source == "movielens":
        paths.append(movielens_root(data.movielens.root))
    if data.source == "preprocessed" and data.preprocessed is not None and data.preprocessed.path:
        paths.append(data.preprocessed.path)
    if data.source == "parquet" and data.parquet is not None:
        p = data.parquet
        paths += p.paths + (p.eval_paths or []) + ([p.vocab_dir] if p.vocab_dir else [])
    return [Path(x) for x in paths]


def is_predictions_file(path: Path) -> bool:
    """Whether an existing file reads as predictions (an earlier output, which --out replaces): empty,
    or lines of comma-separated numbers, under a header of names (_header) or not. Anything else
    there (a config, a log) is never written over."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 12)
        if _is_gz(path) and head[:2] == b"\x1f\x8b":  # predictions written gzip-compressed
            with gzip.open(path, "rb") as f:
                head = f.read(1 << 12)
    except (OSError, EOFError, zlib.error):
        return False
    lines = head.split(b"\n")
    if not head or _numbers(lines[0]):
        return True
    header = re.fullmatch(rb"[A-Za-z_][\w./-]*(,[A-Za-z_][\w./-]*)*", lines[0]) is not None
    return header and (len(lines) < 2 or not lines[1] or _numbers(lines[1]))


def _numbers(line: bytes) -> bool:
    """Whether `line` is comma-separated numbers."""
    try:
        for x in line.split(b","):
            float(x)
    except ValueError:
        return False
    return bool(line)


def _header(tasks: list[str], with_labels: bool) -> bytes:
    """The CSV header: none for one probability per line, else the columns' names."""
    if not tasks:
        return b"probability,label\n" if with_labels else b""
    names = tasks + ([f"{t}_label" for t in tasks] if with_labels else [])
    return (",".join(names) + "\n").encode()


def _lines(probs: torch.Tensor, labels: torch.Tensor | None) -> bytes:
    """One line per sample: the probability (9 digits: float32 exactly), or one per task [B, T], then
    the label (or one per task) if given."""
    rows = probs.reshape(probs.shape[0], -1).tolist()
    if labels is None:
        text = "".join(",".join(f"{p:.9g}" for p in r) + "\n" for r in rows)
    else:
        ys = labels.reshape(labels.shape[0], -1).tolist()
        text = "".join(
            ",".join([f"{p:.9g}" for p in r] + [str(int(y)) for y in yr]) + "\n"
            for r, yr in zip(rows, ys, strict=True)
        )
    return text.encode()


def result_text(r: PredictResult) -> str:
    """What `neorec predict` prints."""
    rows = [
        ("predictions", f"{r.out} ({r.num_samples:,} lines)"),
        ("model tables", f"{r.quantization} row-wise" if r.quantization else "float (as trained)"),
        ("time", f"{r.seconds:.1f} s ({r.num_samples / r.seconds if r.seconds > 0 else 0:,.0f} samples/s)"),
    ]
    for key in ("auc", "log_loss", "ne", "calibration"):
        if key in r.metrics:
            rows.append((key, f"{r.metrics[key]:.6f}"))
    for key, value in r.metrics.items():  # a multi-task model's AUC per task
        if key.endswith("/auc"):
            rows.append((key, f"{value:.6f}"))
    if r.held_out:
        rows.append(("held-out data", r.held_out))
    if r.dropped_ids:
        per = ", ".join(f"{f} {n:,}" for f, n in sorted(r.dropped_ids.items()))
        rows.append(("ids dropped (outside their tables)", f"{sum(r.dropped_ids.values()):,} ({per})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)} | {v}" for k, v in rows)
