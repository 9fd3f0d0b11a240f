"""Read a config, apply `--set key=value` overrides, validate, and explain every mistake by key.

How a config is resolved (docs/config.md says the same to users):
1. The config file (a path, or the name of a config shipped in neorec/configs) is read as YAML; its
   top level must be a mapping. An empty file, a file that is not YAML, or any other top level is an error.
2. It is merged over its base: the config its `base:` key names (a shipped config's name, or a path
   relative to the file's folder), else the shipped `default` config. A base may have a base of its own;
   `default` has none. Mappings merge key by key at every depth, so a file lists only what it changes;
   any other value (a number, a string, a list, null) replaces the base's.
3. `--set a.b.c=value` overrides apply in order to the merged mapping. The value is YAML (numbers,
   lists, `null`); an empty value is an error. `null` is a value as any other: a key whose type takes
   null (`train.max_steps`, a section such as `data.criteo`) is set to it, any other key refuses it.
4. The result is validated against neorec/config/schema.py; keys left unset take the schema's defaults.
5. A model key that the file itself or a `--set` writes and that the chosen model does not read is an
   error (neorec/config/model_keys.py), and so is a setting of a data source other than data.source
   (neorec/config/data_keys.py).
`load_config(None)` starts from the schema's defaults alone (library use; the CLI starts from `default`).

YAML is read with limits, so that no config text can take the machine's time or memory: a file or
`--set` value of at most 1 MiB, strings of at most 4096 characters, integers of at most 40 digits,
mappings and lists nested at most 32 deep; a key given twice in one mapping and aliases (`*name`,
which can multiply a small text into gigabytes) are errors naming the line.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Collection
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from neorec.config.data_keys import unread_data_keys, written_data_keys
from neorec.config.model_keys import unread_model_keys, written_model_keys
from neorec.config.schema import RunConfig
from neorec.errors import ConfigError

DEFAULT_BASE = "default"  # the shipped config that a config without `base:` is merged over
MAX_TEXT_BYTES = 1 << 20  # of a config file or a --set value
MAX_STRING = 4096  # characters of one string (a path: PATH_MAX)
MAX_DIGITS = 40  # characters of one integer (int64 has 19 digits)
MAX_DEPTH = 32  # nested mappings and lists
MAX_BASES = 16  # configs in a chain of bases


class _Refused(yaml.MarkedYAMLError):
    """YAML that is valid but beyond what a config may hold (see the module docstring)."""


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader within the limits of the module docstring."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(None, None, f"alias *{event.anchor} (configs take no aliases; write the value out)",
                           event.start_mark)  # fmt: skip
        if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_STRING:
            raise _Refused(None, None, f"a value of {len(event.value)} characters (at most {MAX_STRING})",
                           event.start_mark)  # fmt: skip
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(None, None, f"mappings and lists nested more than {MAX_DEPTH} deep", event.start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # yaml's own error names it
            if key in seen:
                raise _Refused(None, None, f"key {_short(key)} appears twice in this mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(node.value)
        if len(text) > MAX_DIGITS:
            raise _Refused(None, None, f"an integer of {len(text)} characters (at most {MAX_DIGITS})", node.start_mark)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_yaml_map)


def load_yaml(text: str) -> Any:
    """The value of YAML `text`, within the limits of the module docstring; yaml.YAMLError otherwise
    (a MarkedYAMLError names the line)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise yaml.YAMLError(f"{len(text.encode('utf-8', 'surrogatepass'))} bytes of text (at most {MAX_TEXT_BYTES})")
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def shipped_configs() -> list[str]:
    """Names of the configs that ship with neorec (usable as `--config NAME` and `base: NAME`)."""
    folder = resources.files("neorec") / "configs"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_config(
    path_or_name: str | None = None, overrides: list[str] | None = None, *, reads: Collection[str] = ()
) -> RunConfig:
    """The validated RunConfig of a config file or shipped name (merged over its base; None: the
    schema's defaults alone), with `key=value` overrides applied. `reads`: the data sources whose
    settings the command reads besides data.source's (`neorec data generate`: synthetic)."""
    raw: dict[str, Any] = {}
    where = "defaults"
    own: dict[str, Any] = {}  # what the file itself writes (not its bases)
    if path_or_name is not None:
        raw, where, own = _read_config(path_or_name)
    marks: dict[str, Any] = {}  # what --set writes
    for item in overrides or []:
        apply_override(raw, item)
        apply_override(marks, item)
    where += " with --set" if overrides else ""
    cfg = validate_config(raw, where)
    unread = unread_model_keys(cfg.model, written_model_keys(own) + written_model_keys(marks))
    unread += unread_data_keys(cfg.data, written_data_keys(own) + written_data_keys(marks), reads)
    if unread:
        raise ConfigError(f"{where}: " + "; ".join(unread))
    return cfg


def read_config(path_or_name: str, base_of: Path | None = None, chain: tuple[str, ...] = ()) -> tuple[dict, str]:
    """(raw mapping merged over its bases, description of the files it came from). `base_of`: the
    folder of the config that names this one as its base (then shipped names are looked up first)."""
    raw, where, _ = _read_config(path_or_name, base_of, chain)
    return raw, where


def _read_config(
    path_or_name: str, base_of: Path | None = None, chain: tuple[str, ...] = ()
) -> tuple[dict, str, dict]:
    """read_config's (raw, where), and the mapping the file itself writes (empty for a shipped config)."""
    text, where, shipped = _resolve(path_or_name, base_of, chain)
    if where in chain:
        raise ConfigError(f"config bases form a cycle: {' -> '.join([*chain, where])}")
    if len(chain) >= MAX_BASES:
        raise ConfigError(f"{where}: more than {MAX_BASES} configs in a chain of bases")
    raw = parse_config(text, where)
    own = raw if shipped is None else {}
    if "base" in raw:
        base = raw.pop("base")
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"{where}: key 'base': expected a shipped config name or a path, got {_short(base)}")
    elif shipped == DEFAULT_BASE:
        return raw, where, own
    else:
        base = DEFAULT_BASE
    folder = Path(where).parent if shipped is None else None
    under, under_where = read_config(base, folder or Path("."), (*chain, where))
    return merge(under, raw), f"{where} over {under_where}", own


def _resolve(
    path_or_name: str, base_of: Path | None, chain: tuple[str, ...] = ()
) -> tuple[str, str, str | None]:
    """(text, where, shipped name or None) of a config file path or a shipped config name; `chain`:
    the configs read so far, the last of which names this one as its base."""
    is_name = not Path(path_or_name).suffix and "/" not in path_or_name and path_or_name in shipped_configs()
    path = Path(path_or_name) if base_of is None else base_of / path_or_name
    if is_name and (base_of is not None or not path.is_file()):
        res = resources.files("neorec") / "configs" / f"{path_or_name}.yaml"
        return res.read_text(), f"neorec/configs/{path_or_name}.yaml", path_or_name
    if path.is_file():
        try:
            if path.stat().st_size > MAX_TEXT_BYTES:
                raise ConfigError(f"{path}: {path.stat().st_size} bytes; a config holds at most {MAX_TEXT_BYTES}")
            return path.read_text(), str(path), None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a YAML config (not UTF-8 text)") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if path.is_dir():
        raise ConfigError(f"config {path}: is a folder; expected a YAML file or a shipped config name")
    what = f"config {path_or_name!r}"
    if base_of is not None:  # named by the last config of the chain being read
        what = f"{chain[-1] if chain else 'a config'}: key 'base': {path_or_name!r} (looked for {path})"
    raise ConfigError(f"{what} is neither a file nor a shipped config; shipped: {', '.join(shipped_configs())}")


def parse_config(text: str, where: str) -> dict[str, Any]:
    """The top-level mapping of a config file's text; errors name the file (and line)."""
    try:
        raw = load_yaml(text)
    except _Refused as e:
        line = f":{e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise ConfigError(f"{where}{line}: {e.problem}") from None
    except yaml.MarkedYAMLError as e:
        line = f":{e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise ConfigError(f"{where}{line}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        raise ConfigError(f"{where}: empty config (no keys); leave out --config to run the default config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return raw


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: mappings key by key at every depth, other values replaced."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else value
    return out


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` (value parsed as YAML: numbers, lists, null...) to a raw config dict."""
    if len(item.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise ConfigError(f"--set {_short(item)}: {len(item)} characters; a --set holds at most {MAX_TEXT_BYTES} bytes")
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {_short(item)}: expected key=value, e.g. --set train.max_steps=100")
    if not value.strip():
        raise ConfigError(
            f"--set {_short(item)}: empty value; give a value, or {key.strip()[:80]}=null for a key that "
            "takes null"
        )
    parts = key.strip().split(".")
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"--set {_short(item)}: a key of more than {MAX_DEPTH} parts")
    node = raw
    for i, p in enumerate(parts[:-1]):
        if node.get(p) is None:  # absent, or null in a written config: a section starts here
            node[p] = {}
        nxt = node[p]
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {_short(item)}: {'.'.join(parts[: i + 1])[:120]} is a value, not a section")
        node = nxt
    try:
        node[parts[-1]] = load_yaml(value)
    except _Refused as e:
        raise ConfigError(f"--set {_short(key.strip())}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {_short(item)}: value is not valid YAML: {' '.join(str(e).split())}") from None


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: an error line quotes a value, never a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def validate_config(raw: dict[str, Any], where: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        # one line however many problems: the first few, each cut short, then how many more
        hinted: set[tuple[str, ...]] = set()  # sections whose allowed keys a line lists already
        lines = [_cut(_explain(err, hinted), MAX_PROBLEM_CHARS) for err in errors[:MAX_PROBLEMS_SHOWN]]
        if len(errors) == 1:
            raise ConfigError(f"{where}: {lines[0]}") from None
        more = f"; and {len(errors) - len(lines)} more" if len(errors) > len(lines) else ""
        raise ConfigError(f"{where}: {len(errors)} problems: " + "; ".join(lines) + more) from None


MAX_PROBLEMS_SHOWN = 5  # problems a config error lists (then "and N more")
MAX_PROBLEM_CHARS = 300  # characters of each


def _cut(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _explain(err: dict[str, Any], hinted: set[tuple[str, ...]] | None = None) -> str:
    """One problem of a config on a line. An unknown key comes with the keys its section allows,
    once per section in `hinted` (the sections listed already, updated here)."""
    loc = [str(p) for p in err["loc"]]
    # pydantic adds union member names ("list[int]", "literal['none']") to the location; drop them
    loc = [p for p in loc if not _is_union_tag(p)]
    key = _cut(".".join(p if p.isprintable() else repr(p)[1:-1] for p in loc), 120) or "(top level)"
    if err["type"] == "extra_forbidden":
        section = tuple(loc[:-1])
        allowed = _allowed_keys(loc[:-1]) if hinted is None or section not in hinted else []
        if hinted is not None:
            hinted.add(section)
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"unknown key '{key}'{hint}"
    if err["type"] == "missing":
        return f"missing key '{key}'"
    got = err.get("input")
    got_text = "" if isinstance(got, dict) else f" (got {_short(got)})"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across sections (its message names the keys)
        return f"{msg}{got_text}"
    return f"key '{key}': {msg}{got_text}"


def _is_union_tag(part: str) -> bool:
    return any(part.startswith(t) for t in ("list[", "literal[", "int", "float", "str", "dict[", "function-"))


def _allowed_keys(loc: list[str]) -> list[str]:
    """Field names of the config section at `loc` (for 'did you mean' style messages)."""
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
    return sorted(model.model_fields) if model is not None else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        m = _model_of(arg)
        if m is not None:
            return m
    return None


def dump_config(cfg: RunConfig, out_dir: str | Path | None = None) -> str:
    """`cfg` as the YAML of a run's config.yaml, which load_config reads back as a record of the run.
    `out_dir`: the folder the run writes (`--output-dir`), recorded as output_dir where `cfg`'s resolves
    to another one, so that the config run again writes to the same folder."""
    if out_dir is not None and Path(out_dir) != Path(cfg.resolved_output_dir):
        cfg = cfg.model_copy(update={"output_dir": str(out_dir)})
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_changes(previous: dict, cfg: RunConfig, ignore: Collection[str] = ()) -> list[str]:
    """The settings of `cfg` that differ from `previous` (a run's config.yaml as loaded), as
    "key: old -> new" by dotted key, in the config's order; keys only one of them has count too, the
    dotted keys in `ignore` not."""
    return tree_changes(previous, cfg.model_dump(mode="json"), ignore)


def tree_changes(
    previous: dict, now: dict, ignore: Collection[str] | Callable[[str], bool] = ()
) -> list[str]:
    """config_changes of two configs as dicts (a config.yaml as loaded, a model_dump); `ignore`: the
    dotted keys left out, or a test of a key."""
    skip = ignore if callable(ignore) else ignore.__contains__
    old, new = _flat(previous), _flat(now)
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in changed_keys(previous, now) if not skip(k)]  # fmt: skip


def changed_keys(previous: dict, now: dict) -> list[str]:
    """The dotted keys whose values differ between two configs as dicts, in the config's order (keys
    only one of them has too)."""
    old, new = _flat(previous), _flat(now)
    return [k for k in {**new, **old} if old.get(k) != new.get(k)]


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
