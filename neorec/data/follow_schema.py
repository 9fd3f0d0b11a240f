"""What every partition of a followed stream (neorec/data/follow.py) must share with the stream: its
schema (the dense width; the features, their table sizes, list or not, weights) and, for partitions of
preprocessed shards, its id mapping: the manifest's settings that decide which row a raw value is
written as, and the vocabularies it was mapped with. A partition that differs in either would train
its values on other rows without any error, so the stream refuses it as bad, naming what differs.

The id mapping of a manifest (`id_mapping`), by its `settings.input`:
- criteo: `settings.categorical` (hashing, table_rows, raw_features, or vocab_threshold), and with
  vocab_threshold the vocabulary files of the partition's `vocab/` folder (their sizes and crc32s);
- parquet: each feature's `column`, `rows`, `hashing`, `strings` and `weights` as data.parquet fills
  them in (`settings.parquet.features.<name>.<key>`), `settings.parquet.dense_log1p`,
  `settings.vocab_threshold`, and for features with hashing vocab the vocabulary files (of the
  partition's `vocab/` when preprocessing counted them, else of `settings.parquet.vocab_dir`);
- synthetic: nothing beyond `settings.input` (its ids are generated as table rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neorec.data.source import SourceInfo
from neorec.errors import DataError
from neorec.utils.files import read_json, size_and_crc32

Mapping = dict[str, Any]  # setting (its key path in the manifest) -> value


def schema_change(info: SourceInfo, schema: SourceInfo) -> str:
    """What differs between a partition's schema `info` and the stream's `schema` ("" when nothing)."""
    if info.num_dense != schema.num_dense:
        return f"{info.num_dense} dense features, the stream has {schema.num_dense}"
    mine = {f.name: f for f in info.features}
    for f in schema.features:
        g = mine.get(f.name)
        if g is None:
            return f"no feature {f.name!r}"
        if g != f:
            return f"feature {f.name!r} is {g}, the stream has {f}"
    if len(mine) != len(schema.features):
        extra = sorted(set(mine) - {f.name for f in schema.features})
        return f"features {extra} that the stream does not have"
    return ""


def id_mapping(info: SourceInfo, path: Path) -> Mapping:
    """The id mapping of partition `path` read by a source with `info` (see the module docstring);
    empty for a partition that is not preprocessed shards (a Parquet partition is mapped by the run's
    data.parquet section, the same for every partition)."""
    settings = info.notes.get("settings")
    if not isinstance(settings, dict):
        return {}
    kind = settings.get("input")
    out: Mapping = {"settings.input": kind}
    if kind == "criteo":
        categorical = settings.get("categorical")
        out["settings.categorical"] = categorical
        if isinstance(categorical, dict) and "vocab_threshold" in categorical:
            out["vocabularies"] = _vocabularies(path / "vocab")
    elif kind == "parquet":
        parquet = settings.get("parquet") if isinstance(settings.get("parquet"), dict) else {}
        features = _parquet_features(parquet)
        out["settings.parquet.features"] = features
        out["settings.parquet.dense_log1p"] = parquet.get("dense_log1p", False)
        out["settings.vocab_threshold"] = settings.get("vocab_threshold")
        if any(isinstance(f, dict) and f.get("hashing") == "vocab" for f in features.values()):
            counted = "vocab_threshold" in settings or parquet.get("vocab_dir") is None
            out["vocabularies"] = _vocabularies(path / "vocab" if counted else Path(parquet["vocab_dir"]))
    return out


def mapping_change(mine: Mapping, stream: Mapping, first: str) -> str:
    """What differs between a partition's id mapping `mine` and the stream's `stream` (that of its
    partition `first`): the first setting that differs, with both values ("" when nothing)."""
    found = _first_difference(mine, stream, "")
    if found is None:
        return ""
    key, value, theirs = found
    return (
        f"its id mapping differs from the stream's (that of partition {first}): {key} is {_shown(value)}, "
        f"the stream's is {_shown(theirs)}; raw values would be trained on other rows (preprocess every "
        "partition of a stream with the same settings and vocabularies)"
    )


def checked_mapping(saved: Any, where: str) -> tuple[str, Mapping]:
    """(partition, id mapping) of a position's `id_mapping` ({"partition": NAME, "settings": {...}});
    DataError naming `where` when malformed."""
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("partition"), str)
        or not isinstance(saved.get("settings"), dict)
    ):
        raise DataError(
            f"{where}: id_mapping {str(saved)[:200]}: malformed (expected partition and settings)"
        )
    return saved["partition"], saved["settings"]


_ABSENT = object()


def _first_difference(mine: Any, stream: Any, key: str) -> tuple[str, Any, Any] | None:
    """(key path, mine, stream's) of the first value that differs, or None."""
    if isinstance(mine, dict) and isinstance(stream, dict):
        for k in list(stream) + [k for k in mine if k not in stream]:
            found = _first_difference(
                mine.get(k, _ABSENT), stream.get(k, _ABSENT), f"{key}.{k}" if key else k
            )
            if found is not None:
                return found
        return None
    return None if mine == stream else (key, mine, stream)


def _shown(value: Any) -> str:
    text = "not set" if value is _ABSENT else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _parquet_features(parquet: dict) -> dict[str, Any]:
    """Each feature of a manifest's `settings.parquet` with data.parquet's defaults filled in."""
    from neorec.config.data import ParquetConfig

    try:
        features = ParquetConfig(**parquet).feature_configs()
    except (TypeError, ValueError):  # not a data.parquet section: compare it as written
        return {"(as written)": parquet.get("features")}
    return {f.name: f.model_dump(exclude={"name"}) for f in features}


def _vocabularies(folder: Path) -> dict[str, Any]:
    """Each vocabulary file of `folder`: [size, crc32] as its settings.json records (computed where it
    records none); "missing" when there is no such folder."""
    if not folder.is_dir():
        return {"folder": "missing"}
    record: Any = None
    if (folder / "settings.json").is_file():
        record = read_json(folder / "settings.json", "vocabulary file", "preprocess it again", DataError).get(
            "files"
        )
    if isinstance(record, dict):
        return {str(k): v for k, v in sorted(record.items())}
    return {p.name: size_and_crc32(p) for p in sorted(folder.glob("*.npy"))}
