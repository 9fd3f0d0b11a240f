"""The position a data reader saves (epoch, samples handed out) and the checks that a reader can
continue from one: the same layout (seed, rank, number of processes, shuffle settings) and a position
within its training samples. Both readers with a position of their own (preprocessed shards:
neorec/data/sharded_reader.py, Parquet: neorec/data/parquet.py) check a state with `checked_position`
before loading it; the trainer checks a checkpoint's with `check_resume` before loading anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neorec.errors import ConfigError, DataError

# every layout key a reader may have, in the order they are checked, and how a message names it
_LAYOUT_WORDS = {
    "seed": "seed",
    "rank": "rank",
    "world_size": "number of processes (--nproc)",
    "shuffle": "shuffle setting (data.preprocessed.shuffle / data.parquet.shuffle)",
    "shuffle_window": "data.preprocessed.shuffle_window",
}

# how a message names what a source saves of itself besides its layout (SyntheticSource.state,
# PreprocessedSource.state, ParquetSource.state)
_SOURCE_WORDS = {
    "seed": "seed",
    "train_samples": "data.synthetic.train_samples",
    "generator": "data.synthetic.generator (auto: device with train.device cuda and on_device, else host)",
    "data_crc32": "the data set of data.preprocessed.path (its manifest.json's checksum; written again?)",
    "files_crc32": "the training files of data.parquet.paths (a checksum of their names, row groups and "
    "rows; files added or written again? a folder that grows is for data.follow)",
    "vocab_crc32": "the vocabularies of data.parquet.vocab_dir (a checksum of their values; counted again? "
    "ids would map to other rows)",
}


def layout_mismatch(where: str, key: str, saved: Any, now: Any) -> ConfigError:
    """The error for a reader position saved under another layout (seed, processes, shuffle)."""
    return ConfigError(
        f"{where} was saved with {_LAYOUT_WORDS.get(key, key)} {saved!r}, this run has {now!r}: a reader's "
        "position continues only under the same seed, number of processes and shuffle settings; resume with "
        "those, or start a new run (--overwrite)"
    )


def check_processes(state: Any, num_processes: int, where: str | Path) -> None:
    """Before the processes of a run start: a checkpoint's reader position (the manifest's "state", as
    check_resume takes it) saved under another number of processes is refused. Only a reader that
    splits the data over processes saves one (Parquet, preprocessed shards, a followed folder), and
    such a reader is built for the run's number of processes."""
    reader = state.get("reader") if isinstance(state, dict) and state.get("batches") else None
    if isinstance(reader, dict) and "world_size" in reader and reader["world_size"] != num_processes:
        raise layout_mismatch(f"checkpoint {where}", "world_size", reader["world_size"], num_processes)


def checked_position(
    reader: Any, state: Any, layout_keys: tuple[str, ...], where: str = "reader state"
) -> tuple[int, int]:
    """(epoch, samples) of a saved reader position, after checking that `reader` has the layout
    (`layout_keys`: seed, ranks, shuffle settings) the position is valid for and that the position
    lies within its training samples. Nothing is changed: a bad position is refused before any use."""
    if not isinstance(state, dict):
        raise DataError(f"{where}: the reader position is {type(state).__name__}, not a mapping")
    for key in layout_keys:
        if key in state and state[key] != getattr(reader, key):
            raise layout_mismatch(where, key, state[key], getattr(reader, key))
    epoch, samples = state.get("epoch"), state.get("samples")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, samples)):
        raise DataError(f"{where}: reader position epoch {epoch!r}, samples {samples!r}: not whole numbers >= 0")
    total = reader.num_samples("train") if hasattr(reader, "num_samples") else None  # None: an endless stream
    if total is not None and not samples <= total:
        raise DataError(f"{where}: samples {samples} is outside [0, {total}]")
    return epoch, samples


def check_resume(data: Any, state: Any, where: str | Path) -> None:
    """Refuse, before anything is loaded or said, a checkpoint whose data position `data` (the trainer's
    RankData) cannot continue exactly: `state` is the manifest's "state" (RankData.position, plus the
    trainer's batch_size). A reader with a position of its own (Parquet, preprocessed shards) must have
    the layout it was saved under (seed, number of processes, shuffle settings); ConfigError otherwise,
    naming the checkpoint `where` and what differs."""
    where = f"checkpoint {where}"
    if not isinstance(state, dict):
        raise DataError(f"{where}: its training state is {type(state).__name__}, not a mapping")
    missing = [k for k in ("epoch", "batches") if k not in state]
    if missing:
        raise DataError(
            f"{where}: its training state has no {' or '.join(missing)}: it was not saved by `neorec train`, "
            "which resumes only from its own checkpoints"
        )
    saved = state.get("batch_size")
    if saved is not None and saved != data.batch_size:
        raise ConfigError(
            f"{where} was trained with data.batch_size {saved!r}, this run has {data.batch_size}: resuming "
            "exactly needs the same data.batch_size"
        )
    reader = state.get("reader")
    source = data.source
    if not state.get("batches") or reader is None or not hasattr(source, "load_state"):
        return  # nothing read yet, or a source that re-reads the trained batches
    if not isinstance(reader, dict):
        raise DataError(f"{where}: the reader position is {type(reader).__name__}, not a mapping")
    layout = tuple(k for k in _LAYOUT_WORDS if hasattr(source, k))  # a Parquet reader has no shuffle_window
    reader = {**reader, "rank": data.rank} if data.reads_part else reader
    checked_position(source, reader, layout, where)
    own = source.state() if hasattr(source, "state") and not hasattr(source, "position_after") else {}
    for key, now in own.items():  # the rest of what the source saves of itself (generator, data set)
        if key not in (*layout, "epoch", "samples") and key in reader and reader[key] != now:
            raise ConfigError(
                f"{where} was trained with {_SOURCE_WORDS.get(key, key)} {reader[key]!r}, this run has "
                f"{now!r}: resuming exactly needs the same {'seed' if key == 'seed' else 'data settings'}"
            )


# settings of a data section that do not change which samples train, in which order: eval-only ones,
# the readers' speed (threads, batches made ahead) and what a TSV line that stopped the run may be
# (bad_lines: fail stops at the first bad line, so the lines before a resume are the same under skip);
# data.follow has its own stream position, and the synthetic source its generator (host or device,
# "auto" resolved) in its own state
_NOT_THE_STREAM = {
    "synthetic": {"eval_samples", "on_device", "generator"},  # where samples are drawn: SyntheticSource.state
    "criteo": {"eval_paths", "bad_lines", "max_line_bytes"},
    "preprocessed": {"prefetch", "threads"},
    "parquet": {"eval_paths", "prefetch"},
}
_SECTION = {"synthetic": "synthetic", "criteo_tsv": "criteo", "movielens": "movielens",
            "preprocessed": "preprocessed", "parquet": "parquet"}  # fmt: skip
_WORKING_FOLDER = "working_folder"
_FILE_BYTES = "training_file_bytes"  # in a checkpoint's state: check_training_files
_PATH_KEYS = {"shards_dir", "criteo.train_paths", "movielens.root", "preprocessed.path", "parquet.paths",
              "parquet.vocab_dir"}  # fmt: skip


def data_settings(data: Any) -> dict[str, Any]:
    """The settings of `data` (a DataConfig) that decide the training samples and their order, by
    dotted key under `data.`: its source, and its source's section less the keys in _NOT_THE_STREAM;
    and the working folder that relative paths among them start from (_WORKING_FOLDER)."""
    out: dict[str, Any] = {"source": data.source, _WORKING_FOLDER: os.getcwd()}
    if data.source == "shards":
        out["shards_dir"] = data.shards_dir
    name = _SECTION.get(data.source)
    section = getattr(data, name) if name else None
    if section is not None:
        for key, value in section.model_dump(mode="json").items():
            if key not in _NOT_THE_STREAM.get(name, ()):
                out[f"{name}.{key}"] = value
    return out


def check_data_settings(data: Any, state: Any, where: str | Path) -> None:
    """Refuse a checkpoint whose training data differs from this run's (`data_settings` saved in the
    manifest's "state"): its data position would continue in other samples. A path is the same when it
    is written the same (on every node of a job, whatever folder each works in) or names the same
    place from each run's working folder. A checkpoint saved without them is not compared."""
    saved = state.get("data_settings") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return
    if (change := first_data_change(saved, data_settings(data))) is not None:
        key, was, is_ = change
        raise ConfigError(
            f"checkpoint {where} was trained with data.{key} {was!r}, this run has {is_!r}: resuming exactly "
            "needs the same data settings; resume with the checkpoint's (its run's config.yaml), or start a "
            "new run (--overwrite)"
        )


def first_data_change(
    saved: dict[str, Any], now: dict[str, Any], by_place: bool = False
) -> tuple[str, Any, Any] | None:
    """(key under data., saved value, value now) of the first setting two `data_settings` differ in
    (the source first), None when they are the same. A path is the same when written the same or
    naming the same place from each one's working folder; `by_place`: only when naming the same place
    (the same process reading the run's files again, not the nodes of one job)."""
    keys = (saved.keys() | now.keys()) - {"source", _WORKING_FOLDER}
    for key in ["source", *sorted(keys)]:
        was, is_ = saved.get(key), now.get(key)
        if key in _PATH_KEYS and _places(saved, was) == _places(now, is_):
            continue
        if was == is_ and not (by_place and key in _PATH_KEYS):
            continue
        return key, was, is_
    return None


def check_training_files(source: Any, state: Any, where: str | Path) -> None:
    """Refuse a checkpoint trained on files of other sizes than `source`'s now (a source that re-reads
    the trained lines on a resume, TSV or MovieLens, saves its training_file_bytes in the manifest's
    "state"): written again or grown since, they would continue in other samples. A checkpoint saved
    without them, or a source without them, is not compared."""
    saved = state.get(_FILE_BYTES) if isinstance(state, dict) else None
    if saved is None or not hasattr(source, "training_file_bytes"):
        return
    now = source.training_file_bytes()
    if saved != now:
        raise ConfigError(
            f"checkpoint {where} was trained on files of {saved} bytes, the data files have {now} bytes now: "
            "written again or grown since, they continue in other samples; resume over the files it trained "
            "on, or start a new run (--overwrite)"
        )


def training_file_state(source: Any) -> dict[str, Any]:
    """What a checkpoint saves of `source`'s files for check_training_files (nothing for a source that
    keeps a position of its own or draws its data)."""
    return {_FILE_BYTES: source.training_file_bytes()} if hasattr(source, "training_file_bytes") else {}


def _places(settings: dict, value: Any) -> Any:
    """The path or paths `value` from the working folder `settings` were taken in (URIs as they are)."""
    folder = settings.get(_WORKING_FOLDER)
    if not isinstance(folder, str) or not isinstance(value, str | list):
        return value

    def place(path: Any) -> Any:
        if not isinstance(path, str) or "://" in path:
            return path
        return os.path.normpath(os.path.join(folder, path))

    return [place(p) for p in value] if isinstance(value, list) else place(value)
