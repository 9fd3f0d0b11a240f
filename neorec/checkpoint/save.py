"""Writing a checkpoint: every rank its shards, rank 0 the dense state and the manifest, last.

    <root>/.step-00001000.tmp/          written by all ranks, invisible to readers
        rank-00000.bin ...              raw pieces of each rank (replicated tables: rank 0)
        dense.pt                        dense model, optimizers, RNG (torch.save, plain tensors)
        manifest.json                   written last: step, plan, tables, pieces, files, checksums, and a
                                        "crc32" of its own (neorec.utils.files.write_json)
    <root>/step-00001000/               the same folder, renamed once everything is on disk

save_checkpoint is collective (every rank calls it); a crash anywhere before the final rename
leaves only a .tmp folder, which the next save removes, and never touches older checkpoints.
A checkpoint is removed (by `keep`, or replaced by one of the same step) by first renaming it to
.step-XXXXXXXX.deleting, so a crash while deleting leaves a hidden leftover that the next save
removes, never a visible folder with some of its files gone.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from neorec.checkpoint.files import CheckpointError, RawWriter, dtype_name, write_atomic
from neorec.checkpoint.pieces import slots, storages, windows
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused.storage import read_storage
from neorec.utils.files import file_crc32, fsync_dir, json_text

FORMAT, VERSION = "neorec-checkpoint", 2  # version 2: the manifest carries its own crc32; 1 is read too
MANIFEST, DENSE = "manifest.json", "dense.pt"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted((p for p in found if (p / MANIFEST).is_file()), key=lambda p: int(p.name[5:]))


def save_checkpoint(
    root: str | Path,
    step: int,
    embeddings: EmbeddingCollection,
    model: nn.Module | None = None,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    state: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Collective: write checkpoint `step` under `root` and return its folder. `state` is JSON data
    saved as is (the trainer's data position); `keep` removes all but the newest `keep`. The
    checkpoints of later steps are removed (save.prune: they belong to a run this one replaces)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointError(f"checkpoint step must be a whole number in [0, 2^63), got {step!r}")
    root = Path(root)
    topo = getattr(embeddings, "topo", None)
    rank, world = (topo.rank, topo.world_size) if topo is not None else (0, 1)
    name = checkpoint_name(step)
    tmp, final = root / f".{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        tmp.mkdir()
    if hasattr(embeddings, "sync_replica_state"):  # replicated tables' state, current on owners only
        embeddings.sync_replica_state()
    _barrier(world)
    mine = _write_shards(tmp, rank, embeddings)
    everything = _all_gather(mine, world)
    if rank == 0:
        files = [entry for entry, _, _ in everything if entry is not None]
        pieces = [p for _, ps, _ in everything for p in ps]
        steps: dict[str, int] = {}
        for _, _, s in everything:
            for table, n in s.items():
                steps[table] = max(steps.get(table, 0), n)
        write_atomic(tmp / DENSE, lambda f: torch.save(_dense_file(model, embeddings, optimizers), f))
        plan = getattr(embeddings, "plan", None)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": world,
            "local_world_size": topo.local_world_size if topo is not None else 1,
            "plan": plan.to_dict() if plan is not None else None,
            "tables": [t.model_dump(mode="json") for t in embeddings.tables],
            "optimizer": embeddings.optimizer_config.model_dump(mode="json"),
            "embedding_steps": steps,
            "state": state or {},
            "dense": {"name": DENSE, "bytes": (tmp / DENSE).stat().st_size, "crc32": file_crc32(tmp / DENSE)},
            "files": files,
            "pieces": pieces,
        }
        write_atomic(tmp / MANIFEST, lambda f: f.write(json_text(manifest).encode()))
        fsync_dir(tmp)
        _publish(tmp, final)
        prune(root, step, keep)
    _barrier(world)  # nobody goes on (or loads) before the checkpoint is visible
    return final


def _write_shards(folder: Path, rank: int, embeddings: EmbeddingCollection):
    """This rank's file: (file entry or None, piece list, {table: engine step})."""
    owned = [s for s in slots(embeddings) if s.owner]
    steps = {s.table: s.engine.num_updates for s in owned}
    if not owned:
        return None, [], steps
    name = f"rank-{rank:05d}.bin"
    pieces: list[dict] = []
    writer: RawWriter | None = None

    def write(f) -> None:
        nonlocal writer
        writer = RawWriter(f)
        for s in owned:
            num_rows = s.rows[1] - s.rows[0]
            for state, (storage, start) in storages(s).items():
                offset = writer.offset
                for a, b in windows(num_rows, storage):
                    writer.append(read_storage(storage, start + a, start + b))
                shape = [num_rows, storage.width] if storage.width else [num_rows]
                pieces.append({"table": s.table, "state": state, "rows": list(s.rows), "cols": list(s.cols),
                               "file": name, "offset": offset, "shape": shape, "dtype": dtype_name(storage.dtype)})  # fmt: skip

    write_atomic(folder / name, write)
    assert writer is not None
    return {"name": name, "rank": rank, "bytes": writer.offset, "crc32": writer.crc}, pieces, steps


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict without the embedding collection (its tables go to the shard files)."""
    out: dict[str, torch.Tensor] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        if isinstance(module, EmbeddingCollection):
            return
        for n, p in module._parameters.items():
            if p is not None:
                out[prefix + n] = p.detach()
        for n, b in module._buffers.items():
            if b is not None and n not in module._non_persistent_buffers_set:
                out[prefix + n] = b.detach()
        for n, child in module._modules.items():
            if child is not None:
                visit(child, prefix + n + ".")

    visit(model, "")
    return out


def rng_state() -> dict:
    """torch (CPU and CUDA), numpy and Python RNG states as plain tensors and numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_py = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },  # fmt: skip
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss_py},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _dense_file(model: nn.Module | None, embeddings: EmbeddingCollection, optimizers) -> dict:
    return {
        "model": dense_state(model) if model is not None else {},
        "optimizers": {k: opt.state_dict() for k, opt in (optimizers or {}).items()},
        "rng": rng_state(),
    }


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; a folder of the same step is set aside first."""
    old = _set_aside(final) if final.exists() else None
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, step: int, keep: int | None) -> list[Path]:
    """After checkpoint `step` was published, or a run resumed at it (keep None): it is the newest.
    Checkpoints of later steps belong to a run this one replaced (it resumed from an earlier
    checkpoint, or started over) and go; of the rest, all but the newest `keep` go. Returns the
    folders removed."""
    found = list_checkpoints(root)
    stale = [p for p in found if int(p.name[5:]) > step]
    current = [p for p in found if int(p.name[5:]) <= step]
    if keep is not None:
        stale += current[:-keep]
    for old in stale:
        shutil.rmtree(_set_aside(old), ignore_errors=True)
    return stale


def remove_leftovers(root: Path) -> None:
    """What interrupted saves and deletions leave: hidden .step-*.tmp/.deleting folders, and
    step-* folders without a manifest (never a complete checkpoint)."""
    for entry in root.iterdir():
        name = entry.name
        hidden = name.startswith(".step-") and name.endswith((".tmp", ".deleting", ".old"))
        unfinished = name.startswith("step-") and name[5:].isdigit() and not (entry / MANIFEST).is_file()
        if entry.is_dir() and (hidden or unfinished):
            shutil.rmtree(entry, ignore_errors=True)


def _set_aside(folder: Path) -> Path:
    """Rename `folder` to its hidden .deleting name (atomic), so that no half-deleted checkpoint is
    ever visible; returns the new path."""
    gone = folder.with_name(f".{folder.name}.deleting")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    fsync_dir(folder.parent)
    return gone


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _all_gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out
