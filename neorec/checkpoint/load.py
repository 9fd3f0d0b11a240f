"""Reading a checkpoint into the current model, under the current plan and world size.

Each process assembles only the table parts it holds (pieces.PieceReader reads the overlapping
row ranges from whichever shard files hold them), so a checkpoint of 2 ranks loads on 4 ranks
with another plan, or into one process. Nothing is unpickled: shard files are raw bytes described
by the manifest, and the dense file is read with torch.load(weights_only=True). Every file is
checked against the manifest's size and crc32 first; a bad one raises CheckpointError naming it.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from neorec.checkpoint.files import CheckpointError, check_file, load_tensors
from neorec.checkpoint.manifest_checks import MANIFEST_KEYS, check_manifest_structure
from neorec.checkpoint.pieces import PieceReader, slots, storages, windows
from neorec.checkpoint.save import DENSE, FORMAT, MANIFEST, VERSION, list_checkpoints
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused.storage import write_storage
from neorec.embedding.tables import lookup_difference
from neorec.errors import state_mismatch
from neorec.utils.files import CHECKSUM_KEY, check_json, load_json
from neorec.utils.json_checks import is_whole, shown

_DAMAGED = "use an earlier checkpoint"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (None when there is none)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a folder of checkpoints (then its newest)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no complete checkpoint here (a step-XXXXXXXX folder with {MANIFEST})")
    return latest


def checkpoint_folder(path: str | Path) -> Path:
    """`path` itself, checked to be one complete checkpoint (`neorec train --resume PATH`)."""
    path = Path(path)
    if not path.is_dir() or not (path / MANIFEST).is_file():
        what = "does not exist" if not path.exists() else f"is not a checkpoint (no {MANIFEST})"
        raise CheckpointError(
            f"--resume {path}: {what}; give a step-XXXXXXXX checkpoint folder, or --resume alone for the "
            "newest complete checkpoint of the run"
        )
    read_manifest(path)  # the format and version are readable
    return path


def read_manifest(folder: str | Path) -> dict:
    """The checked manifest: its own crc32 (version 2; a version 1 manifest has none), format and
    version, then every value's type and range (manifest_checks.py: files named by bare names inside
    `folder`, pieces inside their files and tables), before any file is opened."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: not a complete checkpoint (no {MANIFEST})")
    manifest = load_json(path, "checkpoint file", _DAMAGED, CheckpointError)
    checked = CHECKSUM_KEY in manifest
    if checked:
        check_json(manifest, path, "checkpoint file", _DAMAGED, CheckpointError)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not a neorec checkpoint manifest")
    version = manifest.get("version")
    if not is_whole(version) or version not in (1, VERSION):
        raise CheckpointError(
            f"checkpoint file {path}: version is {shown(version)}, this neorec reads format versions 1 and {VERSION}"
        )
    if not checked:
        check_json(manifest, path, "checkpoint file", _DAMAGED, CheckpointError, required=version != 1, keys=MANIFEST_KEYS)
    check_manifest_structure(manifest, f"checkpoint file {path}", _DAMAGED)
    return manifest


def check_tables(manifest: dict, embeddings: EmbeddingCollection, where: Path) -> None:
    saved = {t["name"]: t for t in manifest["tables"]}
    current = {t.name: t for t in embeddings.tables}
    if set(saved) != set(current):
        raise CheckpointError(
            f"checkpoint {where}: its manifest.json lists tables {sorted(saved)} but the model has {sorted(current)}; "
            "load it into the model it was trained for"
        )
    for name, t in current.items():
        s = saved[name]
        if (s["rows"], s["dim"]) != (t.rows, t.dim):
            raise CheckpointError(
                f"checkpoint {where}: table {name!r} is {s['rows']} x {s['dim']} in its manifest.json but {t.rows} x "
                f"{t.dim} in the model"
            )
        mc = t.managed_collision.model_dump(mode="json") if t.managed_collision is not None else None
        if s.get("managed_collision") != mc:
            raise CheckpointError(
                f"checkpoint {where}: table {name!r} has managed_collision {s.get('managed_collision')} in its "
                f"manifest.json but {mc} in the model; its rows and id map only fit the same setting"
            )
        rule, now = _saved_rule(manifest, s), (t.optimizer or embeddings.optimizer_config).name
        if rule is not None and rule != now and now != "sgd":  # sgd keeps no state: the saved state is left
            raise CheckpointError(
                f"checkpoint {where}: table {name!r} was trained with another embedding optimizer, {rule} "
                f"(its manifest.json), than the model's {now}, whose state it would load as its own (Adam's "
                "signed first moment as Adagrad's sum of squares); continue with the one it was trained with "
                "(a table's optimizer section merges over embedding.optimizer: `neorec config show` gives "
                "each table's)"
            )
    trained = {n: (s.get("features"), s.get("pooling", "sum")) for n, s in saved.items()}
    differs = lookup_difference(trained, embeddings.tables)
    if differs:
        raise CheckpointError(
            f"checkpoint {where}: "
            + differs.format(trained="its manifest.json", now="the model")
            + "; its rows only score as trained under the same lookup"
        )


def _saved_rule(manifest: dict, table: dict) -> str | None:
    """The update rule a checkpoint's table was trained with: its own optimizer, else the
    collection's (None: not recorded)."""
    own, shared = table.get("optimizer"), manifest.get("optimizer")
    section = own if isinstance(own, dict) else shared if isinstance(shared, dict) else {}
    return section.get("name")


def load_checkpoint(
    folder: str | Path,
    embeddings: EmbeddingCollection,
    model: nn.Module | None = None,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict:
    """Load tables (weights and optimizer state), the dense model, the optimizers and the RNG
    states into the current objects; returns the manifest (its "state" holds the trainer's data
    position). Not collective: every process reads what it holds. `verify` checks checksums."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_tables(manifest, embeddings, folder)
    reader = PieceReader(folder, manifest, verify)
    steps = manifest["embedding_steps"]
    engine_steps: dict[int, int] = {}
    try:
        for slot in slots(embeddings):
            num_rows = slot.rows[1] - slot.rows[0]
            for state, (storage, start) in storages(slot).items():
                for a, b in windows(num_rows, storage):
                    rows = (slot.rows[0] + a, slot.rows[0] + b)
                    values = reader.read(slot.table, state, rows, slot.cols, per_row=storage.width == 0)
                    write_storage(storage, start + a, start + b, values)
                    del values  # before the next window is read: one window in memory, not two
            n = int(steps.get(slot.table, 0))
            engine_steps[id(slot.engine)] = max(engine_steps.get(id(slot.engine), 0), n)
            slot.engine.num_updates = engine_steps[id(slot.engine)]
    finally:
        reader.close()
    dense = manifest["dense"]
    check_file(folder / dense["name"], dense["bytes"], dense["crc32"] if verify else None)
    saved = load_tensors(folder / dense["name"])
    if model is not None:
        load_dense(model, saved["model"], folder / DENSE)
    for key, opt in (optimizers or {}).items():
        if key not in saved["optimizers"]:
            raise CheckpointError(
                f"checkpoint file {folder / DENSE} has no optimizer {key!r}; it has {sorted(saved['optimizers'])}"
            )
        load_optimizer(opt, saved["optimizers"][key], f"checkpoint file {folder / DENSE}: optimizer {key!r}")
    if restore_rng:
        set_rng_state(saved["rng"])
    return manifest


_SAME_MODEL = "continue with the model and optimizer settings the checkpoint was trained with"


def load_optimizer(opt: torch.optim.Optimizer, saved: dict, where: str) -> None:
    """The checkpoint's optimizer state (Adam's moments and step, Adagrad's sums, momentum buffers)
    into `opt`, whose own settings (learning rate, weight decay, eps, momentum, betas) stay: torch's
    load_state_dict would put the saved ones back, ignoring those of the run that resumes. A state
    saved by another kind of optimizer (other settings' names) is refused."""
    mine = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    try:
        opt.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{where} does not fit: {state_mismatch(e)}; {_SAME_MODEL}") from None
    for group, settings in zip(opt.param_groups, mine, strict=True):
        theirs = sorted(group.keys() - {"params"})
        if theirs != sorted(settings):
            raise CheckpointError(
                f"{where} was saved by another kind of optimizer (settings {theirs}, this one's "
                f"{sorted(settings)}); {_SAME_MODEL}"
            )
        group.update(settings)


def load_dense(model: nn.Module, state: dict, where: Path) -> None:
    """The dense part of the model; the embedding collection's keys are the shard files' business."""
    prefixes = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, EmbeddingCollection) and n)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint file {where}: the dense model does not fit: {state_mismatch(e)}; {_SAME_MODEL}"
        ) from None
    missing = [k for k in result.missing_keys if not k.startswith(prefixes)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint file {where}: the dense model does not fit; missing {missing}, unexpected "
            f"{result.unexpected_keys}; {_SAME_MODEL}"
        )


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    p = rng["python"]
    random.setstate((p["version"], tuple(int(w) for w in p["words"].tolist()), p["gauss"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
