"""What stops `neorec predict` is reported as what it is: an id outside its table under
`--bounds-check off` as one DataError line naming the data scored (fp32 and int4 .nrx, pt2), never as
a failed write of the predictions; write_atomic blames the disk only for failures of the writing
(torch's zip writer's RuntimeError included); a `.pt2` file that is not a zip archive is a damaged
AOTInductor package, while a pt2 export's own model.pt2 keeps its pt2 message."""

from __future__ import annotations

import errno
import io
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.errors import DataError
from neorec.serving import ExportError, export_model, load_export, predict_file
from neorec.train.trainer import Trainer
from neorec.utils.files import FileWriteError, write_atomic

ROWS = 100  # of table user_id (hashing none: the file's ids are the rows)
KINDS = ["fp32.nrx", "int4.nrx", "pt2"]


def write_parquet(path: Path, n: int, seed: int, user_ids: np.ndarray | None = None) -> Path:
    g = np.random.default_rng(seed)
    users = g.integers(0, ROWS, n) if user_ids is None else user_ids
    tags = [g.integers(0, 50, g.integers(0, 4)).tolist() for _ in range(n)]
    table = pa.table({
        "clicked": g.integers(0, 2, n), "price": g.random(n).astype(np.float32), "user_id": users,
        "tags": pa.array(tags, pa.list_(pa.int64())),
    })  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    """A tiny Parquet run exported as fp32 and int4 .nrx files and a pt2 folder, and a file with an id
    one past its table (oor/a.parquet)."""
    root = tmp_path_factory.mktemp("predict_failures")
    write_parquet(root / "train" / "a.parquet", 400, 0)
    write_parquet(root / "eval" / "a.parquet", 200, 1)
    users = np.random.default_rng(2).integers(0, ROWS, 200)
    users[3] = ROWS
    write_parquet(root / "oor" / "a.parquet", 200, 2, users)
    sets = [
        "data.source=parquet", "data.batch_size=100", "data.eval_batch_size=64",
        f"data.parquet={{paths: [{root / 'train'}], eval_paths: [{root / 'eval'}], label: clicked, "
        f"dense: [price], table_rows: {ROWS}, hashing: none, features: [user_id, {{name: tags, rows: 50}}]}}",
        "embedding.dim=8", "model.bottom_mlp=[8, 8]", "model.top_mlp=[8]", "train.max_steps=2",
        "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
    ]  # fmt: skip
    Trainer(load_config("default", sets), root / "run").fit()
    export_model(root / "run", root / "fp32.nrx", measure=False)
    export_model(root / "run", root / "int4.nrx", quantize="int4", measure=False)
    export_model(root / "run", root / "pt2", format="pt2", measure=False)
    return root


@pytest.mark.parametrize("kind", KINDS)
def test_an_id_outside_its_table_with_the_check_off_is_one_data_error(exports, kind, tmp_path):
    data, out = exports / "oor" / "a.parquet", tmp_path / "p.txt"
    out.write_text("0.5\n")  # earlier predictions, kept
    with pytest.raises(DataError) as e:
        predict_file(exports / kind, out, data=data, bounds_check="off")
    text = str(e.value)
    assert text.startswith(f"{data}: an id lies outside its table, which --bounds-check off does not"), text
    assert "find it with --bounds-check error" in text and "disk" not in text and "\n" not in text, text
    assert out.read_text() == "0.5\n" and not list(tmp_path.glob("*.tmp"))
    # the same file under the check: the id named, as before
    with pytest.raises(DataError, match=rf"user_id.*{ROWS}"):
        predict_file(exports / kind, out, data=data)
    assert predict_file(exports / kind, out, data=exports / "eval", bounds_check="off").num_samples == 200


@pytest.mark.parametrize("kind", ["int4.nrx", "pt2"])
def test_cli_reports_it_on_one_line(exports, kind, tmp_path, capsys):
    argv = ["predict", str(exports / kind), "--data", str(exports / "oor"), "--bounds-check", "off",
            "--out", str(tmp_path / "p.txt")]  # fmt: skip
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"neorec: error: {exports / 'oor'}: an id lies outside its table"), err
    assert err.count("\n") == 1
    assert not (tmp_path / "p.txt").exists()


# ---- write_atomic ------------------------------------------------------------------------------------
class FullDisk(io.RawIOBase):
    """A file object whose writes fail with ENOSPC after `room` bytes."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)


def test_write_atomic_blames_the_disk_only_for_failures_of_the_writing(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"before")

    def fails(f) -> None:
        f.write(b"some")
        raise RuntimeError("Index 3 of input takes value 100 which is not in the valid range [0, 100)")

    with pytest.raises(RuntimeError, match="Index 3 of input") as e:  # not worded as a write
        write_atomic(path, fails, "predictions file")
    assert not isinstance(e.value, FileWriteError)
    # torch.save into a full disk: its zip writer's RuntimeError, raised during the OSError
    with pytest.raises(FileWriteError, match=r"cannot write model file .*x\.bin: No space left on device \("):
        write_atomic(path, lambda f: torch.save({"w": torch.zeros(10_000)}, FullDisk(f, 100)), "model file")

    def torch_writer(f) -> None:  # torch writing a file itself: its own message, no OSError behind it
        raise RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        )

    with pytest.raises(FileWriteError, match=r"file write failed \(is the disk full"):
        write_atomic(path, torch_writer, "model file")
    assert path.read_bytes() == b"before" and not list(tmp_path.glob("*.tmp"))


# ---- a damaged AOTInductor package ----------------------------------------------------------------------
def test_a_pt2_file_that_is_not_a_zip_is_a_damaged_package(exports, tmp_path, capsys):
    package = tmp_path / "pkg.pt2"
    with zipfile.ZipFile(package, "w") as zf:  # the layout of a package, cut to half below
        zf.writestr("pkg/data/aotinductor/model/x.wrapper.so", np.random.default_rng(0).bytes(4096))
        zf.writestr("pkg/extra/neorec.json", "{}")
    data = package.read_bytes()
    package.write_bytes(data[: len(data) // 2])
    (tmp_path / "x.pt2").write_bytes(b"\x00\x13 a few random bytes")
    for path in (package, tmp_path / "x.pt2"):
        with pytest.raises(ExportError) as e:
            load_export(path)
        text = str(e.value)
        assert text.startswith(f"AOTInductor package {path} is not a readable zip archive: it is"), text
        assert "truncated or corrupted" in text, text
        assert "--format aoti" in text and "--format pt2 --out DIR" not in text, text
    assert cli_main(["predict", str(package), "--out", str(tmp_path / "p.txt")]) == 2
    err = capsys.readouterr().err
    assert "AOTInductor package" in err and "truncated" in err and err.count("\n") == 1, err
    # the model.pt2 of a pt2 export (its weights beside it) is read as one, and worded as one
    folder = tmp_path / "pt2"
    shutil.copytree(exports / "pt2", folder)
    model = folder / "model.pt2"
    model.write_bytes(model.read_bytes()[:1000])
    for path in (folder, model):
        with pytest.raises(ExportError, match=r"pt2 export .*model\.pt2 is not a pt2 archive .*--format pt2"):
            load_export(path)
