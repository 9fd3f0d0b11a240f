"""Which `model.*` keys each model reads, and the refusal of a key set for a model that does not read it.

A key counts as set when `--set` or the config file given to `--config` writes it (its bases and the
shipped configs do not count: a config that switches `model.arch` away from its base's model keeps
working), with a value other than its default. A file whose `model` section lists every key, as a
run's config.yaml and `neorec config show` write it, is a record of a run: its keys do not count.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from neorec.config.schema import ModelConfig
from neorec.errors import ConfigError

POOLED_INPUT = ("dlrm", "dcnv2", "deepfm", "multitask", "din")  # models with a bottom and a top MLP
# the models that read each key: a model.arch, or "multitask/<trunk>", or "din/cross" (din with
# model.din.cross_layers > 0, whose cross layers are DCNv2's); model.arch itself is read by all
USED_BY: dict[str, tuple[str, ...]] = {
    "bottom_mlp": POOLED_INPUT,
    "top_mlp": POOLED_INPUT,
    "self_interaction": ("dlrm", "multitask/dlrm"),
    "cross_layers": ("dcnv2", "multitask/dcnv2"),
    "low_rank": ("dcnv2", "multitask/dcnv2", "din/cross"),
    "precision": POOLED_INPUT,
    "trunk": ("multitask",),
    "tasks": ("multitask",),
    "two_tower": ("two_tower",),
    "din": ("din",),
}
_NAMES = {
    "multitask/dlrm": "multitask with model.trunk dlrm",
    "multitask/dcnv2": "multitask with model.trunk dcnv2",
    "din/cross": "din with model.din.cross_layers > 0",
}
_SECTIONS = ("two_tower", "din")  # model keys that are sections: their keys count one by one
# keys that every run's config.yaml has held in its model section (newer keys may be missing in older runs)
RECORD_KEYS = ("arch", "bottom_mlp", "top_mlp", "self_interaction", "cross_layers", "low_rank")


def written_model_keys(raw: dict[str, Any]) -> list[str]:
    """The model keys a raw config mapping writes ("low_rank", "two_tower.temperature"); none for a
    record of a run (a model section with every key of RECORD_KEYS)."""
    model = raw.get("model")
    if not isinstance(model, dict) or all(k in model for k in RECORD_KEYS):
        return []
    out = []
    for key, value in model.items():
        if key in _SECTIONS and isinstance(value, dict):
            out.extend(f"{key}.{sub}" for sub in value)
        else:
            out.append(str(key))
    return out


def _kinds(m: ModelConfig) -> set[str]:
    """The names under which model `m` reads keys in USED_BY."""
    if m.arch == "multitask":
        return {"multitask", f"multitask/{m.trunk}"}
    if m.arch == "din" and m.din.cross_layers > 0:
        return {"din", "din/cross"}
    return {m.arch}


def _is_default(m: ModelConfig, key: str) -> bool:
    """Whether `key` of `m` ("low_rank", "din.max_len") holds its schema default."""
    section: BaseModel = m
    *outer, name = key.split(".")
    for part in outer:
        section = getattr(section, part)
    field = type(section).model_fields.get(name)
    return field is None or getattr(section, name) == field.get_default(call_default_factory=True)


def _model_text(m: ModelConfig, key: str) -> str:
    if m.arch == "multitask":
        return f"model.arch multitask with model.trunk {m.trunk}"
    if m.arch == "din" and key == "low_rank":
        return "model.arch din with model.din.cross_layers 0 (no cross layers)"
    return f"model.arch {m.arch}"


def check_model_keys(m: ModelConfig, written: list[str], where: str) -> None:
    """ConfigError naming each key of `written` that holds a value other than its default and that
    model `m` does not read, with the chosen model and the models that read it."""
    kinds = _kinds(m)
    problems = []
    for key in dict.fromkeys(written):
        users = USED_BY.get(key.split(".")[0])
        if users is None or kinds & set(users) or _is_default(m, key):
            continue
        readers = ", ".join(_NAMES.get(u, u) for u in users)
        model = _model_text(m, key)
        problems.append(
            f"key 'model.{key}' is set, but {model} does not use it (used by: {readers}); remove it"
        )
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
