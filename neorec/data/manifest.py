"""The files of a preprocessed folder that say what it holds, and the checks of every file it has.

    manifest.json           settings, features, shards; once complete, per shard its samples, skipped
                            lines and the size and crc32 of each of its .npy files ("files"); a "crc32"
                            of its own (neorec.utils.files.write_json)
    shards/<k>/meta.json    written with shard k: samples per split, skipped lines, its files' sizes and
                            crc32s, and a "crc32" of its own; copied into the manifest when all are done

Every file (manifest, meta.json, each .npy column) is written by neorec.utils.files.write_atomic, and a
shard's folder is renamed into place once all of its files are. Reading: `load_manifest` checks the
manifest's crc32, then the type and range of every value (manifest_checks.py: counts, sizes, feature
names that are plain names, as they name files: ids_<feature>.npy); a shard's meta.json is checked the
same way when read back. `check_part_files` checks a shard's .npy files against the manifest's sizes
and crc32s before the reader (sharded_reader.py) maps them. A folder written before these checksums were recorded has none:
its manifest is read without its crc32 (any unknown key refused) and its .npy files without theirs; a
manifest or meta.json that records file crc32s but no crc32 of its own was edited, and is refused.
A rerun of `neorec data preprocess` checks the shards written before (`damaged_shards`) and writes a
missing or damaged one again (`reopen`: the manifest made not complete, the shard's folder removed).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neorec.data.criteo_lines import DEFAULT_MAX_LINE_BYTES
from neorec.data.manifest_checks import DONE_KEYS, PLAN_KEYS, check_manifest_structure, check_meta_structure
from neorec.data.manifest_checks import SPLITS as SPLITS
from neorec.errors import DataError
from neorec.utils.files import (
    check_recorded,
    fsync_dir,
    plain_name,
    read_json_of_files,
    size_and_crc32,
    write_atomic,
    write_json,
)
from neorec.utils.json_checks import shown

FORMAT = "neorec-columnar-1"
MANIFEST = "manifest.json"
META = "meta.json"
MANIFEST_KEYS = ("format", "complete", "settings", "num_dense", "features", "notes", "shards", "num_samples", "skipped")
_AGAIN = "preprocess the data again into a new folder"
_KEEPS = "the shards written before it are intact; rerun the same command to resume"
_REDO = "the shard is written again"


@dataclass
class ShardPlan:
    """What shard `index` is made of: lines [first, first + count) of `file` (synthetic: blocks)."""

    index: int
    file: str  # input file; "" for synthetic data
    role: str  # "train", "eval", "split" (line numbers that are multiples of eval_every go to eval), or
    # "column" (Parquet rows go to eval by their eval column)
    first: int  # first line (1-based) or first synthetic block
    count: int  # lines or blocks
    offset: int = -1  # byte offset of line `first` in a plain file; -1 for .gz and synthetic

    @property
    def name(self) -> str:
        return shard_name(self.index)


def shard_name(index: int) -> str:
    """The folder name of shard `index` under shards/."""
    return f"{index:05d}"


def check_feature_names(features: list[dict], manifest: Path) -> None:
    """Every feature's name is a plain name: it is part of file names (ids_<feature>.npy)."""
    for f in features:
        name = f.get("name") if isinstance(f, dict) else None
        plain_name(name, f"{manifest}: feature", DataError)  # ids_<feature>.npy, lengths_<feature>.npy, ...


def load_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a preprocessed folder, checked (its crc32, its format, then every value's type
    and range: neorec/data/manifest_checks.py); DataError naming it and the key when missing,
    unreadable, damaged, foreign or malformed."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: missing; is {root} a folder written by `neorec data preprocess`?")
    manifest = _read_checked(path, "preprocessed data manifest", MANIFEST_KEYS)
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {shown(manifest.get('format'))}, expected {FORMAT!r}")
    unknown = sorted(set(manifest) - set(MANIFEST_KEYS))
    if unknown:
        raise DataError(f"{path}: unknown key(s) {shown(unknown)} (allowed: {', '.join(MANIFEST_KEYS)}); {_AGAIN}")
    check_manifest_structure(manifest, str(path), _AGAIN)
    return manifest


def _read_checked(path: Path, what: str, keys: tuple[str, ...], hint: str = _AGAIN) -> dict:
    """A manifest or meta.json without its "crc32" key, checked against it. One without the key is read
    only as written before checksums were recorded, which had no file checksums either: one that lists
    its files' crc32s ("files") but has no crc32 of its own was edited, and is refused."""
    return read_json_of_files(path, what, hint, DataError, _records_files, keys)


def _records_files(data: dict) -> bool:
    entries = data.get("shards") if isinstance(data.get("shards"), list) else [data]
    return any(isinstance(entry, dict) and "files" in entry for entry in entries)


def read_meta(path: Path, hint: str = _AGAIN) -> dict:
    """A written shard's meta.json, checked (its crc32, then every value: manifest_checks.py)."""
    meta = _read_checked(path, "preprocessed shard file", DONE_KEYS, hint)
    check_meta_structure(meta, str(path), hint)
    return meta


def write_manifest(out: Path, manifest: dict) -> None:
    write_json(out / MANIFEST, manifest, "preprocessed data manifest", sort_keys=True)


def resume_or_start(out: Path, settings: dict) -> dict | None:
    """The manifest of an earlier run with the same settings (to resume), or None to start afresh."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: is a file; give a folder for the shards")
    if not (out / MANIFEST).is_file():
        if out.is_dir() and any(p.name != "vocab" and not p.name.startswith("vocab.") for p in out.iterdir()):
            raise DataError(f"{out}: exists and is not an unfinished preprocessing run; choose a new folder")
        out.mkdir(parents=True, exist_ok=True)
        return None
    manifest = load_manifest(out)
    stored = manifest["settings"]
    if "bad_lines" in stored:  # a TSV run written before max_line_bytes was recorded read lines with its default
        stored = {"max_line_bytes": DEFAULT_MAX_LINE_BYTES, **stored}
    if stored != settings:
        keys = sorted(k for k in set(settings) | set(stored) if settings.get(k) != stored.get(k))
        if keys == ["sizes"]:  # the same arguments, and input files of other sizes
            raise DataError(
                f"{out}: holds an unfinished preprocessing of input files that have changed size since "
                "(written again or edited?); its shards are of the old files: remove the folder, or choose "
                "a new one"
            )
        raise DataError(
            f"{out}: holds preprocessing with other settings ({', '.join(keys)} differ); "
            "rerun with the same arguments to resume, or choose a new folder"
        )
    return manifest


def start_manifest(out: Path, settings: dict, plan: list, num_dense: int, features: list[dict], notes: dict) -> dict:
    """Write the manifest of a new run (its shards planned, none written); features are checked first."""
    check_feature_names(features, out / MANIFEST)
    manifest = {
        "format": FORMAT,
        "complete": False,
        "settings": settings,
        "num_dense": num_dense,
        "features": features,
        "notes": notes,
        "shards": [asdict(s) for s in plan],
    }
    (out / "shards").mkdir(exist_ok=True)
    write_manifest(out, manifest)
    return manifest


def complete_manifest(out: Path, manifest: dict, shard_names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Copy every shard's meta.json (checked) into the manifest, mark it complete and write it;
    returns (samples per split, skipped lines per reason)."""
    num_samples: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for entry, name in zip(manifest["shards"], shard_names, strict=True):
        meta = read_meta(out / "shards" / name / META)
        entry.update(samples=meta["samples"], skipped=meta["skipped"])
        if "files" in meta:
            entry["files"] = meta["files"]
        for reason, n in meta["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        for split, n in meta["samples"].items():
            num_samples[split] = num_samples.get(split, 0) + n
    manifest.update(complete=True, num_samples=num_samples, skipped=dict(sorted(skipped.items())))
    write_manifest(out, manifest)
    return num_samples, skipped


# ---- a shard's files ---------------------------------------------------------------------------------------
def write_columns(
    folder: Path, columns: dict[str, dict[str, np.ndarray]], id_types: dict[str, type], skipped: dict[str, int]
) -> dict:
    """Write every split's columns as <split>/<column>.npy (ids_<feature> as id_types[feature], lengths
    int32, the rest float32) and meta.json into the shard's temporary `folder`; returns the meta dict."""
    files: dict[str, list[int]] = {}
    samples = {}
    for split, cols in columns.items():
        (folder / split).mkdir()
        for key, values in cols.items():
            dtype = id_types[key[4:]] if key.startswith("ids_") else np.int32 if key.startswith("lengths_") else np.float32
            arr = np.ascontiguousarray(values, dtype=dtype)
            path = folder / split / f"{key}.npy"
            write_atomic(path, lambda f, arr=arr: np.save(f, arr), "preprocessed shard file", _KEEPS)
            files[f"{split}/{key}.npy"] = size_and_crc32(path)
        samples[split] = int(len(cols["labels"]))
    meta = {"samples": samples, "skipped": dict(sorted(skipped.items())), "files": files}
    write_json(folder / META, meta, "preprocessed shard file")
    return meta


def damaged_shards(out: Path, manifest: dict, threads: int = 1) -> dict[int, str]:
    """The shards a rerun writes again, each with the first thing found wrong with it: a shard a complete
    manifest records whose folder is missing; a shard folder whose meta.json is missing or damaged, or
    (complete manifest) says other than the manifest's record of it; a .npy file it records that is
    missing, or has another size or crc32 (every recorded file is read once, by `threads` threads)."""
    complete = manifest["complete"]

    def damage(entry: dict) -> str | None:
        folder = out / "shards" / shard_name(entry["index"])
        if not folder.is_dir():
            return f"{folder}: missing, though {out / MANIFEST} records it as written" if complete else None
        try:
            meta = read_meta(folder / META, _REDO)
            if complete and any(entry.get(k) != meta.get(k) for k in DONE_KEYS):
                return f"{folder / META}: differs from {out / MANIFEST}'s record of the shard; {_REDO}"
            for name, recorded in meta.get("files", {}).items():
                check_recorded(folder / name, recorded, folder / META, _REDO, DataError)
        except DataError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(max(1, threads)) as pool:
        found = pool.map(damage, manifest["shards"])
        return {entry["index"]: why for entry, why in zip(manifest["shards"], found, strict=True) if why}


def reopen(out: Path, manifest: dict, shards: list[int]) -> dict:
    """The manifest made not complete again (its totals and shards' records dropped: they are copied
    again from the shards' meta.json once every shard is written), with the folders of `shards` removed
    for the run to write them again; returns it."""
    if manifest["complete"]:
        manifest = {k: v for k, v in manifest.items() if k not in ("num_samples", "skipped")}
        manifest["shards"] = [{k: v for k, v in s.items() if k in PLAN_KEYS} for s in manifest["shards"]]
        manifest["complete"] = False
        write_manifest(out, manifest)
    for index in shards:
        folder, tmp = out / "shards" / shard_name(index), out / "shards" / f".tmp-{shard_name(index)}"
        if folder.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            os.replace(folder, tmp)  # a folder under its final name is complete: out of it in one step
            shutil.rmtree(tmp)
    return manifest


def publish_shard(tmp: Path, final: Path) -> None:
    """Rename a finished shard folder into place, durably."""
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def check_part_files(folder: Path, files: dict[str, list[int]]) -> None:
    """The .npy files of one shard's split (`folder` = shards/<k>/<split>) have the sizes and crc32s
    `files` (the manifest's entry of the shard) records; DataError naming the file otherwise."""
    split = folder.name
    for name, recorded in files.items():
        if name.startswith(split + "/"):
            check_recorded(folder / name.partition("/")[2], recorded, folder.parents[2] / "manifest.json", _AGAIN, DataError)
