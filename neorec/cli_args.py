"""Values of the command line checked where argparse reads them (counts, durations) and paths that
must be folders; each mistake is one line naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from neorec.errors import NeorecError


def output_folder(path: str, flag: str) -> str:
    """`path`, checked to be a folder or free: a file there is a mistake, not something to write over."""
    if Path(path).exists() and not Path(path).is_dir():
        raise NeorecError(f"{flag} {path}: is a file; give a folder")
    return path


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
