"""Values of the command line checked where argparse reads them (counts, durations) and paths that
must be folders, or places this user may write; each mistake is one line naming the flag."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from neorec.errors import NeorecError


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (an unknown flag, a value out of range, a missing argument) are
    one `neorec: error:` line with exit 2, as every other mistake, instead of the usage and a message."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        if len(message) > 300:  # "unrecognized arguments: ..." quotes what was given
            message = f"{message[:300]}... ({len(message)} characters)"
        self.exit(2, f"neorec: error: {message} (see {self.prog} --help)\n")


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
    if not folder.is_dir():  # a file (or device) where a folder of the path must be
        raise NeorecError(f"{flag} {path}: {folder} is not a folder; choose another path")
    if os.access(folder, os.W_OK | os.X_OK):
        return path
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only file system" if read_only else "is not writable (permission denied)"
    raise NeorecError(f"{flag} {path}: {folder} {why}; choose another folder")


def path_text(text: str) -> str:
    """argparse type of paths and config names: an empty one (an unset shell variable) is a mistake,
    never the default it would otherwise fall back to."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return text


def positive_int(text: str) -> int:
    """argparse type of counts that must be at least 1."""
    return _number(text, int, 1, None, "a whole number >= 1")


def count(text: str) -> int:
    """argparse type of counts that may be 0."""
    return _number(text, int, 0, None, "a whole number >= 0")


def seconds(text: str) -> float:
    """argparse type of a duration in seconds, from 0 to a day."""
    return _number(text, float, 0, DAY, "a number of seconds >= 0 and at most 86400 (a day)")


def whole_number(least: int, most: int | Callable[[], int], why: str = "") -> Callable[[str], int]:
    """argparse type of a whole number from `least` to `most` (a bound, or a function of this machine
    that gives it), `why` saying what the bound is ("4 per core of this machine")."""

    def parse(text: str) -> int:
        bound = most() if callable(most) else most
        return _number(text, int, least, bound, f"a whole number >= {least} and at most {bound}{why}")

    return parse


DAY = 86400.0
MAX_BATCHES_READ = 1000  # batches a command reads for statistics (plan --batches, data inspect --batches)
_SHOWN = 40  # characters of a refused value that an error shows


def _number(text: str, kind: type, least: float, most: float | None, what: str) -> Any:
    shown = text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"
    try:
        value = kind(text)
    except (ValueError, OverflowError):  # not a number; int() of more than 4300 digits
        raise argparse.ArgumentTypeError(f"expected {what}, got {shown!r}") from None
    if not value >= least or (most is not None and not value <= most):  # NaN too
        raise argparse.ArgumentTypeError(f"expected {what}, got {shown}")
    return value
