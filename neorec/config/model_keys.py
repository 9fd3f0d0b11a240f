"""Which `model.*` keys each model reads, and the refusal of a key set for a model that does not read it.

What counts as set (the file given to `--config` and `--set`, not its bases, and not a record of a run:
a `model` section that lists every key of the model, its `two_tower` and `din` sections in full, as a
run's config.yaml and `neorec config show` write it): neorec/config/unread_keys.py.
"""

from __future__ import annotations

from typing import Any

from neorec.config.schema import ModelConfig
from neorec.config.unread_keys import set_keys, written_keys

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


def written_model_keys(raw: dict[str, Any]) -> list[str]:
    """The model keys a raw config mapping writes ("low_rank", "two_tower.temperature"); none for a
    record of a run."""
    return written_keys(raw.get("model"), ModelConfig, _SECTIONS)


def _kinds(m: ModelConfig) -> set[str]:
    """The names under which model `m` reads keys in USED_BY."""
    if m.arch == "multitask":
        return {"multitask", f"multitask/{m.trunk}"}
    if m.arch == "din" and m.din.cross_layers > 0:
        return {"din", "din/cross"}
    return {m.arch}


def _model_text(m: ModelConfig, key: str) -> str:
    if m.arch == "multitask":
        return f"model.arch multitask with model.trunk {m.trunk}"
    if m.arch == "din" and key == "low_rank":
        return "model.arch din with model.din.cross_layers 0 (no cross layers)"
    return f"model.arch {m.arch}"


def unread_model_keys(m: ModelConfig, written: list[str]) -> list[str]:
    """A problem line for each key of `written` that holds a value other than its default and that
    model `m` does not read, naming the chosen model and the models that read it."""
    kinds = _kinds(m)
    problems = []
    for key in set_keys(m, written):
        users = USED_BY.get(key.split(".")[0])
        if users is None or kinds & set(users):
            continue
        readers = ", ".join(_NAMES.get(u, u) for u in users)
        model = _model_text(m, key)
        problems.append(
            f"key 'model.{key}' is set, but {model} does not use it (used by: {readers}); remove it"
        )
    return problems
