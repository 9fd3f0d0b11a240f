"""Ids outside their tables (neorec/sparse/bounds.py) on every single-process engine, in each mode.

Each engine keeps its tables side by side, so an id past a table's end would read and train the
next table's rows (and a negative one the previous table's). The check must stop the batch naming
feature, table, id, rows and sample (error), or drop the id from its bag and count it (warn):
training on a batch with bad ids under warn must be bitwise training on the same batch without
them, and the table next to a bad id must never change.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neorec.embedding.cache import CacheSettings, cached_storage_factory
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.reference import ReferenceEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, ManagedCollisionConfig, TableConfig
from neorec.errors import ConfigError, DataError
from neorec.serving.embeddings import InferenceEmbeddings
from neorec.sparse import IdBounds, SparseBatch
from neorec.sparse.bounds import FeatureBound

TRITON = importlib.util.find_spec("triton") is not None
ENGINES = ["reference", "fused", "dram", "ssd", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON, reason="needs triton (scripts/install-test-deps.sh)"))]  # fmt: skip
OPTIMIZER = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)


def two_tables(pooling: str = "sum") -> list[TableConfig]:
    """The issue's case: tables a and b of 10 rows each, side by side in one buffer."""
    return [
        TableConfig(name="a", rows=10, dim=4, features=["fa"], pooling=pooling),
        TableConfig(name="b", rows=10, dim=4, features=["fb"], pooling=pooling),
    ]


def build(engine: str, tables: list[TableConfig], mode: str, tmp_path) -> torch.nn.Module:
    if engine == "reference":
        return ReferenceEmbeddingCollection(tables, OPTIMIZER, seed=0, bounds_check=mode)
    if engine in ("dram", "ssd"):
        settings = CacheSettings(fraction=0.5, directory=tmp_path / f"cache-{mode}", io_thread=False)
        factory = cached_storage_factory({t.name: engine for t in tables}, settings)
        tiers = {t.name: engine for t in tables}
        return FusedEmbeddingCollection(
            tables, OPTIMIZER, seed=0, group_storage_factory=factory, table_tiers=tiers, bounds_check=mode
        )
    if engine == "triton":  # compiled kernels on a GPU, else the interpreter (conftest.py)
        emb = FusedEmbeddingCollection(
            tables, OPTIMIZER, seed=0, kernels="triton", bounds_check=mode, device=device_of(engine)
        )
        emb.test_device = device_of(engine)
        return emb
    return FusedEmbeddingCollection(tables, OPTIMIZER, seed=0, kernels="torch", bounds_check=mode)


def device_of(engine: str) -> str:
    return "cuda" if engine == "triton" and torch.cuda.is_available() else "cpu"


def step(emb: torch.nn.Module, sparse: SparseBatch) -> torch.Tensor:
    """One training step: a fixed linear loss of the pooled vectors, backward (the fused engines
    update there), and the reference engine's own optimizer."""
    opt = getattr(emb, "_test_opt", None)
    if opt is None:
        opt = emb._test_opt = emb.build_optimizer()
    pooled = emb(sparse.to(getattr(emb, "test_device", "cpu")))
    g = torch.Generator().manual_seed(1)
    loss = (pooled * torch.randn(pooled.shape, generator=g).to(pooled.device)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return pooled.detach()


def tables_of(emb: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in emb.table_weights().items()}


def batch(fa: list[list[int]], fb: list[list[int]], weights: bool = False) -> SparseBatch:
    feats = {}
    for name, bags in (("fa", fa), ("fb", fb)):
        ids = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
        lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.int64)
        feats[name] = (ids, lengths, 0.5 + 0.1 * ids.abs().float()) if weights else (ids, lengths)  # per id
    return SparseBatch.from_features(feats)


# ---- the check itself ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_id_limits_are_each_features_extremes(data):
    """Per-feature min and max (empty features: (0, -1)), one-hot and multi-hot, and bounds that
    survive select, slice and concat."""
    num_features = data.draw(st.integers(1, 4))
    b = data.draw(st.integers(1, 6))
    one_hot = data.draw(st.booleans())
    feats = {}
    for f in range(num_features):
        lengths = [1] * b if one_hot else data.draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
        ids = data.draw(st.lists(st.integers(-5, 50), min_size=sum(lengths), max_size=sum(lengths)))
        feats[f"f{f}"] = (torch.tensor(ids, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))
    sparse = SparseBatch.from_features(feats)
    lows, highs = sparse.id_limits()
    for k, (ids, _) in enumerate(feats.values()):
        expected = (int(ids.min()), int(ids.max())) if ids.numel() else (0, -1)
        assert (lows[k], highs[k]) == expected
    part = sparse.slice_samples(0, max(1, b // 2)).select(list(reversed(sparse.keys)))
    p_lows, p_highs = part.known_id_limits()
    for k, key in enumerate(part.keys):
        ids = part.feature(key)[0]
        if ids.numel():
            assert p_lows[k] <= int(ids.min()) and int(ids.max()) <= p_highs[k]
    both = SparseBatch.concat([sparse.select(sparse.keys[:1]), sparse.select(sparse.keys[1:])])
    assert both.known_id_limits() == (lows, highs)


def test_error_names_feature_table_id_rows_and_sample():
    bounds = IdBounds.of_tables(two_tables())
    with pytest.raises(DataError) as e:
        bounds.check(batch([[1], [2], [12]], [[3], [4], [5]]))
    msg = str(e.value)
    for part in (
        "feature 'fa'",
        "table 'a'",
        "10 rows",
        "id 12",
        "sample 2",
        "[0, 10)",
        "bounds_check: warn",
    ):
        assert part in msg
    with pytest.raises(DataError, match=r"feature 'fb' \(table 'b', 10 rows\): id -1 of sample 0.*1 more"):
        bounds.check(batch([[1], [2]], [[-1, 3], [10]]))


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="bounds_check must be one of"):
        IdBounds.of_tables(two_tables(), "ignore")


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_warn_drops_exactly_the_ids_outside(data):
    """The kept batch equals the batch built without the bad ids (lengths shrink, weights follow),
    the count is per feature, and a batch without bad ids comes back as itself."""
    b = data.draw(st.integers(1, 5))
    bags = {
        f: data.draw(st.lists(st.lists(st.integers(-3, 13), max_size=3), min_size=b, max_size=b))
        for f in ("fa", "fb")
    }
    weighted = data.draw(st.booleans())
    dirty = batch(bags["fa"], bags["fb"], weights=weighted)
    bounds = IdBounds.of_tables(two_tables(), "warn")
    got = bounds.check(dirty)
    clean_bags = {f: [[i for i in bag if 0 <= i < 10] for bag in v] for f, v in bags.items()}
    bad = {f: sum(1 for bag in v for i in bag if not 0 <= i < 10) for f, v in bags.items()}
    if not any(bad.values()):
        assert got is dirty
        return
    assert torch.equal(got.values, batch(clean_bags["fa"], clean_bags["fb"]).values)
    assert torch.equal(got.lengths, batch(clean_bags["fa"], clean_bags["fb"]).lengths)
    assert got.length_per_key() == [sum(map(len, clean_bags[f])) for f in ("fa", "fb")]
    if weighted:
        keep = (dirty.values >= 0) & (dirty.values < 10)
        assert torch.equal(got.weights, dirty.weights[keep])
    assert dict(bounds.dropped) == {f: n for f, n in bad.items() if n}
    assert bounds.check(dirty) is got  # the same batch again: neither dropped nor counted twice
    assert dict(bounds.dropped) == {f: n for f, n in bad.items() if n}


def test_warn_logs_the_first_drop_and_each_power_of_ten(neorec_warnings):
    bounds = IdBounds.of_tables(two_tables(), "warn")
    for _ in range(12):
        bounds.check(batch([[11]], [[1]]))
    lines = [r.getMessage() for r in neorec_warnings.records]
    assert len(lines) == 2 and "1 so far" in lines[0] and "10 so far" in lines[1]
    assert "feature 'fa'" in lines[0] and "e.g. id 11" in lines[0]


def test_raw_id_tables_take_any_id_but_negative():
    """A managed-collision table's ids are raw 63-bit ids: only a negative one is outside."""
    tables = [
        TableConfig(name="m", rows=8, dim=4, features=["fm"], managed_collision=ManagedCollisionConfig())
    ]
    bounds = IdBounds.of_tables(tables)
    big = SparseBatch.from_features({"fm": (torch.tensor([2**62, 5]), torch.tensor([1, 1]))})
    assert bounds.check(big) is big
    with pytest.raises(DataError, match=r"table 'm', raw ids >= 0\): id -4 of sample 1 of the batch is negative"):
        bounds.check(SparseBatch.from_features({"fm": (torch.tensor([3, -4]), torch.tensor([1, 1]))}))


def test_known_limits_skip_the_scan():
    """Limits given by the batch's maker are trusted (a GPU batch then reads nothing back); limits
    that reach outside the table make the check look at the ids themselves."""
    bounds = IdBounds({"fa": FeatureBound("a", 10)})
    sparse = SparseBatch(["fa"], torch.tensor([1, 2]), torch.tensor([1, 1]), id_limits=([0], [9]))
    assert bounds.check(sparse) is sparse
    loose = SparseBatch(["fa"], torch.tensor([1, 2]), torch.tensor([1, 1]), id_limits=([0], [99]))
    with pytest.raises(DataError, match="id 2"):  # the limits say "maybe", the ids are then read: fine
        IdBounds({"fa": FeatureBound("a", 2)}).check(loose)


# ---- every engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad", [("fa", 12), ("fb", -1), ("fa", -1), ("fb", 10)])
def test_error_mode_stops_before_any_row_changes(engine, bad, tmp_path):
    """Id 12 of a (10 rows) would be row 2 of b, id -1 of b row 9 of a; the batch stops with the
    feature, table, id and rows named, and no row of any table changes."""
    emb = build(engine, two_tables(), "error", tmp_path)
    step(emb, batch([[1], [2, 3]], [[4], [5]]))
    before = tables_of(emb)
    feature, value = bad
    fa, fb = [[1], [2, 3]], [[4], [5]]
    (fa if feature == "fa" else fb)[1].append(value)
    table = feature[1]
    with pytest.raises(
        DataError, match=rf"feature '{feature}' \(table '{table}', 10 rows\): id {value} of sample 1"
    ):
        step(emb, batch(fa, fb))
    for name, w in tables_of(emb).items():
        assert torch.equal(w, before[name]), f"table {name} changed"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_warn_mode_trains_as_if_the_ids_were_not_there(engine, pooling, tmp_path):
    """Bitwise the training of the batch without its bad ids (a mean-pooled bag averages the ids that
    remain); b's row 2, which id 12 of a would hit, and a's row 9 (id -1 of b) stay as they were."""
    tables = two_tables(pooling)
    warn = build(engine, tables, "warn", tmp_path / "w")
    clean = build(engine, tables, "error", tmp_path / "c")
    start = tables_of(warn)
    dirty_bags = ([[1, 12], [2, 3], [12]], [[4, -1], [5], [6]])
    clean_bags = ([[1], [2, 3], []], [[4], [5], [6]])
    weights = not (engine == "reference" and pooling == "mean")  # nn.EmbeddingBag: no weights with mean
    for _ in range(3):
        out_w = step(warn, batch(*dirty_bags, weights=weights))
        out_c = step(clean, batch(*clean_bags, weights=weights))
        assert torch.equal(out_w, out_c)
    got, want = tables_of(warn), tables_of(clean)
    for name in want:
        assert torch.equal(got[name], want[name]), f"table {name}"
    assert torch.equal(got["b"][2], start["b"][2]) and torch.equal(got["a"][9], start["a"][9])
    assert warn.dropped_ids() == {"fa": 6, "fb": 3}
    assert clean.dropped_ids() == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_off_mode_does_not_look_at_the_ids(engine, tmp_path):
    emb = build(engine, two_tables(), "off", tmp_path)
    sparse = batch([[1], [2]], [[3], [4]]).to(device_of(engine))
    step(emb, sparse)
    assert sparse.known_id_limits() is None  # never computed: no check ran


@pytest.mark.parametrize("engine", ["fused", "dram"])
def test_prefetched_batch_is_checked_once(engine, tmp_path):
    """A batch prefetched before its step (the pipeline's order) is checked when prefetched; its
    step reuses that result, so warn counts its ids once and both see the same rows."""
    emb = build(engine, two_tables(), "warn", tmp_path)
    dirty = batch([[1, 12]], [[4]])
    emb.prefetch(dirty)
    step(emb, dirty)
    assert emb.dropped_ids() == {"fa": 1}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("change", ["in place", "through a view", "replaced"])
def test_a_batch_changed_after_its_check_is_checked_again(engine, change, tmp_path):
    """A batch trained, then changed (a buffer refilled in place, its ids replaced) and trained again:
    its id limits, cached by the first check, were trusted, and id 12 of a read and trained row 2 of b.
    The change is seen (the tensors' version counters), and the ids are checked again."""
    emb = build(engine, two_tables(), "error", tmp_path)
    sparse = batch([[1], [2, 3]], [[4], [5]])
    step(emb, sparse)
    before = tables_of(emb)
    if change == "in place":
        sparse.values[1] = 12  # fa's second bag: [12, 3]
    elif change == "through a view":
        sparse.feature("fa")[0].add_(10)  # fa: [11], [12, 13]
    else:
        sparse.values = torch.tensor([1, 12, 3, 4, 5])
    with pytest.raises(DataError, match=r"feature 'fa' \(table 'a', 10 rows\): id 1[12] of sample [01]"):
        step(emb, sparse)
    for name, w in tables_of(emb).items():
        assert torch.equal(w, before[name]), f"table {name} changed"


@pytest.mark.parametrize("engine", ["dram", "ssd"])
def test_a_batch_changed_after_its_prefetch_is_refused(engine, tmp_path):
    """A prefetched batch's step used what its prefetch checked and read: the old ids. A batch
    changed in between is refused, naming the prefetch, and no row changes."""
    emb = build(engine, two_tables(), "error", tmp_path)
    sparse = batch([[1], [2]], [[4], [5]])
    emb.prefetch(sparse)
    sparse.values[0] = 7
    before = tables_of(emb)
    with pytest.raises(DataError, match=r"changed \(in place, or replaced\) after prefetch\(batch\)"):
        step(emb, sparse)
    assert all(torch.equal(w, before[name]) for name, w in tables_of(emb).items())


def test_error_in_a_sequence_table():
    """pooling none (one row per id): the same check, the same names."""
    tables = [TableConfig(name="hist", rows=6, dim=4, features=["h"], pooling="none")]
    emb = FusedEmbeddingCollection(tables, OPTIMIZER)
    sparse = SparseBatch.from_features({"h": (torch.tensor([1, 6]), torch.tensor([2]))})
    with pytest.raises(DataError, match=r"feature 'h' \(table 'hist', 6 rows\): id 6 of sample 0"):
        emb.embed(sparse)


# ---- inference --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["error", "warn"])
def test_inference_embeddings(mode):
    """An exported model's lookups: error names the id; warn scores the batch without it."""
    tables = two_tables("mean")
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.rows, t.dim, generator=g) for t in tables}
    emb = InferenceEmbeddings(tables, weights, bounds_check=mode)
    dirty, clean = batch([[1, 12], [2]], [[3], [-2, 4]]), batch([[1], [2]], [[3], [4]])
    if mode == "error":
        with pytest.raises(DataError, match="feature 'fa' .* id 12 of sample 0"):
            emb(dirty)
        return
    assert torch.equal(emb(dirty), InferenceEmbeddings(tables, weights)(clean))
    assert emb.dropped_ids() == {"fa": 1, "fb": 1}


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_reads_nothing_back_for_a_fed_batch():
    """A batch that came through the device feed had its limits counted on the host: the check of
    the GPU batch then makes no synchronizing call. A GPU batch without them is read back once."""
    from neorec.data.batch import Batch
    from neorec.data.device_feed import DeviceFeed

    emb = FusedEmbeddingCollection(two_tables(), OPTIMIZER, device="cuda")
    host = Batch(torch.zeros(2, 1), batch([[1], [2]], [[3], [4]]), torch.zeros(2))
    (fed,) = list(DeviceFeed([host], "cuda", worker=True))
    assert fed.sparse.device.type == "cuda" and fed.sparse.known_id_limits() == ([1, 3], [2, 4])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert emb.bounds.check(fed.sparse) is fed.sparse
        unknown = SparseBatch(fed.sparse.keys, fed.sparse.values, fed.sparse.lengths, length_per_key=[2, 2])
        with pytest.raises(RuntimeError, match="synchroniz"):
            emb.bounds.check(unknown)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with pytest.raises(DataError, match="id 12"):
        emb.bounds.check(batch([[12], [2]], [[3], [4]]).to("cuda"))


@pytest.mark.parametrize("generator", ["host", "device"])
@pytest.mark.parametrize("bags", [None, [2, 1, 3]])
def test_synthetic_limits_hold(generator, bags):
    """The generator's id limits, which the check trusts without reading the ids, hold for every
    batch of both splits (raw ids of a managed-collision feature included)."""
    from neorec.data.synthetic import SyntheticSource, SyntheticSpec
    from neorec.sparse.batch import _id_limits

    spec = SyntheticSpec(rows=[7, 300, 50], num_dense=2, train_samples=3000, eval_samples=1000, seed=5,
                         bag_sizes=bags, variable_bags=bags is not None)  # fmt: skip
    source = SyntheticSource(spec, cache=False, generator=generator, raw_features={"C2"})
    batches = [*source.train_batches(512), *source.eval_batches(700)]
    for b in batches:
        lows, highs = b.sparse.known_id_limits()
        assert highs[0] == 6 and highs[2] == 49 and highs[1] == 2**63 - 1
        sparse = b.sparse
        actual_lows, actual_highs = _id_limits(sparse.values, sparse.length_per_key(), None, sparse.keys)
        for k in range(3):
            assert lows[k] <= actual_lows[k] and actual_highs[k] <= highs[k], (k, actual_lows, actual_highs)


@pytest.mark.parametrize("mode", ["error", "warn"])
def test_a_slice_keeps_its_batchs_limits_and_still_trains_when_its_own_ids_fit(mode):
    """A slice carries its batch's id limits (bounds, possibly wider than its ids): a bad id elsewhere in
    the batch made the check look for a bad id the slice does not have (an IndexError). The check
    recomputes a slice's own limits before it refuses, and still refuses a bad id of the slice."""
    table = TableConfig(name="user", rows=10, dim=2, features=["user_id"])
    optimizer = EmbeddingOptimizerConfig(name="sgd", lr=1.0)
    engine = FusedEmbeddingCollection([table], optimizer, bounds_check=mode)
    sb = SparseBatch.from_dense_ids(["user_id"], torch.tensor([[99], [1], [2], [3]]))
    sb.id_limits()  # known for the whole batch, as a forward or validate leaves them
    assert engine(sb.slice_samples(2, 4)).shape == (2, 2)
    assert engine.bounds.dropped.get("user_id", 0) == 0
    if mode == "error":
        with pytest.raises(DataError, match=r"feature 'user_id' .*id 99 of sample 0"):
            engine(sb.slice_samples(0, 2))
