"""A folder of snapshots for serving: complete, verified exports behind a `LATEST` pointer.

    SNAPSHOTS/snapshot-00001200/       one export (model.nrx, or model.pt2 + weights.safetensors)
                                       and snapshot.json: its step, format, and every file's size
                                       and crc32
    SNAPSHOTS/LATEST                   JSON naming the newest published snapshot (with its crc32)

Publishing (`publish`): the export is written into `.tmp-snapshot-<step>/`, read back and verified
(every checksum of the export format), described in snapshot.json, then the folder is renamed to its
final name and the folder's directory entry synced; only then is LATEST replaced (write_atomic:
temporary file, fsync, rename). A reader of LATEST therefore only ever finds a complete folder whose
files are all written and verified; a job killed at any moment leaves at most a `.tmp-` folder,
which the next publish removes. Old snapshots are removed beyond the newest `keep` (never the one
LATEST names); with keep >= 2 a reader that just read LATEST has at least one publish's time to open
its files, and an open file stays readable after its folder is removed.

A run resumed from an older checkpoint trains the later steps again, perhaps with other settings:
`withdraw_after` moves LATEST back to the newest intact snapshot of the resumed step or before (or
removes it when there is none), then removes the snapshots of later steps, so that neither serving
nor a later publish takes a model of the run the resumed one replaced.

Reading (`latest_snapshot`): LATEST's checksum, a plain folder name, snapshot.json's checksum, and every
file's size and crc32 against it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from neorec.errors import NeorecError
from neorec.utils.files import file_crc32, fsync_dir, plain_name, read_json, write_json

log = logging.getLogger(__name__)

LATEST = "LATEST"
DESCRIPTION = "snapshot.json"
_NAME = re.compile(r"^snapshot-(\d{8,})$")
_HINT = "it is damaged; the next snapshot replaces it"


class SnapshotError(NeorecError):
    """A snapshot folder or LATEST is missing or damaged. Names the file."""


def snapshot_name(step: int) -> str:
    return f"snapshot-{step:08d}"


def list_snapshots(root: str | Path) -> list[Path]:
    """The published snapshot folders under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def publish(
    root: str | Path,
    step: int,
    write: Callable[[Path], dict],
    verify: Callable[[Path], None],
    keep: int,
) -> Path:
    """Publish the snapshot of `step` (module docstring): write(folder) writes the export into a fresh
    folder and returns what snapshot.json should say of it; verify(folder) reads it back (raising on
    damage). Returns the published folder; LATEST names it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / snapshot_name(step)
    for leftover in root.glob(".tmp-snapshot-*"):  # a publish cut short: never named by LATEST
        shutil.rmtree(leftover, ignore_errors=True)
    if final.is_dir():  # this step published before (the trainer withdraws later steps when it resumes)
        try:
            check_snapshot(final)
        except SnapshotError:
            if _latest_name(root) == final.name:
                raise
            shutil.rmtree(final)
    if not final.is_dir():
        tmp = root / f".tmp-{final.name}"
        tmp.mkdir()
        try:
            described = write(tmp)
            verify(tmp)
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                files[path.relative_to(tmp).as_posix()] = {
                    "bytes": path.stat().st_size,
                    "crc32": file_crc32(path),
                }
            description = {
                "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **described,
                "files": files,
            }
            write_json(tmp / DESCRIPTION, description, "snapshot description")
            fsync_dir(tmp)
        except BaseException:  # nothing is published; LATEST still names the previous snapshot
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.replace(tmp, final)
        fsync_dir(root)
    write_json(root / LATEST, {"snapshot": final.name, "step": step}, "snapshot pointer")
    prune(root, keep)
    return final


def withdraw_after(root: str | Path, step: int) -> list[Path]:
    """A run resumed at `step` trains the later steps again (from an older checkpoint, perhaps with
    other settings), so the snapshots of later steps are of a model it will not have: LATEST is moved
    back to the newest intact snapshot of `step` or before (removed when there is none) before those
    folders are removed. Serving never follows, and a publish never finds, a snapshot of a run this
    one replaced. Returns the folders removed."""
    root = Path(root)
    found = [(int(_NAME.match(p.name).group(1)), p) for p in list_snapshots(root)]
    later = [p for s, p in found if s > step]
    if not later:
        return []
    pointer = root / LATEST
    if pointer.exists() and _latest_name(root) not in {p.name for s, p in found if s <= step}:
        for s, p in reversed([(s, p) for s, p in found if s <= step]):
            try:
                check_snapshot(p)
            except SnapshotError:
                continue
            write_json(pointer, {"snapshot": p.name, "step": s}, "snapshot pointer")
            break
        else:
            pointer.unlink()
            fsync_dir(root)
    for p in later:
        shutil.rmtree(p, ignore_errors=True)
    return later


def prune(root: Path, keep: int) -> list[Path]:
    """Remove snapshots beyond the newest `keep`, never the one LATEST names; returns those removed."""
    current = _latest_name(root)
    old = [p for p in list_snapshots(root)[:-keep] if p.name != current]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def _latest_name(root: Path) -> str | None:
    try:
        return latest_snapshot(root, verify=False).name
    except SnapshotError:
        return None


def latest_snapshot(root: str | Path, verify: bool = True) -> Path:
    """The folder LATEST names, after checking LATEST and (verify) the folder's every file."""
    root = Path(root)
    pointer = root / LATEST
    for _ in range(5):  # a folder removed after LATEST moved on (several publishes in between): read it again
        if not pointer.is_file():
            raise SnapshotError(f"{pointer}: no snapshot is published yet")
        entry = read_json(pointer, "snapshot pointer", _HINT, SnapshotError, required=True)
        folder = root / plain_name(entry.get("snapshot"), f"{pointer}: snapshot", SnapshotError)
        if not verify:
            return folder
        try:
            check_snapshot(folder)
            return folder
        except SnapshotError:
            if _latest_name(root) == folder.name:
                raise
    raise SnapshotError(f"{pointer}: the snapshot it names keeps being replaced; read it again")


def check_snapshot(folder: str | Path) -> dict:
    """snapshot.json of `folder`, after checking every file it lists (size and crc32)."""
    folder = Path(folder)
    description = read_json(folder / DESCRIPTION, "snapshot description", _HINT, SnapshotError, required=True)
    files = description.get("files")
    if not isinstance(files, dict) or not files:
        raise SnapshotError(f"{folder / DESCRIPTION}: lists no files; {_HINT}")
    for name, entry in files.items():
        path = folder / Path(
            *[plain_name(part, f"{folder / DESCRIPTION}: file", SnapshotError) for part in name.split("/")]
        )
        if not isinstance(entry, dict) or not path.is_file():
            raise SnapshotError(f"snapshot file {path} is missing; {_HINT}")
        if path.stat().st_size != entry.get("bytes") or file_crc32(path) != entry.get("crc32"):
            raise SnapshotError(f"snapshot file {path}: size or crc32 differs from {DESCRIPTION}; {_HINT}")
    return description
