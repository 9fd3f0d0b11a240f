"""A run folder holds one run: `neorec train` refuses a folder with another run's results unless told
to resume it or to overwrite it, and checks this before any work starts, while it holds the folders'
lock (run_folders; neorec/train/run_lock.py), so that no other run can start there meanwhile."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neorec.config.schema import RunConfig
from neorec.errors import ConfigError
from neorec.train.run_lock import LOCK_FILE

log = logging.getLogger(__name__)
RESULTS = ("summary.json", "model.pt")  # written when a run finishes
STARTED = ("plan.json",)  # written when a sharded run starts (a run of one process writes none)
STALE = ("tensorboard",)  # added to by every run that writes it, so an overwritten run's events would stay
# every name a run writes in its folder (outputs of other commands never take one: serving/file_format.py)
RUN_PLACES = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "snapshots", *RESULTS, *STARTED,
              *STALE)  # fmt: skip


def checkpoint_root(cfg: RunConfig, out_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"


def snapshot_root(cfg: RunConfig, out_dir: Path) -> Path:
    return Path(cfg.snapshot.dir) if cfg.snapshot.dir else out_dir / "snapshots"


def run_folders(cfg: RunConfig, out_dir: Path) -> list[Path]:
    """The folders a run writes into and locks: the run folder, and checkpoint.dir and snapshot.dir
    where they lie outside it and hold checkpoints (snapshots) or will (an absent one that the run
    does not write is left alone), and embedding.cache.directory, whose table files a run creates
    afresh (two runs there would write each other's rows)."""
    folders = [out_dir]
    cache = cfg.embedding.cache.directory
    for root, enabled in ((checkpoint_root(cfg, out_dir), cfg.checkpoint.enabled),
                          (snapshot_root(cfg, out_dir), cfg.snapshot.enabled),
                          (Path(cache) if cache else None, True)):  # fmt: skip
        if root is None:
            continue
        inside = any(root.resolve().is_relative_to(f.resolve()) for f in folders)
        if not inside and (root.is_dir() or enabled):
            folders.append(root)
    return folders


@contextmanager
def private_cache_directory(cfg: RunConfig) -> Iterator[RunConfig]:
    """`cfg` for a command that reads a run without training it (eval, export-dcp): the files of its
    ssd tables go into a folder of their own inside embedding.cache.directory, removed afterwards, as
    a run training there (which holds the folder) creates its tables' files afresh under those names."""
    e = cfg.embedding
    if e.cache.directory is None or not e.uses_ssd:  # one process: no plan's tiers
        yield cfg
        return
    try:
        Path(e.cache.directory).mkdir(parents=True, exist_ok=True)
        own = tempfile.mkdtemp(prefix=".neorec-reader-", dir=e.cache.directory)
    except OSError as err:
        raise ConfigError(
            f"embedding.cache.directory {e.cache.directory}: cannot hold the ssd tables' files "
            f"({err.strerror or err}); set it to a folder this user can write"
        ) from None
    try:
        cache = cfg.embedding.cache.model_copy(update={"directory": own})
        yield cfg.model_copy(update={"embedding": cfg.embedding.model_copy(update={"cache": cache})})
    finally:
        shutil.rmtree(own, ignore_errors=True)


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` holds a run: its config.yaml, and its lock file or metrics.jsonl (a project
    folder holding a config.yaml of the user's own is none)."""
    return (folder / "config.yaml").is_file() and any(
        (folder / name).is_file() for name in (LOCK_FILE, "metrics.jsonl")
    )


def check_not_a_run_place(path: str | Path, flag: str) -> None:
    """An output is never written where a run keeps its own files, even ones not there yet, as a later
    resume or run would find it in the way or remove it: a name of the run's (RUN_PLACES) in a run
    folder (is_run_folder) or anything under it (inside its checkpoints, snapshots), a
    run's lock file, and anything inside the other folders a run locks (checkpoint.dir, snapshot.dir
    or embedding.cache.directory elsewhere: they hold its lock file and no config.yaml)."""
    given, path = path, Path(path).absolute()
    if path.name == LOCK_FILE:
        raise ConfigError(f"{flag} {given}: is the lock file of the run in {path.parent}; give another path")
    below = path.name
    for folder in path.parents:
        if is_run_folder(folder):
            if below in RUN_PLACES:
                where = "" if folder == path.parent else "inside "
                raise ConfigError(
                    f"{flag} {given}: is {where}where the run in {folder} keeps its {below}; give another path"
                )
        elif (folder / LOCK_FILE).is_file():
            raise ConfigError(
                f"{flag} {given}: is inside {folder}, a folder a run writes (it holds the run's "
                f"{LOCK_FILE}); give a path outside it"
            )
        below = folder.name


def check_output_dir(out_dir: Path, cfg: RunConfig | None = None) -> None:
    """The run folder, and with `cfg` the other folders the run writes (run_folders), are folders or
    absent: a file there is refused naming its setting. None lies where another run keeps its files
    (check_not_a_run_place: inside its checkpoints, say, which its --overwrite would remove)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--output-dir {out_dir}: is a file; the run folder must be a folder")
    check_not_a_run_place(out_dir, "--output-dir")
    if cfg is None:
        return
    for key, folder in (("checkpoint.dir", cfg.checkpoint.dir), ("snapshot.dir", cfg.snapshot.dir),
                        ("embedding.cache.directory", cfg.embedding.cache.directory)):  # fmt: skip
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(f"{key} {folder}: is a file; give a folder")
        if folder and not Path(folder).absolute().is_relative_to(out_dir.absolute()):
            check_not_a_run_place(folder, key)


def previous_run(out_dir: Path, ckpt_root: Path, snapshots: Path | None = None) -> list[str]:
    """What in `out_dir` (and the checkpoint and snapshot folders) shows that a run was trained there
    already."""
    from neorec.checkpoint.save import list_checkpoints  # (torch: imported once the folder is locked)
    from neorec.serving.snapshots import LATEST, list_snapshots

    found = [name for name in RESULTS if (out_dir / name).exists()]
    if list_checkpoints(ckpt_root):
        found.append(f"checkpoints in {ckpt_root}")
    if snapshots is not None and (list_snapshots(snapshots) or (snapshots / LATEST).exists()):
        found.append(f"snapshots in {snapshots}")
    return found


def check_run_folder(cfg: RunConfig, out_dir: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse to train into a folder that holds another run, unless `resume` or `overwrite`."""
    check_output_dir(out_dir)
    if overwrite and resume:
        raise ConfigError("--overwrite starts afresh and --resume continues: give one of them")
    root = checkpoint_root(cfg, out_dir)
    found = previous_run(out_dir, root, snapshot_root(cfg, out_dir))
    if not found or overwrite:
        return
    resumable = any(name.startswith("checkpoints in") for name in found)
    # a run found in checkpoint.dir or snapshot.dir outside the run folder: another --output-dir is not enough
    folders = (root, snapshot_root(cfg, out_dir))
    outside = [p for p in folders if not p.resolve().is_relative_to(out_dir.resolve())]
    elsewhere = any(x.endswith(f" in {p}") for p in outside for x in found)
    where = "this run's folders hold" if elsewhere else f"{out_dir} holds"
    new = "--output-dir for a new folder"
    if elsewhere:
        new = "new folders (--output-dir, checkpoint.dir, snapshot.dir)"
    if resume and not resumable:
        raise ConfigError(
            f"{where} a run ({', '.join(found)}) but no checkpoint in {root} to resume from: pass "
            f"--overwrite to replace it, or {new}"
        )
    if not resume:
        continue_it = "--resume to continue it from its checkpoints, " if resumable else ""
        raise ConfigError(
            f"{where} a run already ({', '.join(found)}): pass {continue_it}--overwrite to replace it, "
            f"or {new}"
        )


def clear_run_folder(cfg: RunConfig, out_dir: Path) -> None:
    """Remove what a new run in `out_dir` would not rewrite from its start: the results, the
    TensorBoard events and the checkpoints (which `--resume` would otherwise continue from)."""
    for name in RESULTS + STARTED:
        (out_dir / name).unlink(missing_ok=True)
    for name in STALE:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    snapshots = snapshot_root(cfg, out_dir)
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


def clear_unfinished_run(cfg: RunConfig, out_dir: Path) -> None:
    """A run that starts from step 0 in a folder whose run ended before its first checkpoint and its
    results (killed: check_run_folder found no run there): that run's TensorBoard events go, as its
    metrics.jsonl is replaced, so that TensorBoard does not draw the two runs as one."""
    from neorec.checkpoint.save import list_checkpoints  # (torch: imported once the folder is locked)

    if list_checkpoints(checkpoint_root(cfg, out_dir)):  # resumed
        return
    stale = [out_dir / n for n in STALE if (out_dir / n).is_dir() and any((out_dir / n).iterdir())]
    for folder in stale:
        shutil.rmtree(folder)
    if stale:
        names = ", ".join(p.name for p in stale)
        log.info(f"{out_dir}: removed {names} of a run there that ended before its first checkpoint")


def check_resume_before_launch(cfg: RunConfig, out_dir: Path, resume: bool | str, num_processes: int) -> None:
    """What the launcher can tell of the checkpoint a resume continues before any process starts: a
    step past train.max_steps, a data position saved under another number of processes
    (reader_position.check_processes), other data settings. Each process checks the rest before it
    loads or writes anything (reader_position.check_resume)."""
    from neorec.checkpoint.load import checkpoint_folder, latest_checkpoint, read_manifest
    from neorec.data.reader_position import check_data_settings, check_processes

    path = latest_checkpoint(checkpoint_root(cfg, out_dir)) if resume is True else checkpoint_folder(resume)
    if path is not None:
        manifest = read_manifest(path)
        check_steps_left(cfg.train.max_steps, manifest.get("step"), path)
        state = manifest.get("state")
        check_processes(state, num_processes, path)
        check_data_settings(cfg.data, state, path)


def check_steps_left(max_steps: int | None, step: object, path: Path) -> None:
    """A resume of checkpoint `path` (of step `step`) that train.max_steps ends before is refused."""
    if max_steps is not None and isinstance(step, int) and step > max_steps:
        raise ConfigError(
            f"train.max_steps {max_steps} is below step {step} of checkpoint {path}: the resumed run would "
            f"train nothing and leave a model of step {step} under a config of {max_steps} steps; raise "
            "train.max_steps, or resume an earlier checkpoint (--resume PATH)"
        )
