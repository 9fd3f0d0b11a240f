"""What a followed stream (neorec/data/follow.py) refuses to train: a partition after --until in the
stream's order, and a preprocessed partition whose id mapping differs from the stream's (also after a
resume, once the partition that set the mapping is gone)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from test_follow import SPEC, follow_config, partitions_logged, write_days

from neorec.config.load import load_config
from neorec.data.drifting import write_day
from neorec.data.preprocess import preprocess_criteo
from neorec.errors import DataError
from neorec.train.trainer import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"


def test_until_never_trains_a_partition_named_after_it(tmp_path, neorec_warnings):
    """Name order, --until day-001 missing while day-002 is there: day-002 is not trained; the run
    waits for day-001 as for any partition not landed yet, and ends at the idle timeout with a warning
    naming both; day-001 landing during the wait is trained and ends the run."""
    stream = tmp_path / "s"
    write_days(stream, [0, 2])
    cfg = follow_config(
        tmp_path / "idle", stream, "data.follow.until=day-001", "data.follow.idle_timeout=0.2"
    )
    assert partitions_logged(Trainer(cfg).fit()) == ["day-000"]
    told = [r.getMessage() for r in neorec_warnings.records if "ends before --until" in r.getMessage()]
    assert len(told) == 1, told
    assert "--until day-001 (data.follow.until), which never came" in told[0]
    assert "last partition finished is day-000" in told[0]
    assert "day-002 comes after --until day-001 in the stream's order (data.follow.order: name)" in told[0]

    cfg = follow_config(tmp_path / "wait", stream, "data.follow.until=day-001", "data.follow.idle_timeout=60")
    trainer = Trainer(cfg)

    def land() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and trainer.source._idle_since is None:
            time.sleep(0.01)
        write_day(SPEC, stream, 1)

    writer = threading.Thread(target=land)
    writer.start()
    result = trainer.fit()
    writer.join()
    assert partitions_logged(result) == ["day-000", "day-001"] and trainer.source.ended == "until"


def test_until_in_completion_order_ends_after_it(tmp_path):
    """order mtime: the partitions completed before --until's are trained (whatever their names), then
    it; one completed after it is not."""
    stream = tmp_path / "s"
    write_days(stream, range(4))
    for day, completed in ((0, 100), (2, 200), (1, 300), (3, 400)):
        os.utime(stream / f"day-00{day}" / "_SUCCESS", (completed, completed))
    cfg = follow_config(tmp_path / "run", stream, "data.follow.order=mtime", "data.follow.until=day-001")
    assert partitions_logged(Trainer(cfg).fit()) == ["day-000", "day-002", "day-001"]


def preprocessed_config(out: Path, stream: Path, until: str):
    return load_config(
        "default",
        [
            "data.source=preprocessed", f"data.follow.dir={stream}", f"data.follow.until={until}",
            "data.follow.idle_timeout=0", "data.follow.poll_seconds=0.05", "data.batch_size=6",
            "checkpoint.every_steps=2", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false", f"output_dir={out}",
        ],
    )  # fmt: skip


def preprocess_day(stream: Path, name: str, **settings) -> None:
    preprocess_criteo([FIXTURE], stream / name, table_rows=1000, progress=False, **settings)


@pytest.mark.parametrize(
    ("settings", "what"),
    [
        ({"hashing": "hash"}, "settings.categorical.hashing is 'hash', the stream's is 'modulo'"),
        ({"raw_features": ["C3"]}, "settings.categorical.raw_features is ['C3'], the stream's is not set"),
    ],
)
def test_a_preprocessed_partition_with_another_id_mapping_is_refused(tmp_path, settings, what):
    """day-001 was preprocessed with other id-mapping settings than day-000 (same features and table
    sizes): its raw values would land in other rows, so it is bad, named with the setting and both
    values; skipped with bad_partitions: skip."""
    stream = tmp_path / "s"
    preprocess_day(stream, "day-000")
    preprocess_day(stream, "day-001", **settings)
    with pytest.raises(DataError, match=r"partition day-001 .* is bad: its id mapping differs") as e:
        Trainer(preprocessed_config(tmp_path / "stop", stream, "day-001")).fit()
    assert what in str(e.value) and "(that of partition day-000)" in str(e.value)
    cfg = preprocessed_config(tmp_path / "skip", stream, "day-001")
    cfg.data.follow.bad_partitions = "skip"
    assert partitions_logged(Trainer(cfg).fit()) == ["day-000"]


def test_a_resumed_stream_keeps_the_id_mapping_it_trained_with(tmp_path):
    """The position in a checkpoint holds the stream's id mapping: resumed after day-000 (which set it)
    was removed, a day-001 of other hashing is refused, not taken as the stream's new first partition;
    one of the same settings trains."""
    stream, out = tmp_path / "s", tmp_path / "run"
    preprocess_day(stream, "day-000")
    assert partitions_logged(Trainer(preprocessed_config(out, stream, "day-000")).fit()) == ["day-000"]
    shutil.rmtree(stream / "day-000")  # retention: trained days go
    preprocess_day(stream, "day-001", hashing="hash")
    with pytest.raises(DataError, match=r"partition day-001 .* is bad: its id mapping differs") as e:
        Trainer(preprocessed_config(out, stream, "day-001"), resume=True).fit()
    assert "settings.categorical.hashing is 'hash', the stream's is 'modulo'" in str(e.value)
    shutil.rmtree(stream / "day-001")
    preprocess_day(stream, "day-001")
    resumed = Trainer(preprocessed_config(out, stream, "day-001"), resume=True).fit()
    assert partitions_logged(resumed) == ["day-001"]


def test_a_partition_that_leaves_samples_to_no_rank_is_warned_of_once(tmp_path, neorec_warnings):
    """Each of W ranks reads n // W samples of a partition of n: rank 0 warns of the rest at the first
    partition that leaves some (401 rows over 2 ranks: 1), once."""
    from types import SimpleNamespace

    from neorec.data.drifting import DriftSpec
    from neorec.train.build import build_source

    stream = tmp_path / "s"
    write_days(stream, [0, 1], DriftSpec(rows=401, vocab=300, shift=100, row_group=256))
    cfg = follow_config(tmp_path / "run", stream, "data.follow.until=day-001")
    source = build_source(cfg, SimpleNamespace(rank=0, world_size=2))  # rank 0 alone chooses the partitions
    assert sum(len(b) for b in source.train_batches(50)) == 2 * 200
    said = [r.getMessage() for r in neorec_warnings.records if "do not divide" in r.getMessage()]
    assert said == ["partition day-000: the 401 training samples do not divide over 2 processes: each reads "
                    "200 of them, leaving the last 1 of the partition's order untrained (one process trains "
                    "them all); a number of training samples divisible by 2 trains every one (said for the "
                    "first partition that leaves some)"]  # fmt: skip


def test_a_partition_with_more_features_than_the_stream_is_a_schema_change():
    from neorec.data.follow_schema import schema_change
    from neorec.data.source import FeatureSpec, SourceInfo

    stream = SourceInfo(2, [FeatureSpec("a", 10)])
    assert schema_change(SourceInfo(2, [FeatureSpec("a", 10)]), stream) == ""
    more = SourceInfo(2, [FeatureSpec("a", 10), FeatureSpec("b", 5)])
    assert schema_change(more, stream) == "features ['b'] that the stream does not have"
