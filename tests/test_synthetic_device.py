"""data.synthetic.generator: device — blocks drawn with torch where training runs.

The teacher and the hashes are the host generator's, bitwise; the random stream is torch's, so the
samples are another draw from the same distribution. Checked on the CPU (torch's CPU generator) and,
where there is one, on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.config.load import load_config
from neorec.data import synthetic_device as sd
from neorec.data.synthetic import SyntheticSource, SyntheticSpec, _hash_uniform, raw_ids, spec_from_config
from neorec.metrics.auc import auc
from neorec.train.build import build_source
from neorec.train.trainer import Trainer


def spec(**kw) -> SyntheticSpec:
    base = {"rows": [50, 3000, 7, 100_000, 1], "train_samples": 40_000, "eval_samples": 20_000, "seed": 3}
    return SyntheticSpec(**{**base, **kw})


def test_hashes_are_the_host_generators_bit_for_bit():
    rng = np.random.default_rng()
    ids = np.concatenate([rng.integers(0, 2**62, 3000), rng.integers(0, 100, 50), [0, 2**62 - 1]])
    for key in rng.integers(0, 2**31, 4).tolist() + [0]:
        host = _hash_uniform(ids, key, 9)
        device = sd.hash_uniform(torch.from_numpy(ids), key, 9).to(torch.float32).numpy()
        assert np.array_equal(host, device), key
        assert np.array_equal(raw_ids(ids, key), sd.raw_ids(torch.from_numpy(ids), key).numpy()), key


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"bag_sizes": [1, 4, 2, 9, 3]},
        {"bag_sizes": [1, 4, 0, 9, 3], "variable_bags": True, "weighted": True},
        {"labels": ("click", "conversion")},
    ],  # fmt: skip
    ids=["one-hot", "fixed-bags", "poisson-weighted", "two-labels"],
)
def test_device_blocks_follow_the_host_distribution_and_teacher(kw):
    s = spec(**kw)
    host = SyntheticSource(s, cache=False)
    dev = SyntheticSource(s, cache=False, generator="device")
    h = [host.block("eval", i) for i in range(2)]
    d = [dev.block("eval", i) for i in range(2)]

    def click(b):
        return b.labels[:, 0] if b.labels.dim() == 2 else b.labels

    ctr_h = float(torch.cat([click(b) for b in h]).mean())
    ctr_d = float(torch.cat([click(b) for b in d]).mean())
    assert abs(ctr_h - ctr_d) < 0.02 and abs(ctr_d - s.base_ctr) < 0.02, (ctr_h, ctr_d)
    auc_h = auc(torch.cat([b.probs for b in h]), torch.cat([click(b) for b in h]))
    auc_d = auc(torch.cat([b.probs for b in d]), torch.cat([click(b) for b in d]))
    assert abs(auc_h - auc_d) < 0.02, (auc_h, auc_d)
    b = d[0]
    n = len(b)
    assert b.dense.dtype == torch.float32 and b.dense.shape == (n, s.num_dense)
    assert abs(float(b.dense.mean()) - float(h[0].dense.mean())) < 0.05
    # the labels' probabilities are the host teacher's on these very features
    teacher = host.teacher
    dense_std = (b.dense.double().numpy() - teacher.dense_mu) / teacher.dense_sigma
    bags = [(v.numpy(), ln.numpy(), None) for v, ln in zip(b.values, b.lengths, strict=True)]
    want = 1.0 / (1.0 + np.exp(-teacher.logits(dense_std, bags)))
    np.testing.assert_allclose(b.probs.numpy(), want, rtol=1e-5, atol=1e-6)
    for f, (v, ln, off) in enumerate(zip(b.values, b.lengths, b.offsets, strict=True)):
        assert v.dtype == torch.int64 and ln.shape == (n,)
        assert v.numel() == 0 or (int(v.min()) >= 0 and int(v.max()) < s.rows[f])
        if off is None:
            assert v.numel() == n and bool((ln == 1).all())
        else:  # host offsets agree with the device lengths: batches are cut without reading sizes back
            assert off[-1] == v.numel() and np.array_equal(np.diff(off), ln.numpy())
        if s.bag_sizes is not None and not s.variable_bags:
            assert bool((ln == s.bag_sizes[f]).all())
    if s.variable_bags:
        assert any(bool((ln == 0).any()) for ln in b.lengths)  # empty bags occur
        means = [float(ln.double().mean()) for ln in b.lengths]
        assert all(
            abs(m - want_mean) < 0.1 * want_mean + 0.05
            for m, want_mean in zip(means, s.bag_sizes, strict=True)
        )
    if s.weighted:
        w = torch.cat(b.weights)
        assert w.dtype == torch.float32 and float(w.min()) > 0 and float(w.max()) <= 1.001
    # Zipf: the most popular id of a large table takes a share like the host's
    top = lambda blk: np.bincount(blk.values[3].numpy()).max() / blk.values[3].numel()  # noqa: E731
    assert abs(top(b) - top(h[0])) < 0.02


def test_device_blocks_are_a_function_of_seed_split_and_index():
    s = spec(bag_sizes=[2, 1, 3, 1, 5], variable_bags=True)
    a = SyntheticSource(s, cache=False, generator="device")
    b = SyntheticSource(s, cache=False, generator="device")
    late = b.block("train", 2)  # drawn first here, third there: the same samples
    for i in range(3):
        x = a.block("train", i)
        if i == 2:
            for name in ("dense", "labels", "probs"):
                assert torch.equal(getattr(x, name), getattr(late, name))
            assert all(torch.equal(u, v) for u, v in zip(x.values, late.values, strict=True))
    assert not torch.equal(a.block("train", 0).dense, a.block("train", 1).dense)
    assert not torch.equal(a.block("train", 0).dense, a.block("eval", 0).dense)
    other = SyntheticSource(
        spec(bag_sizes=[2, 1, 3, 1, 5], variable_bags=True, seed=4), cache=False, generator="device"
    )
    assert not torch.equal(a.block("train", 0).dense, other.block("train", 0).dense)


def test_device_batches_do_not_depend_on_the_batch_size_and_raw_ids_map_back():
    s = spec(bag_sizes=[1, 3, 1, 2, 1])
    src = SyntheticSource(s, generator="device", raw_features={"C2"})
    small = list(src.train_batches(1000))
    big = list(src.train_batches(4096))
    assert sum(len(b) for b in small) == sum(len(b) for b in big) == s.train_samples
    assert torch.equal(torch.cat([b.labels for b in small]), torch.cat([b.labels for b in big]))
    assert torch.equal(torch.cat([b.dense for b in small]), torch.cat([b.dense for b in big]))

    def feature(batches, f):  # feature f's ids over all batches (a batch holds its ids feature by feature)
        out = []
        for b in batches:
            per_feature = b.sparse.lengths.view(len(s.rows), -1).sum(1).tolist()
            out.append(b.sparse.values.split(per_feature)[f])
        return torch.cat(out)

    assert all(torch.equal(feature(small, f), feature(big, f)) for f in range(len(s.rows)))
    for b in small + big:  # each feature's number of ids comes with the batch (from the host offsets)
        assert b.sparse._length_per_key == b.sparse.lengths.view(len(s.rows), -1).sum(1).tolist()
    block = src.block("train", 0)
    plain = SyntheticSource(s, generator="device").block("train", 0)
    assert torch.equal(block.values[1], sd.raw_ids(plain.values[1], src.teacher.key[1]))
    assert torch.equal(block.values[0], plain.values[0])


def test_generator_setting_picks_the_drawer_and_a_device_drawn_run_learns(tmp_path):
    base = ["data.synthetic.preset=custom", "data.synthetic.rows=[200, 3000, 7, 5000]", "data.synthetic.num_sparse=4",
            "data.synthetic.train_samples=20000", "data.synthetic.eval_samples=4000", "data.batch_size=256",
            "train.progress=false", "logging.plot=false", "logging.tensorboard=false"]  # fmt: skip
    assert build_source(load_config("default", base)).generator == "host"  # auto on the CPU
    cfg = load_config("default", [*base, "data.synthetic.generator=device"])
    assert build_source(cfg).generator == "device"
    result = Trainer(cfg, tmp_path / "run").fit()
    assert result.eval["auc"] > 0.7, result.eval
    with pytest.raises(Exception, match="generator"):
        load_config("default", [*base, "data.synthetic.generator=gpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_draws_are_deterministic_on_the_gpu_and_never_wait_on_the_host():
    cfg = load_config("criteo_kaggle", ["train.device=cuda", "data.synthetic.train_samples=50000"])
    s = spec_from_config(cfg.data.synthetic, 0)
    a = SyntheticSource(s, cache=False, device="cuda", generator="device")
    b = SyntheticSource(s, device="cuda", generator="device")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        blocks = [a.block("train", i) for i in range(2)]
        batches = list(b.train_batches(4096))
        shuffled = list(b.train_batches(4096, epoch=1))  # a later epoch gathers samples in a new order
        counts = [batch.sparse.length_per_key() for batch in batches + shuffled]  # carried, not read back
        limits = [batch.sparse.id_limits() for batch in batches + shuffled]  # the generator's: no read either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert limits[0] == ([0] * len(s.rows), [r - 1 for r in s.rows])
    assert blocks[0].dense.is_cuda and batches[0].sparse.values.is_cuda and shuffled[0].labels.is_cuda
    assert len(shuffled) == len(batches) and not torch.equal(shuffled[0].labels, batches[0].labels)
    assert counts[0] == batches[0].sparse.lengths.view(len(s.rows), -1).sum(1).tolist()
    again = SyntheticSource(s, cache=False, device="cuda", generator="device").block("train", 1)
    assert torch.equal(again.labels, blocks[1].labels) and torch.equal(again.values[5], blocks[1].values[5])
    ctr = float(torch.cat([b.labels for b in blocks]).mean())
    assert abs(ctr - s.base_ctr) < 0.02
