"""Cached tables (row cache over DRAM or SSD files) in the sharded collection, on real gloo processes:
the same losses and final weights as one process without any cache, prefetch through the pipeline,
per-rank files named by table and shard, and sharded checkpoints of cached shards.

Tolerance as in test_distributed (fp32 exchanges change only the order of float additions); the
cache itself is exact (tests/test_cache.py), so it adds nothing to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import (
    build_model,
    fit_rank,
    make_batches,
    make_tables,
    optimizer_config,
    run_steps,
    spawn,
    train,
)
from test_distributed import BATCH, STEPS, check_against_single

from neorec.distributed.comms import Comms
from neorec.distributed.plan import ShardingPlan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology
from neorec.embedding.cache import CacheSettings
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.errors import ConfigError

pytestmark = pytest.mark.distributed

# Table-wise and row-wise shards behind caches, tiers from the plan (t2, t3: plain memory).
TW_RW = {
    "tables": {
        "t0": {"kind": "tw", "ranks": [1], "tier": "ssd"},
        "t1": {"kind": "rw", "ranks": [0, 1], "tier": "ssd"},
        "t2": {"kind": "rw", "ranks": [1, 0]},
        "t3": {"kind": "tw", "ranks": [0]},
        "t4": {"kind": "rw", "ranks": [1, 0], "tier": "cached"},
        "t5": {"kind": "tw", "ranks": [0], "tier": "ssd"},
    }
}
# Every other kind behind a cache.
OTHER_KINDS = {
    "tables": {
        "t0": {"kind": "cw", "ranks": [1, 0], "tier": "ssd"},
        "t1": {"kind": "twrw", "node": 0, "tier": "ssd"},
        "t2": {"kind": "twcw", "node": 0, "tier": "cached"},
        "t3": {"kind": "dp", "tier": "ssd"},
        "t4": {"kind": "dp"},
        "t5": {"kind": "tw", "ranks": [1], "tier": "ssd"},
    }
}


def cached_collection(
    topo, plan_dict, optimizer_name, directory, policy="lru", fraction=0.25, comms=None, io_thread="auto"
):
    comms = comms or Comms(topo)
    settings = CacheSettings(policy=policy, fraction=fraction, directory=directory, io_thread=io_thread)
    emb = ShardedEmbeddingCollection(
        make_tables(), optimizer_config(optimizer_name), ShardingPlan.from_dict(plan_dict), comms, seed=0,
        cache=settings,
    )  # fmt: skip
    return comms, emb


def cached_run(
    topo: Topology, plan_dict: dict, optimizer_name: str, directory: str, policy: str, pipeline: bool, io_thread="auto"
):
    comms, emb = cached_collection(topo, plan_dict, optimizer_name, directory, policy, io_thread=io_thread)
    tables = make_tables()
    losses, _ = train(emb, make_batches(tables, STEPS, BATCH), topo.world_size, topo.rank, comms, "fp32", pipeline)
    full = emb.gather_tables()
    folder = Path(directory) / f"rank-{topo.rank:05d}"
    files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []  # none without ssd shards
    return losses, {k: v["weight"] for k, v in full.items()}, full, emb.cache_stats(), files


@pytest.mark.parametrize(
    ("plan", "policy", "pipeline"), [(TW_RW, "lru", True), (OTHER_KINDS, "lfu", True), (TW_RW, "lru", False)]
)
def test_two_ranks_with_cached_tables_match_one_uncached_process(tmp_path, plan, policy, pipeline):
    directory = str(tmp_path / "tables")
    results = spawn(2, cached_run, (plan, "adagrad", directory, policy, pipeline), tmp_path=tmp_path)
    check_against_single({r: out[:4] for r, out in results.items()}, "adagrad")
    tables = make_tables()
    topo = Topology(2, 0, 2)
    plan_obj = ShardingPlan.from_dict(plan)
    for rank, (_, _, _, stats, files) in results.items():
        shards = [
            f"{t.name}#{i}"
            for t in tables
            if plan_obj.tables[t.name].kind != "dp"
            for i, s in enumerate(plan_obj.shards(t, topo))
            if s.rank == rank
        ]
        cached_shards = [n for n in shards if plan_obj.tables[n.split("#")[0]].tier]
        cached_dp = [t.name for t in tables if plan_obj.tables[t.name].kind == "dp" and plan_obj.tables[t.name].tier]
        assert set(stats) == set(cached_shards + cached_dp), f"rank {rank}"
        # eviction pressure: a quarter of each shard's rows cached, batches touch more
        assert sum(s["evictions"] for s in stats.values()) > 0 and all(s["lookups"] > 0 for s in stats.values())
        # files of ssd shards only, in the rank's own folder, named by (the first) table and shard of a group
        ssd = {n for n in cached_shards + cached_dp if plan_obj.tables[n.split("#")[0]].tier == "ssd"}
        assert files and {f.split(".")[0] for f in files} <= ssd, (files, ssd)


# ---- checkpoints of cached shards ------------------------------------------------------------------------
BEFORE, AFTER = 5, 5
SAVE_PLAN = TW_RW
LOAD_PLAN = {  # another sharding of every table, cached in other tiers
    "tables": {
        "t0": {"kind": "rw", "ranks": [0, 1], "tier": "cached"},
        "t1": {"kind": "tw", "ranks": [1], "tier": "ssd"},
        "t2": {"kind": "cw", "ranks": [0, 1], "tier": "ssd"},
        "t3": {"kind": "rw", "ranks": [1, 0], "tier": "ssd"},
        "t4": {"kind": "dp", "tier": "ssd"},
        "t5": {"kind": "tw", "ranks": [1]},
    }
}


def _pieces(emb):
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return model, emb.build_optimizer(), torch.optim.SGD(dense, lr=0.05, momentum=0.9)


def _state(emb) -> dict:
    return {f"{t}.{k}": v.clone() for t, entries in emb.gather_tables().items() for k, v in entries.items()}


def save_cached(topo, root, directory):
    from neorec.checkpoint import save_checkpoint

    comms, emb = cached_collection(topo, SAVE_PLAN, "adam", directory, fraction=0.2)
    model, emb_opt, dense_opt = _pieces(emb)
    batches = make_batches(emb.tables, BEFORE, BATCH)
    run_steps(model, emb, emb_opt, dense_opt, batches, topo.rank, topo.world_size, comms, pipeline=True)
    save_checkpoint(root, BEFORE, emb, model, {"dense": dense_opt, "embedding": emb_opt})
    return _state(emb)


def load_cached_and_continue(topo, root, directory):
    from neorec.checkpoint import latest_checkpoint, load_checkpoint

    comms, emb = cached_collection(topo, LOAD_PLAN, "adam", directory, policy="lfu", fraction=0.2)
    model, emb_opt, dense_opt = _pieces(emb)
    load_checkpoint(latest_checkpoint(root), emb, model, {"dense": dense_opt, "embedding": emb_opt})
    loaded = _state(emb)
    batches = make_batches(emb.tables, BEFORE + AFTER, BATCH)[BEFORE:]
    losses = run_steps(model, emb, emb_opt, dense_opt, batches, topo.rank, topo.world_size, comms, pipeline=True)
    return losses, loaded, _state(emb)


def test_checkpoint_of_cached_shards_saves_and_loads_under_another_plan(tmp_path):
    """2 ranks save cached tw/rw shards; 2 ranks load them as other cached shards and keep training:
    every step and state as one uncached process trained straight through."""
    root = str(tmp_path / "ckpt")
    saved = spawn(2, save_cached, (root, str(tmp_path / "a")), tmp_path=tmp_path / "pa")
    resumed = spawn(2, load_cached_and_continue, (root, str(tmp_path / "b")), tmp_path=tmp_path / "pb")
    # the reference: one process, no cache, BEFORE + AFTER steps
    emb = FusedEmbeddingCollection(make_tables(), optimizer_config("adam"), seed=0)
    model, emb_opt, dense_opt = _pieces(emb)
    batches = make_batches(emb.tables, BEFORE + AFTER, BATCH)
    run_steps(model, emb, emb_opt, dense_opt, batches[:BEFORE])
    at_save = {k.removeprefix("tables."): v.clone() for k, v in emb.state_dict().items() if not k.endswith(".step")}
    losses = run_steps(model, emb, emb_opt, dense_opt, batches[BEFORE:])
    at_end = {k.removeprefix("tables."): v for k, v in emb.state_dict().items() if not k.endswith(".step")}

    def close(got, want, what):
        assert set(got) == set(want), what
        for k, v in want.items():
            torch.testing.assert_close(torch.as_tensor(got[k]), v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")

    for rank in (0, 1):
        close(saved[rank], at_save, f"rank {rank} at the save")
        r_losses, loaded, after = resumed[rank]
        close(loaded, at_save, f"rank {rank} as loaded")
        torch.testing.assert_close(torch.tensor(r_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        close(after, at_end, f"rank {rank} after {AFTER} more steps")


# ---- errors and one process ------------------------------------------------------------------------------
def test_world_of_one_with_every_kind_cached_equals_fused(tmp_path):
    topo = Topology(1, 0, 1)
    plan = {"tables": {"t0": {"kind": "tw", "ranks": [0], "tier": "ssd"}, "t1": {"kind": "rw", "ranks": [0]},
                       "t2": {"kind": "cw", "ranks": [0, 0], "tier": "cached"}, "t3": {"kind": "dp", "tier": "ssd"},
                       "t4": {"kind": "twrw", "node": 0, "tier": "ssd"}, "t5": {"kind": "twcw", "node": 0}}}  # fmt: skip
    out = cached_run(topo, plan, "adam", str(tmp_path / "tables"), "lru", True)
    check_against_single({0: out[:4]}, "adam")


@pytest.mark.parametrize("tier", ["ssd", "cached"])
def test_world_of_one_through_the_device_path_equals_fused(tmp_path, monkeypatch, tier):
    """Every shard's cache over SSD files or host memory (cached) on the path a GPU takes (DeviceIO:
    records cross to the backing store through host buffers, misses read ahead on the worker), with
    CPU tensors standing in for device memory."""
    from neorec.embedding.cache import device_io

    staged: list[int] = []

    class CountedIO(device_io.DeviceIO):
        def __init__(self, io, device) -> None:
            super().__init__(io, device)
            staged.append(self)

    monkeypatch.setattr(device_io, "stages_through_host", lambda device: True)
    monkeypatch.setattr(device_io, "DeviceIO", CountedIO)
    plan = {"tables": {"t0": {"kind": "tw", "ranks": [0], "tier": tier}, "t1": {"kind": "rw", "ranks": [0]},
                       "t2": {"kind": "cw", "ranks": [0, 0], "tier": tier}, "t3": {"kind": "dp", "tier": tier},
                       "t4": {"kind": "twrw", "node": 0, "tier": tier}, "t5": {"kind": "twcw", "node": 0}}}  # fmt: skip
    # reads ahead on the worker, as on a GPU (io_thread auto picks by cores on the CPU)
    out = cached_run(Topology(1, 0, 1), plan, "adam", str(tmp_path / "tables"), "lru", True, io_thread=True)
    check_against_single({0: out[:4]}, "adam")
    assert staged and all(io.background for io in staged)  # one per cache of a group of cached shards


def test_ssd_tier_without_a_directory_names_the_tables():
    plan = {"tables": {t.name: {"kind": "tw", "ranks": [0]} for t in make_tables()}}
    plan["tables"]["t3"]["tier"] = "ssd"
    with pytest.raises(ConfigError, match=r"\['t3'\] are in tier ssd.*embedding\.cache\.directory"):
        cached_collection(Topology(1, 0, 1), plan, "sgd", None)


# ---- neorec train under torchrun: the plan file's tiers ------------------------------------------------
def test_train_nproc_2_builds_the_plan_files_cached_tables(tmp_path):
    """A plan file with cached/ssd tiers: the workers of `neorec train --nproc 2` train those tables
    through row caches (files per rank under embedding.cache.directory) and end with one process's
    tables."""
    import json

    from test_launch import SMALL, _run, _sets, _tables

    from neorec.config.load import load_config
    from neorec.distributed.plan import default_plan
    from neorec.train.build import build_source, build_tables

    cfg = load_config("default", SMALL)
    tables = build_tables(cfg, build_source(cfg).info)
    plan = default_plan(tables, Topology(2, 0, 2)).to_dict()
    for i, t in enumerate(tables[:6]):
        entry = {"kind": "rw", "ranks": [0, 1]} if i % 2 else plan["tables"][t.name]
        plan["tables"][t.name] = {**entry, "tier": "ssd" if i % 3 else "cached"}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    cache = [f"embedding.cache.directory={tmp_path / 'files'}", "embedding.cache.fraction=0.1"]
    multi, single = tmp_path / "multi", tmp_path / "single"
    spawn(2, fit_rank, ([*SMALL, f"distributed.plan={tmp_path / 'plan.json'}", *cache], str(multi)),
          tmp_path=tmp_path / "pg")  # fmt: skip
    p = _run(["-m", "neorec", "train", "--output-dir", str(single), *_sets([])])
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _tables(single), _tables(multi)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    for rank in (0, 1):
        names = {f.name.split(".")[0] for f in (tmp_path / "files" / f"rank-{rank:05d}").iterdir()}
        assert names and all("#" in n for n in names), names  # shards of ssd tables
    records = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "cache" and r["evictions"] > 0 for r in records)
