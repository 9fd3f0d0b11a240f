"""The structure of a preprocessed folder's manifest.json and of a shard's meta.json (neorec/data/manifest.py):
every value's type and range, checked when the file is read back, before anything uses it. A file
whose checksum matches can still be wrong (written by hand, or by a tool that recomputed its "crc32"):
it is refused with a DataError naming the file and the key path.

    format        "neorec-columnar-1"
    complete      true once every shard is written (then num_samples, skipped and each shard's
                  samples and skipped are present; before, none of them)
    settings      an object: "input" (criteo, synthetic, parquet) and what preprocessing was given
    num_dense     dense features, a whole number in [0, MAX_DENSE]
    features      [{name, num_ids in [1, 2^63), multi_hot, weighted}], names plain and distinct
    notes         an object; "dense" (when present): num_dense names
    shards        [{index (its position), file, role, first, count, offset, samples, skipped, files}]
    num_samples   per split (train, eval): the sum of the shards' samples
    skipped       per reason: the sum of the shards' skipped lines
"""

from __future__ import annotations

from typing import Any

from neorec.errors import DataError
from neorec.utils.files import plain_name
from neorec.utils.json_checks import JsonChecks, key_path

SPLITS = ("train", "eval")
# split: TSV lines that are multiples of eval_every go to eval; column: Parquet rows by their eval column
ROLES = ("train", "eval", "split", "column")
INPUTS = ("criteo", "synthetic", "parquet")
PLAN_KEYS = ("index", "file", "role", "first", "count", "offset")  # ShardPlan's fields
DONE_KEYS = ("samples", "skipped", "files")  # a written shard's (from its meta.json)
FEATURE_KEYS = ("name", "num_ids", "multi_hot", "weighted")
MAX_IDS = 2**63 - 1  # ids are int64: a table of more rows cannot be addressed
MAX_DENSE = 1 << 20  # dense features; no data set has near this many, a larger count is damage
CRC32_MAX = 2**32 - 1


def check_manifest_structure(manifest: dict[str, Any], where: str, hint: str) -> None:
    """Every value of a manifest (see the module doc); DataError naming `where` and the key path."""
    c = JsonChecks(where, hint, DataError)
    complete = c.flag(c.field(manifest, "complete"), "complete")
    _check_settings(c, c.mapping(c.field(manifest, "settings"), "settings"))
    num_dense = c.whole(c.field(manifest, "num_dense"), "num_dense", 0, MAX_DENSE)
    features = c.items(c.field(manifest, "features"), "features")
    if not features:
        c.wrong("features", features, "a list of at least one feature")
    _check_features(c, features)
    notes = c.mapping(c.field(manifest, "notes"), "notes")
    if "dense" in notes:
        names = c.items(notes["dense"], "notes.dense")
        for i, name in enumerate(names):
            c.text(name, f"notes.dense[{i}]")
        if len(names) != num_dense:
            c.fail("notes.dense", f"names {len(names)} dense features, but num_dense is {num_dense}")
    shards = c.items(c.field(manifest, "shards"), "shards")
    for i, entry in enumerate(shards):
        check_shard_entry(c, entry, i, complete)
    if not complete:
        for key in ("num_samples", "skipped"):
            if key in manifest:
                c.fail(key, "is present, but the manifest is not complete")
        return
    _check_shard_columns(c, shards, features)
    for key, names in (("num_samples", SPLITS), ("skipped", None)):
        totals = c.counts(c.field(manifest, key), key, names)
        summed: dict[str, int] = {}
        for entry in shards:
            for name, n in entry["samples" if key == "num_samples" else "skipped"].items():
                summed[name] = summed.get(name, 0) + n
        if {k: v for k, v in totals.items() if v} != {k: v for k, v in summed.items() if v}:
            c.fail(key, f"is {totals}, but the shards hold {summed}")


def _check_settings(c: JsonChecks, settings: dict) -> None:
    """What readers take from the settings (the rest must equal a rerun's settings to resume)."""
    c.text(c.field(settings, "input", "settings"), "settings.input", INPUTS)
    if "categorical" in settings:
        categorical = c.mapping(settings["categorical"], "settings.categorical")
        if "raw_features" in categorical:
            raw = c.items(categorical["raw_features"], "settings.categorical.raw_features")
            for i, name in enumerate(raw):
                c.text(name, f"settings.categorical.raw_features[{i}]")


def _check_features(c: JsonChecks, features: list) -> None:
    seen: set[str] = set()
    for i, feature in enumerate(features):
        key = f"features[{i}]"
        c.mapping(feature, key)
        c.only(feature, FEATURE_KEYS, key)
        name = plain_name(c.field(feature, "name", key), f"{c.where}: feature", DataError)
        if name in seen:
            c.fail(f"{key}.name", f"is {name!r}, which an earlier feature has too")
        seen.add(name)
        c.whole(c.field(feature, "num_ids", key), f"{key}.num_ids", 1, MAX_IDS)
        for flag in ("multi_hot", "weighted"):
            if flag in feature:
                c.flag(feature[flag], f"{key}.{flag}")


def _check_shard_columns(c: JsonChecks, shards: list, features: list) -> None:
    """A written shard lists, for each split it holds samples of, every column file the reader opens:
    dense, labels, each feature's ids, and the bag sizes and weights of multi-hot and weighted ones."""
    needed = {"dense.npy": "every shard", "labels.npy": "every shard"}
    for k, f in enumerate(features):
        needed[f"ids_{f['name']}.npy"] = f"features[{k}]"
        for flag, column in (("multi_hot", "lengths"), ("weighted", "weights")):
            if f.get(flag):
                needed[f"{column}_{f['name']}.npy"] = f"features[{k}] ({flag})"
    for i, entry in enumerate(shards):
        if "files" not in entry:  # a folder written before file checksums were recorded
            continue
        for split in (split for split, n in entry["samples"].items() if n):
            for column, who in needed.items():
                if f"{split}/{column}" not in entry["files"]:
                    c.fail(f"shards[{i}].files", f'lists no "{split}/{column}", which {who} needs')


def check_shard_entry(c: JsonChecks, entry: Any, i: int, complete: bool) -> None:
    """Shard i's entry: its plan, and (written) its samples, skipped lines and files."""
    key = f"shards[{i}]"
    c.mapping(entry, key)
    c.only(entry, PLAN_KEYS + DONE_KEYS, key)
    if c.field(entry, "index", key) != i:
        c.wrong(f"{key}.index", entry["index"], f"{i} (its position in the list)")
    c.text(c.field(entry, "file", key), f"{key}.file")
    c.text(c.field(entry, "role", key), f"{key}.role", ROLES)
    c.whole(c.field(entry, "first", key), f"{key}.first")
    c.whole(c.field(entry, "count", key), f"{key}.count")
    c.whole(c.field(entry, "offset", key), f"{key}.offset", -1)
    if not complete:
        for done in DONE_KEYS:
            if done in entry:
                c.fail(f"{key}.{done}", "is present, but the manifest is not complete")
        return
    c.counts(c.field(entry, "samples", key), f"{key}.samples", SPLITS)
    c.counts(c.field(entry, "skipped", key), f"{key}.skipped")
    if "files" in entry:  # a folder written before file checksums were recorded has none
        check_files(c, entry["files"], f"{key}.files")


def check_files(c: JsonChecks, files: Any, key: str) -> None:
    """{"<split>/<column>.npy": [size, crc32]} with plain names."""
    for name, record in c.mapping(files, key).items():
        split, _, column = name.partition("/")
        c.text(split, f"{key_path(key, name)} (its folder)", SPLITS)
        plain_name(column, f"{c.where}: {key}: file", DataError)
        at = key_path(key, name)
        if not isinstance(record, list) or len(record) != 2:
            c.wrong(at, record, "[size, crc32]")
        c.whole(record[0], f"{at}[0]")
        c.whole(record[1], f"{at}[1]", 0, CRC32_MAX)


def check_meta_structure(meta: dict[str, Any], where: str, hint: str) -> None:
    """A shard's meta.json: samples per split, skipped lines per reason, and (when present) its files."""
    c = JsonChecks(where, hint, DataError)
    c.only(meta, DONE_KEYS)
    c.counts(c.field(meta, "samples"), "samples", SPLITS)
    c.counts(c.field(meta, "skipped"), "skipped")
    if "files" in meta:
        check_files(c, meta["files"], "files")
