"""`neorec train` on preprocessed shards with an id outside its table, in each embedding.bounds_check
mode, on one process and on two: error stops before training naming the file and row; warn trains
with the id dropped from its bag, counted in metrics.jsonl and summary.json; off trains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import fit_rank, neorec_train, spawn

from neorec.data.manifest import load_manifest, write_manifest
from neorec.data.preprocess import preprocess_synthetic
from neorec.data.synthetic import SyntheticSpec
from neorec.utils.files import file_crc32

SPEC = SyntheticSpec(rows=[50, 1000, 7], num_dense=4, train_samples=2048, eval_samples=512, seed=3)
COMMON = ["train.progress=false", "logging.plot=false", "logging.tensorboard=false", "data.batch_size=256",
          "train.log_every=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8]", "embedding.dim=4"]  # fmt: skip


@pytest.fixture(scope="module")
def spoiled(tmp_path_factory) -> tuple[Path, Path]:
    """Preprocessed shards with C1's id at row 5 of the first training part set to 1000 (C1 has 50
    rows: the id would be row 950 of C2) and its C3 id at row 9 set to -1; (folder, that ids file)."""
    root = tmp_path_factory.mktemp("bounds_runs")
    preprocess_synthetic(SPEC, root / "clean", progress=False)
    data = Path(shutil.copytree(root / "clean", root / "spoiled"))
    part = sorted(data.glob("shards/*/train"))[0]
    manifest = load_manifest(data)  # records the spoiled files, as if the ids had come with the data
    files = manifest["shards"][int(part.parent.name)]["files"]
    for name, row, value in (("C1", 5, 1000), ("C3", 9, -1)):
        ids = np.load(part / f"ids_{name}.npy")
        ids[row] = value
        np.save(part / f"ids_{name}.npy", ids)
        files[f"train/ids_{name}.npy"] = [(part / f"ids_{name}.npy").stat().st_size, file_crc32(part / f"ids_{name}.npy")]
    write_manifest(data, manifest)
    return data, part / "ids_C1.npy"


def sets(data: Path, mode: str) -> list[str]:
    return [*COMMON, "data.source=preprocessed", f"data.preprocessed={{path: {data}, shuffle: false}}",
            f"embedding.bounds_check={mode}"]  # fmt: skip


def test_error_stops_naming_the_file_and_row(spoiled, tmp_path):
    data, ids_file = spoiled
    run = neorec_train(tmp_path / "run", sets(data, "error"))
    assert run.returncode == 2, run.stderr
    assert f"{ids_file}, row 5: feature C1 has id 1000" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run" / "model.pt").exists()


def test_warn_trains_without_the_ids_and_counts_them(spoiled, tmp_path):
    data, _ = spoiled
    run = neorec_train(tmp_path / "run", sets(data, "warn"))
    assert run.returncode == 0, run.stderr
    _counted_once(tmp_path / "run")
    assert (
        "ids_C1.npy: 1 ids of feature C1 outside its table of 50 rows" in run.stderr
    )  # the reader's warning
    assert "dropped 1 id(s) outside the table" in run.stderr  # the engine's
    assert "ids dropped (outside tables)" in run.stdout


@pytest.mark.distributed
def test_warn_over_two_processes_counts_each_dropped_id_once(spoiled, tmp_path):
    """The workers of `neorec train --nproc 2` (their Trainer, on spawned ranks): the ranks' counts add up."""
    data, _ = spoiled
    spawn(2, fit_rank, (sets(data, "warn"), str(tmp_path / "run")), tmp_path=tmp_path / "pg")
    _counted_once(tmp_path / "run")


def _counted_once(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_ids"] == {"C1": 1, "C3": 1}  # one epoch: each bad id met once, on whichever rank
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if x["split"] == "dropped_ids"]
    assert logged and logged[-1]["total"] == 2 and logged[-1]["C1"] == 1


def test_off_trains_without_a_word(spoiled, tmp_path):
    data, _ = spoiled
    run = neorec_train(tmp_path / "run", sets(data, "off"))
    assert run.returncode == 0, run.stderr
    assert "dropped_ids" not in json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "outside" not in run.stderr
