"""SSD tables of the row cache (neorec/embedding/cache): files created without loading the table, reads from
the map, the write log, checkpoints and model.pt streamed in windows, training through them, and the cache's
config: errors that name the key, io_thread and release_mib chosen by "auto"."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_cache import TINY, cached_engine

from neorec.config.load import load_config
from neorec.embedding.cache import CacheSettings, SsdBacking, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.init import init_rows
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError


def test_ssd_table_is_created_without_materialising(tmp_path) -> None:
    """A 512 MiB table (weights) goes to disk window by window; its state_dict entry is a view of the
    file: resident memory grows by far less than the table."""
    t = TableConfig(name="big", rows=2_000_000, dim=64, features=["big"])
    opt = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    before = _rss_mib()
    engine = cached_engine([t], opt, tmp_path, fraction=0.001)
    backing = engine.weights[0].cache.backing
    assert isinstance(backing, SsdBacking)
    assert backing.layout.record_bytes == t.dim * 4  # sgd: the weights alone, 256 bytes
    assert backing.path.stat().st_size == t.rows * t.dim * 4
    weight = engine.state_dict()["tables.big.weight"]
    assert weight.shape == (t.rows, t.dim)
    assert torch.equal(weight[123_456:123_460], init_rows(t, 0, 123_456, 123_460))
    assert _rss_mib() - before < 150, "creating or saving the table loaded it into memory"


@pytest.mark.parametrize("release_bytes", [1 << 12, 256 << 20])
def test_ssd_reads_from_the_map_equal_positioned_reads(tmp_path, release_bytes) -> None:
    """Both ways of reading missed rows (reads="map", the default, and "pread" on I/O threads) give
    the records written, for single rows, runs of neighbours, the first and last rows, more rows than
    one piece, and none; with a tiny release size the map's pages are dropped after every piece."""
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 24, torch.float32), ("momentum1", 0, torch.float32)])
    rows_total = 20_000
    values = torch.randn(rows_total, 24, generator=torch.Generator().manual_seed(3))
    inits = {
        "weight": lambda a, b: values[a:b],
        "momentum1": lambda a, b: torch.arange(a, b, dtype=torch.float32),
    }
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, rows_total, inits)
    by_map = SsdBacking(path, layout, rows_total, release_bytes, reads="map")
    by_pread = SsdBacking(path, layout, rows_total, release_bytes, reads="pread")
    by_map.piece_rows = 1000  # rows not in ascending order: pieces of 1000, each followed by the check
    picks = torch.cat([torch.tensor([0, 5, 6, 7, 19_999]), torch.randperm(rows_total)[:4321]])
    for rows in (torch.unique(picks), torch.arange(100, 3100), torch.empty(0, dtype=torch.int64)):
        got = by_map.read(rows)
        assert torch.equal(got, by_pread.read(rows))
        assert torch.equal(layout.view(got, "weight"), values[rows])
        assert torch.equal(layout.view(got, "momentum1"), rows.to(torch.float32))
    shuffled = picks[torch.randperm(picks.numel())]
    got = by_map._gather(by_map._words, by_map.fd, shuffled).view(torch.uint8)
    assert torch.equal(
        got, by_pread.read(torch.unique(picks))[torch.searchsorted(torch.unique(picks), shuffled)]
    )
    with pytest.raises(ValueError, match="ssd reads"):
        SsdBacking(path, layout, rows_total, reads="mmap")


def test_ssd_map_reads_stay_within_release_bytes(tmp_path, monkeypatch) -> None:
    """Gathering many scattered rows (from the table file and from the write log) never lets the
    process's resident file pages grow past release_bytes over the last drop, even where each row
    maps a 2 MiB page-cache folio; checked after every gather."""
    from neorec.embedding.cache import backing as backing_module
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 64, torch.float32), ("momentum1", 64, torch.float32)])
    rows_total = 100_000  # 49 MiB of 512-byte records
    path = tmp_path / "t.rows.bin"
    zeros = {name: (lambda a, b: torch.zeros(b - a, 64)) for name in ("weight", "momentum1")}
    create_ssd_file(path, layout, rows_total, zeros)
    release = 8 << 20
    store = SsdBacking(path, layout, rows_total, release, reads="map", log_fraction=0.5)
    worst = 0
    gather = torch.index_select

    def checked(*args, **kwargs):
        nonlocal worst
        out = gather(*args, **kwargs)
        worst = max(worst, backing_module._resident_file_bytes() - store._baseline)
        return out

    gen = torch.Generator().manual_seed(5)
    written = torch.unique(torch.randint(0, rows_total, (6000,), generator=gen))
    store.write(written, layout.empty(written.numel()))  # now in the write log
    monkeypatch.setattr(torch, "index_select", checked)
    for _ in range(6):
        store.read(torch.unique(torch.randint(0, rows_total, (5000,), generator=gen)))
    assert 0 < worst <= release


@pytest.mark.parametrize("reads", ["map", "pread"])
def test_write_log_keeps_every_rows_last_record(tmp_path, reads) -> None:
    """Rows written back go to the write log (write_log.py): a log of 10% of the rows, so its halves
    fill, swap and are folded into the table file many times, in windows of 64 rows. After every
    write, rows read back (from the log or the file), ranges read in windows, a field written over a
    range and a map view of the file all hold each row's last written record."""
    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 6, torch.float32), ("momentum1", 6, torch.float32)])
    n = 3_000
    gen = torch.Generator().manual_seed(7)
    expected = {"weight": torch.randn(n, 6, generator=gen), "momentum1": torch.zeros(n, 6)}
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, n, {k: (lambda a, b, v=v: v[a:b].clone()) for k, v in expected.items()})
    backing = SsdBacking(path, layout, n, 1 << 16, reads=reads, log_fraction=0.1)
    log = backing.log
    log._window_rows = 64
    for step in range(60):
        rows = torch.unique(
            torch.randint(0, n, (int(torch.randint(1, 400, (1,), generator=gen)),), generator=gen)
        )
        values = {k: torch.randn(rows.numel(), 6, generator=gen) for k in expected}
        backing.write(rows, layout.pack(values))
        for k in expected:
            expected[k][rows] = values[k]
        probe = torch.unique(torch.randint(0, n, (500,), generator=gen))
        assert torch.equal(layout.view(backing.read(probe), "weight"), expected["weight"][probe]), step
        if step % 20 == 19:
            assert torch.equal(backing.read_range("momentum1", 0, n), expected["momentum1"])
    assert log.appended > 5 * log.half and log.compacted_windows > 0  # it swapped and folded
    backing.write_range("weight", 100, 900, torch.full((800, 6), 2.0))
    expected["weight"][100:900] = 2.0
    assert torch.equal(backing.read(torch.arange(n)), layout.pack(expected))
    assert bool((log.where[100:900] < 0).all())  # those rows live in the file again
    assert torch.equal(backing.view_range("momentum1", 0, n), expected["momentum1"])  # the file itself
    assert bool((log.where < 0).all())
    with pytest.raises(ValueError, match="write log"):
        SsdBacking(path, layout, n, log_fraction=1.5)


def test_write_log_reads_race_appends_and_folds(tmp_path) -> None:
    """A thread reads rows while another appends new versions of them, filling, swapping and folding
    the log's halves: every record read is whole (all its words from one version of that row) and no
    older than the last version written before the read began."""
    import threading

    from neorec.embedding.cache.backing import create_ssd_file
    from neorec.embedding.cache.records import RecordLayout

    layout = RecordLayout([("weight", 16, torch.float32)])  # 64 bytes: 8 int64 words a record
    n = 500
    path = tmp_path / "t.rows.bin"
    create_ssd_file(path, layout, n, {"weight": lambda a, b: torch.zeros(b - a, 16)})
    backing = SsdBacking(path, layout, n, 1 << 16, log_fraction=0.2)
    backing.log._window_rows = 25
    version = torch.zeros(n, dtype=torch.int64)  # last version written per row
    done, errors = threading.Event(), []

    def writer() -> None:
        gen = torch.Generator().manual_seed(1)
        for v in range(1, 100):
            rows = torch.unique(torch.randint(0, n, (40,), generator=gen))
            records = (rows * 1_000_000 + v).unsqueeze(1).expand(-1, 8).contiguous()  # words: row, version
            backing.write(rows, records.view(torch.uint8))
            version[rows] = v
        done.set()

    def reader() -> None:
        while not done.is_set():
            rows = torch.arange(n)
            floor = version.clone()
            words = backing.read(rows).view(torch.int64)
            seen = words[:, 0] % 1_000_000
            if not bool((words == words[:, :1]).all()):
                errors.append("torn record")
            elif not bool(((words[:, 0] // 1_000_000 == rows) | (words[:, 0] == 0)).all()):
                errors.append("another row's record")
            elif not bool((seen >= floor).all()):
                errors.append("a stale record")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert backing.log.compacted_windows > 0, "the log never folded"
    final = backing.read(torch.arange(n)).view(torch.int64)[:, 0] % 1_000_000
    assert torch.equal(final, version)

_SAVE_SCRIPT = """
import ctypes, json, sys, torch
from pathlib import Path
import neorec.checkpoint.pieces as pieces, neorec.checkpoint.stream as stream
import neorec.embedding.cache.backing as backing
from neorec.checkpoint import load_checkpoint, save_checkpoint
from neorec.embedding.cache import CacheSettings, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch
from neorec.utils.files import check_zip

# glibc returns freed blocks of 1 MiB and more at once (M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_ would
# set at start), so the peak counts live memory only
assert ctypes.CDLL(None).mallopt(-3, 1 << 20) == 1
pieces.WINDOW_BYTES = stream.WINDOW_BYTES = backing._WINDOW_BYTES = 8 << 20  # windows of 8 MiB
root = Path(sys.argv[1])
table = TableConfig(name="big", rows=1_000_000, dim=32, features=["big"])
opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)

def ssd_engine(name):
    settings = CacheSettings(fraction=0.01, directory=root / name, release_mib=8)
    factory = cached_storage_factory({"big": "ssd"}, settings)
    return FusedEmbeddingCollection([table], opt, group_storage_factory=factory)

def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

def growth(work):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident memory
    before = kib("VmRSS")
    work()
    return (kib("VmHWM") - before) / 1024

engine = ssd_engine("a")
gen = torch.Generator().manual_seed(0)
for _ in range(3):  # updated rows in the file, and in the cache (dirty) when saving
    ids = torch.randint(0, table.rows, (4096,), generator=gen)
    pooled = engine(SparseBatch.from_features({"big": (ids, torch.ones(4096, dtype=torch.int64))}))
    pooled.backward(torch.randn(pooled.shape, generator=gen))
out = {
    "save": growth(lambda: save_checkpoint(root / "ckpt", 3, engine)),
    "model_pt": growth(lambda: stream.save_model_state(engine.state_dict(), root / "model.pt", engine)),
}
restored = ssd_engine("b")
out["load"] = growth(lambda: load_checkpoint(root / "ckpt" / "step-00000003", restored))
plain = FusedEmbeddingCollection([table], opt, seed=1)
load_checkpoint(root / "ckpt" / "step-00000003", plain)
model_pt = torch.load(root / "model.pt", weights_only=True, mmap=True)
check_zip(root / "model.pt", "model file", "")  # every entry's CRC32, computed by the streaming save
for key, value in plain.state_dict().items():
    assert torch.equal(value, engine.state_dict()[key]), key
    assert torch.equal(value, restored.state_dict()[key]), key
    assert torch.equal(value, model_pt[key]), key
print(json.dumps(out))
"""


def test_ssd_checkpoint_and_model_pt_stream_rows_in_windows(tmp_path) -> None:
    """Saving a 256 MiB SSD table (weights + AdaGrad state) as a sharded checkpoint or as model.pt,
    and loading the checkpoint into another SSD table, raise peak RSS by a few windows (8 MiB here),
    not by the table; what was saved equals the table."""
    from forked import run_python

    # in a process of its own, forked from one that has imported torch and neorec (tests/forked.py)
    run = run_python(["-c", _SAVE_SCRIPT, str(tmp_path)], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    growth = json.loads(run.stdout.strip().splitlines()[-1])
    table_mib = 1_000_000 * 32 * 4 * 2 / 2**20  # 244 MiB
    for step, mib in growth.items():
        assert mib < table_mib / 5, f"{step}: peak RSS grew by {mib:.0f} MiB for a {table_mib:.0f} MiB table"




def test_trainer_with_ssd_tables_logs_cache_stats_and_matches_memory(tmp_path) -> None:
    from neorec.train.trainer import Trainer

    ssd = [
        "embedding.tier=ssd",
        f"embedding.cache.directory={tmp_path / 'tables'}",
        "embedding.cache.policy=lfu",
    ]
    a = Trainer(load_config("default", TINY), tmp_path / "a").fit()
    b = Trainer(load_config("default", TINY + ssd + ["embedding.cache.fraction=0.5"]), tmp_path / "b").fit()
    assert a.losses == b.losses
    saved_a, saved_b = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in "ab")
    assert saved_a.keys() == saved_b.keys()
    assert all(torch.equal(saved_a[k], saved_b[k]) for k in saved_a)  # model.pt of ssd tables too
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    cache = [r for r in records if r["split"] == "cache"]
    assert cache and 0 <= cache[-1]["hit_rate"] <= 1 and cache[-1]["evictions"] > 0
    assert "mib_from_ssd" in cache[-1]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["embedding.tier=ssd"], "embedding.cache.directory"),
        (["embedding.cache.fraction=0.1", "embedding.cache.size_mib=10"], "embedding.cache.fraction or"),
        (["embedding.tier=disk"], "embedding.tier"),
        (["embedding.cache.policy=fifo"], "embedding.cache.policy"),
        (["embedding.cache.fraction=1.5"], "embedding.cache.fraction"),
        (["embedding.tables={C1: {tier: tape}}"], "embedding.tables.C1.tier"),
        (["embedding.cache.io_thread=sometimes"], "embedding.cache.io_thread"),
    ],
)
def test_bad_cache_config_names_the_key(sets, message) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config("default", TINY + sets)


def test_cache_build_errors_name_tables_and_keys(tmp_path) -> None:
    from neorec.train.trainer import Trainer

    # C1 would share one buffer with C2 (same dim, dtype, optimizer) but has its own tier: its own group
    mixed = TINY + [f"embedding.cache.directory={tmp_path}", "embedding.tables={C1: {tier: ssd}}"]
    emb = Trainer(load_config("default", mixed), tmp_path / "x").embeddings
    assert [len(g.tables) for g in emb.layout.groups] == [1, 3] and set(emb.cache_stats()) == {"C1"}
    with pytest.raises(ConfigError, match=r"different tiers .*'ssd': \['a'\]"):  # the factory's own check
        factory = cached_storage_factory({"a": "ssd"}, CacheSettings(directory=tmp_path))
        FusedEmbeddingCollection([TableConfig(name=n, rows=10, dim=4, features=[n]) for n in "ab"],
                                 EmbeddingOptimizerConfig(name="sgd", lr=0.1), group_storage_factory=factory)  # fmt: skip
    with pytest.raises(ConfigError, match="only the fused engine"):
        Trainer(
            load_config("default", TINY + ["embedding.tier=dram", "embedding.engine=reference"]),
            tmp_path / "y",
        )
    with pytest.raises(ConfigError, match=r"embedding\.cache\.size_mib"):
        settings = CacheSettings(fraction=None, size_mib=1e-6)
        factory = cached_storage_factory({"t": "dram"}, settings, total_cached_rows=10)
        FusedEmbeddingCollection([TableConfig(name="t", rows=10, dim=4, features=["t"])],
                                 EmbeddingOptimizerConfig(name="sgd", lr=0.1), group_storage_factory=factory)  # fmt: skip


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_io_thread_auto_only_where_a_core_is_left(monkeypatch) -> None:
    """auto: a worker thread only when torch's threads of every process on the node leave a core."""
    from neorec.embedding.cache.build import use_io_thread

    assert use_io_thread(True) and not use_io_thread(False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert not use_io_thread("auto")  # 2 cores, 2 intra-op threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert use_io_thread("auto")  # 4 cores, 2 threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not use_io_thread("auto")  # 2 processes x 2 threads on 4 cores
    assert use_io_thread("auto", "cuda")  # the step runs on the GPU, not on the intra-op threads
    assert not use_io_thread(False, "cuda")
    with pytest.raises(ConfigError, match="embedding.cache.io_thread"):
        use_io_thread("sometimes")


def test_release_auto_is_a_quarter_of_memory_per_process_on_the_node(monkeypatch) -> None:
    """release_mib auto: a quarter of physical memory over torchrun's LOCAL_WORLD_SIZE; a number is MiB."""
    from neorec.embedding.cache.build import release_bytes

    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert release_bytes("auto") == memory // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert release_bytes("auto") == memory // 4 // 4
    assert release_bytes(256) == 256 << 20 and release_bytes(0.5) == 1 << 19
    for bad in ("sometimes", 0, -1.0):
        with pytest.raises(ConfigError, match="embedding.cache.release_mib"):
            release_bytes(bad)


def test_a_disk_without_room_is_refused_before_a_table_file_is_written(tmp_path, monkeypatch) -> None:
    """The table file and its write log need more than the disk's free space (an earlier run's files
    of those names count as room, as they are replaced): refused naming the folder and the sizes,
    before anything is written. A disk filled meanwhile (posix_fallocate) or a write that fails leaves
    no part of a file behind."""
    import collections
    import errno

    from neorec.embedding.cache import backing
    from neorec.embedding.cache.records import RecordLayout
    from neorec.errors import MachineError

    layout = RecordLayout([("weight", 16, torch.float32)])  # 64 bytes a row
    inits = {"weight": lambda a, b: torch.zeros(b - a, 16)}
    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": 1000 * 64 * 2 - 1}  # one record short of the 1000-row file and its log of 1000 rows
    monkeypatch.setattr(backing.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free["bytes"]))
    path = tmp_path / "tables" / "t.rows.bin"
    with pytest.raises(MachineError, match=r"tables: the disk has 0\.1 MiB free, but table file t\.rows\.bin"
                       r" needs 0\.1 MiB .*write log"):  # fmt: skip
        backing.create_ssd_file(path, layout, 1000, inits, log_fraction=1.0)
    assert not path.exists()
    backing.create_ssd_file(path, layout, 1000, inits, log_fraction=0.0)  # no log: room enough
    assert path.stat().st_size == 64_000
    free["bytes"] = 64_000  # with the old file's 64,000 bytes the log has room
    backing.create_ssd_file(path, layout, 1000, inits, log_fraction=1.0)

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(backing.os, "posix_fallocate", full)
    with pytest.raises(MachineError, match=r"t\.rows\.bin: no room on the disk for the weights"):
        backing.create_ssd_file(path, layout, 1000, inits)
    assert not path.exists()
    monkeypatch.undo()
    monkeypatch.setattr(backing.shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    inits["weight"] = lambda a, b: (_ for _ in ()).throw(OSError(errno.EIO, os.strerror(errno.EIO)))
    with pytest.raises(OSError, match="Input/output error") as failed:
        backing.create_ssd_file(path, layout, 1000, inits)
    assert failed.value.filename == str(path) and not path.exists()


def test_a_failing_read_or_write_of_a_table_file_names_it(tmp_path) -> None:
    from neorec.embedding.cache.file_io import transfer

    path = tmp_path / "t.rows.bin"
    path.write_bytes(bytes(64))
    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(OSError) as failed:  # a write through a read-only descriptor
        transfer(fd, torch.zeros(16), 0, True, path)
    assert failed.value.filename == str(path)
    os.close(fd)
    with pytest.raises(OSError) as failed:  # a read of a closed descriptor
        transfer(fd, torch.zeros(16), 0, False, path)
    assert failed.value.filename == str(path)
