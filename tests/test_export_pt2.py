"""The pt2 export: a torch.export program that scores like `neorec predict` (fp32 bitwise, int8
within the AUC bound) for any batch size, loads in a process without neorec, and safetensors
weights that other readers take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.embedding.tables import TableConfig
from neorec.serving import ExportError, export_model, load_export, predict_file
from neorec.serving.embeddings import InferenceEmbeddings
from neorec.serving.export import load_trained, quantize_tables
from neorec.serving.file_format import read_export
from neorec.serving.pt2_model import TableLookups, program_inputs
from neorec.serving.quantize import quantize_rows
from neorec.serving.safetensors_file import read_safetensors
from neorec.sparse import SparseBatch
from neorec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_export import TINY  # noqa: E402 - the same tiny run: multi-hot, weights, mean pooling, an fp16 table

# One-hot ids without weights, sum pooling: the lookups' other paths; DCNv2 under bf16 autocast.
ONE_HOT = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[40, 200, 9]", "data.synthetic.num_sparse=3",
    "data.synthetic.train_samples=2000", "data.synthetic.eval_samples=1000", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "model.arch=dcnv2",
    "model.precision=bf16",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly trained tiny run and its exports: .nrx and pt2, fp32 and int8."""
    root = tmp_path_factory.mktemp("pt2")
    trainer = Trainer(load_config("default", TINY), root / "run")
    trainer.fit()
    reports = {
        "fp32": export_model(root / "run", root / "fp32", format="pt2"),
        "int8": export_model(root / "run", root / "int8", int8=True, format="pt2"),
    }
    export_model(root / "run", root / "fp32.nrx", measure=False)
    export_model(root / "run", root / "int8.nrx", int8=True, measure=False)
    return {"root": root, "trainer": trainer, "reports": reports}


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("one_hot", [False, True])
def test_lookups_bitwise_like_inference_embeddings(weighted, one_hot):
    """Every table kind (fp32, fp16, bf16, int8; a table shared by two features; sum and mean), bags
    of any length or all of one id (where neorec gathers instead of pooling)."""
    g = torch.Generator().manual_seed(int(weighted) * 2 + int(one_hot))
    tables = [
        TableConfig(name="a", rows=30, dim=4, features=["f1", "f2"], pooling="sum"),
        TableConfig(name="b", rows=20, dim=4, features=["f3"], pooling="mean", dtype="fp16"),
        TableConfig(name="c", rows=10, dim=4, features=["f4"], pooling="sum", dtype="bf16"),
        TableConfig(name="d", rows=25, dim=4, features=["f5"], pooling="mean"),
        TableConfig(name="e", rows=25, dim=4, features=["f6"], pooling="sum"),
    ]
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    weights = {t.name: torch.randn(t.rows, t.dim, generator=g).to(dtypes[t.dtype]) for t in tables}
    weights["d"], weights["e"] = quantize_rows(weights["d"]), quantize_rows(weights["e"], torch.float16)
    names, batch_size = [f for t in tables for f in t.features], 9
    rows = {f: t.rows for t in tables for f in t.features}
    if one_hot:
        lengths = torch.ones(len(names) * batch_size, dtype=torch.int64)
    else:
        lengths = torch.randint(0, 4, (len(names) * batch_size,), generator=g)
    values = torch.cat([
        torch.randint(0, rows[f], (int(lengths[k * batch_size : (k + 1) * batch_size].sum()),), generator=g)
        for k, f in enumerate(names)
    ])  # fmt: skip
    sparse = SparseBatch(
        names, values, lengths, torch.rand(values.numel(), generator=g) if weighted else None
    )
    want = InferenceEmbeddings(tables, weights)(sparse)
    batch = Batch(torch.zeros(batch_size, 1), sparse, torch.zeros(batch_size))
    _, ids, offsets, w = program_inputs(batch, names, weighted)
    got = TableLookups(tables, weights)(ids, offsets, w)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def predictions(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().splitlines()]


def test_fp32_program_scores_bitwise_like_predict(tiny, tmp_path):
    root = tiny["root"]
    assert cli_main(["predict", str(root / "fp32.nrx"), "--out", str(tmp_path / "a.txt")]) == 0
    assert cli_main(["predict", str(root / "fp32"), "--out", str(tmp_path / "b.txt")]) == 0
    assert (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text()  # 9 digits: float32 exactly
    assert len(predictions(tmp_path / "b.txt")) == 4000
    # the same, as tensors, batch by batch
    nrx, pt2 = load_export(root / "fp32.nrx"), load_export(root / "fp32" / "model.pt2")
    assert pt2.is_program and not pt2.quantized
    for batch in tiny["trainer"].source.eval_batches(1000):
        assert torch.equal(pt2.probabilities(batch), nrx.probabilities(batch))


def test_int8_program_within_the_auc_bound(tiny, tmp_path):
    r = tiny["reports"]["int8"]
    assert abs(r.auc_change) <= 0.002, r.eval
    fp32 = predict_file(tiny["root"] / "fp32", tmp_path / "a.txt")
    int8 = predict_file(tiny["root"] / "int8", tmp_path / "b.txt")
    assert int8.quantized and abs(int8.metrics["auc"] - fp32.metrics["auc"]) <= 0.002
    assert int8.metrics["auc"] == pytest.approx(r.eval["int8"]["auc"], abs=1e-9)  # what export measured
    nrx = predict_file(tiny["root"] / "int8.nrx", tmp_path / "c.txt")
    a, b = torch.tensor(predictions(tmp_path / "b.txt")), torch.tensor(predictions(tmp_path / "c.txt"))
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert nrx.metrics["auc"] == pytest.approx(int8.metrics["auc"])


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_one_program_scores_batches_of_1_7_and_300(tiny, kind):
    program = load_export(tiny["root"] / kind)
    reference = load_export(tiny["root"] / f"{kind}.nrx")
    batch = next(iter(tiny["trainer"].source.eval_batches(300)))
    for size in (1, 7, 300):
        part = batch.slice(0, size)
        got = program.probabilities(part)
        assert got.shape == (size,)
        want = reference.probabilities(part)
        if kind == "fp32":
            assert torch.equal(got, want), size
        else:
            assert torch.allclose(got, want, rtol=0, atol=1e-6), size


def test_one_hot_sum_tables_and_bf16_dcnv2_bitwise(tmp_path):
    Trainer(load_config("default", ONE_HOT), tmp_path / "run").fit()
    export_model(tmp_path / "run", tmp_path / "pt2", format="pt2", measure=False)
    export_model(tmp_path / "run", tmp_path / "m.nrx", measure=False)
    a = predict_file(tmp_path / "pt2", tmp_path / "a.txt", batch_size=77)
    predict_file(tmp_path / "m.nrx", tmp_path / "b.txt", batch_size=77)
    assert a.num_samples == 1000 and (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text()


SCRIPT = """
import os, sys
# hide neorec: its editable-install finder and any path that holds a neorec package
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
sys.path = [p for p in sys.path if "__editable__" not in p and not os.path.isdir(os.path.join(p or ".", "neorec"))]
sys.path_importer_cache.clear()
try:
    import neorec
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("neorec is importable: " + neorec.__file__)
import torch
scores = {}
for kind, program_file, inputs_file in zip(*[iter(sys.argv[2:])] * 3):
    program = torch.export.load(program_file).module()
    with torch.no_grad():
        scores[kind] = [program(*args) for args in torch.load(inputs_file, weights_only=True)]
torch.save(scores, sys.argv[1])
assert "neorec" not in sys.modules
"""


def test_programs_load_and_score_without_neorec(tiny, tmp_path):
    batch = next(iter(tiny["trainer"].source.eval_batches(300)))
    sizes = (1, 7, 300)
    exported, args = {}, []
    for kind in ("fp32", "int8"):
        exported[kind] = e = load_export(tiny["root"] / kind)
        names, weighted = e.header["inputs"]["feature_names"], e.header["inputs"]["weighted"]
        torch.save(
            [program_inputs(batch.slice(0, n), names, weighted) for n in sizes], tmp_path / f"{kind}.pt"
        )
        args += [kind, str(tiny["root"] / kind / "model.pt2"), str(tmp_path / f"{kind}.pt")]
    (tmp_path / "score.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-I", str(tmp_path / "score.py"), str(tmp_path / "out.pt"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for kind in ("fp32", "int8"):
        for got, n in zip(out[kind], sizes, strict=True):
            assert got.shape == (n,) and torch.equal(got, exported[kind].probabilities(batch.slice(0, n))), (
                kind,
                n,
            )


def test_safetensors_weights(tiny):
    st = pytest.importorskip("safetensors.torch")
    for kind in ("fp32", "int8"):
        path = tiny["root"] / kind / "weights.safetensors"
        _, nrx = read_export(tiny["root"] / f"{kind}.nrx")
        ours, meta = read_safetensors(path)  # checks every crc32
        theirs = st.load_file(str(path))
        assert list(ours) == list(nrx) and sorted(theirs) == sorted(nrx)
        for name, t in nrx.items():
            assert theirs[name].dtype == t.dtype and torch.equal(theirs[name], t), name
            assert torch.equal(ours[name], t), name
            assert f"crc32/{name}" in meta
        assert json.loads(meta["inputs"])["feature_names"] == ["C1", "C2", "C3", "C4"]
        if kind == "int8":
            assert theirs["tables/C1/codes"].dtype == torch.uint8 and "int8_rowwise" in meta["quantization"]
    # the tables are the trained ones, and int8 codes/scales/biases are those neorec quantizes
    trained = load_trained(tiny["root"] / "run")
    q = quantize_tables(trained.weights)
    fp32 = st.load_file(str(tiny["root"] / "fp32" / "weights.safetensors"))
    int8 = st.load_file(str(tiny["root"] / "int8" / "weights.safetensors"))
    for name, w in trained.weights.items():
        assert torch.equal(fp32[f"tables/{name}/weight"], w)
        assert torch.equal(int8[f"tables/{name}/codes"], q[name].codes)
        assert torch.equal(int8[f"tables/{name}/scale"], q[name].scale)
        assert torch.equal(int8[f"tables/{name}/bias"], q[name].bias)


def test_corrupted_safetensors_and_foreign_pt2_name_the_file(tiny, tmp_path):
    data = bytearray((tiny["root"] / "fp32" / "weights.safetensors").read_bytes())
    data[-3] ^= 0x40
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match="checksum mismatch in tensor") as e:
        read_safetensors(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(e.value)
    (tmp_path / "other.pt2").write_bytes(b"not a zip file")  # a lone .pt2 file: an AOTInductor package's name
    with pytest.raises(ExportError, match=r"AOTInductor package .*other\.pt2 is not a readable zip archive"):
        load_export(tmp_path / "other.pt2")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.pt2").write_bytes((tiny["root"] / "fp32" / "model.pt2").read_bytes()[:5000])
    with pytest.raises(ExportError, match="truncated or corrupted"):
        load_export(cut)
    with pytest.raises(ExportError, match="folder without model.pt2"):
        load_export(tmp_path)
    (tmp_path / "file").write_text("x")
    assert (
        cli_main(["export", str(tiny["root"] / "run"), "--format", "pt2", "--out", str(tmp_path / "file")])
        == 2
    )


def test_cli_export_pt2(tiny, tmp_path, capsys):
    out = tmp_path / "m"
    args = ["export", str(tiny["root"] / "run"), "--format", "pt2", "--int8", "--no-eval", "--out", str(out)]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "model.pt2 + weights.safetensors" in text and "int8 row-wise" in text, text
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "weights.safetensors"]
