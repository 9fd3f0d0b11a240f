"""The Parquet source (neorec/data/parquet.py): the same batches and losses as the TSV reader and the
generator, multi-hot and weighted columns, rank shares, exact resume (also after SIGKILL), and errors
that name the file and column."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from dist_helpers import spawn
from forked import run_python
from test_rank_data import assert_same, concat_samples

from neorec.cli import main
from neorec.config.load import load_config
from neorec.config.schema import ParquetConfig
from neorec.data.criteo import CATEGORICAL_NAMES, DENSE_NAMES, CriteoTSVSource
from neorec.data.parquet import ParquetSource
from neorec.data.ranks import RankData
from neorec.data.synthetic import SyntheticSource, SyntheticSpec
from neorec.errors import ConfigError, DataError
from neorec.train.build import build_source

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"
SAMPLE = Path(__file__).parents[2] / "shared" / "data" / "criteo_sample.tsv"


# ---- writing Parquet copies ------------------------------------------------------------------------
def tsv_to_parquet(src: Path, dst: Path, row_group_size: int, eval_every: int | None = 10) -> Path:
    """A Criteo TSV as Parquet: label, I1..I13 (int64, null when empty), C1..C26 (hex strings, null when
    empty), and is_eval (line number a multiple of eval_every)."""
    cols: dict[str, list] = {"label": [], **{n: [] for n in DENSE_NAMES + CATEGORICAL_NAMES}, "is_eval": []}
    for number, line in enumerate(src.read_text().splitlines(), start=1):
        fields = line.split("\t")
        cols["label"].append(int(fields[0]))
        for name, v in zip(DENSE_NAMES, fields[1:14], strict=True):
            cols[name].append(int(v) if v else None)
        for name, v in zip(CATEGORICAL_NAMES, fields[14:], strict=True):
            cols[name].append(v or None)
        cols["is_eval"].append(eval_every is not None and number % eval_every == 0)
    types = {n: pa.int64() for n in DENSE_NAMES} | {n: pa.string() for n in CATEGORICAL_NAMES}
    table = pa.table({k: pa.array(v, types.get(k)) for k, v in cols.items()})
    pq.write_table(table, dst, row_group_size=row_group_size)
    return dst


def criteo_config(paths, **kw) -> ParquetConfig:
    kw = {"eval_column": "is_eval", "table_rows": 1000, "shuffle": False, "dense": DENSE_NAMES,
          "features": CATEGORICAL_NAMES, **kw}  # fmt: skip
    kw.setdefault("strings", "hex")
    return ParquetConfig(paths=[str(p) for p in paths], dense_log1p=True, **kw)


def synthetic_to_parquet(source: SyntheticSource, folder: Path, split: str, rows_per_group: int) -> Path:
    """The generator's blocks of `split` as Parquet files (one per block): d0.. dense, label, per feature
    a list<int64> column (multi-hot) or int64, and w_<feature> list<float> weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(source.num_blocks(split)):
        b = source.block(split, i)
        cols = {f"d{j}": b.dense[:, j].numpy() for j in range(b.dense.shape[1])} | {"label": b.labels.numpy()}
        for f, spec in enumerate(source.info.features):
            ids = b.values[f].numpy()
            offsets = np.concatenate([[0], np.cumsum(b.lengths[f].numpy())]).astype(np.int32)
            cols[spec.name] = pa.ListArray.from_arrays(offsets, ids) if spec.multi_hot else ids
            if b.weights is not None:
                cols[f"w_{spec.name}"] = pa.ListArray.from_arrays(offsets, b.weights[f].numpy())
        pq.write_table(pa.table(cols), folder / f"{i:05d}.parquet", row_group_size=rows_per_group)
    return folder


def synthetic_config(root: Path, spec: SyntheticSpec, **kw) -> dict:
    features = [{"name": f"C{i + 1}", "rows": r, "hashing": "none"} | ({"weights": f"w_C{i + 1}"} if spec.weighted else {})
                for i, r in enumerate(spec.rows)]  # fmt: skip
    return {"paths": [str(root / "train")], "eval_paths": [str(root / "eval")],
            "dense": [f"d{j}" for j in range(spec.num_dense)], "features": features, "shuffle": False, **kw}  # fmt: skip


SPEC = SyntheticSpec(rows=[30, 500, 7], num_dense=3, bag_sizes=[3, 1, 2], variable_bags=True, weighted=True,
                     train_samples=20000, eval_samples=3000, seed=4)  # fmt: skip


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    source = SyntheticSource(SPEC)
    synthetic_to_parquet(source, root / "train", "train", 3000)  # row groups of 3000, the last of each file smaller
    synthetic_to_parquet(source, root / "eval", "eval", 1000)
    return root


# ---- the same batches as the TSV reader and the generator -------------------------------------------
@pytest.mark.parametrize("hashing", ["modulo", "hash"])
@pytest.mark.parametrize("row_group_size", [1, 7, 100])
def test_criteo_copy_gives_the_tsv_readers_batches(tmp_path, hashing, row_group_size):
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", row_group_size)
    source = ParquetSource(criteo_config([path], hashing=hashing))
    tsv = CriteoTSVSource(FIXTURE, table_rows=1000, hashing=hashing)
    assert source.info.num_train_samples == 18 and source.num_samples("eval") == 2
    for got, want in ((source.train_batches(4), tsv.train_batches(4)), (source.eval_batches(3), tsv.eval_batches(3))):
        got, want = list(got), list(want)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def test_criteo_hashes_stored_as_int32_give_the_tsv_readers_ids(tmp_path):
    """The hex values as signed int32 (those of 2^31 or more negative): the same ids as the TSV reader."""
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 8)
    table = pq.read_table(path)
    for name in CATEGORICAL_NAMES:
        hexes = table.column(name).to_pylist()
        values = np.array([int(v, 16) if v else 0 for v in hexes], np.uint32).view(np.int32)
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(values))
    assert any(min(table.column(n).to_pylist()) < 0 for n in CATEGORICAL_NAMES)
    pq.write_table(table, path)
    for hashing in ("modulo", "hash"):
        source = ParquetSource(criteo_config([path], hashing=hashing, strings="fnv1a"))
        tsv = CriteoTSVSource(FIXTURE, table_rows=1000, hashing=hashing)
        for g, w in zip(source.train_batches(6), tsv.train_batches(6), strict=True):
            assert_same(g, w)


def test_held_out_files_instead_of_a_column(tmp_path):
    train = tsv_to_parquet(FIXTURE, tmp_path / "train.parquet", 5, eval_every=None)
    (tmp_path / "ev").mkdir()
    tsv_to_parquet(FIXTURE, tmp_path / "ev" / "part-0.parquet", 5, eval_every=None)
    cfg = criteo_config([train], eval_column=None, eval_paths=[str(tmp_path / "ev")])
    source = ParquetSource(cfg)
    tsv = CriteoTSVSource(FIXTURE, eval_paths=shutil.copy(FIXTURE, tmp_path / "held.tsv"), table_rows=1000)
    assert source.info.num_train_samples == 20 and source.num_samples("eval") == 20
    for g, w in zip(source.eval_batches(6), tsv.eval_batches(6), strict=True):
        assert_same(g, w)


TRAIN = ["data.batch_size=4", "data.eval_batch_size=8", "train.progress=false", "train.threads=1", "train.epochs=2",
         "logging.plot=false", "logging.tensorboard=false", "model.bottom_mlp=[8]", "model.top_mlp=[8]",
         "embedding.dim=8", "train.log_every=1"]  # fmt: skip


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump({"data": data}))
    return str(path)


@pytest.mark.parametrize("tsv", [FIXTURE, SAMPLE], ids=["criteo_20", "criteo_sample"])
def test_criteo_copy_trains_to_the_same_losses_as_the_tsv_path(tmp_path, tsv):
    from neorec.train.trainer import Trainer

    if not tsv.is_file():
        pytest.skip(f"{tsv} not found")
    path = tsv_to_parquet(tsv, tmp_path / "c.parquet", 16)
    sets = [*TRAIN, "data.batch_size=16", "data.criteo.table_rows=500", "data.criteo.hashing=hash"]
    direct = Trainer(load_config(None, [*sets, "data.source=criteo_tsv", f"data.criteo.train_paths=[{tsv}]"]),
                     tmp_path / "tsv").fit()  # fmt: skip
    section = json.dumps(criteo_config([path], table_rows=500, hashing="hash").model_dump())
    cfg = load_config(None, [*(s for s in sets if ".criteo." not in s), "data.source=parquet", f"data.parquet={section}"])
    via_parquet = Trainer(cfg, tmp_path / "parquet").fit()
    assert len(direct.losses) == len(via_parquet.losses) > 1
    assert via_parquet.losses == direct.losses
    assert json.dumps(via_parquet.eval) == json.dumps(direct.eval)  # (criteo_20's 2 held-out labels are 0: nan AUC)


def test_multi_hot_weighted_copy_gives_the_generators_batches_and_losses(tmp_path, synthetic):
    from neorec.train.trainer import Trainer

    source = ParquetSource(ParquetConfig(**synthetic_config(synthetic, SPEC)))
    assert [(f.num_ids, f.multi_hot, f.weighted) for f in source.info.features] == [
        (30, True, True), (500, True, True), (7, True, True)
    ]
    generator = SyntheticSource(SPEC)
    for got, want in ((source.train_batches(777), generator.train_batches(777)),
                      (source.eval_batches(1000), generator.eval_batches(1000))):  # fmt: skip
        got, want = list(got), list(want)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    assert any((b.sparse.lengths == 0).any() for b in got)  # empty bags came through

    generated = ["data.synthetic.preset=custom", "data.synthetic.rows=[30, 500, 7]", "data.synthetic.num_sparse=3",
                 "data.synthetic.num_dense=3", "data.synthetic.multi_hot=[3, 1, 2]", "data.synthetic.variable_bags=true",
                 "data.synthetic.weighted=true", "data.synthetic.train_samples=20000", "data.synthetic.eval_samples=3000",
                 "seed=4", "data.batch_size=1000", "data.eval_batch_size=1000", "train.epochs=1"]  # fmt: skip
    sets = [s for s in TRAIN if not s.startswith(("data.batch_size", "data.eval_batch_size", "train.epochs"))]
    direct = Trainer(load_config(None, [*sets, *generated]), tmp_path / "gen").fit()
    parquet = ["data.source=parquet", f"data.parquet={json.dumps(synthetic_config(synthetic, SPEC))}"]
    cfg = load_config(None, [*sets, *parquet, "seed=4", "train.epochs=1", "data.batch_size=1000", "data.eval_batch_size=1000"])
    via_parquet = Trainer(cfg, tmp_path / "parquet").fit()
    assert len(direct.losses) == 20 and via_parquet.losses == direct.losses
    assert via_parquet.eval == {k: v for k, v in direct.eval.items() if k != "teacher_auc"}  # (the generator's own)


def test_string_ids_fnv1a_vocab_nulls_and_scalar_weights(tmp_path):
    table = pa.table({
        "label": pa.array([True, False, True, False]),
        "x": pa.array([1.5, None, -2.0, 3.0]),
        "s": pa.array(["apple", None, "", "pear"]),
        "n": pa.array([5, None, 2**40, -1], pa.int64()),
        "w": pa.array([0.5, 2.0, None, 1.0], pa.float64()),
        "tags": pa.array([[3, 4], None, [], [None, 9]], pa.list_(pa.int32())),
        "flag": pa.array([0, 0, 1, 0], pa.int8()),
        "words": pa.array([["a", "b"], None, ["c"], [None, "d"]], pa.list_(pa.string())),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "n.npy", np.array([2, 5, 2**40], np.uint64))
    cfg = ParquetConfig(paths=[str(tmp_path / "t.parquet")], eval_column="flag", dense=["x"], table_rows=1 << 20,
                        vocab_dir=str(vocab), shuffle=False,
                        features=["s", {"name": "n", "hashing": "vocab", "weights": "w"}, {"name": "tags", "hashing": "none", "rows": 10},
                                  {"name": "words", "rows": 1000}])  # fmt: skip
    source = ParquetSource(cfg)
    assert [(f.num_ids, f.multi_hot, f.weighted) for f in source.info.features] == [
        (1 << 20, False, False), (4, False, True), (10, True, False), (1000, True, False)
    ]
    (batch,) = source.train_batches(10)
    assert batch.labels.tolist() == [1, 0, 0] and batch.dense[:, 0].tolist() == [1.5, 0, 3]

    def fnv1a(text: str) -> int:
        h = 0xCBF29CE484222325
        for byte in text.encode():
            h = ((h ^ byte) * 0x100000001B3) % 2**64
        return h

    ids, lengths, weights = batch.sparse.feature("s")
    assert ids.tolist() == [fnv1a("apple") % (1 << 20), 0, fnv1a("pear") % (1 << 20)]
    ids, _, weights = batch.sparse.feature("n")
    assert ids.tolist() == [2, 0, 0] and weights.tolist() == [0.5, 2.0, 1.0]  # -1 and null: not in the vocabulary
    ids, lengths, _ = batch.sparse.feature("tags")
    assert ids.tolist() == [3, 4, 0, 9] and lengths.tolist() == [2, 0, 2]
    ids, lengths, _ = batch.sparse.feature("words")
    assert ids.tolist() == [fnv1a(w) % 1000 for w in "ab"] + [0, fnv1a("d") % 1000] and lengths.tolist() == [2, 0, 2]
    (held,) = source.eval_batches(10)
    assert held.labels.tolist() == [1] and held.sparse.feature("tags")[1].tolist() == [0]


# ---- rank shares and resume ---------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_read_disjoint_shares_of_equal_size(synthetic, world_size):
    kw = synthetic_config(synthetic, SPEC, shuffle=True)
    whole = list(ParquetSource(ParquetConfig(**kw), seed=1).train_batches(20000, epoch=2))[0]
    parts = [ParquetSource(ParquetConfig(**kw), rank=r, world_size=world_size, seed=1) for r in range(world_size)]
    got = [list(p.train_batches(500, epoch=2)) for p in parts]
    n = 20000 // world_size
    assert all(p.info.num_train_samples == n for p in parts)
    assert len({len(g) for g in got}) == 1 and all(sum(len(b) for b in g) == n for g in got)
    joined = concat_samples([b for g in got for b in g])
    assert_same(joined, whole.slice(0, n * world_size))  # rank r: samples [r n, (r + 1) n) of the epoch
    reads = []
    read = ParquetSource._read
    try:
        ParquetSource._read = lambda self, split, i: reads.append(i) or read(self, split, i)
        list(parts[0].train_batches(500, epoch=2))
    finally:
        ParquetSource._read = read
    assert len(reads) < len(parts[0].groups["train"])  # a rank reads only the row groups of its share
    other = list(ParquetSource(ParquetConfig(**kw), seed=1).train_batches(20000, epoch=3))[0]
    assert not torch.equal(other.dense, whole.dense)  # another epoch, another order


@pytest.mark.parametrize(("world_size", "stop", "new_batch"), [(1, 7, 300), (2, 3, 1000)])
def test_resume_gives_exactly_the_remaining_samples(synthetic, world_size, stop, new_batch):
    kw = synthetic_config(synthetic, SPEC, shuffle=True)
    for rank in range(world_size):
        full = concat_samples(list(ParquetSource(ParquetConfig(**kw), rank=rank, world_size=world_size, seed=3)
                                   .train_batches(700, epoch=1)))  # fmt: skip
        source = ParquetSource(ParquetConfig(**kw), rank=rank, world_size=world_size, seed=3)
        it = source.train_batches(700, epoch=1)
        head = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(source.state()))
        del it
        assert state["epoch"] == 1 and state["samples"] == 700 * stop
        restarted = ParquetSource(ParquetConfig(**kw), rank=rank, world_size=world_size, seed=3)
        restarted.load_state(state)
        assert_same(concat_samples(head + list(restarted.train_batches(new_batch, epoch=1))), full)
    with pytest.raises(ConfigError, match=r"number of processes \(--nproc\) 2, this run has 4"):
        ParquetSource(ParquetConfig(**kw), world_size=4, seed=3).load_state({**state, "rank": 0, "world_size": 2})


def _as_rank(topo) -> None:
    os.environ.update(WORLD_SIZE=str(topo.world_size), RANK=str(topo.rank), LOCAL_WORLD_SIZE=str(topo.world_size))


DIST = [*TRAIN, "seed=2", "data.batch_size=1000", "data.eval_batch_size=1500", "train.epochs=2", "train.max_steps=14",
        "train.log_every=2", "embedding.optimizer.name=adagrad", "train.dense_optimizer.name=sgd",
        "distributed.forward_precision=fp32", "distributed.backward_precision=fp32"]  # fmt: skip


def train_two_ranks(topo, config):
    from neorec.train.trainer import Trainer

    _as_rank(topo)
    result = Trainer(load_config(config, DIST), Path(config).parent / "two").fit()
    return result.losses, result.eval


class RankOrderSource:
    """One process's equivalent of 2 ranks: global batches are the ranks' local batches in rank order."""

    def __init__(self, cfg: ParquetConfig, world_size: int, seed: int) -> None:
        self.parts = [ParquetSource(cfg, rank=r, world_size=world_size, seed=seed) for r in range(world_size)]
        self.whole = ParquetSource(cfg, seed=seed)
        self.info = self.whole.info
        self.info.num_train_samples = self.parts[0].info.num_train_samples * world_size

    def train_batches(self, batch_size: int, epoch: int = 0):
        local = [p.train_batches(batch_size // len(self.parts), epoch) for p in self.parts]
        return (concat_samples(list(b)) for b in zip(*local, strict=True))

    def eval_batches(self, batch_size: int):
        return self.whole.eval_batches(batch_size)


def test_two_ranks_train_like_one_process_on_the_same_global_batches(tmp_path, synthetic):
    from neorec.train.trainer import Trainer

    config = write_yaml(tmp_path / "p.yaml", {"source": "parquet", "parquet": synthetic_config(synthetic, SPEC, shuffle=True)})
    two = spawn(2, train_two_ranks, (config,), tmp_path=tmp_path / "pg")
    cfg = load_config(config, DIST)
    trainer = Trainer(cfg, tmp_path / "one")
    trainer.source = RankOrderSource(cfg.data.parquet, 2, cfg.seed)
    trainer.data = RankData(trainer.source, cfg.data.batch_size)
    one = trainer.fit()
    assert len(one.losses) == 14
    losses = [(a + b) / 2 for a, b in zip(two[0][0], two[1][0], strict=True)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), rtol=1e-5, atol=1e-6)
    for rank in (0, 1):
        for key, value in one.eval.items():  # the whole held-out set, 2 batches of 1500
            assert two[rank][1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


KILLER = """
import os, signal, sys
from neorec.cli import main
from neorec.train.trainer import Trainer
step, count = Trainer.train_step, [0]
def killed_at(self, *args, **kwargs):
    count[0] += 1
    if count[0] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)
Trainer.train_step = killed_at
main(sys.argv[2:])
"""


def test_sigkill_and_resume_is_bitwise_equal(tmp_path, synthetic):
    """Row groups of 3000, batches of 700, shuffled; checkpoints every 6 steps, SIGKILL at step 17
    (epoch 0 has 29 steps): resumed after 12 batches, inside a row group."""
    data = {"source": "parquet", "batch_size": 700, "parquet": synthetic_config(synthetic, SPEC, shuffle=True)}
    config = write_yaml(tmp_path / "p.yaml", data)
    sets = [*TRAIN, "data.batch_size=700", "data.eval_batch_size=1000", "train.max_steps=40", "checkpoint.every_steps=6"]
    args = ["train", "--config", config] + [x for s in sets for x in ("--set", s)]
    assert main([*args, "--output-dir", str(tmp_path / "whole")]) == 0
    # `python -c KILLER ...` in a process forked from one that has imported neorec (tests/forked.py)
    killed = run_python(["-c", KILLER, "17", *args, "--output-dir", str(tmp_path / "run")], timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "run" / "model.pt").exists()
    from neorec.checkpoint.load import latest_checkpoint, read_manifest

    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == "step-00000012"
    reader = read_manifest(latest)["state"]["reader"]
    assert (reader["epoch"], reader["samples"], reader["shuffle"]) == (0, 8400, True)  # 8400 % 3000 != 0
    assert main([*args, "--output-dir", str(tmp_path / "run"), "--resume"]) == 0
    want = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# ---- errors -------------------------------------------------------------------------------------------
def test_errors_name_the_file_and_column(tmp_path):
    path = tsv_to_parquet(FIXTURE, tmp_path / "c.parquet", 7)
    with pytest.raises(DataError, match=r"c\.parquet: no column 'C27' \(ids of feature C27\)"):
        ParquetSource(criteo_config([path], features=[*CATEGORICAL_NAMES, "C27"]))
    with pytest.raises(DataError, match=r"c\.parquet: column 'C3' has type string; dense features must be numbers"):
        ParquetSource(criteo_config([path], dense=["I1", "C3"]))
    with pytest.raises(DataError, match=r"c\.parquet: column 'C2' has type string; the held-out flag"):
        ParquetSource(criteo_config([path], eval_column="C2"))
    with pytest.raises(DataError, match="column 'C1' has type string; the label must be 0/1"):
        ParquetSource(criteo_config([path], label="C1"))
    with pytest.raises(DataError, match=r"column 'C1' has type string.*hashing none of feature C1 needs integer"):
        ParquetSource(criteo_config([path], hashing="none"))
    (tmp_path / "folder").mkdir()
    pq.write_table(pq.read_table(path), tmp_path / "folder" / "a.parquet")
    (tmp_path / "folder" / "b.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"b\.parquet: not a readable Parquet file"):
        ParquetSource(criteo_config([tmp_path / "folder"]))
    with pytest.raises(DataError, match="no such file or folder"):
        ParquetSource(criteo_config([tmp_path / "missing.parquet"]))
    pq.write_table(pa.table({"label": [0, 1], "a": [1, 2], "flag": [True, True]}), tmp_path / "held.parquet")
    with pytest.raises(DataError, match="no training rows for 1 rank.*every row's 'flag' is true"):
        ParquetSource(ParquetConfig(paths=[str(tmp_path / "held.parquet")], eval_column="flag", features=["a"]))
    with pytest.raises(DataError, match=r"c\.parquet, row group 0, row 0: column 'C1' value 'xyz' is not a hex hash"):
        bad = pq.read_table(path).set_column(14 + 0, "C1", pa.array(["xyz"] * 20))
        pq.write_table(bad, path)
        list(ParquetSource(criteo_config([path])).train_batches(4))


def test_value_errors_name_the_row(tmp_path):
    table = pa.table({"label": pa.array([0, 2]), "ids": pa.array([[1], [1, 50]]), "w": pa.array([[1.0], [1.0]]),
                      "flag": pa.array([False, False])})  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    cfg = dict(paths=[str(tmp_path / "t.parquet")], eval_column="flag", shuffle=False)
    with pytest.raises(DataError, match=r"t\.parquet, row group 0, row 1: label column 'label' = 2 is not 0 or 1"):
        list(ParquetSource(ParquetConfig(**cfg, features=["ids"])).train_batches(2))
    table = table.set_column(0, "label", pa.array([0, 1]))
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"row 1: weights column 'w' has 1 weights for the 2 ids of column 'ids'"):
        list(ParquetSource(ParquetConfig(**cfg, features=[{"name": "ids", "weights": "w"}])).train_batches(2))
    (tmp_path / "two").mkdir()
    pq.write_table(table.set_column(1, "ids", pa.array([1, 2])), tmp_path / "two" / "a.parquet")
    pq.write_table(table.set_column(0, "label", pa.array([None, 1])), tmp_path / "two" / "b.parquet")
    two = {**cfg, "paths": [str(tmp_path / "two")], "features": ["ids"]}
    with pytest.raises(DataError, match=r"b\.parquet: column 'ids' is a list here but not a list in .*a\.parquet"):
        ParquetSource(ParquetConfig(**two))
    pq.write_table(table.set_column(0, "label", pa.array([None, 1])).set_column(1, "ids", pa.array([1, 2])),
                   tmp_path / "two" / "b.parquet")  # fmt: skip
    with pytest.raises(DataError, match=r"b\.parquet, row group 0, row 0: column 'label' is null"):
        list(ParquetSource(ParquetConfig(**two)).train_batches(2))
    with pytest.raises(DataError, match=r"row 1: column 'ids' holds id 50, outside \[0, 10\) of feature ids's table"):
        list(ParquetSource(ParquetConfig(**cfg, features=[{"name": "ids", "hashing": "none", "rows": 10}])).train_batches(2))
    pq.write_table(table.set_column(1, "ids", pa.array([9, 10])), tmp_path / "t.parquet")  # 10: just past it
    edge = ParquetSource(ParquetConfig(**cfg, features=[{"name": "ids", "hashing": "none", "rows": 10}]))
    with pytest.raises(DataError, match=r"row 1: column 'ids' holds id 10, outside \[0, 10\) of feature ids"):
        list(edge.train_batches(2))


def test_config_errors_name_the_key(tmp_path, capsys):
    base = ["data.source=parquet", "data.parquet.paths=[x.parquet]", "data.parquet.features=[a]"]
    with pytest.raises(ConfigError, match="data.parquet section"):
        load_config(None, ["data.source=parquet"])
    with pytest.raises(ConfigError, match="data.parquet: set one of eval_paths .* or eval_column"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="hashing vocab needs data.parquet.vocab_dir"):
        load_config(None, [*base, "data.parquet.eval_column=f", "data.parquet.hashing=vocab"])
    with pytest.raises(ConfigError, match="feature names must be unique"):
        load_config(None, [*base, "data.parquet.eval_column=f", "data.parquet.features=[a, {name: a}]"])
    cfg = load_config(None, [*base, f"data.parquet.eval_paths=[{tmp_path}/none]"])
    with pytest.raises(DataError, match="x.parquet: no such file or folder"):
        build_source(cfg)
    assert main(["data", "inspect", "--set", "data.source=parquet", "--set", f"data.parquet.paths=[{tmp_path}/y]",
                 "--set", "data.parquet.features=[a]", "--set", "data.parquet.eval_column=f"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("neorec: error:") and "y: no such file or folder" in err and "Traceback" not in err


@pytest.mark.parametrize("mode", ["warn", "off"])
def test_ids_outside_their_table_follow_bounds_check(tmp_path, mode, neorec_warnings):
    """hashing none: warn logs the id (file, row group, row) and passes it on for the engine to drop
    and count; off reads no id."""
    pq.write_table(pa.table({"label": [0, 1], "ids": pa.array([[1], [2, 50]])}), tmp_path / "a.parquet")
    shutil.copy(tmp_path / "a.parquet", tmp_path / "held.parquet")
    cfg = ParquetConfig(paths=[str(tmp_path / "a.parquet")], eval_column=None,
                        eval_paths=[str(tmp_path / "held.parquet")],
                        features=[{"name": "ids", "hashing": "none", "rows": 10}])  # fmt: skip
    (batch,) = list(ParquetSource(cfg, bounds_check=mode, seed=0).eval_batches(2))
    assert batch.sparse.values.tolist() == [1, 2, 50]
    assert batch.sparse.known_id_limits() is None  # the engine's check scans these ids
    warned = [r.getMessage() for r in neorec_warnings.records]
    if mode == "off":
        assert not warned
    else:
        assert len(warned) == 1
        assert "held.parquet, row group 0, column 'ids': 1 ids of feature ids outside" in warned[0]
        assert "the first at row 1: 50" in warned[0]


def test_row_groups_give_their_batches_id_limits(tmp_path):
    """Ids that hashing maps into the table and checked ones (hashing none) are bounded by the table,
    so the engines' id check reads none of them again; one unchecked feature (hashing none under
    bounds_check off) leaves the batch's limits unknown."""
    pq.write_table(pa.table({"label": [0, 1, 1], "a": [5, 7, 9], "b": [1, 2, 3], "s": ["x", "y", "x"]}),
                   tmp_path / "t.parquet")  # fmt: skip
    feats = [{"name": "a", "rows": 4}, {"name": "b", "hashing": "none", "rows": 10},
             {"name": "s", "strings": "fnv1a", "hashing": "hash", "rows": 6}]  # fmt: skip
    shutil.copy(tmp_path / "t.parquet", tmp_path / "held.parquet")
    held = str(tmp_path / "held.parquet")
    cfg = ParquetConfig(paths=[str(tmp_path / "t.parquet")], eval_paths=[held], features=feats)
    (batch,) = list(ParquetSource(cfg, seed=0).train_batches(3))
    assert batch.sparse.known_id_limits() == ([0, 0, 0], [3, 9, 5])
    (batch,) = list(ParquetSource(cfg, seed=0, bounds_check="off").train_batches(3))
    assert batch.sparse.known_id_limits() is None
