"""The AOTInductor export: the commands of docs/export-pt2.md write a package that
`torch._inductor.aoti_load_package` loads in a process without neorec and that scores as `neorec
predict` does (int4 tables, any batch size); neorec reads it back checked, and refuses what the
format cannot hold. One AOTInductor compile for the whole file (tens of seconds): the fixture's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.serving import ExportError, export_model, load_export
from neorec.serving.aoti_package import AOTI_FORMAT, is_aoti, read_header
from neorec.serving.export import check_exportable
from neorec.serving.pt2_model import program_inputs
from neorec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_export import TINY  # noqa: E402 - multi-hot, weights, mean pooling, an fp16 table
from test_export_pt2 import SCRIPT as PT2_SCRIPT  # noqa: E402 - hides neorec, then loads and scores

DOCS = Path(__file__).resolve().parent.parent / "docs" / "export-pt2.md"
TOLERANCE = 1e-6  # as tests/test_export_pt2.py holds quantized programs to the .nrx model


def documented_commands() -> list[list[str]]:
    """The `neorec` commands of the page's `text` block that exports with --format aoti."""
    blocks = re.findall(r"^```text\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    block = next(b for b in blocks if "--format aoti" in b)
    lines = [line for line in block.splitlines() if line.startswith("neorec ")]
    return [shlex.split(line, comments=True)[1:] for line in lines]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A tiny run in runs/default, exported by the page's commands (in its folder), and the same
    run's int4 .nrx export to compare with."""
    root = tmp_path_factory.mktemp("aoti")
    Trainer(load_config("default", TINY), root / "runs" / "default").fit()
    commands = documented_commands()
    assert [c[0] for c in commands] == ["export", "predict"], commands
    with contextlib.chdir(root):
        for argv in commands:
            assert cli_main(argv) == 0, argv
    export, predict = commands
    out = root / export[export.index("--out") + 1]
    export_model(root / "runs" / "default", root / "int4.nrx", quantize="int4", measure=False)
    return {"root": root, "out": out, "predictions": root / predict[predict.index("--out") + 1]}


def lines(path: Path) -> torch.Tensor:
    return torch.tensor([float(x) for x in path.read_text().splitlines()], dtype=torch.float64)


def test_package_scores_as_predict_on_the_nrx_export(package, tmp_path):
    assert package["out"].suffix == ".pt2" and is_aoti(package["out"])
    assert cli_main(["predict", str(package["root"] / "int4.nrx"), "--out", str(tmp_path / "nrx.txt")]) == 0
    got, want = lines(package["predictions"]), lines(tmp_path / "nrx.txt")
    assert got.shape == want.shape == (4000,)
    assert torch.allclose(got, want, rtol=0, atol=TOLERANCE), (got - want).abs().max()
    exported = load_export(package["out"])
    assert exported.is_program and exported.quantization == "int4"
    assert exported.header["format"] == AOTI_FORMAT and exported.header["inputs"]["weighted"]


SCRIPT = PT2_SCRIPT.replace(
    "program = torch.export.load(program_file).module()",
    "program = torch._inductor.aoti_load_package(program_file)",
)


def test_package_loads_and_scores_without_neorec(package, tmp_path):
    """Batches of 1, 7 and 300 through one package, in a `python -I` process where neorec is hidden."""
    assert SCRIPT != PT2_SCRIPT
    reference = load_export(package["root"] / "int4.nrx")
    names = load_export(package["out"]).header["inputs"]["feature_names"]
    batch = next(iter(_eval_batches(reference, 300)))
    sizes = (1, 7, 300)
    torch.save([program_inputs(batch.slice(0, n), names, True) for n in sizes], tmp_path / "inputs.pt")
    (tmp_path / "score.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["int4", str(package["out"]), str(tmp_path / "inputs.pt")]
    cmd = [sys.executable, "-I", str(tmp_path / "score.py"), str(tmp_path / "out.pt"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)["int4"]
    for got, n in zip(out, sizes, strict=True):
        want = reference.probabilities(batch.slice(0, n))
        assert got.shape == (n,) and torch.allclose(got, want, rtol=0, atol=TOLERANCE), n


def _eval_batches(exported, size: int):
    from neorec.train.build import build_source

    return build_source(exported.config).eval_batches(size)


def test_package_checks_its_ids(package):
    """The compiled program keeps the pt2 program's id check; neorec's own check names the id first."""
    exported = load_export(package["out"])
    batch = next(iter(_eval_batches(exported, 8)))
    dense, ids, offsets, weights = program_inputs(batch, exported.header["inputs"]["feature_names"], True)
    ids[0] = ids[0].clone()
    ids[0][0] = 50  # table C1 has 50 rows
    with pytest.raises(RuntimeError, match=r"feature 'C1' \(table 'C1', 50 rows\): an id is outside"):
        exported.model(dense, ids, offsets, weights)


def test_damaged_and_foreign_packages_are_refused(package, tmp_path):
    data = package["out"].read_bytes()
    with zipfile.ZipFile(package["out"]) as zf:
        library = next(i for i in zf.infolist() if i.filename.endswith(".so"))
    flipped = bytearray(data)
    flipped[library.header_offset + 200] ^= (
        0x20  # inside the compiled library's bytes (stored, not compressed)
    )
    (tmp_path / "flipped.pt2").write_bytes(bytes(flipped))
    with pytest.raises(ExportError, match="does not read back") as e:
        load_export(tmp_path / "flipped.pt2")
    assert "flipped.pt2" in str(e.value)
    (tmp_path / "cut.pt2").write_bytes(data[: len(data) // 2])  # no zip directory: a damaged package
    with pytest.raises(ExportError, match=r"AOTInductor package .*cut\.pt2 .*truncated or corrupted") as e:
        load_export(tmp_path / "cut.pt2")
    assert "--format aoti --out FILE.pt2" in str(e.value) and "--format pt2 --out DIR" not in str(e.value)
    with zipfile.ZipFile(tmp_path / "foreign.pt2", "w") as zf:  # compiled files but no neorec header
        zf.writestr("archive/data/aotinductor/model/x.wrapper.cpp", "")
    with pytest.raises(ExportError, match="not one written by `neorec export --format aoti`"):
        load_export(tmp_path / "foreign.pt2")
    with zipfile.ZipFile(tmp_path / "other.pt2", "w") as zf:
        zf.writestr("archive/data/aotinductor/model/x.wrapper.cpp", "")
        zf.writestr("archive/extra/neorec.json", json.dumps({"format": "neorec-pt2"}))
    with pytest.raises(ExportError, match="is not the header of `neorec export --format aoti`"):
        read_header(tmp_path / "other.pt2")


def test_refused_before_any_work(package, tmp_path, capsys):
    run = str(package["root"] / "runs" / "default")
    for out, message in ((tmp_path / "m.aoti", "is a .pt2 file"), (tmp_path, "is a folder")):
        assert cli_main(["export", run, "--format", "aoti", "--no-eval", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    cfg = load_config("default", [*TINY, "model.arch=multitask", "model.tasks=[{name: click}]"])
    with pytest.raises(ExportError, match="cannot be exported with --format aoti"):
        check_exportable(cfg, "runs/x", "aoti")
