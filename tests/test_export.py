"""Export for inference: int8 row-wise quantization and pooled lookups against float64 references,
the export file (round trip, no pickle, truncated/corrupted/foreign files), exact fp32 exports,
int8 AUC within 0.002 of fp32, and `neorec predict`."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.data.criteo import CriteoTSVReader
from neorec.errors import ConfigError, DataError
from neorec.metrics.evaluation import binary_metrics, probability_metrics
from neorec.serving import ExportError, export_model, load_export, predict_file
from neorec.serving import quantize as quantize_module
from neorec.serving.file_format import read_export, read_header, write_export
from neorec.serving.quantize import QuantizedRows, dequantize_rows, pooled_lookup, quantize_rows
from neorec.train.trainer import Trainer

SHARED = Path(__file__).parents[2] / "shared" / "data"
MOVIELENS = SHARED / "ml-latest-small"
CRITEO = SHARED / "criteo_sample.tsv"

# Multi-hot with empty bags, per-id weights, mean pooling, and one fp16 table: every lookup path.
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.multi_hot=[1, 3, 1, 5]", "data.synthetic.variable_bags=true", "data.synthetic.weighted=true",
    "embedding.pooling=mean", "embedding.tables={C2: {dtype: fp16}, C3: {pooling: sum}}",
    "data.synthetic.train_samples=8000", "data.synthetic.eval_samples=4000", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=10",
]  # fmt: skip


# ---- quantization against float64 references ------------------------------------------------------
def random_table(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 3 + torch.randn(
        rows, 1, generator=g
    )
    w[0] = 0.25  # a constant row
    w[1, :] = torch.linspace(-1e-3, 1e-3, dim)  # a tiny range
    w[2, 0] = 40.0  # one outlier
    return w


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,dim", [(37, 13), (5, 1), (300, 64)])
def test_quantize_within_half_a_step_of_float64(rows, dim, scale_dtype):
    w = random_table(rows, dim)
    q = quantize_rows(w, scale_dtype)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (rows, dim)
    assert q.scale.dtype == scale_dtype and q.bias.dtype == scale_dtype and q.scale.shape == (rows,)
    w64 = w.to(torch.float64)
    s64, b64 = q.scale.to(torch.float64), q.bias.to(torch.float64)
    # The stored scale and bias cover the row: bias <= min and bias + 255 * scale >= max (up to fp32 rounding).
    assert (b64 <= w64.amin(1)).all()
    assert (b64 + 255 * s64 >= w64.amax(1) - 1e-6 * w64.abs().amax(1)).all()
    if scale_dtype == torch.float32:
        span = (w64.amax(1) - w64.amin(1)) / 255
        assert torch.allclose(s64, span, rtol=1e-6, atol=0)
    # Every element is within scale / 2 of its value (fp32 dequantization adds a few ulps).
    deq = dequantize_rows(q).to(torch.float64)
    ref = q.codes.to(torch.float64) * s64[:, None] + b64[:, None]
    assert torch.allclose(deq, ref, rtol=1e-6, atol=1e-7)
    bound = s64[:, None] / 2 + 1e-6 * (w64.abs() + 1)
    assert ((ref - w64).abs() <= bound).all()
    # The codes are the float64 nearest codes, except (at most by one) at exact ties.
    exact = ((w64 - b64[:, None]) / torch.where(s64 > 0, s64, 1.0)[:, None]).round().clamp(0, 255)
    assert (exact - q.codes.to(torch.float64)).abs().max() <= 1
    assert ((ref - w64).abs() <= s64[:, None] / 2 + 1e-12).float().mean() > 0.99
    assert torch.equal(deq[0], torch.full((dim,), float(q.bias[0]), dtype=torch.float64))  # constant row


def test_quantize_rejects_nan_and_fp16_overflow():
    w = torch.ones(4, 3)
    w[2, 1] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        quantize_rows(w)
    with pytest.raises(Exception, match="fp16 range"):
        quantize_rows(torch.tensor([[-1e6, 0.0, 1.0]]), torch.float16)


def reference_pool(q: QuantizedRows, ids, offsets, weights, mode) -> torch.Tensor:
    """float64, one bag at a time."""
    table = q.codes.to(torch.float64) * q.scale.to(torch.float64)[:, None] + q.bias.to(torch.float64)[:, None]
    out = torch.zeros(offsets.numel() - 1, q.dim, dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        for i in range(lo, hi):
            w = float(weights[i]) if weights is not None else 1.0
            out[b] += w * table[ids[i]]
        if mode == "mean" and hi > lo:
            out[b] /= hi - lo
    return out


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [1 << 16, 7])
def test_pooled_lookup_matches_float64(mode, weighted, chunk, monkeypatch):
    monkeypatch.setattr(quantize_module, "_CHUNK_IDS", chunk)  # 7: many blocks, bags cut at their starts
    g = torch.Generator().manual_seed(3)
    q = quantize_rows(random_table(23, 11), torch.float16)
    lengths = torch.randint(0, 6, (41,), generator=g)
    lengths[:3] = 0  # leading empty bags
    lengths[-1] = 0  # and a trailing one
    lengths[10] = 17  # a bag longer than a block
    ids = torch.randint(0, 5, (int(lengths.sum()),), generator=g)  # few rows: many duplicates
    ids[::3] = torch.randint(0, 23, (ids[::3].numel(),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    got = pooled_lookup(q, ids, offsets, weights, mode)
    assert got.dtype == torch.float32 and got.shape == (41, 11)
    ref = reference_pool(q, ids, offsets, weights, mode)
    assert torch.allclose(got.to(torch.float64), ref, rtol=1e-5, atol=1e-5)
    assert (got[lengths == 0] == 0).all()


def test_pooled_lookup_one_hot_and_empty():
    q = quantize_rows(random_table(9, 4))
    ids = torch.tensor([3, 3, 8, 0])
    got = pooled_lookup(q, ids, torch.arange(5))
    assert torch.equal(got, dequantize_rows(q, ids))
    empty = pooled_lookup(
        q, torch.empty(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), mode="mean"
    )
    assert torch.equal(empty, torch.zeros(3, 4))


# ---- the file format ------------------------------------------------------------------------------
def test_file_round_trip_is_exact(tmp_path):
    tensors = {
        "a": torch.randn(7, 3),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randint(0, 255, (4, 9), dtype=torch.uint8),
        "d": torch.tensor(3, dtype=torch.int64),
        "e": torch.empty(0, 4),
        "f": torch.randn(2, 2).to(torch.float16),
    }
    size = write_export(tmp_path / "x.nrx", {"note": "hi"}, tensors)
    assert size == (tmp_path / "x.nrx").stat().st_size
    header, back = read_export(tmp_path / "x.nrx")
    assert header["note"] == "hi" and list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    assert not list(tmp_path.glob("*.tmp"))


def test_damaged_header_padding_and_a_newer_version_are_refused(tmp_path):
    import zlib

    write_export(tmp_path / "x.nrx", {"note": "hi"}, {"a": torch.ones(3)})
    data = (tmp_path / "x.nrx").read_bytes()
    end = 26 + int.from_bytes(data[14:22], "little")  # the header's end: zero padding follows
    assert end % 64
    (tmp_path / "p.nrx").write_bytes(data[:end] + b"\x01" + data[end + 1 :])
    with pytest.raises(ExportError, match="padding after its header is not zero"):
        read_export(tmp_path / "p.nrx")
    text = data[26:end].replace(b'"version": 1', b'"version": 2')
    (tmp_path / "v.nrx").write_bytes(data[:22] + zlib.crc32(text).to_bytes(4, "little") + text + data[end:])
    with pytest.raises(ExportError, match="format version 2, this neorec reads 1"):
        read_export(tmp_path / "v.nrx")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly trained tiny synthetic run, its trainer, and its fp32 and int8 exports."""
    root = tmp_path_factory.mktemp("tiny")
    trainer = Trainer(load_config("default", TINY), root / "run")
    result = trainer.fit()
    fp32 = export_model(root / "run", root / "fp32.nrx")
    int8 = export_model(root / "run", root / "int8.nrx", int8=True)
    return {"root": root, "trainer": trainer, "result": result, "fp32": fp32, "int8": int8}


def damaged(tmp_path, src: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    out = tmp_path / "damaged.nrx"
    out.write_bytes(bytes(edit(data)))
    return out


def test_truncated_corrupted_and_foreign_files_name_the_file(tiny, tmp_path):
    src = tiny["root"] / "fp32.nrx"
    size = src.stat().st_size

    def flip(at):
        def edit(d):
            d[at] ^= 0x40
            return d

        return edit

    cases = [
        (lambda d: d[: size - 100], "truncated"),
        (lambda d: d[:20], "truncated"),
        (lambda d: d[:200], "truncated"),
        (flip(size - 50), "checksum mismatch in the tensor data"),
        (flip(40), "checksum mismatch in the header"),
        (lambda d: d + b"extra", "longer than written"),
        (lambda d: b"", "not a neorec export file"),
    ]
    for edit, words in cases:
        path = damaged(tmp_path, src, edit)
        with pytest.raises(ExportError, match=words) as e:
            load_export(path)
        assert str(path) in str(e.value)
    # model.pt (a torch zip file) is not an export, and nothing of it is unpickled
    with pytest.raises(ExportError, match="not a neorec export file.*run folder"):
        load_export(tiny["root"] / "run" / "model.pt")
    with pytest.raises(ExportError, match="cannot be opened"):
        load_export(tmp_path / "missing.nrx")
    assert cli_main(["predict", str(tmp_path / "damaged.nrx"), "--out", str(tmp_path / "p.txt")]) == 2
    assert not (tmp_path / "p.txt").exists()


# ---- exports of trained runs ----------------------------------------------------------------------
@torch.no_grad()
def trained_scores(trainer: Trainer, batch_size: int = 1000) -> torch.Tensor:
    trainer.model.eval()
    return torch.cat([trainer.model(b) for b in trainer.source.eval_batches(batch_size)])


@torch.no_grad()
def export_scores(path: Path, source, batch_size: int = 1000) -> torch.Tensor:
    model = load_export(path).model
    return torch.cat([model(b) for b in source.eval_batches(batch_size)])


def test_fp32_export_scores_exactly_as_the_trained_model(tiny):
    trainer = tiny["trainer"]
    assert torch.equal(export_scores(tiny["root"] / "fp32.nrx", trainer.source), trained_scores(trainer))
    e = load_export(tiny["root"] / "fp32.nrx")
    assert not e.quantized and not any(p.requires_grad for p in e.model.parameters())
    assert e.model.embeddings.table(1).dtype == torch.float16  # tables keep their training dtype
    assert tiny["fp32"].eval["fp32"]["auc"] == pytest.approx(tiny["result"].eval["auc"], abs=1e-12)


def test_int8_export_auc_within_0002_and_smaller(tiny):
    r = tiny["int8"]
    assert r.eval["fp32"]["auc"] > 0.65, r.eval
    assert abs(r.auc_change) <= 0.002, r.eval
    assert r.num_bytes < r.fp32_bytes == tiny["fp32"].num_bytes
    assert r.table_bytes["int8"] < r.table_bytes["fp32"] / 2
    # What export measured is what the file scores.
    e = load_export(tiny["root"] / "int8.nrx")
    assert e.quantized and read_header(tiny["root"] / "int8.nrx")["quantization"]["kind"] == "int8_rowwise"
    logits = export_scores(tiny["root"] / "int8.nrx", tiny["trainer"].source)
    labels = torch.cat([b.labels for b in tiny["trainer"].source.eval_batches(1000)])
    assert binary_metrics(logits, labels)["auc"] == pytest.approx(r.eval["int8"]["auc"], abs=1e-12)


def test_int8_fp16_scales(tiny, tmp_path):
    r = export_model(tiny["root"] / "run", tmp_path / "h.nrx", int8=True, scale_dtype="fp16")
    assert abs(r.auc_change) <= 0.002 and r.num_bytes < tiny["int8"].num_bytes
    assert load_export(tmp_path / "h.nrx").model.embeddings.table(0).scale.dtype == torch.float16


def test_export_from_a_checkpoint_equals_model_pt(tmp_path):
    extra = ["checkpoint.every_steps=10", "train.max_steps=25", "model.arch=dcnv2", "model.low_rank=4",
             "embedding.optimizer={name: adam, lr: 0.01}"]  # fmt: skip
    trainer = Trainer(load_config("default", TINY + extra), tmp_path / "run")
    trainer.fit()
    export_model(tmp_path / "run", tmp_path / "a.nrx", measure=False)
    export_model(tmp_path / "run" / "checkpoints", tmp_path / "b.nrx", measure=False)  # the newest: step 25
    (tmp_path / "run" / "model.pt").unlink()
    export_model(
        tmp_path / "run", tmp_path / "c.nrx", measure=False
    )  # a run without model.pt: its checkpoint
    _, a = read_export(tmp_path / "a.nrx")
    for other in ("b.nrx", "c.nrx"):
        _, b = read_export(tmp_path / other)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), other
    assert torch.equal(export_scores(tmp_path / "b.nrx", trainer.source), trained_scores(trainer))
    with pytest.raises(ExportError, match="neither a run folder"):
        export_model(tmp_path, tmp_path / "d.nrx")


@pytest.mark.distributed
@pytest.mark.slow
def test_export_of_a_two_process_run_from_its_checkpoint(tmp_path):
    """A 2-rank run's sharded checkpoint, read into one process, gives the same file as its
    model.pt (whose tables the ranks gathered at the end)."""
    from dist_helpers import fit_rank, spawn

    rw = "distributed.sharding={C4: {kind: rw, ranks: [0, 1]}}"  # a row-wise table: two shard files
    sets = TINY + ["checkpoint.every_steps=10", "train.max_steps=20", rw]
    spawn(2, fit_rank, (sets, str(tmp_path / "run")), tmp_path=tmp_path / "pg")  # the workers' Trainer
    export_model(tmp_path / "run", tmp_path / "a.nrx", measure=False)
    export_model(tmp_path / "run" / "checkpoints", tmp_path / "b.nrx", measure=False)
    _, a = read_export(tmp_path / "a.nrx")
    _, b = read_export(tmp_path / "b.nrx")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- predict --------------------------------------------------------------------------------------
def test_predict_writes_one_line_per_sample_and_eval_auc(tiny, tmp_path):
    out = tmp_path / "sub" / "pred.txt"
    assert (
        cli_main(["predict", str(tiny["root"] / "fp32.nrx"), "--out", str(out), "--batch-size", "333"]) == 0
    )
    lines = out.read_text().splitlines()
    assert len(lines) == 4000
    probs = torch.tensor([float(x) for x in lines], dtype=torch.float64)
    labels = torch.cat([b.labels for b in tiny["trainer"].source.eval_batches(4000)])
    # what `neorec eval` reports, up to ties float32 probabilities make among close logits
    assert probability_metrics(probs, labels)["auc"] == pytest.approx(tiny["result"].eval["auc"], abs=1e-6)
    r = predict_file(tiny["root"] / "int8.nrx", tmp_path / "p.csv", with_labels=True, batch_size=1000)
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert rows[0] == "probability,label" and len(rows) == 4001 and r.num_samples == 4000
    assert [int(x.split(",")[1]) for x in rows[1:]] == labels.int().tolist()
    assert r.metrics["auc"] == pytest.approx(tiny["int8"].eval["int8"]["auc"], abs=1e-12)
    with pytest.raises(ExportError, match="Criteo TSV"):
        predict_file(tiny["root"] / "fp32.nrx", tmp_path / "x.txt", data=tmp_path / "any.tsv")


def test_predictions_are_written_as_float32_exactly():
    from neorec.serving.predict import _lines

    p = torch.tensor([0.123456789, 1e-8, 0.99999994, 0.5], dtype=torch.float32)
    back = [float(x) for x in _lines(p, None).decode().splitlines()]
    assert torch.equal(torch.tensor(back, dtype=torch.float32), p)
    rows = _lines(p, torch.tensor([1.0, 0.0, 1.0, 0.0])).decode().splitlines()
    assert [r.split(",")[1] for r in rows] == ["1", "0", "1", "0"]


def test_cli_export_prints_sizes_and_auc_change(tiny, tmp_path, capsys):
    assert cli_main(["export", str(tiny["root"] / "run"), "--out", str(tmp_path / "m.nrx"), "--int8"]) == 0
    text = capsys.readouterr().out
    for words in [
        "unquantized export size",
        "eval AUC fp32",
        "eval AUC int8",
        "AUC change int8 - fp32",
        "file size",
    ]:
        assert words in text, text
    assert cli_main(["export", str(tmp_path), "--out", str(tmp_path / "n.nrx")]) == 2
    assert "neither a run folder" in capsys.readouterr().err


@pytest.mark.skipif(not CRITEO.is_file(), reason=f"shared Criteo sample not found at {CRITEO}")
def test_predict_criteo_tsv(tmp_path):
    sets = ["data.source=criteo_tsv", f"data.criteo={{train_paths: [{CRITEO}], table_rows: 1000, hashing: hash}}",
            "data.batch_size=32", "train.max_steps=5", "train.progress=false", "logging.plot=false",
            "logging.tensorboard=false"]  # fmt: skip
    Trainer(load_config("default", sets), tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "m.nrx", int8=True)
    r = predict_file(tmp_path / "m.nrx", tmp_path / "p.txt", data=CRITEO, batch_size=64)
    assert r.num_samples == 200 and len((tmp_path / "p.txt").read_text().splitlines()) == 200
    # The held-out lines (every 10th) scored from the file give the same scores as the run's source.
    held_out = tmp_path / "held_out.tsv"
    held_out.write_text(
        "".join(x for i, x in enumerate(CRITEO.read_text().splitlines(True), 1) if i % 10 == 0)
    )
    a = predict_file(tmp_path / "m.nrx", tmp_path / "a.txt", data=held_out)
    b = predict_file(tmp_path / "m.nrx", tmp_path / "b.txt")
    assert (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text() and a.num_samples == 20
    assert math.isfinite(b.metrics["log_loss"])
    # A bad line stops with file:line, and leaves neither the output nor its temporary file.
    bad = tmp_path / "bad.tsv"
    bad.write_text(held_out.read_text() + "1\tnot-enough-fields\n")
    with pytest.raises(DataError, match=f"{bad}:21"):
        predict_file(tmp_path / "m.nrx", tmp_path / "c.txt", data=bad)
    assert not list(tmp_path.glob("c.txt*"))
    # Lines without the label (Criteo's test files: 39 fields), plain and .gz, score as their labeled
    # lines do (through the fast parser, and line by line where a block holds a bad line); no metrics
    lines = CRITEO.read_text().splitlines(True)
    unlabeled = tmp_path / "test.tsv"
    unlabeled.write_text("".join(x.split("\t", 1)[1] for x in lines))
    zipped = tmp_path / "test.tsv.gz"
    zipped.write_bytes(gzip.compress(unlabeled.read_bytes()))
    for path in (unlabeled, zipped):
        u = predict_file(tmp_path / "m.nrx", tmp_path / "u.txt", data=path, batch_size=64)
        assert (tmp_path / "u.txt").read_text() == (tmp_path / "p.txt").read_text() and u.metrics == {}
        assert u.num_samples == len(lines)
    with pytest.raises(ConfigError, match="--with-labels: .*test.tsv has no labels"):
        predict_file(tmp_path / "m.nrx", tmp_path / "u.csv", data=unlabeled, with_labels=True)
    mixed = tmp_path / "mixed.tsv"
    mixed.write_text(unlabeled.read_text() + lines[0])  # a labeled line among unlabeled ones
    with pytest.raises(DataError, match=r"mixed.tsv:201: expected 39 tab-separated fields \(I1..I13, C1"):
        predict_file(tmp_path / "m.nrx", tmp_path / "c.txt", data=mixed)
    # that block read line by line (the bad line skipped) gives the labeled file's values
    (whole,) = CriteoTSVReader([CRITEO], 1000, "hash").batches(1000)
    (lined,) = CriteoTSVReader([mixed], 1000, "hash", "skip", labeled=False).batches(1000)
    assert torch.equal(whole.dense, lined.dense) and torch.equal(whole.sparse.values, lined.sparse.values)


@pytest.mark.skipif(
    not (MOVIELENS / "ratings.csv").is_file(), reason=f"shared MovieLens not found at {MOVIELENS}"
)
def test_movielens_int8_auc_within_0002(tmp_path):
    sets = [f"data.movielens.root={MOVIELENS}", "data.batch_size=512", "train.epochs=1", "train.progress=false",
            "logging.plot=false", "logging.tensorboard=false"]  # fmt: skip
    trainer = Trainer(load_config("movielens", sets), tmp_path / "run")
    result = trainer.fit()
    r = export_model(tmp_path / "run", tmp_path / "m.nrx", int8=True)
    assert (
        r.eval["fp32"]["auc"] == pytest.approx(result.eval["auc"], abs=1e-12) and r.eval["fp32"]["auc"] > 0.7
    )
    assert abs(r.auc_change) <= 0.002, r.eval
    assert r.num_bytes < r.fp32_bytes / 2
