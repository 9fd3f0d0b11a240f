"""Fused engine: checkpoints keyed by table, and the optimizer surface the trainer drives."""

from __future__ import annotations

import io

import pytest
import torch

from neorec.embedding.fused import FusedEmbeddingCollection, FusedEmbeddingOptimizer
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.sparse import SparseBatch


def tables() -> list[TableConfig]:
    adam = EmbeddingOptimizerConfig(name="adam", lr=0.01)
    return [
        TableConfig(name="a", rows=50, dim=8, features=["a"]),
        TableConfig(name="b", rows=40, dim=8, features=["b1", "b2"], dtype="fp16", optimizer=adam),
        TableConfig(name="c", rows=30, dim=4, features=["c"], pooling="mean"),
    ]


def batch(seed: int, ts: list[TableConfig] | None = None) -> SparseBatch:
    gen = torch.Generator().manual_seed(seed)
    ts = ts or tables()
    features = {}
    for t in ts:
        for f in t.features:
            lengths = torch.randint(0, 4, (6,), generator=gen)
            features[f] = (torch.randint(0, t.rows, (int(lengths.sum()),), generator=gen), lengths)
    return SparseBatch.from_features(features)


def train(engine: FusedEmbeddingCollection, seeds: range) -> None:
    for s in seeds:
        engine(batch(s)).pow(2).sum().backward()


def opt() -> EmbeddingOptimizerConfig:
    return EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05)


def test_state_dict_keys_dtypes_and_shapes() -> None:
    engine = FusedEmbeddingCollection(tables(), opt())
    train(engine, range(2))
    sd = engine.state_dict()
    assert sorted(sd) == sorted(
        ["tables.a.weight", "tables.a.momentum1", "tables.a.step"]
        + ["tables.b.weight", "tables.b.momentum1", "tables.b.momentum2", "tables.b.step"]
        + ["tables.c.weight", "tables.c.momentum1", "tables.c.step"]
    )
    assert sd["tables.b.weight"].dtype == torch.float16 and sd["tables.b.momentum1"].dtype == torch.float32
    assert sd["tables.a.momentum1"].shape == (50,) and sd["tables.b.momentum2"].shape == (40, 8)
    assert int(sd["tables.a.step"]) == 2
    # torch.save writes each table, not the whole shared buffer behind a view
    buf = io.BytesIO()
    torch.save(sd, buf)
    payload = sum(v.numel() * v.element_size() for v in sd.values())
    assert buf.tell() < payload + 20_000


def test_resume_from_checkpoint_is_bitwise_identical() -> None:
    a = FusedEmbeddingCollection(tables(), opt())
    train(a, range(2))
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    saved.seek(0)
    b = FusedEmbeddingCollection(tables(), opt(), seed=7)  # other initial weights, all overwritten
    b.load_state_dict(torch.load(saved))
    train(a, range(2, 4))
    train(b, range(2, 4))  # adam's bias correction needs the restored step
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_checkpoint_loads_into_another_layout() -> None:
    """Reordered tables and another dtype give other groups and row offsets; keys are per table."""
    a = FusedEmbeddingCollection(tables(), opt())
    train(a, range(3))
    other = [tables()[2], tables()[0].model_copy(update={"dtype": "bf16"}), tables()[1]]
    b = FusedEmbeddingCollection(other, opt())
    b.load_state_dict(a.state_dict())
    wa, wb = a.table_weights(), b.table_weights()
    assert torch.equal(wa["b"], wb["b"]) and torch.equal(wa["c"], wb["c"])
    assert torch.equal(wa["a"].to(torch.bfloat16), wb["a"])
    assert torch.equal(a.state_dict()["tables.b.momentum2"], b.state_dict()["tables.b.momentum2"])


def test_strict_loading_names_missing_and_unexpected_keys() -> None:
    engine = FusedEmbeddingCollection(tables(), opt())
    sd = engine.state_dict()
    del sd["tables.b.momentum2"]
    sd["tables.zzz.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"tables\.b\.momentum2[\s\S]*tables\.zzz\.weight"):
        engine.load_state_dict(sd)
    result = engine.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["tables.b.momentum2"]
    sd = engine.state_dict()
    sd["tables.a.weight"] = torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match=r"tables\.a\.weight: shape \(3, 8\)"):
        engine.load_state_dict(sd)


def test_state_dict_nested_in_a_model() -> None:
    model = torch.nn.Module()
    model.embeddings = FusedEmbeddingCollection(tables(), opt())
    sd = model.state_dict()
    assert "embeddings.tables.a.weight" in sd
    model.load_state_dict(sd)


def test_optimizer_surface_drives_the_learning_rate() -> None:
    engine = FusedEmbeddingCollection(tables(), opt())
    optimizer = engine.build_optimizer()
    assert isinstance(optimizer, torch.optim.Optimizer) and isinstance(optimizer, FusedEmbeddingOptimizer)
    assert [g["table"] for g in optimizer.param_groups] == ["a", "b", "c"]
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.01, 0.05]

    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.param_groups[2]["lr"] = 0.1
    before = {k: v.clone() for k, v in engine.table_weights().items()}
    train(engine, range(1))
    optimizer.step()
    optimizer.zero_grad()
    after = engine.table_weights()
    assert torch.equal(before["a"], after["a"]) and torch.equal(before["b"], after["b"])
    assert not torch.equal(before["c"], after["c"])

    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[2]["lr"] == pytest.approx(0.05)
    state = optimizer.state_dict()
    assert state["num_steps"] == 2

    fresh = engine.build_optimizer()
    fresh.load_state_dict(state)
    assert fresh.num_steps == 2 and fresh.param_groups[2]["lr"] == pytest.approx(0.05)
    assert list(engine.parameters()) == []  # the placeholders belong to no module


def test_an_optimizer_replaced_by_a_later_build_refuses_to_step() -> None:
    """The collection follows the newest optimizer's learning rates; a schedule stepped on an older
    one would change nothing, so stepping it is an error (single and sharded collections)."""
    from neorec.distributed.comms import Comms
    from neorec.distributed.plan import ShardingPlan
    from neorec.distributed.sharded import ShardedEmbeddingCollection
    from neorec.distributed.topology import Topology

    single = FusedEmbeddingCollection(tables(), opt())
    plan = ShardingPlan.from_dict({"tables": {t.name: {"kind": "tw", "ranks": [0]} for t in tables()}})
    sharded = ShardedEmbeddingCollection(tables(), opt(), plan, Comms(Topology()))
    for engine in (single, sharded):
        first, newest = engine.build_optimizer(), engine.build_optimizer()
        for g in newest.param_groups:
            g["lr"] = 0.0
        before = {k: v.clone() for k, v in engine.state_dict().items() if k.endswith("weight")}
        engine(batch(0)).pow(2).sum().backward()
        newest.step()
        after = engine.state_dict()
        assert all(torch.equal(w, after[k]) for k, w in before.items())  # the newest one's lr applied
        with pytest.raises(RuntimeError, match="replaced by a later build_optimizer"):
            first.step()


def test_module_conversions_keep_the_storage_dtype() -> None:
    engine = FusedEmbeddingCollection(tables(), opt())
    engine.half().to("cpu")
    dtypes = {name: w.dtype for name, w in engine.table_weights().items()}
    assert dtypes == {"a": torch.float32, "b": torch.float16, "c": torch.float32}
    assert engine(batch(0)).dtype == torch.float32


def test_engine_without_tables() -> None:
    """A rank that holds no shard still answers forward, state_dict and build_optimizer."""
    engine = FusedEmbeddingCollection([], opt())
    pooled = engine(batch(0))
    assert pooled.shape == (6, 0)
    assert engine.state_dict() == {} and engine.build_optimizer().lrs() == []


def test_a_checkpoint_of_another_update_rule_is_refused(tmp_path) -> None:
    """Adam's first moment has Adagrad's name and shape: loaded as a sum of squares (signed), it made
    the rows NaN at the next step. Refused, naming the table; sgd keeps no state, so it loads."""
    from neorec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    tables = [TableConfig(name="a", rows=6, dim=4, features=["fa"])]
    adam = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="adam", lr=0.1), seed=0)
    batch = SparseBatch.from_features({"fa": (torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.int64))})
    (adam(batch) * torch.tensor([1.0, -1, 1, -1])).sum().backward()
    path = save_checkpoint(tmp_path, 1, adam)
    for other in ("adagrad", "rowwise_adagrad"):
        fresh = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name=other), seed=1)
        words = f"table 'a' was trained with another embedding optimizer, adam .*, than the model's {other}"
        with pytest.raises(CheckpointError, match=words):
            load_checkpoint(path, fresh)
    sgd = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="sgd"), seed=1)
    load_checkpoint(path, sgd)
    assert torch.equal(sgd.table_weights()["a"], adam.table_weights()["a"])
