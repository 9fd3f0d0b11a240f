"""Snapshots for serving (neorec/serving/snapshots.py): LATEST only ever names a complete, verified
export, a reader racing the publisher never opens a partial one, a publisher killed at any moment
leaves LATEST readable, old snapshots are pruned by count, and a run resumed from an older
checkpoint withdraws the snapshots of the steps it trains again."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from forked import run_neorec, run_python

from neorec.serving.file_format import ExportError, read_export, write_export
from neorec.serving.snapshots import (
    SnapshotError,
    check_snapshot,
    latest_snapshot,
    list_snapshots,
    publish,
    withdraw_after,
)


def write_model(step: int):
    """write(folder) of a small export whose tensors say which step wrote them."""

    def write(folder: Path) -> dict:
        tensors = {"w": torch.full((64, 256), float(step)), "b": torch.arange(step + 1, dtype=torch.int64)}
        write_export(folder / "model.nrx", {"step": step}, tensors)
        return {"format": "nrx"}

    return write


def verify(folder: Path) -> None:
    read_export(folder / "model.nrx")


def test_publish_names_a_verified_folder_and_prunes_by_count(tmp_path):
    with pytest.raises(SnapshotError, match="no snapshot is published yet"):
        latest_snapshot(tmp_path)
    for step in (10, 20, 30, 40):
        publish(tmp_path, step, write_model(step), verify, keep=2)
    assert [p.name for p in list_snapshots(tmp_path)] == ["snapshot-00000030", "snapshot-00000040"]
    latest = latest_snapshot(tmp_path)
    assert latest.name == "snapshot-00000040" and check_snapshot(latest)["step"] == 40
    header, tensors = read_export(latest / "model.nrx")
    assert header["step"] == 40 and float(tensors["w"][0, 0]) == 40.0
    # damage is named; an export that fails its check is never published
    (latest / "model.nrx").write_bytes((latest / "model.nrx").read_bytes()[:-10])
    with pytest.raises(SnapshotError, match="model.nrx: size or crc32 differs"):
        latest_snapshot(tmp_path)

    def broken(folder: Path) -> dict:
        (folder / "model.nrx").write_bytes(b"neorec-export\n" + bytes(20))
        return {}

    with pytest.raises(Exception, match=r"snapshot-00000050/model.nrx: the header is not valid JSON"):
        publish(tmp_path, 50, broken, verify, keep=2)
    assert not list(tmp_path.glob(".tmp-*"))
    assert (tmp_path / "LATEST").read_text().count("snapshot-00000040") == 1
    assert not (tmp_path / "snapshot-00000050").exists()


def test_pruning_never_removes_the_snapshot_latest_names(tmp_path):
    """A step published again, or one below snapshots another run left in the folder (newer by name:
    the count keeps them), stays with LATEST naming it."""
    for step in (2, 4, 6):
        publish(tmp_path, step, write_model(step), verify, keep=5)
    publish(tmp_path, 2, write_model(2), verify, keep=2)  # published before and intact: LATEST names it again
    assert latest_snapshot(tmp_path).name == "snapshot-00000002"
    assert [p.name for p in list_snapshots(tmp_path)] == [f"snapshot-0000000{s}" for s in (2, 4, 6)]
    other = tmp_path / "other"
    for step in (30, 40):
        publish(other, step, write_model(step), verify, keep=2)
    publish(other, 10, write_model(10), verify, keep=2)
    assert latest_snapshot(other).name == "snapshot-00000010"
    assert [p.name for p in list_snapshots(other)] == [f"snapshot-000000{s}" for s in (10, 30, 40)]


def test_a_reader_racing_the_publisher_never_opens_a_partial_export(tmp_path):
    """One thread publishes 40 snapshots (keep 3) while another reads LATEST and the whole export it
    names, over and over: every read finds a complete, verified file of one step."""
    publish(tmp_path, 0, write_model(0), verify, keep=3)
    done = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def reader() -> None:
        while not done.is_set():
            try:
                folder = latest_snapshot(tmp_path)
                try:
                    header, tensors = read_export(folder / "model.nrx")
                except ExportError:  # "cannot be opened": the folder is gone, or a real failure
                    if folder.exists():
                        raise
                    continue  # pruned (keep newer ones published) before it was opened: read LATEST again
                step = header["step"]
                assert bool((tensors["w"] == float(step)).all()) and tensors["b"].numel() == step + 1
                seen.append(step)
            except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                errors.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=reader)
    thread.start()
    for step in range(1, 41):
        publish(tmp_path, step, write_model(step), verify, keep=3)
    done.set()
    thread.join()
    assert not errors, errors[:3]
    assert len(set(seen)) > 3 and seen == sorted(seen)


PUBLISH_FOREVER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_snapshots import write_model, verify
from neorec.serving.snapshots import publish
step = 1
while True:
    publish({root!r}, step, write_model(step), verify, keep=2)
    step += 1
"""


@pytest.mark.parametrize("seconds", [0.35, 0.8])
def test_a_publisher_killed_at_any_moment_leaves_latest_complete(tmp_path, seconds):
    """A process publishing in a loop is killed (SIGKILL by its timeout) mid-way: LATEST names a
    complete snapshot, and the next publish clears what the killed one left."""
    code = PUBLISH_FOREVER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    with pytest.raises(Exception, match="timed out"):
        run_python(["-c", code], timeout=seconds)
    try:
        folder = latest_snapshot(tmp_path)
    except SnapshotError as e:  # killed before its first publish ended: nothing named yet
        assert "no snapshot is published yet" in str(e)
        return
    header, _ = read_export(folder / "model.nrx")
    step = header["step"]
    publish(tmp_path, step + 100, write_model(step + 100), verify, keep=2)
    assert not list(tmp_path.glob(".tmp-*"))
    assert latest_snapshot(tmp_path).name == f"snapshot-{step + 100:08d}"


def test_withdrawing_later_steps_moves_latest_back_before_removing_them(tmp_path):
    for step in (2, 4, 6):
        publish(tmp_path, step, write_model(step), verify, keep=5)
    assert withdraw_after(tmp_path, 6) == []  # nothing after the newest
    gone = withdraw_after(tmp_path, 3)
    assert [p.name for p in gone] == ["snapshot-00000004", "snapshot-00000006"]
    assert [p.name for p in list_snapshots(tmp_path)] == ["snapshot-00000002"]
    assert latest_snapshot(tmp_path).name == "snapshot-00000002"
    # a publish of a withdrawn step writes its own export
    publish(tmp_path, 4, write_model(40), verify, keep=5)
    assert read_export(latest_snapshot(tmp_path) / "model.nrx")[0]["step"] == 40
    # the newest snapshot before the resumed step is damaged: LATEST goes to the one before it
    publish(tmp_path, 6, write_model(6), verify, keep=5)
    (tmp_path / "snapshot-00000004" / "model.nrx").write_bytes(b"damaged")
    withdraw_after(tmp_path, 5)
    assert latest_snapshot(tmp_path).name == "snapshot-00000002"
    # none before it: LATEST is removed, so nothing of the replaced run is served
    withdraw_after(tmp_path, 1)
    assert list_snapshots(tmp_path) == [] and not (tmp_path / "LATEST").exists()


def test_a_run_resumed_from_an_older_checkpoint_publishes_its_own_snapshots(tmp_path):
    """--resume PATH of an older checkpoint with another learning rate: the snapshots the first run
    published after that checkpoint are withdrawn, and LATEST names the resumed run's own export of
    each step (the first run's was kept and named before)."""
    run = ["train", "--output-dir", str(tmp_path), "--set", "data.synthetic.train_samples=16384",
           "--set", "data.synthetic.eval_samples=1024", "--set", "train.progress=false",
           "--set", "logging.plot=false", "--set", "logging.tensorboard=false",
           "--set", "checkpoint.every_steps=2", "--set", "snapshot.every_steps=2",
           "--set", "snapshot.keep=5"]  # fmt: skip
    first = run_neorec([*run, "--set", "train.max_steps=6"])
    assert first.returncode == 0, first.stderr
    snapshots = tmp_path / "snapshots"
    before = check_snapshot(snapshots / "snapshot-00000004")["files"]["model.nrx"]["crc32"]
    resumed = run_neorec([*run, "--set", "train.max_steps=4", "--set", "embedding.optimizer.lr=0.5",
                          "--resume", str(tmp_path / "checkpoints" / "step-00000002")])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    latest = latest_snapshot(snapshots)
    assert latest.name == "snapshot-00000004"
    assert check_snapshot(latest)["files"]["model.nrx"]["crc32"] != before
    assert [p.name for p in list_snapshots(snapshots)] == ["snapshot-00000002", "snapshot-00000004"]
    assert "removed snapshot-00000004, snapshot-00000006, of steps after step 2" in resumed.stderr


SMALL_RUN = ["--set", "data.synthetic.train_samples=16384", "--set", "data.synthetic.eval_samples=1024",
             "--set", "train.progress=false", "--set", "logging.plot=false",
             "--set", "logging.tensorboard=false", "--set", "checkpoint.every_steps=2"]  # fmt: skip


def test_a_resumed_run_stopped_before_its_first_save_leaves_no_newer_checkpoint(tmp_path, neorec_warnings):
    """--resume PATH of an older checkpoint: the newer ones are of the run it replaces and go once it is
    loaded, so a run that ends (or stops) before its first save leaves none for a plain --resume to
    continue, nor for eval and export to read."""
    from neorec.cli import main

    run = ["train", "--output-dir", str(tmp_path), *SMALL_RUN]
    assert main([*run, "--set", "train.max_steps=6"]) == 0
    older = tmp_path / "checkpoints" / "step-00000002"
    assert main([*run, "--set", "train.max_steps=2", "--resume", str(older)]) == 0  # nothing left to train
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]
    assert "removed step-00000004, step-00000006, of steps after step 2" in neorec_warnings.text


def test_a_snapshot_due_by_the_clock_and_cut_short_is_published_when_the_run_resumes(tmp_path):
    """snapshot.every_minutes: the checkpoint says that its step's snapshot was due. Killed after the
    checkpoint and before LATEST named the snapshot (here: the snapshot of the last step withdrawn, as
    a kill leaves it), the resumed run publishes it before it trains on."""
    from neorec.checkpoint.load import read_manifest
    from neorec.cli import main

    run = ["train", "--output-dir", str(tmp_path), *SMALL_RUN, "--set", "checkpoint.every_steps=null",
           "--set", "checkpoint.every_minutes=60", "--set", "snapshot.every_minutes=60",
           "--set", "snapshot.keep=5"]
    assert main([*run, "--set", "train.max_steps=4"]) == 0  # the end of training is published
    snapshots, step4 = tmp_path / "snapshots", tmp_path / "checkpoints" / "step-00000004"
    assert read_manifest(step4)["state"]["snapshot_due"] is True
    withdraw_after(snapshots, 3)  # as a kill between the checkpoint and the publish leaves the folder
    assert list_snapshots(snapshots) == []
    assert main([*run, "--set", "train.max_steps=6", "--resume"]) == 0
    assert [p.name for p in list_snapshots(snapshots)] == ["snapshot-00000004", "snapshot-00000006"]


def test_missing_says_a_resumed_step_needs_its_snapshot_until_latest_names_it(tmp_path):
    from neorec.config.continuous import SnapshotConfig
    from neorec.distributed.topology import Topology
    from neorec.train.snapshots import PeriodicSnapshots

    by_clock = PeriodicSnapshots(SnapshotConfig(every_minutes=5), tmp_path, Topology())
    by_steps = PeriodicSnapshots(SnapshotConfig(every_steps=4), tmp_path, Topology())
    assert by_clock.missing(8, True) and not by_clock.missing(8, None) and not by_clock.missing(0, True)
    assert by_steps.missing(8, None) and not by_steps.missing(6, None)
    publish(tmp_path, 4, write_model(4), verify, keep=5)
    publish(tmp_path, 8, write_model(8), verify, keep=5)
    assert not by_clock.missing(8, True)
    latest = '{"snapshot": "snapshot-00000004", "step": 4}'
    (tmp_path / "LATEST").write_text(latest)  # killed before LATEST moved
    assert by_clock.missing(8, True) and by_steps.missing(8, None)
