"""Checking the values of a JSON file neorec reads back (a manifest): each value's type and range, so
that a file whose checksum matches but whose content is wrong (written by hand, or by a tool that
recomputed the checksum) is refused with one error naming the file and the key path, e.g.
`pp/manifest.json: features[0].num_ids is NaN, expected a whole number >= 1`, before anything uses it.

JSON numbers are Python ints or floats; a bool is never a number here, and a float is never a whole
number (1.0 in a count is damage, not a count)."""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

_SHOWN = 60  # characters of a value or key shown in a message


def shown(value: Any) -> str:
    """`value` as its JSON text (NaN, Infinity, null, true, "text"), cut to a short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not JSON data: its Python form
        text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def key_path(parent: str, key: str | int) -> str:
    """The path of `key` inside the value at `parent`: `a.b`, `a[0]`, or `a["x/y"]` for a key that is
    not a plain word."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    if key.isidentifier() and len(key) <= _SHOWN:
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{shown(key)}]"


def is_whole(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _upper(high: int) -> str:
    """The closed upper end `high]`, or `2^k)` when high is 2^k - 1 of many digits."""
    k = (high + 1).bit_length() - 1
    return f"2^{k})" if high > 10**6 and high + 1 == 1 << k else f"{high}]"


class JsonChecks:
    """The checks of one file's values: every failure raises `error` naming `where` (the file), the
    key path, the value and what was expected, followed by `hint` (what to do about it)."""

    def __init__(self, where: str, hint: str, error: type[Exception]) -> None:
        self.where, self.hint, self.error = where, hint, error

    def fail(self, key: str, message: str) -> NoReturn:
        """Raise the error `<where>: <key> <message>; <hint>`."""
        raise self.error(f"{self.where}: {key} {message}; {self.hint}")

    def wrong(self, key: str, value: Any, expected: str) -> NoReturn:
        self.fail(key, f"is {shown(value)}, expected {expected}")

    def field(self, mapping: dict, name: str, parent: str = "") -> Any:
        """mapping[name]; an error naming the key when it is missing."""
        if name not in mapping:
            self.fail(parent or "the file", f"has no key {name!r}")
        return mapping[name]

    def only(self, mapping: dict, allowed: tuple[str, ...], parent: str = "") -> None:
        """No key besides `allowed`."""
        unknown = sorted(k for k in mapping if k not in allowed)
        if unknown:
            self.fail(
                parent or "the file", f"has unknown key(s) {shown(unknown)} (allowed: {', '.join(allowed)})"
            )

    def mapping(self, value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            self.wrong(key, value, "an object")
        return value

    def items(self, value: Any, key: str) -> list:
        if not isinstance(value, list):
            self.wrong(key, value, "a list")
        return value

    def text(self, value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or (choices is not None and value not in choices):
            self.wrong(key, value, f"one of {', '.join(map(shown, choices))}" if choices else "a string")
        return value

    def flag(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            self.wrong(key, value, "true or false")
        return value

    def whole(self, value: Any, key: str, low: int = 0, high: int | None = None) -> int:
        """A whole number in [low, high] (high None: no upper bound)."""
        if not is_whole(value) or value < low or (high is not None and value > high):
            expected = (
                f"a whole number >= {low}" if high is None else f"a whole number in [{low}, {_upper(high)}"
            )
            self.wrong(key, value, expected)
        return value

    def number(self, value: Any, key: str) -> float:
        """A finite number (int or float)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.wrong(key, value, "a finite number")
        return value

    def counts(self, value: Any, key: str, names: tuple[str, ...] | None = None) -> dict[str, int]:
        """An object of whole numbers >= 0 (`names`: its keys must be among them)."""
        for name, n in self.mapping(value, key).items():
            if names is not None and name not in names:
                self.fail(key, f"has key {shown(name)}, expected one of {', '.join(names)}")
            self.whole(n, key_path(key, name))
        return value
