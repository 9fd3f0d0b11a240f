"""Row-wise int4 and int2 tables (and int8 beside them): packing and quantization against float64
references, pooled lookups against a float64 reference, `neorec export --quantize` of a tiny run in
.nrx and pt2 scoring as the in-process quantized model, table sizes, and headers that are refused."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.errors import NeorecError
from neorec.serving import ExportError, export_model, load_export, predict_file
from neorec.serving import quantize as quantize_module
from neorec.serving.export import load_trained, quantize_tables
from neorec.serving.file_format import read_export, read_header, write_export
from neorec.serving.quantize import (
    QuantizedRows,
    dequantize_rows,
    pack_codes,
    packed_width,
    pooled_lookup,
    quantize_rows,
    unpack_codes,
)
from neorec.serving.safetensors_file import read_safetensors
from neorec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_export import TINY  # noqa: E402 - multi-hot, empty bags, weights, mean pooling, an fp16 table

# dim 7: rows end inside a byte for int4 (4 bytes) and int2 (2 bytes)
ODD = [*TINY, "embedding.dim=7", "model.bottom_mlp=[16,7]", "data.synthetic.train_samples=3000",
       "data.synthetic.eval_samples=1500"]  # fmt: skip
KINDS = {"int8": 8, "int4": 4, "int2": 2}


# ---- packing --------------------------------------------------------------------------------------
def test_packing_is_low_bits_first_and_pads_rows_with_zeros():
    codes = torch.tensor([[1, 2, 3], [15, 0, 9]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x03], [0x0F, 0x09]]
    codes = torch.tensor([[1, 2, 3, 0, 1], [3, 3, 3, 3, 2]], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 1], [0xFF, 2]]
    assert torch.equal(pack_codes(codes, 8), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    for dim in range(1, 10):
        codes = torch.randint(0, 1 << bits, (6, dim), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (6, packed_width(dim, bits)) == (6, -(-dim * bits // 8))
        assert torch.equal(unpack_codes(packed, bits, dim), codes)
    empty = torch.empty(0, packed_width(5, bits), dtype=torch.uint8)
    assert unpack_codes(empty, bits, 5).shape == (0, 5)


# ---- quantization against float64 ----------------------------------------------------------------
def random_table(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 3
    w += torch.randn(rows, 1, generator=g)
    w[0] = 0.25  # a constant row
    w[1] = -7.5  # a constant negative row
    w[2] = -torch.rand(dim, generator=g) - 2.0  # a row of negative values only
    if rows > 3:
        w[3, :] = torch.linspace(-1e-3, 1e-3, dim)  # a tiny range
    if rows > 4:
        w[4, 0] = 40.0  # one outlier
    return w


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("rows,dim", [(37, 13), (5, 1), (11, 3), (9, 6), (200, 64)])
def test_quantize_within_half_a_step_of_float64(rows, dim, bits, scale_dtype):
    w = random_table(rows, dim, seed=dim)
    q = quantize_rows(w, scale_dtype, bits)
    qmax = (1 << bits) - 1
    assert (q.bits, q.dim, q.num_rows) == (bits, dim, rows)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (rows, packed_width(dim, bits))
    assert q.scale.dtype == scale_dtype and q.bias.dtype == scale_dtype and q.scale.shape == (rows,)
    assert q.nbytes == rows * (packed_width(dim, bits) + 2 * q.scale.element_size())
    codes = unpack_codes(q.codes, bits, dim)
    assert int(codes.max()) <= qmax
    # the bits past a row's last code are zero
    assert torch.equal(pack_codes(codes, bits), q.codes)
    w64 = w.to(torch.float64)
    s64, b64 = q.scale.to(torch.float64), q.bias.to(torch.float64)
    # The stored scale and bias cover the row: bias <= min and bias + qmax * scale >= max (up to fp32 rounding).
    assert (b64 <= w64.amin(1)).all()
    assert (b64 + qmax * s64 >= w64.amax(1) - 1e-6 * w64.abs().amax(1)).all()
    if scale_dtype == torch.float32:
        assert torch.allclose(s64, (w64.amax(1) - w64.amin(1)) / qmax, rtol=1e-6, atol=0)
    # Dequantized in fp32 as the float64 reference, and every element within scale / 2 of its value.
    ref = codes.to(torch.float64) * s64[:, None] + b64[:, None]
    assert torch.allclose(dequantize_rows(q).to(torch.float64), ref, rtol=1e-6, atol=1e-7)
    assert ((ref - w64).abs() <= s64[:, None] / 2 + 1e-6 * (w64.abs() + 1)).all()
    # The codes are the float64 nearest codes, except (at most by one) at exact ties.
    exact = ((w64 - b64[:, None]) / torch.where(s64 > 0, s64, 1.0)[:, None]).round().clamp(0, qmax)
    assert (exact - codes.to(torch.float64)).abs().max() <= 1
    for r in (0, 1):  # constant rows (of values fp16 holds exactly) come back exactly, as codes 0
        assert torch.equal(dequantize_rows(q)[r], w[r]) and (codes[r] == 0).all()


def test_rows_are_read_by_id_and_checked():
    q = quantize_rows(random_table(9, 5), torch.float16, 2)
    ids = torch.tensor([4, 0, 4])
    assert torch.equal(dequantize_rows(q, ids), dequantize_rows(q)[ids])
    with pytest.raises(ValueError, match="take 2 bytes a row, got 5"):
        QuantizedRows(torch.zeros(9, 5, dtype=torch.uint8), q.scale, q.bias, 2, 5)
    with pytest.raises(ValueError, match="need the table's dim"):
        QuantizedRows(q.codes, q.scale, q.bias, 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_rows(random_table(9, 5), bits=3)
    with pytest.raises(Exception, match="NaN"):
        quantize_rows(torch.full((2, 3), float("nan")), bits=4)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_minimum_and_constant_rows_come_back_as_docs_export_md_says(bits):
    """fp32 scale and bias: every row's minimum, so every constant row, comes back exactly. fp16: only
    when the minimum is an fp16 number; otherwise within half the stored scale, which is (range + d) /
    qmax rounded up to fp16, d = min - bias below one fp16 step at min."""
    qmax = (1 << bits) - 1
    w = torch.tensor([[0.1] * 5, [1e5] * 5, [-3e7] * 5, [0.25] * 5, [-7.5] * 5, [1024.0] * 5,
                      [0.1, 0.7, -0.3, 2.0, 0.9], [-7.5, 3.0, 1.0, 2.5, -1.0]])  # fmt: skip
    lowest = w.argmin(1)
    back = dequantize_rows(quantize_rows(w, torch.float32, bits))
    assert torch.equal(back[:6], w[:6])
    assert torch.equal(back.gather(1, lowest[:, None]), w.amin(1, keepdim=True))
    half = w[[0, 3, 4, 5, 6, 7]]  # magnitudes fp16 holds
    q = quantize_rows(half, torch.float16, bits)
    back = dequantize_rows(q)
    in_fp16 = half.amin(1) == half.amin(1).half().float()  # 0.25, -7.5, 1024, -7.5: yes; 0.1: no
    assert in_fp16.tolist() == [False, True, True, True, False, True]
    assert torch.equal(back[1:4], half[1:4])
    assert torch.equal(back.gather(1, half.argmin(1)[:, None])[in_fp16], half.amin(1, keepdim=True)[in_fp16])
    assert not torch.equal(back[0], half[0]) and (back[0] - half[0]).abs().max() < 1e-6
    w64, s64, b64 = half.double(), q.scale.double(), q.bias.double()
    d = w64.amin(1) - b64
    step = torch.tensor([2.0 ** (math.floor(math.log2(abs(x))) - 10) for x in w64.amin(1).tolist()])
    assert ((d >= 0) & (d < step.double())).all()
    bound = ((w64.amax(1) - w64.amin(1) + d) / qmax).float().half()  # to nearest: at most one step below
    assert (s64 <= torch.nextafter(bound, torch.tensor(float("inf"), dtype=torch.float16)).double()).all()
    assert ((back.double() - w64).abs() <= s64[:, None] / 2).all()


def test_fp16_refuses_rows_beyond_its_range_naming_table_and_row():
    w = torch.zeros(4, 6)
    w[1] = 1e5  # a constant row above 65504: its bias would be clamped
    with pytest.raises(NeorecError, match=r"row 1: its smallest value 100000 is beyond the fp16 range"):
        quantize_rows(w, torch.float16, 8)
    w[1], w[2] = 0.0, -1e5  # below -65504: its bias would be -inf
    with pytest.raises(NeorecError, match=r"row 2: its smallest value -100000 is beyond the fp16 range"):
        quantize_rows(w, torch.float16, 4)
    w[2], w[3, 0] = 0.0, 1e8  # a range that needs a scale above 65504
    with pytest.raises(NeorecError, match=r"row 3: its values span 1e\+08, a scale of .* beyond the fp16"):
        quantize_rows(w, torch.float16, 2)
    w[3, 0] = 1e5  # bias 0 and a scale fp16 holds: values beyond 65504 are fine
    q = quantize_rows(w, torch.float16, 8)
    assert ((dequantize_rows(q) - w).abs() <= q.scale.float()[:, None] / 2).all()
    w[0] = 7e4
    words = r"^table 'C7': row 0: its smallest value 70000 is beyond the fp16 .*\(--scale-dtype fp32\)"
    with pytest.raises(ExportError, match=words):
        quantize_tables({"C7": w}, "fp16", "int4")
    assert torch.equal(dequantize_rows(quantize_tables({"C7": w}, "fp32", "int4")["C7"])[0], w[0])


# ---- pooled lookups against float64 ---------------------------------------------------------------
def reference_pool(q: QuantizedRows, ids, offsets, weights, mode) -> torch.Tensor:
    """float64, one bag at a time, from the unpacked codes."""
    codes = unpack_codes(q.codes, q.bits, q.dim).to(torch.float64)
    table = codes * q.scale.to(torch.float64)[:, None] + q.bias.to(torch.float64)[:, None]
    out = torch.zeros(offsets.numel() - 1, q.dim, dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        for i in range(lo, hi):
            out[b] += (float(weights[i]) if weights is not None else 1.0) * table[ids[i]]
        if mode == "mean" and hi > lo:
            out[b] /= hi - lo
    return out


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk", [1 << 16, 7])
def test_pooled_lookup_matches_float64(bits, mode, weighted, chunk, monkeypatch):
    monkeypatch.setattr(quantize_module, "_CHUNK_IDS", chunk)  # 7: many blocks, bags cut at their starts
    g = torch.Generator().manual_seed(bits)
    q = quantize_rows(random_table(23, 11), torch.float16 if weighted else torch.float32, bits)
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
    assert torch.allclose(
        got.to(torch.float64), reference_pool(q, ids, offsets, weights, mode), rtol=1e-5, atol=1e-5
    )
    assert (got[lengths == 0] == 0).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_pooled_lookup_one_hot_and_empty(bits):
    q = quantize_rows(random_table(9, 3), bits=bits)
    ids = torch.tensor([3, 3, 8, 0])
    assert torch.equal(pooled_lookup(q, ids, torch.arange(5)), dequantize_rows(q, ids))
    empty = pooled_lookup(
        q, torch.empty(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), mode="mean"
    )
    assert torch.equal(empty, torch.zeros(3, 3))


# ---- exports of a tiny trained run ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly trained tiny run (dim 7) and its int8, int4 and int2 exports, .nrx and (int4, int2) pt2."""
    root = tmp_path_factory.mktemp("bits")
    trainer = Trainer(load_config("default", ODD), root / "run")
    trainer.fit()
    reports = {k: export_model(root / "run", root / f"{k}.nrx", quantize=k) for k in KINDS}
    for k in ("int4", "int2"):
        export_model(root / "run", root / k, quantize=k, format="pt2", measure=False)
    return {"root": root, "trainer": trainer, "reports": reports, "trained": load_trained(root / "run")}


def in_process(tiny, kind: str, scale_dtype: str = "fp32") -> torch.nn.Module:
    trained = tiny["trained"]
    return trained.inference_model(quantize_tables(trained.weights, scale_dtype, kind))


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_exports_score_as_the_in_process_quantized_model(tiny, kind):
    root, source = tiny["root"], tiny["trainer"].source
    model = in_process(tiny, kind)
    nrx, pt2 = load_export(root / f"{kind}.nrx"), load_export(root / kind)
    assert nrx.quantization == pt2.quantization == kind and pt2.is_program
    with torch.no_grad():
        for batch in source.eval_batches(500):
            want = model(batch)
            assert torch.equal(nrx.model(batch), want)
            assert torch.equal(pt2.probabilities(batch), torch.sigmoid(want))
        one = next(iter(source.eval_batches(1)))  # the program takes a batch of one sample too
        assert torch.equal(pt2.probabilities(one), torch.sigmoid(model(one)))
    # what export measured is what predict scores from the file
    r = predict_file(root / f"{kind}.nrx", root / f"{kind}.txt")
    assert r.quantization == kind and r.metrics["auc"] == pytest.approx(
        tiny["reports"][kind].eval[kind]["auc"], abs=1e-12
    )
    assert tiny["reports"][kind].auc_change is not None


def test_table_bytes_halve_and_quarter_int8_codes(tiny):
    root, rows = tiny["root"], sum(t.rows for t in tiny["trained"].tables)
    codes = {}
    for kind, bits in KINDS.items():
        header, tensors = read_export(root / f"{kind}.nrx")
        assert header["quantization"] == {"kind": f"{kind}_rowwise", "bits": bits, "scale_dtype": "fp32"}
        codes[kind] = sum(t.numel() for n, t in tensors.items() if n.endswith("/codes"))
        assert tiny["reports"][kind].table_bytes[kind] == codes[kind] + rows * 8  # fp32 scale and bias
        assert tiny["reports"][kind].row_bytes[kind] == pytest.approx(codes[kind] / rows + 8)
    assert codes["int8"] == rows * 7 and codes["int4"] == rows * 4 and codes["int2"] == rows * 2
    assert codes["int4"] / codes["int8"] <= 1 / 2 + 1 / 14 and codes["int2"] / codes["int8"] <= 1 / 4 + 3 / 28
    sizes = [tiny["reports"][k].num_bytes for k in KINDS]
    assert sizes == sorted(sizes, reverse=True) and tiny["reports"]["int2"].fp32_bytes > sizes[0]
    # the pt2 weights hold the same packed tensors, and their metadata the quantization
    tensors, meta = read_safetensors(root / "int2" / "weights.safetensors")
    _, nrx = read_export(root / "int2.nrx")
    assert all(torch.equal(tensors[n], t) for n, t in nrx.items() if n.startswith("tables/"))
    assert '"int2_rowwise"' in meta["quantization"] and "low bits first" in meta["layout"]


def test_fp16_scales(tiny, tmp_path):
    r = export_model(
        tiny["root"] / "run", tmp_path / "h.nrx", quantize="int4", scale_dtype="fp16", measure=False
    )
    assert r.num_bytes < tiny["reports"]["int4"].num_bytes
    e = load_export(tmp_path / "h.nrx")
    assert e.model.embeddings.table(0).scale.dtype == torch.float16 and e.model.embeddings.table(0).bits == 4
    batch = next(iter(tiny["trainer"].source.eval_batches(300)))
    with torch.no_grad():
        assert torch.equal(e.model(batch), in_process(tiny, "int4", "fp16")(batch))


def rewrite(src: Path, out: Path, edit_header=None, edit_tensors=None) -> Path:
    """A copy of an .nrx file with its header or tensors changed, written with fresh checksums."""
    header, tensors = read_export(src)  # write_export replaces the entries of the tensors and checksums
    write_export(
        out,
        edit_header(header) if edit_header else header,
        edit_tensors(tensors) if edit_tensors else tensors,
    )
    return out


def test_unknown_or_malformed_quantization_is_refused_naming_the_file(tiny, tmp_path):
    src = tiny["root"] / "int4.nrx"

    def quant(**entry):
        return lambda h: {**h, "quantization": {**h["quantization"], **entry}}

    cases = [
        (quant(kind="int3_rowwise", bits=3), "quantized as 'int3_rowwise', which this neorec does not read"),
        (lambda h: {**h, "quantization": "int4"}, "quantized as None"),
        (quant(bits=8), "quantization is malformed"),
        (quant(scale_dtype="bf16"), "quantization is malformed"),
        (quant(kind="int2_rowwise", bits=2), "does not fit its header"),  # int4 codes under an int2 header
    ]
    for k, (edit, words) in enumerate(cases):
        path = rewrite(src, tmp_path / f"bad{k}.nrx", edit)
        with pytest.raises(ExportError, match=words) as e:
            load_export(path)
        assert str(path) in str(e.value)
    assert cli_main(["predict", str(tmp_path / "bad0.nrx"), "--out", str(tmp_path / "p.txt")]) == 2
    # a damaged byte in the packed codes is caught by the data checksum
    header, data = read_header(src), bytearray(src.read_bytes())
    data[len(data) - header["data_bytes"] + header["tensors"]["tables/C3/codes"]["offset"]] ^= 0x01
    (tmp_path / "flip.nrx").write_bytes(bytes(data))
    with pytest.raises(ExportError, match="checksum mismatch"):
        load_export(tmp_path / "flip.nrx")


def test_pt2_with_an_unknown_kind_is_refused(tiny, tmp_path):
    import json
    import shutil

    folder = tmp_path / "pt2"
    shutil.copytree(tiny["root"] / "int2", folder)
    extra = {"neorec.json": ""}
    program = torch.export.load(folder / "model.pt2", extra_files=extra)
    header = json.loads(extra["neorec.json"])
    header["quantization"] = {"kind": "int1_rowwise", "bits": 1, "scale_dtype": "fp32"}
    torch.export.save(program, folder / "model.pt2", extra_files={"neorec.json": json.dumps(header)})
    with pytest.raises(ExportError, match="'int1_rowwise', which this neorec does not read") as e:
        load_export(folder)
    assert str(folder / "model.pt2") in str(e.value)


def test_an_int8_header_without_bits_loads_as_before(tiny, tmp_path):
    def drop_bits(h):
        return {**h, "quantization": {"kind": "int8_rowwise", "scale_dtype": "fp32"}}

    old = rewrite(tiny["root"] / "int8.nrx", tmp_path / "old.nrx", drop_bits)
    assert "bits" not in read_header(old)["quantization"]
    a, b = load_export(old), load_export(tiny["root"] / "int8.nrx")
    assert a.quantization == "int8"
    batch = next(iter(tiny["trainer"].source.eval_batches(300)))
    assert torch.equal(a.probabilities(batch), b.probabilities(batch))


def test_cli_quantize_flags(tiny, tmp_path, capsys):
    run = str(tiny["root"] / "run")
    assert (
        cli_main(
            ["export", run, "--out", str(tmp_path / "a.nrx"), "--quantize", "int2", "--scale-dtype", "fp16"]
        )
        == 0
    )
    text = capsys.readouterr().out
    for words in ("int2 row-wise tables, 4 codes a byte, fp16 scale and bias",
                  "tables as trained (fp32, fp16) / int2", "bytes per row as trained / int2", "eval AUC int2",
                  "AUC change int2 - fp32"):  # fmt: skip
        assert words in text, text
    assert read_header(tmp_path / "a.nrx")["quantization"] == {
        "kind": "int2_rowwise",
        "bits": 2,
        "scale_dtype": "fp16",
    }
    assert cli_main(["export", run, "--out", str(tmp_path / "b.nrx"), "--int8", "--no-eval"]) == 0
    assert read_header(tmp_path / "b.nrx")["quantization"]["kind"] == "int8_rowwise"
    capsys.readouterr()
    for argv, words in [
        (["--int8", "--quantize", "int4"], "--int8 and --quantize int4"),
        (["--scale-dtype", "fp16"], "--scale-dtype fp16 is for quantized tables"),
    ]:
        assert cli_main(["export", run, "--out", str(tmp_path / "c.nrx"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("neorec: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "c.nrx").exists()
    with pytest.raises(SystemExit) as e:  # argparse: a choice it does not offer
        cli_main(["export", run, "--out", str(tmp_path / "c.nrx"), "--quantize", "int3"])
    assert e.value.code == 2


def test_one_hot_bags_keep_their_weights():
    """The one-hot path (every bag one id) scales each row by its weight, as the general path does."""
    table = quantize_rows(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))
    got = pooled_lookup(table, torch.tensor([0, 1]), torch.tensor([0, 1, 2]), torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(got, torch.tensor([[2.0, 4.0], [1.5, -0.5]]), atol=0.02, rtol=0)
