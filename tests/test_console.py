"""What a user sees while a run goes: log lines by rank, progress bars, metrics.jsonl, TensorBoard notice."""

import io
import json
import logging
import sys

import pytest

from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.train.logger import MetricsLogger
from neorec.train.reporting import train_line
from neorec.utils import progress
from neorec.utils.logging import setup_logging


@pytest.fixture
def console():
    """setup_logging into a buffer; the "neorec" logger is restored afterwards."""
    logger = logging.getLogger("neorec")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    out = io.StringIO()

    def setup(rank: int, world_size: int) -> io.StringIO:
        out.seek(0)
        out.truncate()
        setup_logging(rank, world_size, stream=out)
        return out

    yield setup
    logger.handlers[:], logger.level, logger.propagate = saved


def emit(name: str = "neorec.train.reporting") -> None:
    log = logging.getLogger(name)
    log.info("step 5 | loss 0.5")
    log.warning("disk almost full")


def test_single_process_logs_info_without_a_rank_prefix(console):
    out = console(0, 1)
    emit()
    assert out.getvalue().splitlines() == ["neorec: step 5 | loss 0.5", "neorec: warning: disk almost full"]


def test_rank_0_of_several_logs_info_with_its_rank(console):
    out = console(0, 4)
    emit()
    assert out.getvalue().splitlines() == [
        "[rank 0] neorec: step 5 | loss 0.5",
        "[rank 0] neorec: warning: disk almost full",
    ]


def test_other_ranks_log_only_warnings_with_their_rank(console):
    out = console(3, 4)
    emit("neorec.train.run_plan")
    logging.getLogger("neorec").error("gone")
    assert out.getvalue().splitlines() == ["[rank 3] neorec: warning: disk almost full", "[rank 3] neorec: error: gone"]


def test_setup_reads_torchrun_environment_and_replaces_its_handler(console, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = io.StringIO()
    setup_logging(stream=out)
    setup_logging(stream=out)  # again: one handler, one line per message
    emit()
    assert out.getvalue().splitlines() == ["[rank 1] neorec: warning: disk almost full"]


def test_metrics_lines_are_strict_json(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log("eval", 3, {"auc": float("nan"), "ne": float("inf"), "log_loss": 0.5, "n": 7})
    logger.log("cache", 3, {"hit_rate": float("nan"), "t/mib": [1.0, float("-inf")], "x": {"y": float("nan")}})
    logger.close()

    def bare(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}")

    records = [json.loads(line, parse_constant=bare) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["auc"] is None and records[0]["ne"] is None and records[0]["log_loss"] == 0.5
    assert records[0]["n"] == 7
    assert records[1]["hit_rate"] is None and records[1]["t/mib"] == [1.0, None] and records[1]["x"] == {"y": None}


def test_missing_tensorboard_is_one_warning(tmp_path, console, monkeypatch):
    out = console(0, 1)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log("train", 1, {"loss": 0.5})
    logger.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("neorec: warning: logging.tensorboard is true"), lines
    assert not (tmp_path / "tensorboard").exists()
    for asked in (False, "auto"):  # none, or only when installed (the default): no notice
        out = console(0, 1)
        MetricsLogger(tmp_path, tensorboard=asked).close()
        assert out.getvalue() == ""
    assert not (tmp_path / "tensorboard").exists()


def test_train_line_shows_learning_rates_and_cache():
    cache = {"hit_rate": 0.912, "misses": 10, "mib_from_ssd": 1.5, "mib_to_ssd": 0.5, "t0/mib_from_ssd": 1.5}
    line = train_line(20, 733, 0.43219, 41234.5, {"lr_dense": 0.002, "lr_embedding": 0.05}, cache)
    assert line == (
        "step 20/733 | loss 0.4322 | 41,234 samples/s | lr dense 0.002 embedding 0.05 | "
        "cache hit rate 0.912, 2.0 MiB moved (since the start)"
    )
    assert train_line(5, 0, 1.0, 10.0, {"lr_dense": 1e-4}, None) == "step 5 | loss 1.0000 | 10 samples/s | lr dense 0.0001"


def test_bars_only_when_enabled_and_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: False)
    assert progress.progress_bar(10, "x", enabled=True) is None
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    assert progress.progress_bar(10, "x", enabled=False) is None
    bar = progress.progress_bar(10, "x", enabled=True, file=io.StringIO())
    assert bar is not None and bar.total == 10
    bar.close()
    with progress.phase("planning", enabled=False):
        pass


def test_table_filling_advances_its_bar(monkeypatch):
    import neorec.embedding.fused.collection as collection

    bars = []

    def recording_bar(total, desc=None, enabled=True, **kwargs):
        from tqdm import tqdm

        if not enabled:
            return None
        bars.append(tqdm(total=total, desc=desc, file=io.StringIO()))
        return bars[-1]

    monkeypatch.setattr(collection, "progress_bar", recording_bar)
    tables = [TableConfig(name="a", rows=70, dim=4, features=["a"]), TableConfig(name="b", rows=30, dim=8, features=["b"])]
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    FusedEmbeddingCollection(tables, opt, progress=False)
    assert bars == []
    FusedEmbeddingCollection(tables, opt, progress=True)
    assert len(bars) == 1 and bars[0].total == 100 and bars[0].n == 100
    assert bars[0].disable  # closed once the storages are built
