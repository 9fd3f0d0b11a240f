"""Keys that a config sets for a part of the run that does not read them: what counts as set, shared by
the model keys of another model (neorec/config/model_keys.py) and the settings of a data source other
than data.source (neorec/config/data_keys.py), both refused before any work.

A key counts as set when `--set` or the config file given to `--config` writes it (its bases and the
shipped configs do not count: a config that switches model.arch or data.source away from its base's
keeps working), with a value other than its default.

A section that lists every key of its schema, and every key of each section under it at every depth
(a section left null aside), is a record of a run, as a run's config.yaml and `neorec config show` write
it: its keys do not count. A config.yaml written before a key was added lacks that key, so it is no
record: its keys count one by one, and one that holds a value other than its default for a part that
does not read it is refused like a hand-written one (remove that key from the file to run it again).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel

from neorec.config.base import leaf_types


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section (a pydantic model) a field holds: SyntheticConfig for `SyntheticConfig` and for
    `CriteoConfig | None`; None for values, lists and mappings of sections."""
    return next((t for t in leaf_types(annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)


def is_record(value: Any, schema: type[BaseModel]) -> bool:
    """Whether mapping `value` lists every key of section `schema`, and each section under it that is
    a mapping every key of its own, at every depth."""
    if not isinstance(value, dict) or not set(schema.model_fields) <= set(value):
        return False
    for name, field in schema.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None and isinstance(value[name], dict) and not is_record(value[name], sub):
            return False
    return True


def written_keys(section: Any, schema: type[BaseModel], expand: Collection[str]) -> list[str]:
    """The keys a raw config section (of schema `schema`) writes, dotted below it ("low_rank",
    "din.max_len"): the keys of its sections named in `expand` one by one, when written as a mapping.
    None for a record of a run (an empty list)."""
    if not isinstance(section, dict) or is_record(section, schema):
        return []
    out = []
    for key, value in section.items():
        if key in expand and isinstance(value, dict):
            out.extend(f"{key}.{sub}" for sub in value)
        else:
            out.append(str(key))
    return out


def set_keys(section: BaseModel, written: list[str]) -> list[str]:
    """The keys of `written` (once each, in order) that hold a value other than their default in the
    validated `section`. A key under a section that is null (data.criteo) holds none."""
    return [key for key in dict.fromkeys(written) if not _is_default(section, key)]


def _is_default(section: BaseModel | None, key: str) -> bool:
    *outer, name = key.split(".")
    for part in outer:
        section = getattr(section, part, None)
    if section is None:
        return True
    field = type(section).model_fields.get(name)
    return field is None or getattr(section, name) == field.get_default(call_default_factory=True)
