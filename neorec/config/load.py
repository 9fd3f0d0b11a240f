"""Read a YAML config, apply `--set key=value` overrides, validate, and explain every mistake by key."""

from __future__ import annotations

import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from neorec.config.schema import RunConfig
from neorec.errors import ConfigError


def shipped_configs() -> list[str]:
    """Names of the configs that ship with neorec (usable as `--config NAME`)."""
    folder = resources.files("neorec") / "configs"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _resolve(path_or_name: str) -> tuple[str, str]:
    """(text, where) of a config file path or a shipped config name."""
    path = Path(path_or_name)
    if path.is_file():
        return path.read_text(), str(path)
    if not path.suffix and path_or_name in shipped_configs():
        res = resources.files("neorec") / "configs" / f"{path_or_name}.yaml"
        return res.read_text(), f"neorec/configs/{path_or_name}.yaml"
    raise ConfigError(
        f"config {path_or_name!r} is neither a file nor a shipped config; shipped: {', '.join(shipped_configs())}"
    )


def load_config(path_or_name: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The validated RunConfig from a YAML file (or shipped name; None = defaults) plus overrides."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path_or_name is not None:
        text, where = _resolve(path_or_name)
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides or []:
        apply_override(raw, item)
    return validate_config(raw, where)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` (value parsed as YAML: numbers, lists, null...) to a raw config dict."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.max_steps=100")
    parts = key.strip().split(".")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML: {e}") from None


def validate_config(raw: dict[str, Any], where: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_explain(err) for err in e.errors()]
        raise ConfigError(f"{where}: {len(lines)} problem(s):\n  " + "\n  ".join(lines)) from None


def _explain(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    # pydantic adds union member names ("list[int]", "literal['none']") to the location; drop them
    loc = [p for p in loc if not _is_union_tag(p)]
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"unknown key '{key}'{hint}"
    if err["type"] == "missing":
        return f"missing key '{key}'"
    got = err.get("input")
    got_text = "" if isinstance(got, dict) else f" (got {got!r})"
    msg = err["msg"].removeprefix("Value error, ")
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


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
