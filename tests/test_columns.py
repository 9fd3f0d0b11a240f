"""Columns (neorec/data/columns.py): gathering samples out of a shuffle window, concatenating windows
and making batches, against the samples picked one by one."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neorec.data.columns import Columns, cut_batches
from neorec.data.packed import PackedColumns


def random_columns(rng: np.random.Generator, n: int, kinds: list[str], id_dtype) -> Columns:
    """n samples; per feature of `kinds` ("one", "multi", "weighted"): ids of `id_dtype`, bag sizes 0-3
    for the multi-hot ones, weights for the weighted ones."""
    values, lengths, weights = [], [], []
    for kind in kinds:
        ln = None if kind == "one" else rng.integers(0, 4, n).astype(np.int64)
        count = n if ln is None else int(ln.sum())
        values.append(rng.integers(0, 1 << 30, count).astype(id_dtype))
        lengths.append(ln)
        weights.append(rng.random(count, dtype=np.float32) if kind == "weighted" else None)
    dense = rng.standard_normal((n, 3)).astype(np.float32)
    return Columns(dense, rng.integers(0, 2, n).astype(np.float32), values, lengths, weights)


def samples(cols: Columns) -> list[tuple]:
    """Each sample as (dense, label, per feature (ids, weights)), read one by one."""
    out = []
    starts = [None if ln is None else np.concatenate([[0], np.cumsum(ln)]) for ln in cols.lengths]
    for i in range(len(cols)):
        feats = []
        for v, w, s in zip(cols.values, cols.weights, starts, strict=True):
            a, b = (i, i + 1) if s is None else (s[i], s[i + 1])
            feats.append((v[a:b].tolist(), None if w is None else w[a:b].tolist()))
        out.append((cols.dense[i].tolist(), float(cols.labels[i]), feats))
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    kinds=st.lists(st.sampled_from(["one", "multi", "weighted"]), min_size=1, max_size=4),
    picks=st.integers(0, 400),
    repeats=st.booleans(),
    wide=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_take_gives_the_samples_asked_in_their_order(n, kinds, picks, repeats, wide, seed):
    """Any order, repeated samples included (a held-out batch is padded with copies of its last
    sample), from one-hot, multi-hot and weighted features."""
    rng = np.random.default_rng(seed)
    cols = random_columns(rng, n, kinds, np.int64 if wide else np.int32)
    idx = rng.integers(0, n, picks) if repeats else rng.permutation(n)[: min(picks, n)]
    got, every = cols.take(idx), samples(cols)
    assert samples(got) == [every[i] for i in idx]
    assert all(v.dtype == cols.values[0].dtype for v in got.values)


def test_cat_keeps_the_ids_dtype_and_batches_widen_it():
    """Windows keep the ids of the file (int32 shards: half the bytes to gather); a batch has int64 ids,
    as many per feature as the columns say, and the id limits the parts knew, joined."""
    rng = np.random.default_rng(0)
    a, b = random_columns(rng, 50, ["one", "multi"], np.int32), random_columns(rng, 30, ["one", "multi"], np.int32)
    a.id_limits, b.id_limits = ([0, 5], [10, 20]), ([2, 0], [40, 9])
    both = Columns.cat([a, b])
    assert [v.dtype for v in both.values] == [np.int32, np.int32] and both.id_limits == ([0, 0], [40, 20])
    assert Columns.cat([a, random_columns(rng, 5, ["one", "multi"], np.int32)]).id_limits is None
    batch = both.to_batch(["x", "y"])
    assert batch.sparse.values.dtype == torch.int64
    assert batch.sparse.known_id_limits() == ([0, 0], [40, 20])
    assert batch.sparse.length_per_key() == [80, len(both.values[1])]
    assert batch.sparse.lengths[:80].tolist() == [1] * 80


def test_cut_batches_cross_window_boundaries_in_order():
    rng = np.random.default_rng(1)
    windows = [random_columns(rng, n, ["one", "weighted"], np.int32) for n in (70, 5, 41)]
    orders = [rng.permutation(len(w)) for w in windows]
    want = []
    for window, order in zip(windows, orders, strict=True):
        every = samples(window)
        want += [every[i] for i in order]
    got = [s for batch in cut_batches(zip(windows, orders, strict=True), 32) for s in samples(batch)]
    assert got == want
    assert [len(b) for b in cut_batches(zip(windows, orders, strict=True), 32)] == [32, 32, 32, 20]


def same_batches(a, b) -> bool:
    sa, sb = a.sparse, b.sparse
    same_weights = (sa.weights is None) == (sb.weights is None) and (
        sa.weights is None or torch.equal(sa.weights, sb.weights)
    )
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(sa.values, sb.values)
        and torch.equal(sa.lengths, sb.lengths)
        and sa.values.dtype == sb.values.dtype == torch.int64
        and sa.length_per_key() == sb.length_per_key()
        and sa.known_id_limits() == sb.known_id_limits()
        and same_weights
    )


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    kinds=st.lists(st.sampled_from(["one", "multi", "weighted", "one_weighted"]), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from([np.int32, np.int64, np.uint32]), min_size=3, max_size=3),
    batch=st.integers(1, 300),
    limits=st.booleans(),
    all_one_hot=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_packed_windows_give_the_batches_of_the_columns(sizes, kinds, dtypes, batch, limits, all_one_hot, seed):
    """A window packed from pieces (ids of mixed integer dtypes, one-hot weighted ones among them) gives,
    cut into batches across windows, the batches the concatenated columns give, bit for bit; every
    feature one-hot (Criteo's case) takes a path of its own."""
    rng = np.random.default_rng(seed)
    kinds = ["one"] * (len(kinds) + 1) if all_one_hot else kinds

    def piece(n: int, dtype) -> Columns:
        cols = random_columns(rng, n, ["one" if k == "one_weighted" else k for k in kinds], dtype)
        for f, kind in enumerate(kinds):
            if kind == "one_weighted":
                cols.weights[f] = rng.random(n, dtype=np.float32)
        if limits:
            cols.id_limits = ([0] * len(kinds), [1 << 30] * len(kinds))
        return cols

    windows = [[piece(n, dtypes[i % 3]) for i, n in enumerate(sizes)] for _ in range(2)]
    orders = [rng.permutation(sum(sizes)) for _ in windows]
    keys = [f"f{f}" for f in range(len(kinds))]
    packed = [PackedColumns.pack(w) for w in windows]
    plain = [Columns.cat(w) for w in windows]
    assert packed[0].packed == [f for f, k in enumerate(kinds) if k == "one"]
    got = [b.to_batch(keys) for b in cut_batches(zip(packed, orders, strict=True), batch)]
    want = [b.to_batch(keys) for b in cut_batches(zip(plain, orders, strict=True), batch)]
    assert len(got) == len(want) and all(same_batches(a, b) for a, b in zip(got, want, strict=True))


def test_packed_ids_of_signed_and_unsigned_64_bits_stay_integers():
    """numpy widens int64 and uint64 together to floats; a packed window holds them as int64."""
    rng = np.random.default_rng(0)
    a, b = random_columns(rng, 4, ["one"], np.int64), random_columns(rng, 3, ["one"], np.uint64)
    window = PackedColumns.pack([a, b])
    assert window.rows.dtype == np.int64
    assert window.rows[:, 0].tolist() == a.values[0].tolist() + b.values[0].tolist()
