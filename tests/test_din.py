"""DIN: the target attention (masking, empty histories, a per-sample reference), config errors, and a
run of `neorec train` on a tiny MovieLens-format folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.cli import main
from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError, DataError
from neorec.model.din import DIN, TargetAttention
from neorec.sparse import SparseBatch
from neorec.train.trainer import Trainer, embedding_collection


def sets(items: list[str]) -> list[str]:
    return [x for kv in items for x in ("--set", kv)]


def attention(dim: int = 8, seed: int = 0) -> TargetAttention:
    torch.manual_seed(seed)
    return TargetAttention(dim, [16, 8]).double()


def test_attention_matches_a_per_sample_softmax():
    att = attention()
    torch.manual_seed(1)
    query, keys = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 5, 8, dtype=torch.float64)
    lengths = [5, 2, 1, 3]
    mask = torch.arange(5).view(1, -1) < torch.tensor(lengths).view(-1, 1)
    out = att(query, keys, mask)
    for b, n in enumerate(lengths):
        k = keys[b, :n]
        q = query[b].expand_as(k)
        w = torch.softmax(att.score(torch.cat([q, k, q - k, q * k], 1)).squeeze(1), 0)
        torch.testing.assert_close(out[b], w @ k)


def test_padding_changes_nothing():
    """Whatever the padded positions hold, and however many there are, the output and the gradients
    of the real keys and the query are the same."""
    att = attention()
    torch.manual_seed(2)
    query = torch.randn(3, 8, dtype=torch.float64)
    keys = torch.randn(3, 4, 8, dtype=torch.float64)
    lengths = torch.tensor([4, 1, 2])
    mask = torch.arange(4).view(1, -1) < lengths.view(-1, 1)

    def run(k: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = query.clone().requires_grad_(), k.clone().requires_grad_()
        out = att(q, k, m)
        out.pow(2).sum().backward()
        return out.detach(), q.grad, k.grad[:, :4][mask]

    plain = run(keys, mask)
    junk = keys.clone()
    junk[~mask] = float("nan")  # anything in the padding
    wide = torch.cat([junk, torch.full((3, 3, 8), 1e30, dtype=torch.float64)], 1)  # and more of it
    for got in (run(junk, mask), run(wide, torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], 1))):
        for a, b in zip(plain, got, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_empty_history_gives_zero_and_finite_gradients():
    att = attention()
    query = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(2, 3, 8, dtype=torch.float64)
    mask = torch.tensor([[False, False, False], [True, True, False]])
    out = att(query, keys, mask)
    assert torch.equal(out[0], torch.zeros(8, dtype=torch.float64)) and out[1].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(query.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in att.parameters())
    # a batch of nothing but empty histories (or a history length of zero) works too
    assert torch.equal(att(query, keys[:, :0], mask[:, :0]), torch.zeros(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_under_autocast(dtype):
    att = TargetAttention(8, [16])
    mask = torch.tensor([[True, False], [False, False]])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = att(torch.randn(2, 8), torch.randn(2, 2, 8), mask)
    assert out.shape == (2, 8) and torch.isfinite(out.float()).all() and not out[1].any()


def tiny_din(cross_layers: int, precision: str, device: str = "cpu", bounds_check: str = "error") -> DIN:
    tables = [
        TableConfig(name="movie", rows=10, dim=8, features=["movie"]),
        TableConfig(name="history", rows=10, dim=8, features=["history"], pooling="none"),
        TableConfig(name="liked", rows=2, dim=8, features=["liked"], pooling="none"),
    ]
    embeddings = FusedEmbeddingCollection(
        tables, EmbeddingOptimizerConfig(name="sgd", lr=0.1), device=device, bounds_check=bounds_check
    )
    model = DIN(2, embeddings, [4], [8], "movie", "history", ["liked"], 3, [8], cross_layers, precision)
    return model.to(device)


def batch_of(histories: list[list[int]]) -> Batch:
    lengths = torch.tensor([len(h) for h in histories])
    ids = torch.tensor([i for h in histories for i in h], dtype=torch.int64)
    sparse = SparseBatch.from_features({
        "movie": (torch.arange(len(histories)), torch.ones(len(histories), dtype=torch.int64)),
        "history": (ids, lengths), "liked": (ids % 2, lengths),
    })  # fmt: skip
    dense = torch.linspace(0, 1, 2 * len(histories)).view(-1, 2)
    return Batch(dense, sparse, torch.tensor([1.0, 0.0, 1.0][: len(histories)]))


@pytest.mark.parametrize("cross_layers, precision", [(0, "fp32"), (2, "fp32"), (2, "bf16")])
def test_din_forward_backward_and_history_cut_to_max_len(cross_layers, precision):
    """Logits of a batch with an empty history, a short one and one longer than max_len (3): the long
    one scores as its last 3 ids; the dense layers get gradients."""
    torch.manual_seed(0)
    model = tiny_din(cross_layers, precision)
    batch = batch_of([[], [4, 5], [1, 2, 3, 6, 7]])
    logits = model(batch)
    assert logits.shape == (3,) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with torch.no_grad():
        cut = model(batch_of([[], [4, 5], [3, 6, 7]]))
    torch.testing.assert_close(logits.detach(), cut)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert all(p.grad is not None for p in model.attention.parameters())


# ---- the model through the CLI -------------------------------------------------------------------
def write_tiny_movielens(root: Path, num_users: int = 24, per_user: int = 12) -> Path:
    """A MovieLens-format folder: 40 movies, users who like the movies their earlier likes resemble
    (even movie ids or odd ones), in ratings.csv order shuffled."""
    root.mkdir(parents=True)
    genres = ["Drama", "Comedy", "Action|Drama", "(no genres listed)"]
    movies = [f"{m},Movie {m} ({1950 + m}),{genres[m % 4]}" for m in range(1, 41)]
    (root / "movies.csv").write_text("movieId,title,genres\n" + "\n".join(movies) + "\n")
    rng = np.random.default_rng(0)
    lines = []
    for u in range(1, num_users + 1):
        taste = u % 2
        for k, m in enumerate(rng.choice(np.arange(1, 41), per_user, replace=False)):
            rating = 4.5 if m % 2 == taste else 2.0
            lines.append(f"{u},{m},{rating},{1_000_000 + 1000 * u + 10 * k}")
    rng.shuffle(lines)
    (root / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(lines) + "\n")
    return root


@pytest.fixture
def tiny(tmp_path) -> list[str]:
    root = write_tiny_movielens(tmp_path / "ml")
    return ["--config", "movielens_seq", *sets([f"data.movielens.root={root}", "data.batch_size=32",
            "train.progress=false", "logging.plot=false", "logging.tensorboard=false"])]  # fmt: skip


def test_neorec_train_runs_din_end_to_end(tmp_path, tiny, capsys):
    out = tmp_path / "run"
    assert main(["train", *tiny, "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval_auc"] <= 1.0 and np.isfinite(summary["eval_log_loss"])
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(tmp_path / "din.nrx")]) == 0  # see test_export_models.py
    assert main(["predict", str(tmp_path / "din.nrx"), "--out", str(tmp_path / "pred.txt")]) == 0
    assert len((tmp_path / "pred.txt").read_text().splitlines()) == summary["eval_num_samples"]


def test_din_trains_the_history_rows_and_scores_without_history(tmp_path):
    """One step moves the rows of the movies in a batch's histories (the attention's gradient reaches
    the sequence table); a batch of first ratings only (empty histories) scores finite logits."""
    root = write_tiny_movielens(tmp_path / "ml")
    cfg = load_config("movielens_seq", [f"data.movielens.root={root}", "data.batch_size=32", "train.max_steps=1",
                                        "train.progress=false", "logging.plot=false", "logging.tensorboard=false"])
    trainer = Trainer(cfg, tmp_path / "run")
    before = embedding_collection(trainer.model).table_weights()["history"].clone()
    trainer.fit()
    after = embedding_collection(trainer.model).table_weights()["history"]
    assert not torch.equal(before, after)
    src = trainer.source
    first = torch.from_numpy(np.flatnonzero(src.history_lengths.numpy() == 0))
    assert len(first) == 24
    with torch.no_grad():
        logits = trainer.model.eval()(src.batch(first))
    assert logits.shape == (24,) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.movielens.history=0", ["model.arch din needs a history feature", "data.movielens.history"]),
        ("embedding.tables.history.pooling=sum", ["'history'", "embedding.tables.history.pooling: none"]),
        ("embedding.tables.movie.pooling=none", ["model.din.target 'movie'", "must be pooled"]),
        ("model.din.attention_mlp=[0]", ["attention_mlp"]),
        ("embedding.tables.history.dim=16", ["dim 16", "set embedding.tables.history.dim to 32"]),
        ("model.din.target=genre", ["model.din.target 'genre'", "is not a feature"]),
        ("embedding.tables.genres.pooling=none", ["tables.genres.pooling", "looked up for nothing"]),
        ("embedding.bounds_check=warn", ["bounds_check warn", "history_side"]),
        ("data.source=synthetic", ["data.source synthetic has none"]),
    ],
)
def test_din_config_mistakes_are_one_line_errors(tiny, capsys, tmp_path, override, words):
    assert main(["train", *tiny, "--set", override, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run" / "summary.json").exists()


def test_din_reads_a_history_from_data_preprocessed_from_parquet():
    """Preprocessed Parquet keeps list columns, so a history can come from there: the config passes
    (the model checks the features once the data is read)."""
    cfg = load_config("movielens_seq", ["data.source=preprocessed", "data.preprocessed.path=prepared"])
    assert cfg.model.arch == "din" and cfg.data.source == "preprocessed"


def test_dcnv2_refuses_a_sequence_table(tiny, capsys, tmp_path):
    argv = ["train", *tiny, "--set", "model.arch=dcnv2", "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "pooling none" in capsys.readouterr().err


def test_din_refuses_a_side_feature_out_of_step_with_the_history():
    """A side feature with more or fewer ids than the history in some sample would pair each history
    id with another id's side row: the batch is refused, naming the feature and the sample."""
    model = tiny_din(0, "fp32")
    batch = batch_of([[1, 2], [3], [4, 5, 6]])
    ids, lengths = torch.tensor([1, 0, 1, 1, 0, 1]), torch.tensor([2, 2, 2])  # sample 1: two flags, one movie
    sparse = SparseBatch.from_features({
        "movie": (torch.arange(3), torch.ones(3, dtype=torch.int64)),
        "history": (torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 1, 3])), "liked": (ids, lengths),
    })  # fmt: skip
    with pytest.raises(DataError, match=r"'liked' has 2 ids in sample 1 of the batch, but history 'history'"):
        model(Batch(batch.dense, sparse, batch.labels))


def test_din_checks_the_lengths_it_looked_up_when_ids_are_dropped():
    """bounds_check warn drops a history id outside its table, and not its side feature's: the batch's
    own lengths agree, the looked-up ones do not, and the side rows would pair with other movies."""
    model = tiny_din(0, "fp32", bounds_check="warn")
    sparse = SparseBatch.from_features({
        "movie": (torch.arange(2), torch.ones(2, dtype=torch.int64)),
        "history": (torch.tensor([1, 12, 3]), torch.tensor([2, 1])),
        "liked": (torch.tensor([1, 0, 1]), torch.tensor([2, 1])),
    })  # fmt: skip
    words = r"'liked' has 2 ids in sample 0 of the batch, but history 'history' has 1"
    with pytest.raises(DataError, match=words):
        model(Batch(torch.zeros(2, 2), sparse, torch.ones(2)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_din_checks_a_fed_batchs_side_features_on_the_host(monkeypatch):
    """A batch fed to the GPU has its lengths on the host: the side-feature check compares those,
    and reads nothing back from the device (torch.equal of CUDA tensors waits for the device)."""
    from neorec.data.device_feed import DeviceFeed

    model = tiny_din(0, "fp32", "cuda")
    (fed,) = list(DeviceFeed([batch_of([[1, 2], [3], [4, 5, 6]])], "cuda", worker=True))
    equal, devices = torch.equal, []
    monkeypatch.setattr(torch, "equal", lambda a, b: devices.append(a.device.type) or equal(a, b))
    assert torch.isfinite(model(fed)).all() and devices == ["cpu"]


def test_din_refuses_a_sequence_table_it_does_not_read():
    tables = [
        TableConfig(name="movie", rows=10, dim=8, features=["movie"]),
        TableConfig(name="history", rows=10, dim=8, features=["history"], pooling="none"),
        TableConfig(name="tags", rows=10, dim=8, features=["tags"], pooling="none"),
    ]
    embeddings = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="sgd", lr=0.1))
    with pytest.raises(ConfigError, match=r"\['tags'\] have pooling none.*looked up for nothing"):
        DIN(2, embeddings, [4], [8], "movie", "history", [], 3, [8])
