"""Managed-collision tables: the id map's eviction rules, its determinism, the re-initialisation of
evicted rows in both engines, and configuration errors."""

from __future__ import annotations

import json

import pytest
import torch

from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.fused.optimizers import initial_state_value
from neorec.embedding.id_map import FREE, IdMap, MapShard, bucket_of
from neorec.embedding.init import init_rows, init_rows_at
from neorec.embedding.reference import ReferenceEmbeddingCollection
from neorec.embedding.tables import (
    EmbeddingOptimizerConfig,
    ManagedCollisionConfig,
    TableConfig,
    check_tables,
)
from neorec.errors import ConfigError, DataError
from neorec.sparse import SparseBatch


def mc_table(rows: int = 8, eviction: str = "lru", buckets: int = 1, name: str = "t") -> TableConfig:
    mc = ManagedCollisionConfig(eviction=eviction, buckets=buckets)
    return TableConfig(name=name, rows=rows, dim=4, features=[f"{name}_f"], managed_collision=mc)


def one_map(capacity: int, eviction: str) -> IdMap:
    return IdMap(capacity, eviction, MapShard(0, 1, 1, mc_table(capacity, eviction), 0))


def feed(m: IdMap, stream: list[list[int]]) -> list[list[int]]:
    return [m.remap(torch.tensor(ids), step, True)[0].tolist() for step, ids in enumerate(stream, 1)]


def held(m: IdMap) -> set[int]:
    return {k for k in m.keys.tensor.tolist() if k != FREE}


def test_lru_and_lfu_evict_different_ids():
    # 1 is used often but long ago, 2 once but recently; 3 and 4 fill the map, then 5 comes
    stream = [[1, 1, 1, 3], [1, 1, 4], [2, 3, 4], [5, 3, 4]]
    lru, lfu = one_map(4, "lru"), one_map(4, "lfu")
    feed(lru, stream)
    feed(lfu, stream)
    assert held(lru) == {2, 3, 4, 5}  # 1 was seen last at step 2
    assert held(lfu) == {1, 3, 4, 5}  # 2 was seen once
    assert lru.stats["evictions"] == lfu.stats["evictions"] == 1


def test_ties_go_by_id_and_batch_ids_keep_their_rows():
    m = one_map(3, "lru")
    rows = feed(m, [[30, 10, 20], [40, 50, 20]])
    assert rows[0] == [2, 0, 1]  # free rows in row order, new ids served by id
    # 10 and 30 tie on last_seen; 10 (row 0) goes first, then 30 (row 2); 20 is in the batch
    assert rows[1] == [0, 2, 1]
    assert held(m) == {20, 40, 50}


def test_more_new_ids_than_rows_drops_the_rarest_then_largest():
    m = one_map(2, "lru")
    (rows,) = feed(m, [[7, 9, 9, 8, 5]])
    assert rows == [FREE, 0, 0, FREE, 1]  # 9 (twice) first, then 5: the smallest of the rest
    assert m.stats["dropped"] == 2 and held(m) == {5, 9}


def test_buckets_evict_on_their_own_rows():
    t = mc_table(8, buckets=4)
    m = IdMap(8, "lru", MapShard(0, 4, 4, t, 0))
    ids = torch.arange(1000, 1040)
    rows, _ = m.remap(ids, 1, True)
    bucket = bucket_of(ids, 4)
    placed = rows != FREE
    assert torch.equal(rows[placed] // 2, bucket[placed])  # bucket b holds rows [2b, 2b + 2)
    assert int(placed.sum()) == 8


def test_same_stream_same_map(tmp_path):
    g = torch.Generator().manual_seed(3)
    stream = [torch.randint(0, 50, (20,), generator=g) * 7919 for _ in range(30)]
    maps = []
    for _ in range(2):
        m = IdMap(16, "lfu", MapShard(0, 2, 2, mc_table(16, "lfu", 2), 0))
        for step, ids in enumerate(stream, 1):
            m.remap(ids, step, True)
        maps.append(m)
    for name in ("mc_keys", "mc_last_seen", "mc_counts"):
        assert torch.equal(maps[0].storages()[name].tensor, maps[1].storages()[name].tensor)
    assert maps[0].stats == maps[1].stats and maps[0].stats["evictions"] > 0


def test_evaluation_does_not_change_the_map():
    m = one_map(4, "lru")
    feed(m, [[1, 2]])
    before = {k: v.tensor.clone() for k, v in m.storages().items()}
    rows, evicted = m.remap(torch.tensor([2, 99]), 5, train=False)
    assert rows.tolist() == [1, FREE] and evicted.numel() == 0
    assert all(torch.equal(before[k], v.tensor) for k, v in m.storages().items())


def batches(table: TableConfig, steps: int, vocab: int, seed: int = 0) -> list[SparseBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (6,), generator=g)
        ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=g) * 1_000_003 + 17
        out.append(SparseBatch(table.features, ids, lengths))
    return out


def train(engine, data: list[SparseBatch]) -> list[float]:
    opt = engine.build_optimizer()
    target = torch.linspace(-1, 1, engine.output_dim)
    losses = []
    for sparse in data:
        loss = ((engine(sparse) - target) ** 2).sum()
        if hasattr(opt, "zero_grad"):
            opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_fused_equals_reference_with_evictions(eviction):
    t = mc_table(6, eviction)
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)
    data = batches(t, 12, vocab=15)
    fused, ref = FusedEmbeddingCollection([t], opt, seed=1), ReferenceEmbeddingCollection([t], opt, seed=1)
    lf, lr = train(fused, data), train(ref, data)
    torch.testing.assert_close(torch.tensor(lf), torch.tensor(lr), rtol=1e-5, atol=1e-6)
    assert fused.id_map_stats()["t"]["evictions"] > 0
    assert fused.id_map_stats() == ref.id_map_stats()
    torch.testing.assert_close(fused.table_weights()["t"], ref.table_weights()["t"], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused.mapped[0].id_map.keys.tensor, ref.mapped[0].id_map.keys.tensor)


def test_same_stream_twice_gives_identical_weights():
    t = mc_table(6, "lfu")
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1)
    runs = []
    for _ in range(2):
        e = FusedEmbeddingCollection([t], opt, seed=2)
        train(e, batches(t, 10, vocab=20, seed=5))
        runs.append(e.state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("engine", ["fused", "reference"])
def test_evicted_rows_get_initial_weights_and_state(engine):
    t = mc_table(2, "lru")
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.5, initial_accumulator=0.25)
    cls = FusedEmbeddingCollection if engine == "fused" else ReferenceEmbeddingCollection
    e = cls([t], opt, seed=4)
    optimizer = e.build_optimizer()
    first = SparseBatch(t.features, torch.tensor([100, 200]), torch.ones(2, dtype=torch.int64))
    e(first).sum().backward()
    optimizer.step()
    trained = e.table_weights()["t"].clone()
    assert not torch.equal(trained, init_rows(t, 4))
    # 300 evicts 100 (row 0; same step as 200, smaller id); look at the row before any update
    e(SparseBatch(t.features, torch.tensor([300, 200]), torch.ones(2, dtype=torch.int64)))
    weights = e.table_weights()["t"]
    torch.testing.assert_close(weights[0], init_rows_at(t, 4, torch.tensor([0]))[0])
    torch.testing.assert_close(weights[1], trained[1])
    if engine == "fused":
        state = e.state_dict()["tables.t.momentum1"]
    else:
        state = optimizer.state[e.bags[0].weight]["sum"]
    assert torch.all(state[0] == initial_state_value("adagrad", 0.25))
    assert torch.all(state[1] > 0.25)


def test_init_rows_of_a_mapped_table_are_the_same_row_by_row():
    t = mc_table(10)
    whole = init_rows(t, 7)
    assert torch.equal(whole[3:6], init_rows(t, 7, 3, 6))
    assert torch.equal(whole[[8, 1]], init_rows_at(t, 7, torch.tensor([8, 1])))
    assert whole.abs().max() <= 1 / 10**0.5 and whole.std() > 0.1


def test_unknown_ids_in_evaluation_leave_their_bags():
    t = mc_table(4)
    e = FusedEmbeddingCollection([t], EmbeddingOptimizerConfig(name="sgd", lr=0.1))
    e(SparseBatch(t.features, torch.tensor([5, 6]), torch.tensor([1, 1])))
    e.eval()
    both = e(SparseBatch(t.features, torch.tensor([5, 99]), torch.tensor([2])))
    known = e(SparseBatch(t.features, torch.tensor([5]), torch.tensor([1])))
    torch.testing.assert_close(both, known)
    stats = e.id_map_stats()["t"]
    assert stats["misses"] == 2 and stats["hits"] == 0  # training's: 5 and 6 when first seen
    assert stats["eval_misses"] == 1 and stats["eval_hits"] == 2  # the evaluation's, apart: 99; 5 twice


def test_negative_raw_id_is_refused():
    t = mc_table(4)
    e = FusedEmbeddingCollection([t], EmbeddingOptimizerConfig(name="sgd", lr=0.1))
    with pytest.raises(DataError, match="'t'.*negative"):
        e(SparseBatch(t.features, torch.tensor([-3]), torch.tensor([1])))


def test_state_dict_round_trip_restores_the_map():
    t = mc_table(6, "lfu")
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)
    data = batches(t, 14, vocab=20, seed=9)
    whole = FusedEmbeddingCollection([t], opt)
    expected = train(whole, data)
    first = FusedEmbeddingCollection([t], opt)
    train(first, data[:7])
    second = FusedEmbeddingCollection([t], opt)
    second.load_state_dict(first.state_dict())
    assert train(second, data[7:]) == expected[7:]


def test_buckets_must_divide_rows():
    with pytest.raises(ConfigError, match="table 'u'.*buckets 4 must divide its 10 rows"):
        check_tables([mc_table(10, buckets=4, name="u")])


# ---- the trainer: raw ids from the synthetic source, checkpoints and exact resume ----------------
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=5",
    "train.epochs=2", "train.max_steps=20", "embedding.optimizer.name=adam", "embedding.optimizer.lr=0.01",
    "checkpoint.every_steps=7", "checkpoint.keep=2",
    "embedding.tables.C2.managed_collision.eviction=lru", "embedding.tables.C2.rows=120",
    "embedding.tables.C4.managed_collision.eviction=lfu", "embedding.tables.C4.managed_collision.buckets=4",
    "embedding.tables.C4.rows=400",
]  # fmt: skip


def test_trainer_resume_with_id_maps_is_bitwise(tmp_path, monkeypatch):
    from neorec.checkpoint import latest_checkpoint
    from neorec.config.load import load_config
    from neorec.train.trainer import Trainer

    cfg = load_config("default", TINY)
    whole = Trainer(cfg, tmp_path / "whole")
    full = whole.fit()
    stats = whole.embeddings.id_map_stats()
    assert set(stats) == {"C2", "C4"} and stats["C2"]["evictions"] > 0 and stats["C4"]["evictions"] > 0
    logged = (tmp_path / "whole" / "metrics.jsonl").read_text()
    assert '"C2/evictions"' in logged

    crashing = Trainer(cfg, tmp_path / "run")
    step = Trainer.train_step
    calls = [0]

    def crash_at_17(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 17:
            raise KeyboardInterrupt("killed")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", crash_at_17)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000014"
    resumed = Trainer(cfg, tmp_path / "run", resume=True)
    assert resumed.fit().losses == full.losses[14:]
    final = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "whole" / "model.pt", weights_only=True).items():
        assert torch.equal(value, final[key]), key
    assert any(k.endswith("C4.mc_keys") for k in final)
    # the id maps' logged counters go on from the checkpoint's: the uninterrupted run's lines
    assert _id_map_lines(tmp_path / "run") == _id_map_lines(tmp_path / "whole")
    # summary.json: the counters at the end, the final evaluation's lookups counted as well
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())["id_map"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["id_map"] == summary
    last = _id_map_lines(tmp_path / "whole")[-1]
    for t in ("C2", "C4"):
        ended = summary[t]
        logged_last = {k.split("/")[1]: v for k, v in last.items() if k.startswith(t + "/")}
        seen = logged_last["eval_hits"] + logged_last["eval_misses"]
        assert ended["eval_hits"] + ended["eval_misses"] > seen
        assert ended["inserts"] == logged_last["inserts"] and ended["capacity"] == stats[t]["capacity"]


def _id_map_lines(run) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k != "time"} for x in lines if x["split"] == "id_map"]


def test_rows_only_for_managed_collision_tables():
    from neorec.config.load import load_config
    from neorec.data.synthetic import SyntheticSource, spec_from_config
    from neorec.train.build import build_tables

    cfg = load_config("default", [*TINY[:5], "embedding.tables.C1.rows=10"])
    info = SyntheticSource(spec_from_config(cfg.data.synthetic, 0)).info
    with pytest.raises(ConfigError, match="embedding.tables.C1.rows: only managed-collision tables"):
        build_tables(cfg, info)


def test_a_managed_collision_table_off_memory_is_refused_by_the_config():
    """Refused when the config is read, naming the user's table (a run of several processes refused
    it in every worker, naming a shard, "C1#1", as a key to set)."""
    from neorec.config.load import load_config

    mc = ["embedding.tables.C1.managed_collision.eviction=lru", "embedding.tables.C1.rows=400"]
    ssd = ["embedding.tier=ssd", "embedding.cache.directory=/tmp/unused"]
    with pytest.raises(ConfigError, match=r"table 'C1' has managed collision, .* but embedding\.tier is ssd: "
                       r"set embedding\.tables\.C1\.tier to memory"):  # fmt: skip
        load_config("default", [*mc, *ssd])
    with pytest.raises(ConfigError, match=r"embedding\.tables\.C1\.tier is dram"):
        load_config("default", [*mc, "embedding.tables.C1.tier=dram"])
    assert load_config("default", [*mc, *ssd, "embedding.tables.C1.tier=memory"]).embedding.tier == "ssd"


# ---- the planner ----------------------------------------------------------------------------------
def test_planner_counts_the_id_map_and_keeps_it_with_its_rows():
    from neorec.distributed.plan import ShardingPlan, TablePlan
    from neorec.embedding.id_map import BYTES_PER_ROW
    from neorec.planner import build_workload, estimate_plan, plan_sharding, this_machine
    from neorec.planner.hardware import CALIBRATED_CPU

    plain = TableConfig(name="t", rows=1000, dim=16, features=["f"])
    mapped = plain.model_copy(update={"managed_collision": ManagedCollisionConfig(buckets=2)})
    cluster = this_machine(4, calibration=dict(CALIBRATED_CPU), memory=2**34)
    weights = []
    for t in (plain, mapped):
        wl = build_workload([t], "sgd", 64)
        plan = estimate_plan(ShardingPlan({"t": TablePlan("rw", [0, 1])}), wl, cluster)
        weights.append([r.weights["device"] for r in plan.ranks[:2]])
    assert weights[1] == [w + 500 * BYTES_PER_ROW for w in weights[0]]
    result = plan_sharding(build_workload([mapped], "sgd", 64), cluster, time_budget=2.0)
    entry = result.plan.tables["t"]
    assert entry.kind in ("tw", "rw") and (entry.kind == "tw" or 2 % len(entry.ranks) == 0)
    assert entry.tier in (None, "device", "host")


def test_criteo_reader_passes_raw_ids_for_managed_collision_features():
    from pathlib import Path

    from neorec.data.criteo import CATEGORICAL_NAMES, CriteoTSVReader

    fixture = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
    batches = list(CriteoTSVReader([fixture], table_rows=7, raw_features=["C3"]).batches(64))
    ids = torch.cat([b.sparse.values.view(len(CATEGORICAL_NAMES), -1).t() for b in batches])
    lines = [x.split("\t") for x in fixture.read_text().splitlines() if x.strip()]
    hex_c3 = torch.tensor([int(f[1 + 13 + 2] or "0", 16) for f in lines])
    assert torch.equal(ids[:, 2], hex_c3) and int(hex_c3.max()) >= 7
    assert int(ids[:, [0, 1, 3]].max()) < 7
    with pytest.raises(ConfigError, match="raw-id features \\['X9'\\]"):
        CriteoTSVReader([fixture], table_rows=7, raw_features=["X9"])


def test_preprocessed_criteo_keeps_raw_ids_for_managed_collision_features(tmp_path):
    from pathlib import Path

    from neorec.config.load import load_config
    from neorec.data.preprocess import preprocess_criteo
    from neorec.train.build import build_source, build_tables

    fixture = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
    out = tmp_path / "pre"
    preprocess_criteo([fixture], out, table_rows=7, eval_every=5, raw_features=["C3"], progress=False)
    data = ["data.source=preprocessed", f"data.preprocessed.path={out}", "data.preprocessed.shuffle=false"]
    mapped = ["embedding.tables.C3.managed_collision.eviction=lru", "embedding.tables.C3.rows=16"]
    cfg = load_config(None, [*data, *mapped])
    source = build_source(cfg)
    (batch,) = list(source.train_batches(64))
    ids, _, _ = batch.sparse.feature("C3")
    lines = [x.split("\t") for x in fixture.read_text().splitlines() if x.strip()]
    train_lines = [f for i, f in enumerate(lines, 1) if i % 5]
    assert sorted(ids.tolist()) == sorted(int(f[16] or "0", 16) for f in train_lines)
    assert int(batch.sparse.feature("C4")[0].max()) < 7
    assert [t.rows for t in build_tables(cfg, source.info) if t.name == "C3"] == [16]
    with pytest.raises(ConfigError, match=r"holds raw ids for \['C3'\]: give their tables"):
        build_source(load_config(None, data))


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_a_cached_table_beside_a_managed_collision_table_trains_as_in_memory(tmp_path, tier):
    """A managed-collision table (in memory) and a cached one in one engine, each batch read ahead
    (prefetched) before its step as the pipeline does: bitwise the engine with every table in memory.
    The prefetch prepares the batch before its raw ids are mapped; the lookup maps them."""
    from neorec.embedding.cache import CacheSettings, cached_storage_factory

    m, p = mc_table(6, "lru", name="m"), TableConfig(name="p", rows=40, dim=4, features=["p_f"])
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.1)
    tiers = {"m": "memory", "p": tier}
    settings = CacheSettings(policy="lru", fraction=0.2, directory=tmp_path / "tables", io_thread=True)
    factory = cached_storage_factory(tiers, settings)
    cached = FusedEmbeddingCollection([m, p], opt, seed=1, group_storage_factory=factory, table_tiers=tiers)
    plain = FusedEmbeddingCollection([m, p], opt, seed=1)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(10):
        lengths = torch.randint(0, 4, (12,), generator=g)
        n = int(lengths[:6].sum()), int(lengths[6:].sum())
        raw = torch.randint(0, 15, (n[0],), generator=g) * 1_000_003 + 17  # ids of the map's: many evictions
        data.append(SparseBatch(["m_f", "p_f"], torch.cat([raw, torch.randint(0, 40, (n[1],), generator=g)]),
                                lengths))  # fmt: skip
    for engine in (cached, plain):
        opt_ = engine.build_optimizer()
        for i, sparse in enumerate(data):
            if i + 1 < len(data):
                engine.prefetch(data[i + 1])
            out = engine(sparse)
            loss = (out * torch.linspace(-1, 1, out.shape[1])).sum()
            loss.backward()
            opt_.step()
    assert cached.id_map_stats()["m"]["evictions"] > 0
    a, b = cached.state_dict(), plain.state_dict()
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_logged_id_map_counts_are_every_rank_s_summed():
    """Under several processes the id_map log line counts every shard of a table, not rank 0's alone;
    a rank that holds no shard of it takes part all the same (the sum is collective)."""
    from types import SimpleNamespace

    from neorec.train.reporting import RunReporting

    fields = ("hits", "misses", "inserts", "evictions", "dropped", "eval_hits", "eval_misses", "occupied",
              "capacity")
    theirs = {"m": dict(zip(fields, (5, 1, 1, 0, 0, 2, 1, 3, 4), strict=True))}

    class TwoRanks:  # rank 1 holds `theirs`
        def sum_over_ranks(self, mine, direction):
            return mine + torch.tensor([float(theirs["m"][k]) for k in fields], dtype=mine.dtype)

    tables = {"m": SimpleNamespace(managed_collision=object()), "p": SimpleNamespace(managed_collision=None)}
    cfg = SimpleNamespace(embedding=SimpleNamespace(tables=tables))
    mine = {"m": dict(zip(fields, (7, 2, 2, 1, 0, 1, 0, 4, 4), strict=True))}
    rank0 = SimpleNamespace(embeddings=SimpleNamespace(id_map_stats=lambda: mine), comms=TwoRanks(), cfg=cfg)
    summed = (12, 3, 3, 1, 0, 3, 1, 7, 8)
    assert RunReporting._id_map_totals(rank0) == {"m": dict(zip(fields, summed, strict=True))}
    empty = SimpleNamespace(embeddings=SimpleNamespace(id_map_stats=lambda: {}), comms=TwoRanks(), cfg=cfg)
    assert RunReporting._id_map_totals(empty) == {"m": theirs["m"]}
