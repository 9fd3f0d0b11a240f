"""The partitions of a followed folder (`data.follow.dir`): which are complete, and in which order.

A partition is a subfolder of the followed folder (`day=2024-05-01/`, `20240501/`, ...); names starting
with "." or "_" are skipped, as Hive and Spark skip them. It is complete when its producer says so:
- Parquet partitions: the marker file (`data.follow.marker`, `_SUCCESS` by default) is in it; a
  producer writes it after the data files, as Spark and Hive do;
- preprocessed partitions (`neorec data preprocess --out DIR/NAME`): its manifest.json says
  `complete`, which preprocessing writes last.
Until then a partition is not listed: a half-written day is never opened. Order: by name, or by the
time it was completed (the marker's or manifest's modification time; ties by name).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from neorec.errors import DataError


@dataclass(frozen=True)
class Partition:
    name: str
    path: Path
    completed: float  # modification time of what marks it complete


def completion_file(path: Path, kind: str, marker: str) -> Path:
    """The file whose presence (and, for a manifest, content) marks partition `path` complete."""
    return path / ("manifest.json" if kind == "preprocessed" else marker)


def completion_text(kind: str, marker: str) -> str:
    """What a partition of a `kind` stream needs to be complete, in words."""
    return f"a {marker} file" if kind == "parquet" else "a complete manifest.json"


def is_complete(path: Path, kind: str, marker: str) -> bool:
    """Whether partition `path` of a `kind` ("parquet" or "preprocessed") stream is complete."""
    done = completion_file(path, kind, marker)
    if kind != "preprocessed":
        return done.is_file()
    try:  # the manifest is rewritten atomically while preprocessing runs; "complete" comes last
        return json.loads(done.read_bytes()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


def list_partitions(root: str | Path, kind: str, marker: str, order: str = "name") -> list[Partition]:
    """The complete partitions under `root`, in stream order; DataError when `root` is not a folder."""
    root = Path(root)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        raise DataError(f"data.follow.dir {root}: no such folder") from None
    except NotADirectoryError:
        raise DataError(
            f"data.follow.dir {root}: is a file; give the folder that holds the partitions"
        ) from None
    except OSError as e:
        raise DataError(f"data.follow.dir {root}: cannot be listed ({e.strerror or e})") from None
    out = []
    for entry in entries:
        if entry.name.startswith((".", "_")) or not entry.is_dir():
            continue
        path = Path(entry.path)
        if not is_complete(path, kind, marker):
            continue
        try:
            completed = completion_file(path, kind, marker).stat().st_mtime
        except OSError:  # removed between the two looks: not there any more
            continue
        out.append(Partition(entry.name, path, completed))
    if order == "mtime":
        out.sort(key=lambda p: (p.completed, p.name))
    return out
