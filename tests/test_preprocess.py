"""`neorec data preprocess`: the same values as the raw readers, vocabularies, resume, bad lines, CLI."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.cli import main
from neorec.data.blocks import Block
from neorec.data.criteo import CATEGORICAL_NAMES, CriteoTSVReader, CriteoTSVSource, parse_hex
from neorec.data.preprocess import index_lines, load_manifest, preprocess_criteo, preprocess_synthetic
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import DataError
from tests.tiny_cli import criteo_lines

SHARED_SAMPLE = Path(__file__).parents[2] / "shared" / "data" / "criteo_sample.tsv"
FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The 200 raw Criteo lines of ../shared, or where they are missing (a fresh clone), 200 lines made
    in their form (tiny_cli.criteo_lines: empty fields, repeated ids)."""
    if SHARED_SAMPLE.is_file():
        return SHARED_SAMPLE
    path = tmp_path_factory.mktemp("criteo") / "sample.tsv"
    path.write_text("".join(criteo_lines(200)))
    return path


def read_split(out: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, dense, ids [n, 26]) of a split, shards in manifest order."""
    manifest = load_manifest(out)
    parts = []
    for entry in manifest["shards"]:
        folder = out / "shards" / f"{entry['index']:05d}" / split
        if folder.is_dir():
            ids = np.stack([np.load(folder / f"ids_{n}.npy") for n in CATEGORICAL_NAMES], 1)
            parts.append((np.load(folder / "labels.npy"), np.load(folder / "dense.npy"), ids))
    return tuple(np.concatenate(p) for p in zip(*parts, strict=True))


def tree_digest(out: Path) -> dict[str, str]:
    """sha256 of every file under `out`, by relative path."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def batches_as_arrays(batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    batches = list(batches)
    ids = torch.cat([b.sparse.values.view(len(CATEGORICAL_NAMES), -1).t() for b in batches])
    return (
        torch.cat([b.labels for b in batches]).numpy(),
        torch.cat([b.dense for b in batches]).numpy(),
        ids.numpy(),
    )


@pytest.mark.parametrize("hashing", ["modulo", "hash"])
def test_criteo_sample_equals_the_tsv_reader(tmp_path, hashing, sample):
    out = tmp_path / "out"
    result = preprocess_criteo(
        [sample], out, hashing=hashing, table_rows=1000, shard_lines=64, progress=False
    )
    assert result.complete and result.num_shards == 4 and result.num_samples == {"train": 180, "eval": 20}
    source = CriteoTSVSource(sample, table_rows=1000, hashing=hashing)
    for split, batches in (("train", source.train_batches(50)), ("eval", source.eval_batches(7))):
        got, want = read_split(out, split), batches_as_arrays(batches)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    folder = out / "shards" / "00000" / "train"
    assert (
        np.load(folder / "ids_C1.npy").dtype == np.int32 and np.load(folder / "dense.npy").dtype == np.float32
    )


def test_many_files_and_gz_with_eval_files(tmp_path, sample):
    lines = sample.read_bytes().splitlines(keepends=True)
    a, b, ev = tmp_path / "a.tsv", tmp_path / "b.tsv.gz", tmp_path / "ev.tsv"
    a.write_bytes(b"".join(lines[:70]))
    with gzip.open(b, "wb") as f:
        f.write(b"".join(lines[70:170]))
    ev.write_bytes(b"".join(lines[170:]) + b"\n\n")  # trailing blank lines are ignored
    out = tmp_path / "out"
    result = preprocess_criteo([a, b], out, eval_paths=[ev], table_rows=777, shard_lines=32, progress=False)
    assert result.num_samples == {"train": 170, "eval": 30}
    assert [s["file"] for s in load_manifest(out)["shards"]].count(str(b)) == 4  # 100 lines / 32
    want = CriteoTSVReader([sample], table_rows=777)
    labels, dense, ids = batches_as_arrays(want.batches(1000))
    for split, rows in (("train", slice(0, 170)), ("eval", slice(170, 200))):
        got = read_split(out, split)
        for g, w in zip(got, (labels[rows], dense[rows], ids[rows]), strict=True):
            np.testing.assert_array_equal(g, w)


def test_vocabulary_counts_training_lines_only(tmp_path, sample):
    out = tmp_path / "out"
    preprocess_criteo([sample], out, vocab_threshold=3, shard_lines=80, progress=False)
    manifest = load_manifest(out)
    raw_lines = [line.split(b"\t") for line in sample.read_bytes().splitlines()]
    train_raw = [r for n, r in enumerate(raw_lines, start=1) if n % 10 != 0]
    for f, name in enumerate(CATEGORICAL_NAMES):
        column = parse_hex(np.array([r[14 + f] for r in train_raw], dtype=np.bytes_))[0]
        counts = Counter(column.tolist())
        vocab = np.load(out / "vocab" / f"{name}.npy")
        assert vocab.tolist() == sorted(v for v, c in counts.items() if c >= 3)
        assert manifest["features"][f]["num_ids"] == len(vocab) + 1
    # ids: 1 + position in the vocabulary, 0 for rare values; eval lines use the same mapping
    for split, keep in (("train", lambda n: n % 10 != 0), ("eval", lambda n: n % 10 == 0)):
        rows = [r for n, r in enumerate(raw_lines, start=1) if keep(n)]
        ids = read_split(out, split)[2]
        for f, name in enumerate(CATEGORICAL_NAMES):
            vocab = np.load(out / "vocab" / f"{name}.npy").tolist()
            column = parse_hex(np.array([r[14 + f] for r in rows], dtype=np.bytes_))[0].tolist()
            assert ids[:, f].tolist() == [vocab.index(v) + 1 if v in vocab else 0 for v in column]


@pytest.fixture
def forked_workers(monkeypatch):
    """workers=N's processes forked from tests/forked.py's server instead of spawned: the same fresh
    processes (the server has imported torch and neorec, and holds no threads or thread pools to
    inherit, which is why preprocessing spawns them), without each importing torch again."""
    import types

    from forked import context

    from neorec.data import workers

    def get_context(method):
        assert method == "spawn", method  # the tests have imported torch: workers are not forked from them
        return context()

    namespace = types.SimpleNamespace(get_context=get_context, get_all_start_methods=lambda: ["spawn"])
    monkeypatch.setattr(workers, "multiprocessing", namespace)


def small_spec(**kw) -> SyntheticSpec:
    base = dict(rows=[50, 1000, 7], num_dense=4, train_samples=40000, eval_samples=5000, seed=3)
    return SyntheticSpec(**{**base, **kw})


def test_synthetic_multi_hot_weighted_equals_the_generator(tmp_path):
    spec = small_spec(bag_sizes=[2, 1, 3], variable_bags=True, weighted=True)
    result = preprocess_synthetic(spec, tmp_path, blocks_per_shard=2, progress=False)
    assert result.num_samples == {"train": 40000, "eval": 5000} and result.num_shards == 3
    source = SyntheticSource(spec, cache=False)
    want = Block.cat([source.block("train", i) for i in range(source.num_blocks("train"))])
    folders = [tmp_path / "shards" / s / "train" for s in ("00000", "00001")]
    np.testing.assert_array_equal(
        np.concatenate([np.load(f / "dense.npy") for f in folders]), want.dense.numpy()
    )
    for f, name in enumerate(source.keys):
        for prefix, column in (("ids", want.values), ("lengths", want.lengths), ("weights", want.weights)):
            got = np.concatenate([np.load(d / f"{prefix}_{name}.npy") for d in folders])
            np.testing.assert_array_equal(got, column[f].numpy())
    features = load_manifest(tmp_path)["features"]
    assert [f["num_ids"] for f in features] == [50, 1000, 7] and all(
        f["multi_hot"] and f["weighted"] for f in features
    )


def test_interrupted_run_resumes_to_identical_bytes(tmp_path, forked_workers):
    spec = small_spec()
    full = tmp_path / "full"
    preprocess_synthetic(spec, full, blocks_per_shard=1, progress=False)
    part = tmp_path / "part"
    first = preprocess_synthetic(spec, part, blocks_per_shard=1, progress=False, max_shards=2)
    assert (first.written, first.complete) == (2, False)
    assert not load_manifest(part)["complete"]
    # a worker killed while writing shard 2 leaves a half-written temporary folder behind
    (part / "shards" / ".tmp-00002" / "train").mkdir(parents=True)
    (part / "shards" / ".tmp-00002" / "train" / "dense.npy").write_bytes(b"half")
    done_before = (part / "shards" / "00000").stat().st_mtime_ns
    second = preprocess_synthetic(spec, part, blocks_per_shard=1, workers=2, progress=False)
    assert (second.written, second.complete) == (first.num_shards - 2, True)
    assert (part / "shards" / "00000").stat().st_mtime_ns == done_before  # finished shards are not redone
    assert tree_digest(part) == tree_digest(full)
    again = preprocess_synthetic(spec, part, blocks_per_shard=1, progress=False)
    assert again.written == 0 and tree_digest(part) == tree_digest(full)


def test_criteo_resume_and_workers_give_identical_bytes(tmp_path, forked_workers, sample):
    kw = dict(vocab_threshold=2, shard_lines=40, progress=False)
    preprocess_criteo([sample], tmp_path / "one", **kw)
    preprocess_criteo([sample], tmp_path / "two", max_shards=3, **kw)
    preprocess_criteo([sample], tmp_path / "two", workers=2, **kw)
    assert tree_digest(tmp_path / "one") == tree_digest(tmp_path / "two")
    # interrupted after the counting pass: the vocabulary is reused, the result is the same
    shutil.rmtree(tmp_path / "two" / "shards")
    (tmp_path / "two" / "manifest.json").unlink()
    counted = (tmp_path / "two" / "vocab").stat().st_mtime_ns
    preprocess_criteo([sample], tmp_path / "two", **kw)
    assert (tmp_path / "two" / "vocab").stat().st_mtime_ns == counted
    assert tree_digest(tmp_path / "one") == tree_digest(tmp_path / "two")


def test_resume_with_other_settings_names_them(tmp_path):
    preprocess_synthetic(small_spec(), tmp_path, progress=False, max_shards=1)
    with pytest.raises(DataError, match="other settings \\(blocks_per_shard differ\\)"):
        preprocess_synthetic(small_spec(), tmp_path, blocks_per_shard=2, progress=False)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not an unfinished preprocessing run"):
        preprocess_synthetic(small_spec(), stranger, progress=False)


def test_resume_over_input_files_that_changed_size_says_so(tmp_path):
    """The same arguments over an input file edited since (a bad line fixed by deleting it): the
    unfinished shards are of the old file, which the error says, not that the arguments differ."""
    data = tmp_path / "in.tsv"
    data.write_bytes(FIXTURE.read_bytes())
    preprocess_criteo([data], tmp_path / "out", shard_lines=32, progress=False, max_shards=1)
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(DataError, match="input files that have changed size since.*remove the folder"):
        preprocess_criteo([data], tmp_path / "out", shard_lines=32, progress=False)


def corrupt(dst: Path, line: int, field: int, value: str) -> Path:
    lines = FIXTURE.read_text().split("\n")
    fields = lines[line - 1].split("\t")
    fields[field] = value
    lines[line - 1] = "\t".join(fields)
    dst.write_text("\n".join(lines))
    return dst


def test_bad_line_fails_with_file_and_line(tmp_path, forked_workers):
    path = corrupt(tmp_path / "bad.tsv", line=13, field=5, value="12a")
    with pytest.raises(DataError, match=re.escape(f"{path}:13: dense feature I5 = '12a'")):
        preprocess_criteo([path], tmp_path / "out", shard_lines=6, progress=False)
    with pytest.raises(DataError, match=re.escape(f"{path}:13: ")):
        preprocess_criteo([path], tmp_path / "out2", shard_lines=6, workers=2, progress=False)


def test_a_full_disk_stops_preprocessing_before_any_line_is_parsed(tmp_path, monkeypatch):
    """Every shard's files are reserved at their full size (posix_fallocate) before a line is parsed: a
    full disk ends the command there, naming the file."""
    import errno

    from neorec.data import preprocess_tsv
    from neorec.utils.files import FileWriteError

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    parsed = []
    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(preprocess_tsv, "piece_job", parsed.append)
    out = tmp_path / "out"
    with pytest.raises(FileWriteError, match=r"cannot write preprocessed shard file .*/\.tmp-0000\d/\w+/\w+\.npy: "
                       r"No space left on device \(is the disk full"):  # fmt: skip
        preprocess_criteo([FIXTURE], out, shard_lines=6, progress=False)
    assert parsed == [] and not list((out / "shards").glob("0*"))


def test_bad_lines_are_skipped_and_counted_per_shard(tmp_path):
    path = corrupt(tmp_path / "bad.tsv", line=13, field=0, value="7")
    lines = path.read_text().split("\n")
    lines[3] += "\textra"
    path.write_text("\n".join(lines))
    out = tmp_path / "out"
    result = preprocess_criteo([path], out, bad_lines="skip", shard_lines=6, eval_every=5, progress=False)
    assert result.skipped == Counter({"label": 1, "field_count": 1})
    assert sum(result.num_samples.values()) == 18
    manifest = load_manifest(out)
    assert [sum(s["skipped"].values()) for s in manifest["shards"]] == [1, 0, 1, 0]
    assert manifest["skipped"] == dict(result.skipped)


def test_index_lines_offsets_and_trailing_blank_lines(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_bytes(b"a\nbb\n\nccc\nd\n \n\n")
    assert index_lines(path, 2) == (5, [0, 5, 10])
    path.write_bytes(b"a\nbb")  # no final newline
    assert index_lines(path, 1) == (2, [0, 2])


def test_cli_preprocess_then_resume_is_a_no_op(tmp_path, capsys, sample):
    args = ["data", "preprocess", str(sample), "--out", str(tmp_path / "o"), "--shard-lines", "100",
            "--table-rows", "5000", "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert (
        "2 shards (2 written now); samples: eval 20, train 180; bad lines skipped: none"
        in capsys.readouterr().out
    )
    assert main(args) == 0
    assert "(0 written now)" in capsys.readouterr().out
    assert main([*args[:-1], "--hashing", "hash"]) == 2  # other settings into the same folder
    assert "categorical differ" in capsys.readouterr().err
    assert main([*args, "--table-rows", "1,x"]) == 2
    assert "--table-rows: expected one integer or 26" in capsys.readouterr().err


def test_cli_synthetic(tmp_path, capsys):
    args = ["data", "preprocess", "--synthetic", "--out", str(tmp_path / "s"), "--no-progress",
            "--set", "data.synthetic.train_samples=20000", "--set", "data.synthetic.eval_samples=1000"]  # fmt: skip
    assert main(args) == 0
    assert "samples: eval 1000, train 20000" in capsys.readouterr().out


def test_killed_process_resumes_to_identical_bytes(tmp_path):
    """A real interruption: SIGKILL the CLI once its first shard is renamed, then rerun it."""
    from forked import run_neorec, start_neorec

    sets = ["--set", "data.synthetic.train_samples=200000", "--set", "data.synthetic.eval_samples=20000"]
    # `python -m neorec ...` in processes forked from one that has imported neorec (tests/forked.py)
    cmd = ["data", "preprocess", "--synthetic", "--no-progress", *sets]
    proc = start_neorec([*cmd, "--out", str(tmp_path / "killed")])
    deadline = time.monotonic() + 120
    while not (tmp_path / "killed" / "shards" / "00000").is_dir() and proc.poll() is None:
        assert time.monotonic() < deadline, "the first shard never appeared"
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    assert not load_manifest(tmp_path / "killed")["complete"]
    for out in ("killed", "fresh"):
        p = run_neorec([*cmd, "--out", str(tmp_path / out)], timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    assert tree_digest(tmp_path / "killed") == tree_digest(tmp_path / "fresh")


def _worker_pid(_job: int) -> int:
    return os.getpid()


def test_run_jobs_in_a_shared_pool_block_use_the_same_workers(forked_workers, monkeypatch):
    """Inside shared_pool, run_jobs calls with its worker count share one pool (a command's phases start
    their workers once) and it stops at the block's end; outside it, each call starts its own."""
    from neorec.data import workers
    from neorec.data.workers import run_jobs, shared_pool

    pools = []

    class CountedPool(workers.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs) -> None:
            pools.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(workers, "ProcessPoolExecutor", CountedPool)

    def pids(num_workers: int = 2) -> set[int]:
        return set(run_jobs(_worker_pid, list(range(8)), num_workers, False, "test", initializer=None))

    with shared_pool(2, initializer=None):
        assert os.getpid() not in pids() | pids()  # the jobs ran in worker processes
        assert len(pools) == 1  # both calls in one pool
        pids(3)
        assert len(pools) == 2  # another worker count: a pool of its own
    with pytest.raises(RuntimeError, match="shutdown"):  # the block's pool has stopped
        pools[0].submit(_worker_pid, 0)
    pids()
    pids()
    assert len(pools) == 4  # outside the block, a pool per call


def test_inspect_says_which_malformed_lines_it_counts(tmp_path, sample):
    """`neorec data inspect` said "malformed lines skipped: N" both for the lines met reading a sample
    of raw TSV (training lines only) and for every line skipped in preprocessing: it now says which."""
    from neorec.data.inspect import inspect_source

    lines = sample.read_text().splitlines(keepends=True)
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("".join(lines[:3] + ["not a line\n"] + lines[3:150] + ["x\ty\n"] + lines[150:]))
    tsv_keys = ["data.source=criteo_tsv", f"data.criteo.train_paths=[{tsv}]", "data.criteo.bad_lines=skip"]
    raw = inspect_source("default", [*tsv_keys, "data.batch_size=50"], num_batches=1)
    want = "malformed lines skipped in the training lines read (not the whole data): 2"
    assert raw.splitlines()[-1] == want
    preprocess_criteo([tsv], tmp_path / "out", table_rows=1000, bad_lines="skip", progress=False)
    out_keys = ["data.source=preprocessed", f"data.preprocessed.path={tmp_path / 'out'}"]
    done = inspect_source("default", out_keys)
    want = "malformed lines skipped when the data was preprocessed (every split): field_count 2"
    assert done.splitlines()[-1] == want


def test_inspect_shows_no_skew_figure_a_sample_cannot_measure():
    """The top-1% share of a 1,000,000-row table from 8,192 sampled ids read 1.000 even for almost
    uniform ids: 10,000 rows (1%) is more than the sample holds, so it measured the sample's size."""
    from neorec.data.inspect import inspect_source

    text = inspect_source("criteo_kaggle", ["data.synthetic.zipf_alpha=0.01", "data.batch_size=2048"], 2)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("C")}
    assert rows["C3"][1] == "1,000,000" and rows["C3"][-1] == "-"  # 4,096 lookups for 10,000 rows
    assert 0 < float(rows["C20"][-1]) < 0.5  # 4 rows: its most frequent one, about a quarter
    assert "'-' for" in text and "more with --batches" in text
