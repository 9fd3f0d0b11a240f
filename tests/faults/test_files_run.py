"""Damaged files of a run and of its exports, then every command that reads them: one tiny run with
checkpoints, trained once, exported as .nrx and pt2. Each file is flipped in several places (its data,
its headers, its JSON) and truncated; `neorec eval`, `export`, `predict`, `train --resume`,
`checkpoint inspect --verify`, `train` with distributed.plan and `plan` with a calibration file then
stop with one `neorec: error:` line naming the file (exit 2, no traceback). Checkpoint manifests that
name files outside their folder are refused before anything is opened."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from forked import run_python
from test_files_writer import (
    _killed_during,
    assert_one_error,
    damaged,
    flipped,
    json_damage,
    run_cli,
    zip_damage,
)

from neorec.checkpoint import list_checkpoints
from neorec.cli import main as cli_main
from neorec.config.load import load_config
from neorec.data.manifest import load_manifest
from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.planner.hardware import CALIBRATED_CPU
from neorec.serving import export_model
from neorec.train.trainer import Trainer
from neorec.utils.files import json_text, write_json

RUN = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=2048", "data.synthetic.eval_samples=512", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=4",
    "train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep=2",
]  # fmt: skip
SETS = [x for kv in RUN for x in ("--set", kv)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """root/run (model.pt, summary.json, checkpoints step 4 and 8), root/m.nrx and root/pt2."""
    root = tmp_path_factory.mktemp("faults")
    Trainer(load_config("default", RUN), root / "run").fit()
    export_model(root / "run", root / "m.nrx", measure=False)
    export_model(root / "run", root / "pt2", measure=False, format="pt2")
    return root


def _largest_entry(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        return max(zf.infolist(), key=lambda i: i.file_size).filename


# ---- model.pt ---------------------------------------------------------------------------------------------
def test_damaged_model_pt_stops_eval_and_export(run, capsys, tmp_path):
    model = run / "run" / "model.pt"
    for what, change in zip_damage(model, _largest_entry(model)).items():
        with damaged(model, change):
            assert_one_error(*run_cli(["eval", run / "run"], capsys), "model.pt", damage=what)
            code, err = run_cli(["export", run / "run", "--out", tmp_path / "x.nrx", "--no-eval"], capsys)
            line = assert_one_error(code, err, "model.pt", damage=what)
            assert "checkpoint" not in line.split("model.pt")[0], what  # not worded as a checkpoint's failure
    assert run_cli(["eval", run / "run"], capsys)[0] == 0
    assert not (tmp_path / "x.nrx").exists()


def test_summary_json_is_written_whole_and_read_back_by_eval_alone(run, capsys, tmp_path):
    """summary.json records the run's held-out data (eval_data), which `neorec eval` compares: a
    damaged one is named, with the way out."""
    summary = run / "run" / "summary.json"
    assert json.loads(summary.read_text())["steps"] == 8 and not list((run / "run").glob("*.tmp"))
    with damaged(summary, lambda d: d[: len(d) // 2]):
        code, err = run_cli(["eval", run / "run"], capsys)
        assert code == 2 and "summary.json cannot be read" in err and "remove it to evaluate" in err, err


# ---- checkpoints ------------------------------------------------------------------------------------------
def _checkpoint_commands(ckpt: Path, tmp_path: Path) -> list[list]:
    return [
        ["checkpoint", "inspect", "--verify", ckpt],
        ["train", "--output-dir", tmp_path / "resumed", "--resume", ckpt, *SETS],
        ["export", ckpt, "--out", tmp_path / "c.nrx", "--no-eval"],
    ]


def _raw_damage() -> dict:
    return {
        "first byte": lambda d: flipped(d, 0, 0x01),
        "middle byte": lambda d: flipped(d, len(d) // 2, 0x01),
        "last byte": lambda d: flipped(d, -1, 0x80),
        "truncated": lambda d: d[:-8],
        "empty": lambda d: b"",
    }


@pytest.mark.parametrize("name", ["rank-00000.bin", "dense.pt", "manifest.json"])
def test_damaged_checkpoint_files_stop_inspect_resume_and_export(run, capsys, tmp_path, name):
    ckpt = list_checkpoints(run / "run" / "checkpoints")[-1]
    changes = json_damage() if name == "manifest.json" else _raw_damage()
    for what, change in changes.items():
        with damaged(ckpt / name, change):
            for args in _checkpoint_commands(ckpt, tmp_path):
                code, err = run_cli(args, capsys)
                assert_one_error(code, err, f"{ckpt.name}/{name}", damage=f"{what}, {args[0]}")
    assert not (tmp_path / "c.nrx").exists() and not (tmp_path / "resumed" / "model.pt").exists()
    assert run_cli(["checkpoint", "inspect", "--verify", ckpt], capsys)[0] == 0


@pytest.mark.parametrize(
    "where,name",
    [("files", "../../outside/x.bin"), ("files", "/etc/passwd"), ("dense", "/etc/passwd"),
     ("pieces", "../rank-00000.bin"), ("dense", "sub/dense.pt")],
)  # fmt: skip
@pytest.mark.parametrize("version", [1, 2])
def test_checkpoint_manifest_naming_files_outside_its_folder_is_refused(run, capsys, tmp_path, where, name, version):
    """Whatever its checksum says (a version 2 manifest rewritten with a valid one, or a version 1
    manifest, which has none), before any file is opened."""
    ckpt = list_checkpoints(run / "run" / "checkpoints")[0]
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["crc32"]
    if where == "dense":
        manifest["dense"]["name"] = name
    else:
        manifest[where][0]["name" if where == "files" else "file"] = name
    text = json_text(manifest) if version == 2 else json.dumps({**manifest, "version": 1})
    with damaged(path, lambda d: text.encode()):
        for args in _checkpoint_commands(ckpt, tmp_path):
            line = assert_one_error(*run_cli(args, capsys), "manifest.json", repr(name))
            assert "is not a plain name" in line


def test_checkpoint_manifest_of_version_1_without_checksum_still_loads(run, capsys, tmp_path):
    ckpt = list_checkpoints(run / "run" / "checkpoints")[0]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["crc32"]
    with damaged(ckpt / "manifest.json", lambda d: json.dumps({**manifest, "version": 1}).encode()):
        code, err = run_cli(["checkpoint", "inspect", "--verify", ckpt], capsys)
        assert code == 0, err
    version2 = json.dumps(manifest).encode()  # version 2 without its crc32: refused
    with damaged(ckpt / "manifest.json", lambda d: version2):
        assert "has no checksum" in assert_one_error(*run_cli(["checkpoint", "inspect", ckpt], capsys), "manifest.json")


# ---- exports --------------------------------------------------------------------------------------------
def _nrx_damage(path: Path) -> dict:
    data = path.read_bytes()
    length = int.from_bytes(data[14:22], "little")
    header_end = 26 + length
    return {
        "magic": lambda d: flipped(d, 3, 0x01),
        "header length": lambda d: flipped(d, 15, 0x01),
        "header crc": lambda d: flipped(d, 23, 0x01),
        "header JSON": lambda d: flipped(d, 26 + length // 2, 0x01),
        "padding": lambda d: flipped(d, header_end, 0x01) if header_end % 64 else flipped(d, 20, 0x01),
        "tensor data": lambda d: flipped(d, (header_end + len(d)) // 2, 0x01),
        "last byte": lambda d: flipped(d, -1, 0x80),
        "truncated": lambda d: d[: len(d) - 100],
        "empty": lambda d: b"",
    }


def test_damaged_nrx_stops_predict(run, capsys, tmp_path):
    nrx = run / "m.nrx"
    for what, change in _nrx_damage(nrx).items():
        with damaged(nrx, change):
            line = assert_one_error(*run_cli(["predict", nrx, "--out", tmp_path / "p.txt"], capsys), "m.nrx", damage=what)
            assert "checkpoint" not in line, what
    assert not (tmp_path / "p.txt").exists()
    assert run_cli(["predict", nrx, "--out", tmp_path / "p.txt"], capsys)[0] == 0


def test_damaged_pt2_export_stops_predict(run, capsys, tmp_path):
    """model.pt2's zip entries are checked against their CRC32s (torch.export.load does not), and
    weights.safetensors against the size and crc32 that model.pt2's header records."""
    folder = run / "pt2"
    header = json.loads(zipfile.ZipFile(folder / "model.pt2").read(
        next(n for n in zipfile.ZipFile(folder / "model.pt2").namelist() if n.endswith("neorec.json"))
    ))  # fmt: skip
    assert header["weights"]["bytes"] == (folder / "weights.safetensors").stat().st_size
    program = folder / "model.pt2"
    for what, change in zip_damage(program, _largest_entry(program)).items():
        with damaged(program, change):
            assert_one_error(*run_cli(["predict", folder, "--out", tmp_path / "p.txt"], capsys), "model.pt2", damage=what)
    weights = folder / "weights.safetensors"
    n = int.from_bytes(weights.read_bytes()[:8], "little")
    changes = {
        "header JSON": lambda d: flipped(d, 8 + n // 2, 0x01),
        "tensor data": lambda d: flipped(d, -5, 0x01),
        "truncated": lambda d: d[:-50],
        "empty": lambda d: b"",
    }
    for what, change in changes.items():
        with damaged(weights, change):
            code, err = run_cli(["predict", folder, "--out", tmp_path / "p.txt"], capsys)
            assert_one_error(code, err, "weights.safetensors", damage=what)
    with damaged(weights, lambda d: d):
        weights.unlink()
        assert_one_error(*run_cli(["predict", folder, "--out", tmp_path / "p.txt"], capsys), "weights.safetensors")
    assert not (tmp_path / "p.txt").exists()
    assert run_cli(["predict", folder, "--out", tmp_path / "p.txt"], capsys)[0] == 0
    assert torch.export.load(program) is not None  # still a plain torch.export file


def test_sigkill_while_writing_a_pt2_export_leaves_the_earlier_one(run, tmp_path, monkeypatch):
    """The pt2 folder is written as a unit: a writer killed at any of its writes, or before a rename,
    leaves the earlier export whole (both files, as they were); the one that finishes replaces both."""
    from neorec.serving import pt2_export

    captured = []
    real = pt2_export.write_pt2
    monkeypatch.setattr(pt2_export, "write_pt2", lambda *a: captured.append(a[1:]) or real(*a))
    step_4 = list_checkpoints(run / "run" / "checkpoints")[0]  # other weights than run/pt2's
    export_model(step_4, tmp_path / "new", measure=False, format="pt2")
    folder = tmp_path / "pt2"
    shutil.copytree(run / "pt2", folder)
    old = {p.name: p.read_bytes() for p in folder.iterdir()}
    kills, k = 0, 0
    while _killed_during(k, lambda: real(folder, *captured[0])):
        kills += 1
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == old, f"kill at write {k}"
        k = max(k + 1, k * 3 // 2)
    assert kills >= 2
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "new").iterdir()
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


# ---- plans and calibrations -------------------------------------------------------------------------------
def test_damaged_plan_stops_training_that_reads_it(run, capsys, tmp_path):
    plan = tmp_path / "plan.json"
    ShardingPlan({f"C{i}": TablePlan("tw", [i % 2]) for i in range(1, 5)}).save(plan)
    args = ["train", "--nproc", "2", "--output-dir", tmp_path / "r", *SETS, "--set", f"distributed.plan={plan}"]
    for what, change in json_damage().items():
        with damaged(plan, change):
            assert_one_error(*run_cli(args, capsys), "plan.json", damage=what)
    assert not (tmp_path / "r" / "model.pt").exists()


def test_damaged_calibration_stops_plan(run, capsys, tmp_path, monkeypatch):
    calibration = tmp_path / "calibration.json"
    write_json(calibration, {**CALIBRATED_CPU, "measured": {"world_size": 2}}, "calibration file")
    monkeypatch.setenv("NEOREC_CALIBRATION", str(calibration))  # cmd_plan sets it; restored after the test
    args = ["plan", *SETS, "--calibration", calibration, "--output-dir", tmp_path / "p", "--batches", "0",
            "--time-budget", "0.2"]  # fmt: skip
    for what, change in json_damage().items():
        with damaged(calibration, change):
            assert_one_error(*run_cli(args, capsys), "calibration.json", damage=what)
    assert not (tmp_path / "p" / "plan.json").exists()


# ---- a full disk ------------------------------------------------------------------------------------------
_LIMITED = r"""
import contextlib, io, json, resource, shutil, signal, sys
from pathlib import Path
from neorec.cli import main

root, work = Path(sys.argv[1]), Path(sys.argv[2])
sets = json.loads(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead


def limited(limit, *args):
    # (exit code, stderr) of a command under a file-size limit of `limit` bytes; its stdout is not
    # looked at, and kept off this process's stdout, which may be a file (the limit would apply to it)
    sys.stdout.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([str(a) for a in args])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return code, err.getvalue()


out = {}
shutil.copy(root / "m.nrx", work / "x.nrx")
out["nrx"] = limited((work / "x.nrx").stat().st_size // 2, "export", root / "run", "--out", work / "x.nrx", "--no-eval")
shutil.copytree(root / "pt2", work / "pt2")
small = min((work / "pt2" / n).stat().st_size for n in ("model.pt2", "weights.safetensors"))
out["pt2"] = limited(small // 2, "export", root / "run", "--out", work / "pt2", "--format", "pt2", "--no-eval")
model_pt2 = (work / "pt2" / "model.pt2").stat().st_size  # the weights fit under this limit, model.pt2 not
step_4 = sorted((root / "run" / "checkpoints").glob("step-*"))[0]  # other weights than the export's
out["pt2 model"] = limited(model_pt2 - 1, "export", step_4, "--out", work / "pt2", "--format", "pt2", "--no-eval")
model = (root / "run" / "model.pt").stat().st_size
out["model.pt"] = limited(model // 2, "train", "--output-dir", work / "run", *sets, "--set", "checkpoint.every_steps=null")
assert main(["plan", *sets, "--output-dir", str(work / "plan"), "--batches", "0", "--time-budget", "0.2"]) == 0
out["plan"] = limited((work / "plan" / "plan.json").stat().st_size // 2, "plan", *sets, "--output-dir", work / "plan",
                      "--batches", "0", "--time-budget", "0.2")
pre = ["data", "preprocess", "--synthetic", "--out", work / "pre", "--no-progress", *sets]
out["preprocess"] = limited(16 << 10, *pre)
print(json.dumps(out))
"""


def test_a_full_disk_gives_one_clear_error_and_keeps_earlier_files(run, tmp_path):
    """A file-size limit (RLIMIT_FSIZE; writes fail with EFBIG) while `neorec export` (nrx, pt2),
    `train` (its model.pt), `plan` (its plan.json) and `data preprocess` write: one error line naming
    the file and what it is, no traceback, no partial file, and the files written before intact."""
    work = tmp_path / "work"
    work.mkdir()
    # `python -c _LIMITED ...` in a process forked from one that has imported neorec (tests/forked.py)
    p = run_python(["-c", _LIMITED, str(run), str(work), json.dumps(SETS)], timeout=300)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout.strip().splitlines()[-1])
    expect = {
        "nrx": "cannot write export file " + str(work / "x.nrx"),
        "pt2": "cannot write weights file " + str(work / "pt2" / "weights.safetensors"),
        "pt2 model": "cannot write export file " + str(work / "pt2" / "model.pt2"),
        "model.pt": "cannot write model file " + str(work / "run" / "model.pt"),
        "plan": "cannot write plan file " + str(work / "plan" / "plan.json"),
        "preprocess": "cannot write preprocessed shard file " + str(work / "pre" / "shards" / ".tmp-00000"),
    }
    for what, (code, err) in results.items():
        lines = [line for line in err.splitlines() if line.startswith("neorec: error:")]
        assert code in (1, 2) and len(lines) == 1 and "Traceback" not in err, (what, err)
        assert expect[what] in lines[0] and "File too large" in lines[0], (what, lines[0])
        assert "checkpoint" not in lines[0].split(": File too large")[0], (what, lines[0])
    assert not list(work.rglob("*.tmp")), list(work.rglob("*.tmp"))
    assert (work / "x.nrx").read_bytes() == (run / "m.nrx").read_bytes()
    for name in ("model.pt2", "weights.safetensors"):  # the earlier export: both files, as they were
        assert (work / "pt2" / name).read_bytes() == (run / "pt2" / name).read_bytes()
    assert sorted(p.name for p in work.iterdir() if "pt2" in p.name) == ["pt2"]  # no temporary folder left
    assert not (work / "run" / "model.pt").exists() and (work / "run" / "config.yaml").is_file()
    ShardingPlan.load(work / "plan" / "plan.json")  # the earlier plan, whole
    assert not load_manifest(work / "pre")["complete"]  # the manifest, whole; rerun to resume:
    args = ["data", "preprocess", "--synthetic", "--out", work / "pre", "--no-progress", *SETS]
    assert cli_main([str(a) for a in args]) == 0 and load_manifest(work / "pre")["complete"]
