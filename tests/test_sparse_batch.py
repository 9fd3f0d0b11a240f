import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neorec.errors import DataError
from neorec.sparse import SparseBatch

ONES = torch.ones(3)


def make(lengths_by_feature, rows=10, weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = {}
    for name, lengths in lengths_by_feature.items():
        ln = torch.tensor(lengths, dtype=torch.int64)
        v = torch.randint(0, rows, (int(ln.sum()),), generator=g)
        feats[name] = (v, ln, torch.rand(v.numel(), generator=g)) if weighted else (v, ln)
    return SparseBatch.from_features(feats)


@st.composite
def batches(draw):
    b = draw(st.integers(0, 6))
    names = draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True))
    lengths = {n: draw(st.lists(st.integers(0, 4), min_size=b, max_size=b)) for n in names}
    return make(lengths, weighted=draw(st.booleans()), seed=draw(st.integers(0, 100)))


@settings(max_examples=60, deadline=None)
@given(batches(), st.randoms())
def test_select_permute_concat_roundtrip(sb, rnd):
    sb.validate()
    keys = list(sb.keys)
    rnd.shuffle(keys)
    perm = sb.select(keys)
    perm.validate()
    for k in sb.keys:
        v1, l1, w1 = sb.feature(k)
        v2, l2, w2 = perm.feature(k)
        assert torch.equal(v1, v2) and torch.equal(l1, l2)
        assert (w1 is None and w2 is None) or torch.equal(w1, w2)
    cut = rnd.randint(0, len(keys))
    parts = sb.split([keys[:cut], keys[cut:]])
    assert SparseBatch.concat(parts).select(sb.keys) == sb
    assert sb.permute(list(range(sb.num_features))) == sb


def test_offsets_and_views():
    sb = make({"a": [1, 0, 2], "b": [1, 1, 1]})
    assert sb.batch_size == 3
    assert sb.offsets().tolist() == [0, 1, 1, 3, 4, 5, 6]
    assert sb.length_per_key() == [3, 3]
    v, ln, w = sb.feature("b")
    assert ln.tolist() == [1, 1, 1] and v.numel() == 3 and w is None


def test_length_per_key_given_by_the_maker_is_checked_and_travels():
    sb = make({"a": [1, 0, 2], "b": [1, 1, 1]})
    given = SparseBatch(sb.keys, sb.values, sb.lengths, None, [3, 3])
    assert given.length_per_key() == [3, 3] and given.to("cpu").length_per_key() == [3, 3]
    with pytest.raises(DataError, match=r"length_per_key \[2, 3\] does not match the 2 features"):
        SparseBatch(sb.keys, sb.values, sb.lengths, None, [2, 3])


def test_from_dense_ids_is_one_hot_feature_major():
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    sb = SparseBatch.from_dense_ids(["x", "y"], ids)
    assert sb.values.tolist() == [1, 3, 5, 2, 4, 6]
    assert sb.lengths.tolist() == [1] * 6


def test_mixed_weights_concat_fills_ones():
    a = make({"a": [1, 1]}, weighted=True)
    b = make({"b": [2, 0]})
    c = SparseBatch.concat([a, b])
    assert c.weights is not None and torch.equal(c.weights[2:], torch.ones(2))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda sb: setattr(sb, "values", sb.values - 100), "feature 'a': negative id"),
        (lambda sb: setattr(sb, "values", torch.cat([sb.values, sb.values[:1]])), "lengths sum to"),
        (lambda sb: setattr(sb, "weights", torch.ones(1)), "weights for"),
        (lambda sb: setattr(sb, "lengths", torch.tensor([1, -1, 2, 1, 1, 1])), "feature 'a': negative length"),
    ],
)
def test_validate_names_the_problem(mutate, message):
    sb = make({"a": [1, 0, 2], "b": [1, 1, 1]})
    mutate(sb)
    with pytest.raises(DataError, match=message):
        sb.validate({"a": 10, "b": 10})


def test_validate_id_out_of_table_names_feature():
    sb = make({"a": [1, 1], "b": [1, 1]}, rows=5)
    sb.values[-1] = 7
    with pytest.raises(DataError, match="feature 'b': id 7 >= table rows 5"):
        sb.validate({"a": 100, "b": 5})


def test_mismatched_batch_sizes_rejected():
    with pytest.raises(DataError, match="different batch sizes"):
        SparseBatch.from_features({"a": (torch.tensor([1]), torch.tensor([1])), "b": (torch.tensor([1, 2]), torch.tensor([1, 1]))})
    with pytest.raises(DataError, match="not a multiple"):
        SparseBatch(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(DataError, match="different batch sizes"):
        SparseBatch.concat([make({"a": [1]}), make({"b": [1, 1]})])


def test_unknown_feature_named():
    with pytest.raises(DataError, match="feature 'z' is not in this batch"):
        make({"a": [1]}).select(["z"])


def test_to_device_keeps_data():
    sb = make({"a": [2, 0], "b": [1, 3]}, weighted=True)
    moved = sb.to("cpu")
    assert moved == sb and moved.length_per_key() == sb.length_per_key()


def test_to_where_it_is_returns_the_batch_itself():
    """As torch.Tensor.to: the embedding cache recognises a prefetched batch at its lookup by
    identity, and the trainer moves every batch to its device before the lookup."""
    from neorec.data.batch import Batch

    sb = make({"a": [2, 0], "b": [1, 3]}, weighted=True)
    assert sb.to("cpu") is sb and sb.to(torch.device("cpu"), non_blocking=True) is sb
    batch = Batch(torch.randn(2, 3), sb, torch.ones(2))
    assert batch.to("cpu") is batch
    assert batch.to("cpu", non_blocking=True).sparse is sb


def test_lengths_that_do_not_add_up_to_the_ids_are_refused_before_any_lookup():
    """The bounds check read each feature's ids by its share of `values`, the lookup by `lengths`: with
    lengths that do not add up, feature fb's id 5 passed the check of its 2-row table and trained
    table c's row 3 (both in one buffer)."""
    from neorec.embedding import EmbeddingOptimizerConfig, FusedEmbeddingCollection, TableConfig

    tables = [TableConfig(name="a", rows=10, dim=4, features=["fa"]),
              TableConfig(name="b", rows=2, dim=8, features=["fb"]),
              TableConfig(name="c", rows=10, dim=8, features=["fc"])]  # fmt: skip
    engine = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="sgd", lr=1.0), seed=0)
    before = [w.tensor.clone() for w in engine.weights]
    ids = torch.tensor([0, 0, 5, 1, 1, 1, 0, 0, 0])
    sb = SparseBatch(["fa", "fb", "fc"], ids, torch.ones(6, dtype=torch.int64))
    with pytest.raises(DataError, match=r"lengths sum to 6 but there are 9 ids"):
        engine(sb).sum().backward()
    negative = SparseBatch(["fa", "fb"], torch.tensor([1, 2]), torch.tensor([2, -1, 1, 0]))
    with pytest.raises(DataError, match=r"feature 'fa': a negative length"):
        negative.length_per_key()
    assert all(torch.equal(a, w.tensor) for a, w in zip(before, engine.weights, strict=True))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: SparseBatch.from_features({"u": (torch.tensor([3, 4, 5]), torch.tensor([1, 1])),
                                            "i": (torch.tensor([6]), torch.tensor([1, 1]))}),
         r"feature 'u': 3 ids but its lengths sum to 2"),  # u's id 5 became item i's
        (lambda: SparseBatch.from_features({"u": (torch.tensor([1.7, 2.2]), torch.tensor([1, 1]))}),
         r"feature 'u': ids must be an integer tensor, got torch.float32"),  # truncated to rows 1, 2
        (lambda: SparseBatch.from_dense_ids(["u"], torch.tensor([[1.5], [2.0]])), "an integer tensor"),
        (lambda: SparseBatch.from_features({"u": (torch.tensor([1, 2]), torch.tensor([1, 1]),
                                                  torch.tensor([1.0, float("nan")]))}),
         r"feature 'u': a weight is NaN or infinite"),  # trained into the row for good
        (lambda: SparseBatch(["u"], torch.tensor([1, 2]), torch.tensor([1, 1]), torch.ones(3)),
         r"3 weights for 2 ids"),
        (lambda: SparseBatch.from_features({"u": (torch.tensor([1, 2, 3]), torch.tensor([2, 1]), ONES[:2]),
                                            "i": (torch.tensor([4, 5]), torch.tensor([1, 1]), ONES)}),
         r"feature 'u': 2 weights for 3 ids"),  # u's third id took i's first weight
        (lambda: SparseBatch(["u", "i", "u"], torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.int64)),
         r"name \['u'\] twice"),  # the lookup read the second 'u'
        (lambda: SparseBatch(["u"], torch.tensor([1, 2, 3]), torch.tensor([1.5, 1.5])),
         r"lengths are torch.float32; lengths are int64"),
        (lambda: SparseBatch(["u"], torch.tensor([[1, 2]]), torch.tensor([2])),
         r"flat \(1-D\) tensors, not ids \(1, 2\)"),
        (lambda: SparseBatch(["u"], torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1, 2])),
         r"weights are torch.int64; weights are floats"),
        (lambda: SparseBatch.from_features({"u": (torch.tensor([1, 2]), torch.tensor([[1, 1]]))}),
         r"feature 'u': ids, lengths and weights are flat \(1-D\), not \[\(2,\), \(1, 2\)\]"),
        (lambda: SparseBatch(["u", "i"], torch.tensor([1, 2]), torch.tensor([1, 1]),
                             torch.tensor([1.0, float("inf")])).id_limits(),
         r"feature 'i': a weight is NaN or infinite"),  # what every engine's id check reads
    ],
    ids=["lengths", "float_ids", "float_dense_ids", "nan_weight", "weights_count", "weights_per_feature",
         "duplicate_keys", "float_lengths", "ids_2d", "integer_weights", "lengths_2d", "constructor_nan"],
)
def test_a_batch_that_would_train_wrong_rows_is_refused_naming_the_feature(build, message):
    with pytest.raises(DataError, match=message):
        build()


@pytest.mark.parametrize("dtype", [torch.uint64, torch.float32, torch.uint8])
def test_ids_of_another_dtype_are_refused_naming_it(dtype):
    """Only int64 (and int32) tensors hold ids: a uint64 id past 2**63 has no int64 row to map to."""
    with pytest.raises(DataError, match=f"SparseBatch ids are {dtype}; ids are int64"):
        SparseBatch(["f"], torch.tensor([1, 2], dtype=dtype), torch.tensor([2]))
    assert SparseBatch(["f"], torch.tensor([1, 2], dtype=torch.int32), torch.tensor([2])).values.numel() == 2


def test_what_is_derived_from_ids_and_lengths_follows_their_changes():
    """Offsets, per-feature counts and id limits are cached; a batch whose lengths or ids are written
    in place (a reused buffer) or replaced finds them again, and a batch made of inference-mode
    tensors (which keep no version counter) still has them."""
    sb = SparseBatch(["a", "b"], torch.tensor([1, 2, 3, 4]), torch.ones(4, dtype=torch.int64), length_per_key=[2, 2])
    assert sb.id_limits() == ([1, 3], [2, 4]) and sb.offsets().tolist() == [0, 1, 2, 3, 4]
    sb.lengths[0], sb.lengths[2] = 2, 0  # a: [1, 2], [3]; b: [], [4]
    assert sb.length_per_key() == [3, 1] and sb.id_limits() == ([1, 4], [3, 4])
    assert sb.offsets().tolist() == [0, 2, 3, 3, 4]
    sb.lengths = torch.tensor([1, 1, 1, 0])
    with pytest.raises(DataError, match="lengths sum to 3 but there are 4 ids"):
        sb.length_per_key()
    with torch.inference_mode():
        frozen = SparseBatch(["a"], torch.tensor([5, 6]), torch.tensor([1, 1]))
        assert frozen.id_limits() == ([5], [6]) and frozen.length_per_key() == [2]


def test_a_device_batch_keeps_the_host_lengths_it_was_copied_from():
    """What reads a device batch's lengths on the host (DIN's side-feature check) takes those of the
    host batch it was copied from, not a read of the device; none once the lengths changed."""
    sb = SparseBatch(["a", "b"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 0]))
    moved = sb.to("meta")  # a device no value is read from
    assert moved.host_lengths("b").tolist() == [2, 0] and moved.host_lengths("a").device.type == "cpu"
    assert sb.host_lengths("b").tolist() == [2, 0]
    moved.lengths.add_(1)
    assert moved.host_lengths("b") is None
    again = sb.to("meta")
    sb.lengths[3] = 1  # the host buffer refilled after the copy: its lengths are not the device batch's
    assert again.host_lengths("b") is None
    assert SparseBatch(["a"], torch.tensor([1]), torch.tensor([1]).to("meta")).host_lengths("a") is None


def test_a_reused_batch_is_looked_up_with_its_new_weights():
    """A batch whose weights are refilled in place or replaced is looked up with them: by the warn-mode
    check, which keeps the batch it made without the ids outside, and after a prefetch."""
    from neorec.embedding import EmbeddingOptimizerConfig, FusedEmbeddingCollection, TableConfig

    tables = [TableConfig(name="a", rows=10, dim=2, features=["fa"])]
    sgd = EmbeddingOptimizerConfig(name="sgd", lr=0.1)
    emb = FusedEmbeddingCollection(tables, sgd, seed=0, bounds_check="warn")
    row = emb.table_weights()["a"][1]
    sb = SparseBatch.from_features({"fa": (torch.tensor([1, 2, 30]), torch.tensor([1, 1, 1]), torch.ones(3))})
    with torch.no_grad():
        assert torch.equal(emb(sb)[0], row)
        sb.weights.fill_(5.0)  # a loader's buffer refilled for the next batch
        torch.testing.assert_close(emb(sb)[0], 5 * row)
        sb.weights = torch.full((3,), 7.0)
        torch.testing.assert_close(emb(sb)[0], 7 * row)
    stamp = sb.stamp()
    sb.weights.mul_(2)
    with pytest.raises(DataError, match="ids, lengths or weights were changed .* after prefetch"):
        sb.check_unchanged_since(stamp, "prefetch(batch)")
