"""The planner's cached tiers (neorec/planner/tiers.py): exact bytes of a cached shard in each memory
tier (against the row cache's own allocation), bytes a cache moves per step, the hit-rate estimate,
this machine's SSD tier, a model too large for RAM planned onto SSD, and the plan's tier in training."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.planner import build_workload, estimate_plan, plan_sharding, this_machine
from neorec.planner.hardware import CALIBRATED_CPU, Cluster, MemoryTier
from neorec.planner.report import rank_table, summary
from neorec.planner.tiers import placements

TABLE = TableConfig(name="t", rows=1000, dim=16, features=["f"])  # adagrad: 16 x 4 + 16 x 4 = 128 bytes a row


def cpu(world: int = 2, memory: int = 2**34, disk: int | None = 2**40):
    return this_machine(world, calibration=dict(CALIBRATED_CPU), memory=memory, disk=disk)


def test_memory_of_a_cached_shard_is_exact():
    wl = build_workload([TABLE], "adagrad", 64, cache_fraction=0.1)
    cluster = cpu()
    tw = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "ssd")}), wl, cluster)
    # cache: 100 rows x (128 + 26 bytes of bookkeeping) + 4 bytes per row of the table for its slot
    # (and a sink entry) and 4 for its place in the write log; files: every row, and a write log as
    # large (ssd_log 1.0)
    assert tw.ranks[0].weights == {"device": 100 * 154 + 1001 * 4 + 1000 * 4, "ssd": 2 * 1000 * 128}
    assert tw.ranks[1].weights == {}
    rw = estimate_plan(ShardingPlan({"t": TablePlan("rw", [1, 0], None, "ssd")}), wl, cluster)
    assert [r.weights for r in rw.ranks] == [{"device": 50 * 154 + 501 * 4 + 500 * 4, "ssd": 2 * 500 * 128}] * 2
    no_log = build_workload([TABLE], "adagrad", 64, cache_fraction=0.1, ssd_log=0.0)
    tw = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "ssd")}), no_log, cluster)
    assert tw.ranks[0].weights == {"device": 100 * 154 + 1001 * 4, "ssd": 1000 * 128}
    plain = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0])}), wl, cluster)
    assert plain.ranks[0].weights == {"device": 1000 * 128} and not plain.ranks[0].tier_bytes


def test_a_cache_of_a_fraction_of_rows_rounds_up():
    wl = build_workload([TABLE], "adagrad", 64, cache_fraction=0.1)
    thirds = estimate_plan(ShardingPlan({"t": TablePlan("rw", [0, 1, 2], None, "ssd")}), wl, cpu(3))
    # ceil(0.1 x 334) = ceil(0.1 x 333) = 34 rows a cache, as embedding/cache/build.py sizes them
    want = [34 * 154 + (n + 1) * 4 + n * 4 for n in (334, 333, 333)]
    assert [r.weights["device"] for r in thirds.ranks] == want


def _allocated_bytes(cache) -> int:
    """A row cache's buffers and bookkeeping (each memory once: buffers may be views) and, on SSD, each
    row's place in the write log; not the backing store."""
    storages = {}
    for value in [*vars(cache).values(), cache.backing.log.where]:
        for t in value.values() if isinstance(value, dict) else [value]:
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_planned_cache_bytes_equal_the_row_cache_allocation(tmp_path):
    """The device bytes the planner charges are what embedding/cache allocates for that table (lfu
    also keeps each row's use count across evictions: 1 byte a row)."""
    from neorec.embedding.cache import CacheSettings, cached_storage_factory
    from neorec.embedding.fused import FusedEmbeddingCollection

    for optimizer, policy in (
        ("adagrad", "lru"),
        ("rowwise_adagrad", "lru"),
        ("adam", "lru"),
        ("adagrad", "lfu"),
    ):
        settings = CacheSettings(policy=policy, fraction=0.1, directory=tmp_path / f"{optimizer}-{policy}")
        factory = cached_storage_factory({"t": "ssd"}, settings)
        emb = FusedEmbeddingCollection(
            [TABLE], EmbeddingOptimizerConfig(name=optimizer, lr=0.1), group_storage_factory=factory
        )
        wl = build_workload([TABLE], optimizer, 64, cache_fraction=0.1, cache_policy=policy)
        est = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "ssd")}), wl, cpu(1))
        assert est.ranks[0].weights["device"] == _allocated_bytes(emb.weights[0].cache), (optimizer, policy)


def test_bytes_moved_per_step_count_misses_in_pages():
    # no id sample: ids uniform, hit rate = the cached share of rows (0.1); 64 ids a step
    wl = build_workload([TABLE], "adagrad", 64, cache_fraction=0.1)
    touched = 1000 * -np.expm1(-64 / 1000)  # distinct rows of 64 uniform draws
    est = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "ssd")}), wl, cpu())
    # each miss reads one 4 KiB page (a 128-byte row and its state); once evicted, its record is appended
    # to the write log, and folding the log in reads and writes 2 x 1000 / 500 records of the file per
    # record appended (a half of the log holds 500 records)
    assert est.ranks[0].tier_bytes["ssd"] == pytest.approx(0.9 * touched * (4096 + 128 * 5))
    # without a write log, the page is written back in place
    no_log = build_workload([TABLE], "adagrad", 64, cache_fraction=0.1, ssd_log=0.0)
    est = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "ssd")}), no_log, cpu())
    assert est.ranks[0].tier_bytes["ssd"] == pytest.approx(2 * 0.9 * touched * 4096)
    assert est.hit_rates == {"t": pytest.approx(0.1)}
    # over host memory (a GPU's cached tier), rows move by their own bytes
    gpu = Cluster("gpu", 1, 1, (MemoryTier("device", 10**9, 1e12, 5e11), MemoryTier("host", 10**10, 2e10, 1e10)),
                  1e11, 1e10, 1e-5, 5e11, 1e-11, 1e-11)  # fmt: skip
    assert placements(gpu) == ("device", "host", "cached")
    est = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0], None, "cached")}), wl, gpu)
    assert est.ranks[0].tier_bytes["host"] == pytest.approx(2 * 0.9 * touched * 128)
    assert est.ranks[0].weights == {"device": 100 * 154 + 1001 * 4, "host": 128_000}
    # the misses cost time in the lookup stage: a miss-free table is faster
    est_device = estimate_plan(ShardingPlan({"t": TablePlan("tw", [0])}), wl, gpu)
    assert est.ranks[0].stages["lookup"] > est_device.ranks[0].stages["lookup"]


def test_hit_rate_from_the_id_sample():
    """Two sampled batches with distinct rows {0,1,2,3} and {0,1,4,5} (duplicates count once): rows 0
    and 1 are seen twice; the four rows seen once stand for unseen rows (Good-Turing: 4 of 8 lookups)."""
    sample = [[np.array([0, 1, 2, 3, 3])], [np.array([1, 0, 4, 5, 0])]]
    wl = build_workload(
        [TableConfig(name="t", rows=100, dim=4, features=["f"])], "sgd", 5, id_samples={"t": sample}
    )
    load = wl.tables[0]
    assert load.hit_rate(0, 100, 2) == pytest.approx(0.5 * (4 / 8))  # rows 0, 1 cached
    assert load.hit_rate(0, 100, 10) == pytest.approx(0.5 * 1 + 0.5 * (10 - 6) / (100 - 6))
    assert load.hit_rate(0, 100, 100) == pytest.approx(1.0)
    assert load.hit_rate(2, 50, 1) == pytest.approx(0.0)  # a shard of rows [2, 50): every row seen once
    uniform = build_workload([TableConfig(name="t", rows=100, dim=4, features=["f"])], "sgd", 5).tables[0]
    assert uniform.hit_rate(0, 100, 20) == pytest.approx(0.2)  # the stated default: the cached share


def test_this_machine_ssd_tier_from_the_filesystem(tmp_path):
    folder = tmp_path / "not" / "yet"  # created by training; its nearest existing parent's filesystem
    c = this_machine(2, calibration=dict(CALIBRATED_CPU), ssd_directory=folder)
    ssd = c.tier("ssd")
    assert ssd.capacity == pytest.approx(0.9 * shutil.disk_usage(tmp_path).free / 2, rel=0.01)
    assert ssd.access_bytes == 4096 and ssd.lookup_bandwidth == CALIBRATED_CPU["ssd_read_bandwidth"]
    assert placements(c) == ("device", "ssd")
    assert placements(this_machine(2, calibration=dict(CALIBRATED_CPU))) == ("device",)  # no folder: no SSD


def big_workload(sample: bool = False):
    """Four 256 MB tables (sgd: 32 x 4 bytes a row) that do not fit 0.9 GiB of RAM, and two small hot ones."""
    tables = [TableConfig(name=f"big{i}", rows=2_000_000, dim=32, features=[f"b{i}"]) for i in range(4)]
    tables += [TableConfig(name=f"hot{i}", rows=1000, dim=32, features=[f"h{i}"]) for i in range(2)]
    ids = {f"h{i}": 20.0 for i in range(2)}
    return build_workload(tables, "sgd", 512, ids, cache_fraction=0.05)


def test_a_model_larger_than_memory_goes_to_ssd_instead_of_failing():
    wl = big_workload()
    with pytest.raises(ConfigError, match=r"(?s)memory.*embedding\.cache\.directory|SSD tier"):
        plan_sharding(wl, cpu(memory=2**30, disk=None), time_budget=2)
    cluster = cpu(memory=2**30, disk=2**36)
    result = plan_sharding(wl, cluster, time_budget=2)
    tiers = {name: p.tier or "device" for name, p in result.plan.tables.items()}
    assert any(tiers[f"big{i}"] == "ssd" for i in range(4)), tiers
    assert all(tiers[f"hot{i}"] == "device" for i in range(2)), tiers
    for r in result.estimate.ranks:
        for tier in cluster.tiers:
            assert r.memory.get(tier.name, 0) <= tier.capacity, (r.rank, tier.name)
    result.plan.validate(wl.table_configs, cluster.topology())
    again = ShardingPlan.from_dict(result.plan.to_dict())  # the JSON carries the tier for `neorec train`
    assert {n: p.tier for n, p in again.tables.items()} == {n: p.tier for n, p in result.plan.tables.items()}
    text = summary(result, cluster) + "\n" + rank_table(result, cluster, wl.table_configs)
    assert "behind a row cache" in text and "cache MB/step" in text and "ssd GB" in text


def test_train_builds_the_plans_tiers_and_config_overrides_win(tmp_path):
    from neorec.config.load import load_config
    from neorec.train.build import build_source, build_tables
    from neorec.train.embeddings import storage_tiers

    sets = ["data.synthetic.max_rows=500", "data.batch_size=256"]
    cfg = load_config("default", sets)
    tables = build_tables(cfg, build_source(cfg).info)
    plan = ShardingPlan({t.name: TablePlan("tw", [0]) for t in tables})
    plan.tables["C1"].tier, plan.tables["C2"].tier, plan.tables["C3"].tier = "ssd", "cached", "host"
    with pytest.raises(ConfigError, match=r"table 'C1' in tier ssd.*embedding\.cache\.directory"):
        storage_tiers(cfg, tables, plan)
    cfg = load_config(
        "default", [*sets, f"embedding.cache.directory={tmp_path}", "embedding.tables={C2: {tier: ssd}}"]
    )
    tiers = storage_tiers(cfg, tables, plan)
    assert (tiers["C1"], tiers["C2"], tiers["C3"], tiers["C4"]) == ("ssd", "ssd", "memory", "memory")
