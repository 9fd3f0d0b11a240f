"""A run folder holds one run: `neorec train` refuses a folder with another run's results unless told
to resume it or to overwrite it, and checks this before any work starts, while it holds the folders'
lock (run_folders; neorec/train/run_lock.py), so that no other run can start there meanwhile."""

from __future__ import annotations

import shutil
from pathlib import Path

from neorec.config.schema import RunConfig
from neorec.errors import ConfigError

RESULTS = ("summary.json", "model.pt")  # written when a run finishes
STARTED = ("plan.json",)  # written when a sharded run starts (a run of one process writes none)
STALE = ("tensorboard",)  # added to by every run that writes it, so an overwritten run's events would stay


def checkpoint_root(cfg: RunConfig, out_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"


def run_folders(cfg: RunConfig, out_dir: Path) -> list[Path]:
    """The folders a run writes into and locks: the run folder, and checkpoint.dir where that lies
    outside it and holds checkpoints or will (an absent one with checkpoints off is left alone)."""
    root = checkpoint_root(cfg, out_dir)
    inside = root.resolve().is_relative_to(out_dir.resolve())
    return [out_dir] if inside or not (root.is_dir() or cfg.checkpoint.enabled) else [out_dir, root]


def check_output_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--output-dir {out_dir}: is a file; the run folder must be a folder")


def previous_run(out_dir: Path, ckpt_root: Path) -> list[str]:
    """What in `out_dir` (and the checkpoint folder) shows that a run was trained there already."""
    from neorec.checkpoint.save import list_checkpoints  # (torch: imported once the folder is locked)

    found = [name for name in RESULTS if (out_dir / name).exists()]
    if list_checkpoints(ckpt_root):
        found.append(f"checkpoints in {ckpt_root}")
    return found


def check_run_folder(cfg: RunConfig, out_dir: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse to train into a folder that holds another run, unless `resume` or `overwrite`."""
    check_output_dir(out_dir)
    if overwrite and resume:
        raise ConfigError("--overwrite starts afresh and --resume continues: give one of them")
    root = checkpoint_root(cfg, out_dir)
    found = previous_run(out_dir, root)
    if not found or overwrite:
        return
    resumable = any(name.startswith("checkpoints in") for name in found)
    if resume and not resumable:
        raise ConfigError(
            f"{out_dir} holds a run ({', '.join(found)}) but no checkpoint in {root} to resume from: pass "
            "--overwrite to replace it, or --output-dir for a new folder"
        )
    if not resume:
        continue_it = "--resume to continue it from its checkpoints, " if resumable else ""
        raise ConfigError(
            f"{out_dir} holds a run already ({', '.join(found)}): pass {continue_it}--overwrite to replace it, "
            "or --output-dir for a new folder"
        )


def clear_run_folder(cfg: RunConfig, out_dir: Path) -> None:
    """Remove what a new run in `out_dir` would not rewrite from its start: the results, the
    TensorBoard events and the checkpoints (which `--resume` would otherwise continue from)."""
    for name in RESULTS + STARTED:
        (out_dir / name).unlink(missing_ok=True)
    for name in STALE:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    snapshots = Path(cfg.snapshot.dir) if cfg.snapshot.dir else out_dir / "snapshots"
    if snapshots.is_dir():  # only snapshots and their pointer: snapshot.dir may be a folder with other files
        for path in snapshots.iterdir():
            if path.is_dir() and path.name.removeprefix(".tmp-").startswith("snapshot-"):
                shutil.rmtree(path)
        (snapshots / "LATEST").unlink(missing_ok=True)
    root = checkpoint_root(cfg, out_dir)
    if root.is_dir():
        for path in root.iterdir():  # only checkpoints: checkpoint.dir may be a folder with other files
            if path.is_dir() and path.name.removeprefix("diverged-").startswith("step-"):
                shutil.rmtree(path)


def check_resume_before_launch(cfg: RunConfig, out_dir: Path, resume: bool | str, num_processes: int) -> None:
    """What the launcher can tell of the checkpoint a resume continues before any process starts: a
    data position saved under another number of processes (reader_position.check_processes). Each
    process checks the rest before it loads or writes anything (reader_position.check_resume)."""
    from neorec.checkpoint.load import checkpoint_folder, latest_checkpoint, read_manifest
    from neorec.data.reader_position import check_data_settings, check_processes

    path = latest_checkpoint(checkpoint_root(cfg, out_dir)) if resume is True else checkpoint_folder(resume)
    if path is not None:
        state = read_manifest(path).get("state")
        check_processes(state, num_processes, path)
        check_data_settings(cfg.data, state, path)
