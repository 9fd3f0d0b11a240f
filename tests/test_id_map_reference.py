"""The id map against a plain reference (tests/reference_id_map.py, one full sort of the rows per
batch): random streams with repeated ids, more ids than rows, evaluation batches, whole maps and
bucket shards, a reload from the saved state, and both eviction policies give the same rows,
evicted rows, per-row state and stats at every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_id_map import ReferenceIdMap

from neorec.embedding.id_map import STATE, IdMap, MapShard, bucket_of
from neorec.embedding.tables import ManagedCollisionConfig, TableConfig


def make_maps(capacity: int, eviction: str, first: int, count: int, total: int) -> tuple[IdMap, ReferenceIdMap]:
    mc = ManagedCollisionConfig(eviction=eviction, buckets=total)
    table = TableConfig(name="t", rows=capacity * total // count, dim=4, features=["f"], managed_collision=mc)
    shard = MapShard(first, count, total, table, capacity // count * first, eviction)
    return IdMap(capacity, eviction, shard), ReferenceIdMap(capacity, eviction, shard)


def reload(m: IdMap) -> IdMap:
    """A fresh map loaded from `m`'s saved state, as a checkpoint does."""
    out = IdMap(m.capacity, m.eviction, m.shard)
    for name, storage in out.storages().items():
        storage.tensor.copy_(m.storages()[name].tensor)
    out.stats = dict(m.stats)
    return out


def assert_same(m: IdMap, ref: ReferenceIdMap, got: tuple, want: tuple, step: int) -> None:
    assert torch.equal(got[0], want[0]), f"rows differ at step {step}"
    assert torch.equal(got[1], want[1]), f"evicted rows differ at step {step}"
    for name in STATE:
        assert torch.equal(m.storages()[name].tensor, ref.storages()[name].tensor), f"{name} differs at step {step}"
    assert m.stats == ref.stats, f"stats differ at step {step}"


def drive(m: IdMap, ref: ReferenceIdMap, stream: list[tuple[torch.Tensor, bool]], first_step: int = 1) -> IdMap:
    for i, (ids, train) in enumerate(stream):
        step = first_step + i
        assert_same(m, ref, m.remap(ids, step, train), ref.remap(ids, step, train), step)
        if i == len(stream) // 2:
            m = reload(m)
    return m


def random_stream(
    seed: int, steps: int, vocab: int, batch: int, shard: MapShard
) -> list[tuple[torch.Tensor, bool]]:
    """Zipf-like ids (many repeats) from a vocabulary that moves on every step; one batch in five is
    evaluation; ids outside the shard's buckets are dropped, as the input exchange would."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ranks = (torch.rand(batch, generator=g) ** 3 * vocab).to(torch.int64)
        ids = (ranks + step * vocab // 8) * 2_654_435_761 % (1 << 62)
        if shard.total > 1:
            bucket = bucket_of(ids, shard.total)
            ids = ids[(bucket >= shard.first) & (bucket < shard.first + shard.count)]
        out.append((ids, bool(torch.rand(1, generator=g) > 0.2)))
    return out


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize(
    "capacity, buckets, vocab, batch",
    [(64, (0, 1, 1), 300, 50), (256, (0, 4, 4), 2000, 300), (96, (2, 3, 6), 800, 120), (48, (1, 1, 3), 600, 90), (16, (0, 1, 1), 40, 30)],
)
def test_random_streams_match_the_reference(eviction, capacity, buckets, vocab, batch):
    m, ref = make_maps(capacity, eviction, *buckets)
    drive(m, ref, random_stream(capacity + vocab, 60, vocab, batch, m.shard))
    assert m.stats["evictions"] > 0 and m.stats["dropped"] >= 0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_clock_too_large_to_pack_matches_the_reference(eviction):
    # steps near 2^60 leave no room for one packed key per row: both maps sort key by key
    m, ref = make_maps(32, eviction, 0, 2, 2)
    drive(m, ref, random_stream(5, 30, 200, 40, m.shard), first_step=1 << 60)
    assert m.stats["evictions"] > 0


@settings(max_examples=40, deadline=None)
@given(
    eviction=st.sampled_from(["lru", "lfu"]),
    buckets=st.sampled_from([1, 2]),
    stream=st.lists(st.lists(st.integers(0, 30), max_size=12), min_size=1, max_size=12),
)
def test_small_streams_match_the_reference(eviction, buckets, stream):
    m, ref = make_maps(4, eviction, 0, buckets, buckets)
    drive(m, ref, [(torch.tensor(ids, dtype=torch.int64), True) for ids in stream])


@pytest.mark.parametrize("buckets", [(1, 1, 3), (0, 2, 4)])
def test_an_id_of_another_shard_is_an_internal_error(buckets):
    m, _ = make_maps(8, "lru", *buckets)
    ids = torch.arange(100, 140)
    foreign = ids[(bucket_of(ids, m.shard.total) < m.shard.first)
                  | (bucket_of(ids, m.shard.total) >= m.shard.first + m.shard.count)]  # fmt: skip
    with pytest.raises(RuntimeError, match="does not hold its bucket"):
        m.remap(foreign[:3], 1, True)
