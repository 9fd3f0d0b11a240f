"""Every config key, read from the schema: `neorec config keys` (a table, or docs/config.md with
--markdown) and `neorec config show` (a resolved config with each key's description)."""

from __future__ import annotations

import math
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from neorec.config.base import leaf_types, literal_values
from neorec.config.schema import RunConfig

TABLE = "<table>"  # stands for a table name in the keys of per-table mappings


@dataclass
class Key:
    """One config key as the schema defines it."""

    key: str
    type: str  # "int", "float or str", "list[int]", "section", ...
    default: str  # in the shipped `default` config ("" for sections, "required" where there is none)
    allowed: str  # the Literal values and bounds ("> 0", "<= 1"), or ""
    description: str
    schema_default: str = ""  # the schema's own default where it differs from `default`'s


def config_keys() -> list[Key]:
    """Every key of the schema, sections included, in schema order."""
    from neorec.config.load import DEFAULT_BASE, load_config

    return list(_walk(RunConfig, load_config(DEFAULT_BASE), RunConfig(), ""))


def _walk(model: type[BaseModel], shipped: Any, schema: Any, prefix: str) -> typing.Iterator[Key]:
    for name, field in model.model_fields.items():
        key = prefix + name
        desc = field.description or ""
        ours, theirs = _value(shipped, name, field), _value(schema, name, field)
        section = _section_model(field.annotation)
        if section is not None:
            optional = type(None) in leaf_types(field.annotation)
            kind = "section" + (" or null" if optional else "")
            default = "null" if theirs is None and ours is None else ""
            yield Key(key, kind, default, "", desc)
            yield from _walk(section, ours, theirs, key + ".")
            continue
        per_table = _mapping_model(field.annotation)
        if per_table is not None:
            yield Key(key, "mapping: table name -> section", "{}", "", desc)
            yield from _walk(per_table, None, None, f"{key}.{TABLE}.")
            continue
        default = _text(ours) if ours is not _REQUIRED else "required"
        schema_default = _text(theirs) if theirs != ours else ""
        yield Key(key, _type_text(field.annotation), default, _allowed(field), desc, schema_default)


_REQUIRED = object()


def _value(instance: Any, name: str, field: FieldInfo) -> Any:
    """The value of field `name` in `instance`, or the field's own default where there is no instance."""
    if instance is not None:
        return getattr(instance, name)
    if field.is_required():
        return _REQUIRED
    return field.get_default(call_default_factory=True)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    for leaf in leaf_types(annotation):
        if isinstance(leaf, type) and issubclass(leaf, BaseModel):
            return leaf
    return None


def _mapping_model(annotation: Any) -> type[BaseModel] | None:
    if typing.get_origin(annotation) is dict:
        return _section_model(typing.get_args(annotation)[1])
    return None


def _type_text(annotation: Any) -> str:
    names = []
    for leaf in leaf_types(annotation):
        if typing.get_origin(leaf) is typing.Literal:
            name = type(typing.get_args(leaf)[0]).__name__
        elif typing.get_origin(leaf) is list:
            name = f"list[{_type_text(typing.get_args(leaf)[0])}]"
        elif leaf is type(None):
            name = "null"
        else:
            name = getattr(leaf, "__name__", str(leaf))
        if name not in names:
            names.append(name)
    return " or ".join(names)


def _allowed(field: FieldInfo) -> str:
    values = [_text(v) for v in literal_values(field.annotation)]
    bounds = []
    metadata = list(field.metadata)
    # the bounds of a union's members too: Annotated[float, Field(gt=0)] | Literal["auto"]
    for leaf in typing.get_args(field.annotation):
        for extra in typing.get_args(leaf)[1:] if typing.get_origin(leaf) is typing.Annotated else ():
            metadata += getattr(extra, "metadata", [])
    for m in metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "min_length", None):
            text = str in leaf_types(field.annotation) and m.min_length == 1
            bounds.append("not empty" if text else f"at least {m.min_length} item{'s' * (m.min_length > 1)}")
    return ", ".join(values + bounds)


def _text(value: Any) -> str:
    """A value as YAML writes it on one line."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()


# ---- neorec config keys ----------------------------------------------------------------------------
def keys_text() -> str:
    """`neorec config keys`: one line per key (sections are left out: the keys under them name them)."""
    keys = [k for k in config_keys() if not k.type.startswith("section")]
    width = max(len(k.key) for k in keys)
    lines = []
    for k in keys:
        allowed = f" ({k.allowed})" if k.allowed else ""
        schema = f" (schema: {k.schema_default})" if k.schema_default else ""
        lines.append(f"{k.key.ljust(width)}  {k.type}{allowed}, default {k.default}{schema}: {k.description}")
    return "\n".join(lines)


def keys_markdown() -> str:
    """The full text of docs/config.md: the guide, then a table of every key by section."""
    from neorec.config.load import shipped_configs

    keys = config_keys()
    shipped = ", ".join(f"`{name}`" for name in shipped_configs())
    step_1 = ("A config file is YAML whose top level is a mapping; an empty file, a file that is not "
              "YAML, or any other top level is an error that names the file. `--config` takes its path, or "
              f"the name of a config shipped in neorec/configs: {shipped}.")  # fmt: skip
    step_1 = textwrap.fill(step_1, 102, initial_indent="1. ", subsequent_indent="   ", break_on_hyphens=False)
    guide = GUIDE.strip().replace("STEP_1", step_1)
    out = [guide, "", "## Every key", "", "Generated from neorec/config/schema.py by "
           "`neorec config keys --markdown > docs/config.md` (a test checks that this page is current). "
           "Defaults are those of the shipped `default` config, which every config file is merged over "
           "(directly or through its base); where the schema's own default differs (what `RunConfig()` "
           "or `load_config(None)` give in Python), it follows in parentheses.", ""]  # fmt: skip
    groups: dict[str, list[Key]] = {}
    for k in keys:
        top = k.key.split(".")[0] if "." in k.key or k.type.startswith("section") else "(top level)"
        groups.setdefault(top, []).append(k)
    for top, members in groups.items():
        out += [f"### {top}", ""]
        if top != "(top level)":
            out += [members[0].description[0].upper() + members[0].description[1:] + ".", ""]
            members = members[1:]
        out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for k in members:
            default = f"`{k.default}`" if k.default and k.default != "required" else k.default
            if k.schema_default:
                default += f" (schema: `{k.schema_default}`)"
            cells = [f"`{k.key}`", k.type, default, k.allowed, k.description]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


# ---- neorec config show ----------------------------------------------------------------------------
def show_config(cfg: RunConfig) -> str:
    """The resolved config as YAML that `--config` reads back, each key with its description."""
    return "\n".join(_show(cfg, 0))


def _show(model: BaseModel, depth: int) -> typing.Iterator[str]:
    pad = "  " * depth
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        note = f"  # {field.description}" if field.description else ""
        if isinstance(value, BaseModel):
            yield f"{pad}{name}:{note}"
            yield from _show(value, depth + 1)
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            yield f"{pad}{name}:{note}"
            for key, sub in value.items():
                yield f"{pad}  {_text(key)}:"
                yield from _show(sub, depth + 2)
        else:
            shown = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            if isinstance(value, list):  # sections in a list (data.parquet.features) as plain mappings
                shown = [v.model_dump(mode="json", exclude_none=True) if isinstance(v, BaseModel) else v for v in value]
            yield f"{pad}{name}: {_text(shown)}{note}"


GUIDE = """
# Config keys

Every key of a run's config, with its type, default and allowed values, read from
neorec/config/schema.py. The command line prints the same, and the config a run would use:

```bash
neorec config keys                                                # this page, one line per key
neorec config show --config mine.yaml --set train.max_steps=20   # the resolved config, every key explained
```

[configuration.md](configuration.md) walks through configs, overrides and the run folder. In short:

STEP_1
2. It is merged over its base: the config its `base:` key names (a shipped config's name, or a path
   relative to the file's folder), else the shipped `default` config. A base may have a base of its
   own; `default` has none. Mappings merge key by key at every depth; any other value (a number, a
   string, a list, `null`) replaces the base's.
3. `--set a.b.c=VALUE` overrides apply next, in order. VALUE is YAML (`100`, `[64, 32]`, `null`); an
   empty VALUE is an error. `null` is a value like any other, not a reset to the default: a key whose
   type below says "or null" takes it (a section or null, such as `data.criteo`, is then absent), any
   other key refuses it (`--set model.din=null` is an error naming the key). To go back to a default,
   leave the key out or set the default's value.
4. The result is validated before any work starts; a key left unset takes the default below. Where a
   number is expected, `true` or `false` is an error.
5. A key the run does not read is an error when the file itself or a `--set` gives it a value other
   than its default: a `model` key of another `model.arch` ([models.md](models.md)), a setting of a
   data source other than `data.source` (`data.movielens.history` with source synthetic). What a base
   or a shipped config writes does not count, nor a section that lists every key, as a run's
   config.yaml and `neorec config show` write it.

The MovieLens config with a larger embedding, trained longer:

```yaml
# mine.yaml
base: movielens
embedding:
  dim: 64
train:
  epochs: 3
```

`neorec train` refuses a run folder that holds another run (a summary.json, a model.pt, or
checkpoints) before any work starts: `--resume` continues it from its newest checkpoint, `--overwrite`
replaces it (its results, TensorBoard events and checkpoints are removed first), or choose another
`--output-dir`. summary.json is strict JSON: an undefined metric (NaN, such as the AUC of held-out
data with one class only) or an infinite one is written as `null`.
"""
