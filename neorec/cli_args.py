"""Values of the command line checked where argparse reads them (counts, durations) and paths that
must be folders, or places this user may write; each mistake is one line naming the flag."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from neorec.errors import NeorecError


def output_folder(path: str, flag: str) -> str:
    """`path`, checked to be a folder or free: a file there is a mistake, not something to write over;
    and to be writable (`writable`)."""
    if Path(path).exists() and not Path(path).is_dir():
        raise NeorecError(f"{flag} {path}: is a file; give a folder")
    return writable(path, flag)


def writable(path: str, flag: str) -> str:
    """`path` (a file or folder a command writes), checked before any work to lie where this user may
    write: its nearest existing folder must allow it (permissions, and a filesystem not mounted
    read-only)."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        folder = folder.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if os.access(folder, os.W_OK | os.X_OK):
        return path
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only file system" if read_only else "is not writable (permission denied)"
    raise NeorecError(f"{flag} {path}: {folder} {why}; choose another folder")


def positive_int(text: str) -> int:
    """argparse type of counts that must be at least 1."""
    return _number(text, int, 1, "a whole number >= 1")


def count(text: str) -> int:
    """argparse type of counts that may be 0."""
    return _number(text, int, 0, "a whole number >= 0")


def seconds(text: str) -> float:
    """argparse type of a duration in seconds (>= 0)."""
    return _number(text, float, 0, "a number of seconds >= 0")


def _number(text: str, kind: type, least: float, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value >= least:  # NaN too
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value
