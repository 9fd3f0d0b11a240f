"""Followed streams (data.follow), the less travelled paths: pt2 snapshots published by time (the clock
injected, nothing sleeps) and scored as `neorec predict` scores them, partitions taken by the time
they were completed, a stop signal while the run waits for a partition, a finished partition
completed again, and a stream that ends idle before --until."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch
from test_follow import SPEC, follow_config, partitions_logged, write_days

from neorec.checkpoint.save import checkpoint_name
from neorec.data.drifting import write_day
from neorec.data.partitions import list_partitions
from neorec.serving.model import load_export
from neorec.serving.predict import score
from neorec.serving.snapshots import latest_snapshot, list_snapshots
from neorec.train.signals import TrainingStopped
from neorec.train.snapshots import PeriodicSnapshots
from neorec.train.trainer import Trainer

HASHED = [  # pt2 serves tables without id maps: ids hashed into 4096 rows
    "data.parquet.hashing=modulo", "data.parquet.table_rows=4096", "data.follow.expire_after_partitions=null",
    "embedding.tables={}",
]  # fmt: skip


def test_pt2_snapshots_by_minutes_score_as_the_trained_model(tmp_path):
    """every_minutes 1 with a clock that moves 15 s a step: a pt2 snapshot after step 4 and step 8
    (the end); the one LATEST names loads as `neorec predict` loads it and gives the trained model's
    probabilities."""
    stream = tmp_path / "s"
    write_days(stream, range(2))
    cfg = follow_config(tmp_path / "run", stream, *HASHED, "snapshot.every_minutes=1", "snapshot.format=pt2")
    trainer = Trainer(cfg)
    ticks = iter(range(0, 10_000, 15))
    trainer.snapshots = PeriodicSnapshots(
        cfg.snapshot, trainer.snapshots.root, trainer.topo, lambda: next(ticks)
    )
    result = trainer.fit()
    assert result.steps == 8
    root = tmp_path / "run" / "snapshots"
    assert [p.name for p in list_snapshots(root)] == ["snapshot-00000004", "snapshot-00000008"]
    exported = load_export(latest_snapshot(root) / "pt2")
    batch = next(trainer.source._open_source(stream / "day-001", 0).train_batches(100, 0))
    served = torch.cat([p for p, _ in score(exported, iter([batch]))])
    trainer.model.eval()
    with torch.no_grad():
        trained = torch.sigmoid(trainer.model(batch).reshape(-1))
    assert served.shape == (100,)
    torch.testing.assert_close(served.reshape(-1), trained, rtol=1e-5, atol=1e-6)


def test_partitions_are_taken_in_the_order_they_were_completed(tmp_path):
    """order mtime: by the marker's modification time, ties by name; order name: by name."""
    for name, completed in (("day-a", 300), ("day-b", 100), ("day-c", 200), ("day-d", 100)):
        (tmp_path / name).mkdir()
        marker = tmp_path / name / "_SUCCESS"
        marker.write_text("")
        os.utime(marker, (completed, completed))
    (tmp_path / "day-e").mkdir()  # no marker: not complete
    by_time = [p.name for p in list_partitions(tmp_path, "parquet", "_SUCCESS", "mtime")]
    assert by_time == ["day-b", "day-d", "day-c", "day-a"]
    assert [p.name for p in list_partitions(tmp_path, "parquet", "_SUCCESS")] == [
        "day-a",
        "day-b",
        "day-c",
        "day-d",
    ]


def test_a_stop_signal_while_waiting_for_a_partition_ends_with_a_checkpoint_and_resumes(tmp_path):
    """SIGTERM while the run waits (no idle timeout) for the partition after day 0: it ends with a
    checkpoint of its last step; started again once day 1 landed, it trains day 1 and ends with the
    model of a run that found both days present."""
    both = tmp_path / "both"
    write_days(both, range(2))
    ref_trainer = Trainer(follow_config(tmp_path / "ref", both, "data.follow.until=day-001"))
    ref = ref_trainer.fit()

    stream = tmp_path / "s"
    write_days(stream, [0])
    out = tmp_path / "run"
    cfg = follow_config(out, stream, "data.follow.until=day-001", "data.follow.idle_timeout=null")
    trainer = Trainer(cfg)

    waiting: list[bool] = []

    def stop_while_waiting() -> None:
        """SIGTERM once day 0 is trained whole (its last step's checkpoint) and the run waits."""
        deadline = time.monotonic() + 60
        checkpoint = out / "checkpoints" / checkpoint_name(4)
        while time.monotonic() < deadline and not waiting:
            waiting.extend([True] if checkpoint.is_dir() and trainer.source._idle_since is not None else [])
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=stop_while_waiting)
    sender.start()
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit()
    sender.join()
    assert waiting, "day 0 was not trained whole before the run waited for day 1"
    assert stopped.value.step == 4 and stopped.value.checkpoint.is_dir()
    write_day(SPEC, stream, 1)
    resumed = Trainer(cfg, resume=True)
    result = resumed.fit()
    assert partitions_logged(result) == ["day-001"] and result.steps == 8
    assert result.partitions[0] == {**ref.partitions[1]}
    want = ref_trainer.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in resumed.model.state_dict().items())


def test_a_finished_partition_completed_again_is_named_not_trained_again(tmp_path, neorec_warnings):
    """day 0 is written again (a later marker) while the run waits after day 1: the run warns once,
    naming it and both completion times, and goes on to day 2 without training day 0 again; the
    completion times travel in the position, so a resumed run tells too."""
    stream = tmp_path / "s"
    write_days(stream, range(2))
    cfg = follow_config(tmp_path / "run", stream, "data.follow.until=day-002", "data.follow.idle_timeout=60")
    trainer = Trainer(cfg)

    def land() -> None:
        deadline, both = time.monotonic() + 60, [("day-000", "done"), ("day-001", "done")]
        while time.monotonic() < deadline and trainer.source._finished != both:
            time.sleep(0.01)
        marker = write_day(SPEC, stream, 0) / "_SUCCESS"
        later = marker.stat().st_mtime + 5
        os.utime(marker, (later, later))
        time.sleep(0.3)  # polled a few times while day 2 is not there: one warning
        write_day(SPEC, stream, 2)

    writer = threading.Thread(target=land)
    writer.start()
    result = trainer.fit()
    writer.join()
    assert partitions_logged(result) == ["day-000", "day-001", "day-002"]
    told = [r.getMessage() for r in neorec_warnings.records if "completed again" in r.getMessage()]
    assert len(told) == 1 and "partition day-000 " in told[0] and "_SUCCESS is from" in told[0], told
    position = trainer.source.state()
    assert set(position["completed"]) == {"day-000", "day-001", "day-002"}

    copy = tmp_path / "copy"  # the same stream moved: its partitions count as done by name, said once
    shutil.copytree(stream, copy)
    moved = Trainer(follow_config(tmp_path / "run2", copy)).source
    neorec_warnings.clear()
    moved.load_state(position)
    moved._choose({"day-000", "day-001", "day-002"})
    told = [r.getMessage() for r in neorec_warnings.records]
    assert len(told) == 1 and f"the position resumed was saved following {stream.resolve()}" in told[0], told

    again = Trainer(cfg).source  # a resumed stream, whose position says day 1 was completed at time 1
    again.load_state({**position, "completed": {**position["completed"], "day-001": 1.0}})
    neorec_warnings.clear()
    again._choose({"day-000", "day-001", "day-002"})
    told = [r.getMessage() for r in neorec_warnings.records if "completed again" in r.getMessage()]
    assert [m.split()[2] for m in told] == ["day-000", "day-001"], told


def test_a_stream_that_goes_idle_before_until_says_so(tmp_path, neorec_warnings):
    """--until names a partition that never comes and the idle timeout ends the run: a warning names
    both and the last partition trained (a daily job must not read this as done)."""
    stream = tmp_path / "s"
    write_days(stream, range(2))
    cfg = follow_config(tmp_path / "run", stream, "data.follow.until=day-003", "data.follow.idle_timeout=0.2")
    assert partitions_logged(Trainer(cfg).fit()) == ["day-000", "day-001"]
    told = [r.getMessage() for r in neorec_warnings.records if "ends before --until" in r.getMessage()]
    assert len(told) == 1 and "--until day-003" in told[0] and "last partition finished is day-001" in told[0]
