"""The id exchange's sizes travel on the host (neorec/distributed/input_dist.py), on real gloo processes.

A GPU run must not wait for the device to learn how many ids cross. On CPU nothing waits, so these
tests count instead the calls that would read a GPU tensor back to the host (or size an output from
its values) while the input distribution runs, outside the host communicator's own exchange of the
sizes: none for plans without row-split shards, one per batch with them (the shards' id counts,
read together). The exchanged batches themselves are checked against a direct computation."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import count_host_reads, make_batches, make_tables, optimizer_config, spawn
from test_distributed import PLAN_4, PLANS_2

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.sparse import SparseBatch

pytestmark = pytest.mark.distributed

BATCH = 24  # global: 12 samples a rank with 2 ranks, 6 with 4


def local_ids(batch: SparseBatch, rank: int, world: int) -> SparseBatch:
    """The rank's samples of a global batch, its per-feature id counts and id limits known on the host
    (as a reader's batch, which DeviceFeed counts before the copy to the GPU)."""
    b = batch.batch_size // world
    local = batch.slice_samples(rank * b, (rank + 1) * b)
    local.length_per_key()
    local.id_limits()
    return local


def expected_local(plan: ShardingPlan, emb: ShardedEmbeddingCollection, batches, rank, world) -> list[dict]:
    """Per batch, {feature: (ids, lengths)} of this rank's local batch, computed directly: every rank's
    ids of each of its shards' features, rows rebased to a row-split shard."""
    out = []
    dist = emb.input_dist_
    for batch in batches:
        feats = {}
        for key, (unit, f) in zip(dist.local_keys, dist.features[rank], strict=True):
            shards = plan.shards(unit.table, emb.topo)
            ids_all, lens_all = [], []
            for src in range(world):
                ids, lens, _ = local_ids(batch.sparse, src, world).feature(f)
                if unit.kind in ("rw", "twrw"):
                    lo, hi = shards[unit.index].rows
                    bag = torch.arange(lens.numel()).repeat_interleave(lens)
                    keep = (ids >= lo) & (ids < hi)
                    ids, lens = ids[keep] - lo, torch.bincount(bag[keep], minlength=lens.numel())
                ids_all.append(ids)
                lens_all.append(lens)
            feats[key] = (torch.cat(ids_all), torch.cat(lens_all))
        out.append(feats)
    return out


def exchange_reads(topo, plans: dict) -> dict:
    """Per plan: the reads counted in each batch's input distribution, and whether every exchanged
    batch matched the direct computation and carried its per-feature counts."""
    tables = make_tables()
    batches = make_batches(tables, 3, BATCH)
    comms = Comms(topo, transport="backend")
    count, calls = count_host_reads(outside=[(Comms, "all_to_all_host")])
    out = {}
    for name, plan_dict in plans.items():
        plan = ShardingPlan.from_dict(plan_dict)
        emb = ShardedEmbeddingCollection(tables, optimizer_config("adagrad"), plan, comms, seed=0)
        want = expected_local(plan, emb, batches, topo.rank, topo.world_size)
        reads, same, what = [], True, set()
        for batch, expected in zip(batches, want, strict=True):
            local = local_ids(batch.sparse, topo.rank, topo.world_size)
            before = count[0]
            calls.clear()
            got = emb.input_dist(local).wait()
            reads.append(count[0] - before)
            what.update(calls)
            known = got._length_per_key
            for f, (ids, lens) in expected.items():
                g_ids, g_lens, _ = got.feature(f)
                same &= torch.equal(g_ids, ids) and torch.equal(g_lens, lens)
            counted = [int(got.feature(k)[1].sum()) for k in got.keys]
            same &= known is not None and known == counted
        out[name] = (reads, same, sorted(what))
    return out


def test_two_ranks_read_sizes_only_for_row_split_shards(tmp_path):
    results = spawn(2, exchange_reads, (PLANS_2,), tmp_path=tmp_path)
    for rank, by_plan in results.items():
        for name, (reads, same, calls) in by_plan.items():
            assert same, f"rank {rank}, plan {name}: the exchanged batch differs"
            row_split = name in ("rw", "mixed")
            assert reads == [1 if row_split else 0] * 3, f"rank {rank}, plan {name}: reads {reads} ({calls})"


def test_four_ranks_read_sizes_once_a_batch(tmp_path):
    results = spawn(4, exchange_reads, ({"mixed": PLAN_4},), tmp_path=tmp_path)
    for rank, by_plan in results.items():
        reads, same, calls = by_plan["mixed"]
        assert same, f"rank {rank}: the exchanged batch differs"
        assert reads == [1, 1, 1], f"rank {rank}: reads {reads} ({calls})"


def unequal_batches(topo, sizes: list[int]) -> str:
    """The error each rank gets when the ranks pass `sizes` samples (rank order)."""
    from neorec.errors import DataError

    tables = make_tables()
    batch = make_batches(tables, 1, BATCH)[0].sparse
    plan = ShardingPlan.from_dict(PLANS_2["mixed"])
    comms = Comms(topo, transport="backend")
    emb = ShardedEmbeddingCollection(tables, optimizer_config("adagrad"), plan, comms, seed=0)
    try:
        emb(batch.slice_samples(0, sizes[topo.rank]))
    except DataError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("sizes", [[12, 11], [12, 0]], ids=["unequal", "empty"])
def test_ranks_passing_batches_of_other_sizes_are_told_so(tmp_path, sizes):
    """The lengths travel in blocks of the local batch size: unequal batches (a global batch that does
    not divide, a short last batch) failed inside torch with a size mismatch. Every rank says which."""
    for rank, said in spawn(2, unequal_batches, (sizes,), tmp_path=tmp_path).items():
        want = f"rank {rank}: the ranks' batches have {sizes} samples (in rank order) this step; every rank"
        assert said.startswith(want) and "the global batch divided by the world size" in said, said
