"""JSON that every reader accepts: Python writes NaN and Infinity, which are not JSON, so they become null."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float (in dicts, lists and tuples, at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict_dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `obj` with non-finite floats as null (and an error, not invalid JSON, for anything else)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
