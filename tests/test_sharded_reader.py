"""PreprocessedSource: rank parts without overlap or loss, seeded shuffling, exact resume, config wiring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neorec.config.load import load_config
from neorec.data.preprocess import preprocess_criteo, preprocess_synthetic
from neorec.data.sharded_reader import PreprocessedSource
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import ConfigError, DataError
from neorec.train.build import build_source

FILE_LINES = [23, 5, 41]  # uneven files, cut into shards of 10 lines: 10 10 3 | 5 | 10 10 10 10 1
EVAL_LINES = 13


def write_tsv(path: Path, first: int, n: int) -> Path:
    """Criteo-like lines whose C1 is the sample number (so its id is the number under modulo 2^24)."""
    rest = "\t".join(["1"] * 13)
    more = "\t".join(f"{7 * j:x}" for j in range(25))
    path.write_text("".join(f"{(first + i) % 2}\t{rest}\t{first + i:x}\t{more}\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def numbered(tmp_path_factory) -> Path:
    """A preprocessed folder whose samples carry their number in feature C1, in uneven shards."""
    tmp = tmp_path_factory.mktemp("numbered")
    paths, first = [], 0
    for k, n in enumerate(FILE_LINES):
        paths.append(write_tsv(tmp / f"day{k}.tsv", first, n))
        first += n
    ev = write_tsv(tmp / "eval.tsv", 1000, EVAL_LINES)
    preprocess_criteo(paths, tmp / "out", eval_paths=[ev], table_rows=1 << 24, shard_lines=10, progress=False)
    return tmp / "out"


def sample_numbers(batches) -> list[int]:
    """C1 ids (the sample numbers) of every batch, in order."""
    out = []
    for b in batches:
        values, _, _ = b.sparse.feature("C1")
        out += values.tolist()
    return out


N = sum(FILE_LINES)


def test_one_rank_reads_every_sample_once_shuffled_and_seeded(numbered):
    source = PreprocessedSource(numbered, seed=5, shuffle_window=16)
    assert source.info.num_train_samples == N and source.num_batches(8) == 9
    epoch1 = sample_numbers(source.train_batches(8, epoch=1))
    assert sorted(epoch1) == list(range(N)) and epoch1 != list(range(N))
    assert (
        sample_numbers(PreprocessedSource(numbered, seed=5, shuffle_window=16).train_batches(8, 1)) == epoch1
    )
    assert sample_numbers(source.train_batches(8, epoch=2)) != epoch1
    assert (
        sample_numbers(PreprocessedSource(numbered, seed=6, shuffle_window=16).train_batches(8, 1)) != epoch1
    )
    plain = PreprocessedSource(numbered, shuffle=False)
    assert sample_numbers(plain.train_batches(8, 3)) == list(range(N))
    assert sample_numbers(plain.eval_batches(5)) == list(range(1000, 1000 + EVAL_LINES))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("window", [1, 7, 1 << 17])
def test_ranks_partition_the_data_with_equal_batch_counts(numbered, world_size, window):
    for epoch in (0, 1):
        per_rank, sizes = [], []
        for rank in range(world_size):
            source = PreprocessedSource(
                numbered, rank=rank, world_size=world_size, seed=1, shuffle_window=window
            )
            batches = list(source.train_batches(4, epoch))
            assert len(batches) == source.num_batches(4)
            sizes.append([len(b) for b in batches])
            per_rank.append(sample_numbers(batches))
        assert all(s == sizes[0] for s in sizes)  # same number and sizes of batches on every rank
        seen = [x for part in per_rank for x in part]
        assert len(seen) == len(set(seen)) == (N // world_size) * world_size  # no overlap
        assert set(seen) <= set(range(N)) and N - len(seen) == N % world_size  # loss: only the remainder


def test_eval_is_split_over_ranks_too(numbered):
    parts = [
        sample_numbers(PreprocessedSource(numbered, rank=r, world_size=2).eval_batches(4)) for r in range(2)
    ]
    assert parts[0] + parts[1] == list(range(1000, 1000 + EVAL_LINES - 1))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_slices_cover_the_whole_held_out_set_in_every_batch(numbered, world_size):
    """Rank r reads rows [r b, (r + 1) b) of every batch of 4 (b = ceil(n / W)), padded with the
    batch's last sample: in rank order and cut to n, the batches one process reads."""
    readers = [PreprocessedSource(numbered, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [list(reader.eval_slices(4)) for reader in readers]
    want = [sample_numbers([b]) for b in PreprocessedSource(numbered).eval_batches(4)]  # 4, 4, 4, 1 samples
    assert all(len(slices) == len(want) for slices in per_rank)
    for i, numbers in enumerate(want):
        n, b = len(numbers), -(-len(numbers) // world_size)
        assert {per_rank[r][i][1] for r in range(world_size)} == {n}
        assert {len(per_rank[r][i][0]) for r in range(world_size)} == {b}
        joined = [x for r in range(world_size) for x in sample_numbers([per_rank[r][i][0]])]
        assert joined == numbers + [numbers[-1]] * (b * world_size - n)


@pytest.mark.parametrize(("world_size", "stop", "new_batch"), [(1, 3, 8), (2, 2, 5), (4, 1, 3)])
def test_resume_gives_exactly_the_remaining_samples(numbered, world_size, stop, new_batch):
    kw = dict(world_size=world_size, seed=3, shuffle_window=9)
    for rank in range(world_size):
        full = sample_numbers(PreprocessedSource(numbered, rank=rank, **kw).train_batches(4, epoch=2))
        source = PreprocessedSource(numbered, rank=rank, **kw)
        it = source.train_batches(4, epoch=2)
        head = sample_numbers(next(it) for _ in range(stop))
        state = json.loads(json.dumps(source.state()))  # as a checkpoint would store it
        del it
        assert state["epoch"] == 2 and state["samples"] == 4 * stop
        restarted = PreprocessedSource(numbered, rank=rank, **kw)
        restarted.load_state(state)
        tail = sample_numbers(restarted.train_batches(new_batch, epoch=2))
        assert head + tail == full
        assert sample_numbers(restarted.train_batches(4, epoch=2)) == full  # the next pass starts afresh


@pytest.mark.parametrize("threads", [2, 5])
def test_threads_gather_the_same_batches_and_resume_alike(numbered, threads):
    """Batches gathered by several threads are the batches of one, in the same order; the position
    saved counts the batches handed out, not those gathered ahead."""
    kw = dict(world_size=2, rank=1, seed=5, shuffle_window=7)
    for batch_size in (1, 4, 9):
        one = list(PreprocessedSource(numbered, **kw).train_batches(batch_size, epoch=1))
        many = list(PreprocessedSource(numbered, threads=threads, **kw).train_batches(batch_size, epoch=1))
        assert len(one) == len(many)
        for a, b in zip(one, many, strict=True):
            assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels) and a.sparse == b.sparse
    source = PreprocessedSource(numbered, threads=threads, **kw)
    it = source.train_batches(4, epoch=1)
    head = sample_numbers(next(it) for _ in range(2))
    assert source.state()["samples"] == 8
    restarted = PreprocessedSource(numbered, threads=threads, **kw)
    restarted.load_state(source.state())
    full = sample_numbers(PreprocessedSource(numbered, **kw).train_batches(4, epoch=1))
    assert head + sample_numbers(restarted.train_batches(4, epoch=1)) == full


def test_reader_threads_auto_is_one_per_four_cores_of_each_process(monkeypatch):
    from neorec.train.build import reader_threads

    for cores, local, want in [(2, 1, 1), (16, 1, 4), (16, 2, 2), (64, 1, 4), (16, 8, 1)]:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, c=cores: set(range(c)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert reader_threads("auto") == want
    assert reader_threads(3) == 3
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        PreprocessedSource(Path("."), threads=0)


def test_resume_refuses_another_layout(numbered):
    state = PreprocessedSource(numbered, world_size=2).state()
    with pytest.raises(ConfigError, match=r"number of processes \(--nproc\) 2, this run has 4"):
        PreprocessedSource(numbered, world_size=4).load_state(state)
    with pytest.raises(DataError, match="outside"):
        PreprocessedSource(numbered).load_state({"epoch": 0, "samples": N + 1})


def test_multi_hot_weighted_batches_equal_the_generator(tmp_path):
    spec = SyntheticSpec(rows=[30, 500], num_dense=3, bag_sizes=[3, 1], variable_bags=True, weighted=True,
                         train_samples=20000, eval_samples=3000, seed=2)  # fmt: skip
    preprocess_synthetic(spec, tmp_path, blocks_per_shard=1, progress=False)
    source = PreprocessedSource(tmp_path, shuffle=False, shuffle_window=5000)
    want = list(SyntheticSource(spec).train_batches(777))
    got = list(source.train_batches(777))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.dense, w.dense) and torch.equal(g.labels, w.labels) and g.sparse == w.sparse
    assert [f.multi_hot and f.weighted for f in source.info.features] == [True, True]


def test_unfinished_folder_is_refused(tmp_path):
    spec = SyntheticSpec(rows=[10], num_dense=1, train_samples=40000, eval_samples=100)
    preprocess_synthetic(spec, tmp_path, blocks_per_shard=1, progress=False, max_shards=1)
    with pytest.raises(DataError, match="not finished; rerun"):
        PreprocessedSource(tmp_path)


def test_config_builds_the_reader_and_names_keys(numbered):
    cfg = load_config(None, ["data.source=preprocessed", f"data.preprocessed.path={numbered}"])
    source = build_source(cfg)
    assert isinstance(source, PreprocessedSource) and source.info.num_train_samples == N
    assert source.num_skipped == 0
    with pytest.raises(ConfigError, match="data.preprocessed section"):
        load_config(None, ["data.source=preprocessed"])
    with pytest.raises(ConfigError, match="data.preprocessed.path: /no/such has no manifest.json"):
        build_source(load_config(None, ["data.source=preprocessed", "data.preprocessed.path=/no/such"]))
    with pytest.raises(ConfigError, match="shuffle_window"):
        load_config(
            None,
            ["data.source=preprocessed", "data.preprocessed.path=x", "data.preprocessed.shuffle_window=0"],
        )


def test_training_on_preprocessed_data_equals_training_on_the_generator(tmp_path):
    from neorec.data.synthetic import spec_from_config
    from neorec.train.trainer import Trainer

    tiny = ["data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4", "data.synthetic.train_samples=3000",
            "data.synthetic.eval_samples=1000", "data.batch_size=256", "train.progress=false", "train.threads=1",
            "logging.plot=false", "logging.tensorboard=false", "model.bottom_mlp=[16]", "model.top_mlp=[16]"]  # fmt: skip
    cfg = load_config(None, tiny)
    preprocess_synthetic(spec_from_config(cfg.data.synthetic, cfg.seed), tmp_path / "data", progress=False)
    direct = Trainer(cfg, tmp_path / "direct").fit()
    sets = [
        "data.source=preprocessed",
        f"data.preprocessed.path={tmp_path / 'data'}",
        "data.preprocessed.shuffle=false",
    ]
    run = [kv for kv in tiny if not kv.startswith("data.synthetic.")]  # the data is the folder's
    via_shards = Trainer(load_config(None, run + sets), tmp_path / "shards").fit()
    assert via_shards.steps == direct.steps == 12
    assert via_shards.losses == direct.losses
    assert via_shards.eval["auc"] == direct.eval["auc"]
