import math

import numpy as np
import torch

from neorec.data.synthetic import BLOCK, SyntheticSource, SyntheticSpec, zipf_ranks


def spec(**kw):
    base = dict(rows=[50, 1000, 7, 20000], num_dense=5, train_samples=BLOCK + 1000, eval_samples=3000, seed=3)
    base.update(kw)
    return SyntheticSpec(**base)


def collect(batches):
    batches = list(batches)
    return (torch.cat([b.dense for b in batches]), torch.cat([b.labels for b in batches]),
            torch.cat([b.sparse.feature("C2")[0] for b in batches]))  # fmt: skip


def test_deterministic_and_independent_of_batch_size():
    a = collect(SyntheticSource(spec()).train_batches(1000))
    b = collect(SyntheticSource(spec()).train_batches(4096))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    c = collect(SyntheticSource(spec(seed=4)).train_batches(1000))
    assert not torch.equal(a[1], c[1])


def test_ids_in_range_and_batches_validate():
    s = SyntheticSource(spec(bag_sizes=[1, 3, 0, 2], variable_bags=True, weighted=True))
    rows = {f.name: f.num_ids for f in s.info.features}
    n = 0
    for b in s.train_batches(777, epoch=1):
        b.sparse.validate(rows)
        assert b.sparse.weights is not None and bool((b.sparse.weights > 0).all())
        n += len(b)
    assert n == s.spec.train_samples
    lengths = next(iter(s.train_batches(2000))).sparse.feature("C2")[1]
    assert int((lengths == 0).sum()) > 0  # Poisson bags include empty ones


def test_epoch_shuffle_is_a_permutation():
    s = SyntheticSource(spec())
    e0, e1 = collect(s.train_batches(1000, 0)), collect(s.train_batches(1000, 1))
    assert not torch.equal(e0[0], e1[0])
    key = lambda d: sorted(map(tuple, d.numpy().round(5).tolist()))  # noqa: E731
    assert key(e0[0]) == key(e1[0])


def test_zipf_is_skewed_and_popular_ids_are_scattered():
    rng = np.random.default_rng(0)
    ranks = zipf_ranks(rng, 200_000, 10_000, 1.1)
    counts = np.bincount(ranks, minlength=10_000)
    assert counts[:100].sum() / counts.sum() > 0.3  # the top 1% of ids get a large share
    assert counts[0] > counts[10] > counts[1000]
    s = SyntheticSource(spec())
    top = s.teacher.scatter(3, np.arange(10))
    assert top.max() > 1000  # the ten most popular ids are not the ten smallest


def test_labels_follow_the_teacher():
    s = SyntheticSource(spec(eval_samples=40_000))
    auc = s.teacher_auc()
    assert 0.75 < auc < 0.95
    labels = torch.cat([b.labels for b in s.eval_batches(10_000)])
    assert math.isclose(float(labels.mean()), s.spec.base_ctr, abs_tol=0.02)


def test_shards_roundtrip(tmp_path):
    from neorec.data.shards import ShardSource, write_shards

    s = SyntheticSource(spec(bag_sizes=[1, 2, 1, 3]))
    write_shards(s, tmp_path)
    r = ShardSource(tmp_path)
    assert r.info.feature_names == s.info.feature_names
    for x, y in zip(collect(s.train_batches(999)), collect(r.train_batches(999)), strict=True):
        assert torch.equal(x, y)
    assert r.teacher_auc() == s.teacher_auc()


def test_blocks_cut_by_host_offsets_even_when_ids_equal_samples():
    """A multi-hot feature whose ids happen to number as many as its samples (bags of 0, 2, 1, 1)
    is still cut by its bags, and the cuts keep their offsets on the host."""
    from neorec.data.blocks import Block

    lengths = torch.tensor([0, 2, 1, 1])
    ids = torch.tensor([10, 11, 12, 13])
    block = Block(torch.zeros(4, 1), torch.zeros(4), torch.zeros(4), [ids], [lengths], None)
    part = block.slice(1, 3)
    assert part.values[0].tolist() == [10, 11, 12] and part.offsets[0].tolist() == [0, 2, 3]
    taken = block.take(torch.tensor([3, 1, 0]))
    assert taken.values[0].tolist() == [13, 10, 11] and taken.lengths[0].tolist() == [1, 2, 0]
    joined = Block.cat([part, block.slice(3, 4)])
    assert joined.values[0].tolist() == [10, 11, 12, 13] and joined.offsets[0].tolist() == [0, 2, 3, 4]
    one_hot = Block(torch.zeros(2, 1), torch.zeros(2), torch.zeros(2), [ids[:2]], [torch.ones(2, dtype=torch.int64)], None)
    assert one_hot.offsets == [None] and Block.cat([one_hot, block]).offsets[0].tolist() == [0, 1, 2, 2, 4, 5, 6]


def test_source_keeps_blocks_on_its_device():
    """device="cpu" here; on a GPU the same code keeps every drawn block in device memory."""
    source = SyntheticSource(spec(), device="cpu")
    batch = next(iter(source.train_batches(64)))
    assert batch.dense.device == source.device == torch.device("cpu")
    assert source.block("train", 0) is source.block("train", 0)  # drawn once, kept


def test_teacher_fit_is_made_once_per_spec_and_is_the_same(monkeypatch):
    """A second source of the same teacher settings (a run that plans builds its data twice) takes
    the first one's fit, bit for bit, without drawing the calibration sample again; other settings
    (here the seed) get a fit of their own."""
    from neorec.data import synthetic

    spec = SyntheticSpec(rows=[50, 70, 90], train_samples=1000, eval_samples=200, seed=41)
    synthetic._CALIBRATED.clear()
    first = synthetic.Teacher(spec)

    def no_draw(*args, **kwargs):
        raise AssertionError("the calibration sample was drawn again")

    with monkeypatch.context() as m:
        m.setattr(synthetic, "_draw", no_draw)
        again = synthetic.Teacher(SyntheticSpec(rows=[50, 70, 90], train_samples=5, eval_samples=7, seed=41))
    assert (again.scale, again.bias) == (first.scale, first.bias)
    other = synthetic.Teacher(SyntheticSpec(rows=[50, 70, 90], seed=42))
    assert (other.scale, other.bias) != (first.scale, first.bias)
    synthetic._CALIBRATED.clear()
    fresh = synthetic.Teacher(spec)  # fitted afresh: the same values
    assert (fresh.scale, fresh.bias) == (first.scale, first.bias)
