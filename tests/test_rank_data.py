"""What each of W processes reads (neorec/data/ranks.py), and the trainer under W gloo processes
against one process, step by step:
- synthetic data: each rank makes only its slice of every global batch; 2 ranks train like one process
  on the same global batches;
- preprocessed data: each rank reads its own part; 2 ranks train like one process on the global
  batches made of the ranks' local batches concatenated in rank order, evaluate on the whole held-out
  set, and resume (reader position restored, not re-read) to bitwise the uninterrupted run.

Tolerance of 2 ranks against one process: 1e-5 relative, as in test_distributed (fp32 exchanges change
only the order of float additions); resumed against uninterrupted runs: bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_helpers import spawn

from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.data.ranks import RankData
from neorec.data.sharded_reader import PreprocessedSource
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import ConfigError
from neorec.sparse import SparseBatch


def concat_samples(batches: list[Batch]) -> Batch:
    """Batches one after the other along the samples (the global batch of per-rank local batches)."""
    feats = {}
    for k in batches[0].sparse.keys:
        parts = [b.sparse.feature(k) for b in batches]
        ids, lengths = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        feats[k] = (ids, lengths) if parts[0][2] is None else (ids, lengths, torch.cat([p[2] for p in parts]))
    return Batch(
        torch.cat([b.dense for b in batches]), SparseBatch.from_features(feats), torch.cat([b.labels for b in batches])
    )


def assert_same(got: Batch, want: Batch) -> None:
    assert torch.equal(got.dense, want.dense) and torch.equal(got.labels, want.labels)
    assert got.sparse == want.sparse


SPEC = SyntheticSpec(rows=[30, 500, 7], num_dense=3, bag_sizes=[3, 1, 2], variable_bags=True, weighted=True,
                     train_samples=40000, eval_samples=1000, seed=4)  # fmt: skip


# ---- what a rank reads (no processes) --------------------------------------------------------------
@pytest.mark.parametrize("epoch", [0, 1])
def test_synthetic_slices_are_the_global_batches_cut(epoch):
    """3 ranks, batches of 999 over 40000 samples: the last global batch (40 samples) loses 1."""
    source = SyntheticSource(SPEC)
    whole = list(source.train_batches(999, epoch))
    slices = [list(RankData(source, 999, r, 3).train_batches(epoch)) for r in range(3)]
    assert all(len(s) == len(whole) for s in slices)
    for i, batch in enumerate(whole):
        b = len(batch) // 3
        assert_same(concat_samples([s[i] for s in slices]), batch.slice(0, 3 * b))
    assert RankData(source, 999, 0, 3).steps_per_epoch() == len(whole)
    assert RankData(source, 999, 0, 3).untrained_per_epoch() == 1
    assert RankData(source, 999).untrained_per_epoch() == 0


def test_samples_no_rank_trains_are_counted_or_said_when_they_happen(neorec_warnings):
    """A last global batch that does not divide over the ranks loses its remainder: counted where the
    source's size is known (the trainer warns at its start), said by rank 0 when it happens where not."""
    source = SyntheticSource(SPEC)  # 40000 samples: batches of 1000 divide, of 999 leave 40
    assert RankData(source, 1000, 0, 3).untrained_per_epoch() == 0
    assert RankData(source, 999, 0, 7).untrained_per_epoch() == 40 % 7
    unknown = RankData(source, 999, 0, 3)
    unknown.source = type("Stream", (), {"info": type("Info", (), {"num_train_samples": None})()})()
    assert unknown.untrained_per_epoch() is None
    unknown.local_batch(next(iter(source.train_batches(40, 0))))  # 40 over 3: one not trained
    unknown.local_batch(next(iter(source.train_batches(40, 0))))
    said = [r.getMessage() for r in neorec_warnings.records]
    assert said == ["a last batch of 40 samples does not divide over 3 processes: each trains 13 of them, "
                    "leaving 1 untrained (one process trains them all); a number of training samples that "
                    "leaves a last batch divisible by 3 trains every one"]  # fmt: skip


@pytest.mark.parametrize(("epoch", "skip"), [(0, 3), (1, 20), (1, 0)])
def test_synthetic_resume_starts_after_the_trained_samples_without_drawing_them(epoch, skip):
    """Batches of 1000: 16384-sample blocks; resuming after 20 batches never draws the blocks that
    lie wholly before sample 20000 in that epoch's block order."""
    full = list(SyntheticSource(SPEC).train_batches(1000, epoch))
    source = SyntheticSource(SPEC)
    data = RankData(source, 1000)
    position = json.loads(json.dumps(data.position(epoch, skip)))  # as a checkpoint stores it
    want = {"seed": 4, "train_samples": 40000, "generator": "host", "epoch": epoch, "samples": 1000 * skip}
    assert position["reader"] == want
    tail = list(data.train_batches(epoch, position))
    assert len(tail) == len(full) - skip
    for got, want in zip(tail, full[skip:], strict=True):
        assert_same(got, want)
    if skip == 20:  # block order of epoch 1 is a permutation: the first block (16384 samples) is skipped
        assert len(source._blocks) == source.num_blocks("train") - 1
    other = SyntheticSource(SyntheticSpec(**{**vars(SPEC), "train_samples": 30000}))
    with pytest.raises(ConfigError, match="train_samples=40000.*30000"):
        RankData(other, 1000).train_batches(epoch, {**position, "batches": 1})


def test_eval_slices_pad_with_the_last_sample_and_cover_the_batch():
    source = SyntheticSource(SPEC)
    for world in (2, 3, 7):
        for i, batch in enumerate(source.eval_batches(300)):  # 300, 300, 300, 100 samples
            parts = [list(RankData(source, 300, r, world).eval_slices(300))[i] for r in range(world)]
            assert {n for _, n in parts} == {len(batch)} and len({len(p) for p, _ in parts}) == 1
            joined = concat_samples([p for p, _ in parts])
            assert_same(joined.slice(0, len(batch)), batch)
            last = batch.slice(len(batch) - 1, len(batch))
            for k in range(len(batch), len(joined)):
                assert_same(joined.slice(k, k + 1), last)


# ---- 2 gloo processes against one ------------------------------------------------------------------
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.multi_hot=[1, 2, 1, 3]", "data.synthetic.variable_bags=true",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=256",
    "data.eval_batch_size=97", "train.progress=false", "train.threads=1", "train.log_every=3",
    "train.epochs=2", "train.max_steps=20", "logging.plot=false", "logging.tensorboard=false",
    "model.bottom_mlp=[16, 8]", "model.top_mlp=[16]", "embedding.dim=8",
    "embedding.optimizer.name=adagrad", "embedding.optimizer.lr=0.05",
    "train.dense_optimizer.name=sgd", "train.dense_optimizer.lr=0.05",
    "distributed.forward_precision=fp32", "distributed.backward_precision=fp32",
]  # fmt: skip

TINY_RUN = [kv for kv in TINY if not kv.startswith("data.synthetic.")]  # for a run on the preprocessed data


def preprocessed_sets(root) -> list[str]:
    return ["data.source=preprocessed", f"data.preprocessed.path={root}", "data.preprocessed.shuffle_window=200"]


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    from neorec.data.preprocess import preprocess_synthetic
    from neorec.data.synthetic import spec_from_config

    root = tmp_path_factory.mktemp("pre") / "data"
    cfg = load_config(None, TINY)
    preprocess_synthetic(spec_from_config(cfg.data.synthetic, cfg.seed), root, blocks_per_shard=1, progress=False)
    return root


def _as_rank(topo) -> None:
    """What torchrun would set: the trainer reads its rank from the environment."""
    os.environ.update(WORLD_SIZE=str(topo.world_size), RANK=str(topo.rank), LOCAL_WORLD_SIZE=str(topo.world_size))


def _weights(out_dir) -> dict:
    return {k: v for k, v in torch.load(out_dir / "model.pt", weights_only=True).items() if v.is_floating_point()}


def train_two_ranks_synthetic(topo, root):
    from neorec.train.trainer import Trainer

    _as_rank(topo)
    r = Trainer(load_config(None, TINY), root / "two").fit()
    return r.losses, r.eval


def test_two_ranks_train_like_one_process_on_synthetic_slices(tmp_path):
    from neorec.train.trainer import Trainer

    two = spawn(2, train_two_ranks_synthetic, (tmp_path,), tmp_path=tmp_path / "pg")
    one = Trainer(load_config(None, TINY), tmp_path / "one").fit()
    global_losses = [(a + b) / 2 for a, b in zip(two[0][0], two[1][0], strict=True)]
    torch.testing.assert_close(torch.tensor(global_losses), torch.tensor(one.losses), rtol=1e-5, atol=1e-6)
    for rank in (0, 1):
        assert two[rank][1].keys() == one.eval.keys()
        for key, value in one.eval.items():
            assert two[rank][1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    want = _weights(tmp_path / "one")
    for key, value in _weights(tmp_path / "two").items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)


class RankOrderSource:
    """One process's equivalent of a W-process run on preprocessed data: the global batch of a step is
    the W ranks' local batches concatenated in rank order; the held-out set is the whole one."""

    def __init__(self, root, world_size: int, seed: int, shuffle_window: int) -> None:
        self.parts = [PreprocessedSource(root, rank=r, world_size=world_size, seed=seed, shuffle_window=shuffle_window)
                      for r in range(world_size)]  # fmt: skip
        self.whole = PreprocessedSource(root, seed=seed, shuffle_window=shuffle_window)
        self.info = self.whole.info
        self.info.num_train_samples = self.parts[0].info.num_train_samples * world_size

    def train_batches(self, batch_size: int, epoch: int = 0):
        local = [p.train_batches(batch_size // len(self.parts), epoch) for p in self.parts]
        return (concat_samples(list(batches)) for batches in zip(*local, strict=True))

    def eval_batches(self, batch_size: int):
        return self.whole.eval_batches(batch_size)


def train_two_ranks_preprocessed_and_resume(topo, root, out):
    """Uninterrupted; then stopped at step 17 (checkpoints at 7 and 14) and resumed."""
    from neorec.data import sharded_reader
    from neorec.train.trainer import Trainer

    _as_rank(topo)
    sets = [*TINY_RUN, *preprocessed_sets(root), "checkpoint.every_steps=7"]
    whole = Trainer(load_config(None, sets), out / "whole").fit()
    stopping = Trainer(load_config(None, sets), out / "run")
    step = Trainer.train_step
    count = [0]

    def stop_at_17(self, *args, **kwargs):
        if count[0] == 16:
            raise KeyboardInterrupt("stopped")
        count[0] += 1
        return step(self, *args, **kwargs)

    Trainer.train_step = stop_at_17
    try:
        stopping.fit()
    except KeyboardInterrupt:
        pass
    finally:
        Trainer.train_step = step
    loaded, reads = [], []
    load_state, batches = sharded_reader.PreprocessedSource.load_state, sharded_reader.PreprocessedSource._batches

    def spy_load(self, state):
        loaded.append(dict(state))
        return load_state(self, state)

    def spy_batches(self, split, batch_size, epoch, start):
        if split == "train" and self.world_size == 2:  # (the planner samples 2 batches with a one-rank reader)
            reads.append((batch_size, epoch, start))
        return batches(self, split, batch_size, epoch, start)

    sharded_reader.PreprocessedSource.load_state = spy_load
    sharded_reader.PreprocessedSource._batches = spy_batches
    try:
        resumed = Trainer(load_config(None, sets), out / "run", resume=True).fit()
    finally:
        sharded_reader.PreprocessedSource.load_state, sharded_reader.PreprocessedSource._batches = load_state, batches
    return whole.losses, whole.eval, resumed.losses, resumed.eval, loaded, reads


def test_two_ranks_on_preprocessed_parts_train_like_one_process_and_resume_exactly(tmp_path, preprocessed):
    """12 steps per epoch (1500 samples per rank, local batches of 128); 20 steps."""
    from neorec.train.trainer import Trainer

    out = tmp_path / "runs"
    two = spawn(2, train_two_ranks_preprocessed_and_resume, (preprocessed, out), tmp_path=tmp_path / "pg")
    cfg = load_config(None, [*TINY_RUN, *preprocessed_sets(preprocessed)])
    trainer = Trainer(cfg, tmp_path / "one")
    trainer.source = RankOrderSource(preprocessed, 2, cfg.seed, 200)
    trainer.data = RankData(trainer.source, cfg.data.batch_size)
    one = trainer.fit()
    assert len(one.losses) == 20 and trainer.data.steps_per_epoch() == 12
    rank_part = PreprocessedSource(preprocessed, rank=1, world_size=2, shuffle_window=200)
    assert RankData(rank_part, 256, 1, 2).steps_per_epoch() == 12

    losses = [(a + b) / 2 for a, b in zip(two[0][0], two[1][0], strict=True)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), rtol=1e-5, atol=1e-6)
    for rank in (0, 1):
        whole_losses, whole_eval, resumed_losses, resumed_eval, loaded, reads = two[rank]
        assert whole_eval.keys() == one.eval.keys()
        for key, value in one.eval.items():  # the whole held-out set (batches of 97 and 15: both padded)
            assert whole_eval[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert resumed_losses == whole_losses[14:] and resumed_eval == whole_eval  # bitwise
        # the reader restarted after the 2 batches of epoch 1 trained before step 14, without reading them
        assert [(s["epoch"], s["samples"], s["rank"], s["world_size"]) for s in loaded] == [(1, 256, rank, 2)]
        assert reads == [(128, 1, 256)]
    want = _weights(tmp_path / "one")
    whole, run = _weights(out / "whole"), _weights(out / "run")
    for key, value in whole.items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(run[key], value), key
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    uninterrupted = [json.loads(x) for x in (out / "whole" / "metrics.jsonl").read_text().splitlines()]
    # train lines at 3..18 and 20 (the last steps), evaluations at 4, 8, 12, 16 (train.eval_every auto)
    # and 20, epoch 0's end at 12
    assert len(lines) == len(uninterrupted) == 13
    timed = ("time", "samples_per_s", "data_wait_ms")
    for got, want in zip(lines, uninterrupted, strict=True):  # the same lines, up to times and speeds
        assert {k: v for k, v in got.items() if k not in timed} == {k: v for k, v in want.items() if k not in timed}


def test_samples_no_rank_reads_are_counted_and_warned_of(tmp_path):
    """Each of W ranks reads N // W training samples of an epoch: the N % W left are counted, and the
    trainer warns of them at its start (18 training rows: none left over 2 ranks, 2 over 4)."""
    from test_parquet import FIXTURE, criteo_config, tsv_to_parquet  # (it imports this module)

    from neorec.data.parquet import ParquetSource
    from neorec.data.preprocess import preprocess_criteo
    from neorec.data.sharded_reader import PreprocessedSource

    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", row_group_size=7)
    preprocess_criteo([FIXTURE], tmp_path / "pre", table_rows=50, progress=False)  # 18 train lines, too
    for world, left in ((2, 0), (4, 2)):
        for source in (ParquetSource(criteo_config([path]), rank=1, world_size=world),
                       PreprocessedSource(tmp_path / "pre", rank=1, world_size=world)):  # fmt: skip
            data = RankData(source, 2 * world, 1, world)
            assert data.untrained_per_epoch() == left and source.num_samples() == 18 // world
            if left:
                assert data.untrained_warning() == (
                    "the 18 training samples do not divide over 4 processes: each reads 4 of them, leaving "
                    "the last 2 of the epoch's order untrained (one process trains them all); a number of "
                    "training samples divisible by 4 trains every one")  # fmt: skip
            else:
                assert data.untrained_warning() is None


def test_a_last_batch_of_one_sample_is_a_step_and_the_epoch_ends_at_its_size():
    """257 samples in batches of 256 are 2 steps (the step count sets the schedule's length); after
    the short last batch the position is the epoch's 300 samples, not 2 whole batches' 512."""
    from types import SimpleNamespace

    def source(n: int):
        return SimpleNamespace(info=SimpleNamespace(num_train_samples=n), state=lambda: {})

    assert RankData(source(257), 256).steps_per_epoch() == 2
    assert RankData(source(257), 128).steps_per_epoch() == 3
    assert RankData(source(300), 256).position(0, 2)["reader"]["samples"] == 300


def test_parquet_held_out_slices_of_two_ranks_cover_an_uneven_set(tmp_path):
    """5 held-out rows on 2 ranks: the ranks' slices, joined and cut to the batch, are the rows one
    process scores (the last rank pads with the last row, and scores it)."""
    from test_parquet import FIXTURE, criteo_config, tsv_to_parquet

    from neorec.data.parquet import ParquetSource

    train = tsv_to_parquet(FIXTURE, tmp_path / "t.parquet", 5, eval_every=4)  # 5 held-out rows
    whole = list(ParquetSource(criteo_config([train])).eval_batches(5))
    ranks = [ParquetSource(criteo_config([train]), rank=r, world_size=2) for r in range(2)]
    parts = [list(source.eval_slices(5)) for source in ranks]
    assert whole and all(len(p) == len(whole) for p in parts)
    for i, batch in enumerate(whole):
        joined = concat_samples([parts[r][i][0] for r in range(2)])
        assert_same(joined.slice(0, len(batch)), batch)


def test_parquet_row_groups_of_one_size_are_shuffled_each_their_own_way(tmp_path):
    """The order inside a row group comes from (seed, epoch, row group): groups of one size differ."""
    from test_parquet import FIXTURE, criteo_config, tsv_to_parquet

    from neorec.data.parquet import ParquetSource

    train = tsv_to_parquet(FIXTURE, tmp_path / "t.parquet", 5, eval_every=None)  # 4 row groups of 5
    source = ParquetSource(criteo_config([train], eval_column=None, shuffle=True), seed=3)
    orders = [tuple(order.tolist()) for _, order in source._windows("train", 1, 0, 20)]
    assert len(orders) == 4 and len(set(orders)) > 1
