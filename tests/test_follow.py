"""Following a folder of partitions (data.follow, neorec/data/follow.py): partitions landing while
training runs (one and two processes), progressive metrics per partition, held-out batches, id-map
expiry, bad partitions named, and the same stream whether it landed during training or was there."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn

from neorec.config.load import load_config
from neorec.data.drifting import DriftSpec, partition_name, write_day
from neorec.errors import ConfigError, DataError
from neorec.train.streaming import map_clock, mapped_tables
from neorec.train.trainer import Trainer

SPEC = DriftSpec(rows=400, vocab=300, shift=100, row_group=256)


def follow_config(tmp: Path, stream: Path, *sets: str):
    return load_config(
        "continuous",
        [
            f"data.follow.dir={stream}", "data.follow.poll_seconds=0.05", "data.batch_size=100",
            "train.progress=false", "train.log_every=4", "logging.tensorboard=false", "logging.plot=false",
            "checkpoint.every_steps=4", "snapshot.every_steps=null", f"output_dir={tmp}", *sets,
        ],
    )  # fmt: skip


def write_days(stream: Path, days, spec: DriftSpec = SPEC) -> None:
    for d in days:
        write_day(spec, stream, d)


def partitions_logged(result) -> list[str]:
    return [p["partition"] for p in result.partitions]


def test_partitions_landing_during_training_train_as_those_present_from_the_start(tmp_path):
    """A test thread writes day 1 and 2 while the job trains day 0 and waits: the job trains them as
    they land, in order, and ends at --until; its losses equal those of a job that found all three
    partitions present from the start (the stream decides, not the timing)."""
    early = tmp_path / "early"
    write_days(early, range(3))
    ref = Trainer(follow_config(tmp_path / "ref", early, "data.follow.until=day-002")).fit()

    live = tmp_path / "live"
    write_days(live, [0])

    def land() -> None:
        for d in (1, 2):
            time.sleep(0.3)
            write_day(SPEC, live, d)

    writer = threading.Thread(target=land)
    writer.start()
    cfg = follow_config(tmp_path / "run", live, "data.follow.until=day-002", "data.follow.idle_timeout=60")
    result = Trainer(cfg).fit()
    writer.join()
    assert partitions_logged(result) == partitions_logged(ref) == ["day-000", "day-001", "day-002"]
    assert result.losses == ref.losses and result.steps == 12
    for got, want in zip(result.partitions, ref.partitions, strict=True):
        assert got["num_samples"] == 400 and got["auc"] == want["auc"]
        assert 0.3 < got["auc"] < 0.9 and got["ne"] > 0 and got["calibration"] > 0


def test_progressive_metrics_are_the_scores_before_each_update(tmp_path):
    """A partition's progressive AUC and log loss are those of the training forward's scores, each
    batch scored by the weights before its own update: replayed batch by batch, the same numbers."""
    from neorec.metrics.evaluation import binary_metrics

    stream = tmp_path / "s"
    write_days(stream, [0])
    trainer = Trainer(follow_config(tmp_path / "run", stream))
    scores, labels = [], []
    step = trainer.train_step

    def recording(batch, is_local=False):
        loss = step(batch, is_local)
        scores.append(trainer.last_outputs)
        labels.append(batch.labels)
        return loss

    trainer.train_step = recording
    result = trainer.fit()
    exact = binary_metrics(torch.cat(scores), torch.cat(labels))
    got = result.partitions[0]
    assert got["num_samples"] == exact["num_samples"] == 400
    assert abs(got["auc"] - exact["auc"]) < 2e-3
    assert got["log_loss"] == pytest.approx(exact["log_loss"], rel=1e-5)
    assert got["calibration"] == pytest.approx(exact["calibration"], rel=1e-5)


def test_held_out_batches_are_scored_not_trained(tmp_path):
    """held_out_batches 2: the first two batches of each partition are scored apart and never trained
    on (2 of 4 batches train per partition)."""
    stream = tmp_path / "s"
    write_days(stream, range(2))
    result = Trainer(follow_config(tmp_path / "run", stream, "data.follow.held_out_batches=2")).fit()
    assert result.steps == 4
    for p in result.partitions:
        assert p["num_samples"] == 200 and p["held_out_num_samples"] == 200
        assert 0 < p["held_out_auc"] < 1


def test_ids_not_seen_for_n_partitions_or_steps_are_expired_and_counted(tmp_path):
    """expire_after_partitions 1 frees, at each partition's start, the ids the previous partition did not
    use (the vocabulary moves by a third a day); the count is in the partition's record; without it,
    nothing expires while the maps have room."""
    stream = tmp_path / "s"
    write_days(stream, range(3))
    on = Trainer(follow_config(tmp_path / "on", stream, "data.follow.expire_after_partitions=1")).fit()
    off = Trainer(follow_config(tmp_path / "off", stream, "data.follow.expire_after_partitions=null")).fit()
    expired = [p["id_map_expired"] for p in on.partitions]
    assert expired[0] == 0 and expired[1] == 0 and expired[2] > 0
    assert all(p["id_map_expired"] == 0 for p in off.partitions)
    assert on.losses[:8] == off.losses[:8] and on.losses[8:] != off.losses[8:]
    # by steps: ids not in the last 2 batches leave before each step (from the second on), within
    # partitions too; every row given out is evicted, expired or still held, as the records count
    trainer = Trainer(follow_config(tmp_path / "steps", stream, "data.follow.expire_after_partitions=null",
                                    "data.follow.expire_after_steps=2"))  # fmt: skip
    steps = trainer.fit()
    assert all(p["id_map_expired"] > 0 for p in steps.partitions) and steps.losses[1:] != off.losses[1:]
    assert steps.losses[0] == off.losses[0]
    tables, engine = mapped_tables(trainer.embeddings)
    held = sum(t.id_map.occupied for t in tables)
    given = sum(p["id_map_inserts"] - p["id_map_evictions"] - p["id_map_expired"] for p in steps.partitions)
    assert held == given
    last_seen = torch.cat([t.id_map.last_seen.tensor[t.id_map.keys.tensor >= 0] for t in tables])
    assert int(last_seen.min()) >= map_clock(engine) - 1 - 2  # the last sweep kept the last 2 batches' ids
    with pytest.raises(ConfigError, match="expire_after_steps frees rows of managed-collision tables"):
        follow_config(tmp_path, stream, "data.follow.expire_after_partitions=null", "data.follow.expire_after_steps=2",
                      "data.parquet.hashing=modulo", "data.parquet.table_rows=4096", "embedding.tables={}")  # fmt: skip


def write_bad(stream: Path, name: str, how: str) -> None:
    folder = stream / name
    folder.mkdir(parents=True)
    good = stream / partition_name(0) / "part-0.parquet"
    if how == "truncated":
        (folder / "part-0.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    else:  # another schema: a feature's column is missing
        import pyarrow.parquet as pq

        pq.write_table(pq.read_table(good).drop(["c2"]), folder / "part-0.parquet")
    (folder / "_SUCCESS").write_text("")


@pytest.mark.parametrize("how", ["truncated", "schema"])
def test_a_bad_partition_is_named_and_stops_or_is_skipped(tmp_path, how):
    stream = tmp_path / "s"
    write_days(stream, [0, 2])
    write_bad(stream, "day-001", how)
    with pytest.raises(DataError, match=r"partition day-001 .* is bad") as e:
        Trainer(follow_config(tmp_path / "stop", stream)).fit()
    assert ("not a readable Parquet file" if how == "truncated" else "no column 'c2'") in str(e.value)
    result = Trainer(follow_config(tmp_path / "skip", stream, "data.follow.bad_partitions=skip")).fit()
    assert partitions_logged(result) == ["day-000", "day-002"] and result.steps == 8


def test_a_partition_without_its_marker_is_not_read(tmp_path):
    """A half-written partition (no _SUCCESS yet) is waited for, never opened: the run ends at its
    idle timeout with the complete ones trained."""
    stream = tmp_path / "s"
    write_days(stream, [0])
    (stream / "day-001").mkdir()
    (stream / "day-001" / "part-0.parquet").write_bytes(b"half a file")
    result = Trainer(follow_config(tmp_path / "run", stream, "data.follow.idle_timeout=0.2")).fit()
    assert partitions_logged(result) == ["day-000"]


def test_follow_settings_are_checked_before_work(tmp_path):
    with pytest.raises(ConfigError, match="set data.source to parquet or preprocessed"):
        load_config("default", [f"data.follow.dir={tmp_path}", "checkpoint.every_steps=5"])
    with pytest.raises(ConfigError, match="checkpoint.every_steps"):
        load_config("continuous", ["checkpoint.every_steps=null"])
    with pytest.raises(ConfigError, match="leave out data.parquet.paths"):
        load_config("continuous", ["data.parquet.paths=[x.parquet]"])
    # one pass: each batch is scored before it trains
    with pytest.raises(ConfigError, match=r"train.epochs must be 1 \(it is 2\)"):
        load_config("continuous", ["train.epochs=2"])
    with pytest.raises(DataError, match="no such folder"):
        Trainer(follow_config(tmp_path / "run", tmp_path / "missing"))


def _rank_follow(topo, tmp: str, stream: str) -> dict:
    import os

    os.environ.update(
        WORLD_SIZE=str(topo.world_size), RANK=str(topo.rank), LOCAL_WORLD_SIZE=str(topo.world_size)
    )
    cfg = follow_config(
        Path(tmp) / "run", Path(stream), "data.follow.until=day-002", "data.follow.idle_timeout=60",
        "data.follow.held_out_batches=1", "data.follow.bad_partitions=skip",
    )  # fmt: skip
    result = Trainer(cfg).fit()
    return {"partitions": result.partitions, "steps": result.steps, "losses": result.losses}


def test_two_processes_follow_partitions_landing_during_training(tmp_path):
    """Two gloo ranks follow a stream whose day 1 and 2 land while they train: both train every
    partition (each its half of it), agree on the order, and the partition metrics count all samples;
    each partition's first batch is held out on both, and a truncated partition is skipped by both."""
    stream = tmp_path / "s"
    write_days(stream, [0])
    write_bad(stream, "day-000-bad", "truncated")

    def land() -> None:
        for d in (1, 2):
            time.sleep(1.0)
            write_day(SPEC, stream, d)

    writer = threading.Thread(target=land)
    writer.start()
    out = spawn(2, _rank_follow, (str(tmp_path), str(stream)), tmp_path=tmp_path / "pg")
    writer.join()
    for rank in (0, 1):
        got = out[rank]
        assert [p["partition"] for p in got["partitions"]] == ["day-000", "day-001", "day-002"]
        assert got["steps"] == 9 and all(p["num_samples"] == 300 for p in got["partitions"])
        assert all(p["held_out_num_samples"] == 100 for p in got["partitions"])
    assert out[0]["partitions"] == out[1]["partitions"]


def test_preprocessed_partitions_are_followed_once_their_manifest_is_complete(tmp_path):
    """Partitions written by `neorec data preprocess` are complete when their manifest says so; an
    unfinished one (manifest without `complete`) is not read."""
    from neorec.data.preprocess import preprocess_synthetic
    from neorec.data.synthetic import spec_from_config

    small = ["data.synthetic.num_dense=2", "data.synthetic.train_samples=300", "data.synthetic.eval_samples=100"]
    base = load_config("default", small)
    stream = tmp_path / "s"
    for day in range(3):
        preprocess_synthetic(
            spec_from_config(base.data.synthetic, day), stream / f"day-{day}", progress=False
        )
    manifest = stream / "day-2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"complete": true', '"complete": false'))
    cfg = load_config(
        "default",
        ["data.source=preprocessed", f"data.follow.dir={stream}", "data.follow.idle_timeout=0",
         "checkpoint.every_steps=2", "data.batch_size=100", "train.progress=false", "logging.plot=false",
         "logging.tensorboard=false", f"output_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    result = Trainer(cfg).fit()
    assert partitions_logged(result) == ["day-0", "day-1"] and result.steps == 6
    assert all(p["num_samples"] == 300 for p in result.partitions)


def test_a_stream_resumed_inside_a_partition_numbers_its_batches_from_where_it_stopped(tmp_path):
    """Resumed after a partition's first batch, the next batches are its batches 1, 2, 3 (by which the
    trainer tells a partition's start and its held-out batches), not a new partition's 0, 1, 2."""
    from neorec.train.build import _follow_source

    stream = tmp_path / "s"
    write_days(stream, range(1))  # 400 samples: 4 batches of 100
    cfg = follow_config(tmp_path / "run", stream, "data.follow.idle_timeout=0.1")
    first = _follow_source(cfg, None)
    next(first.train_batches(100))
    again = _follow_source(cfg, None)
    again.load_state(first.state())
    assert len(list(again.train_batches(100))) == 3
    assert [again.batch_record(k).index for k in (2, 3, 4)] == [1, 2, 3]
    assert again.batch_record(4).last
