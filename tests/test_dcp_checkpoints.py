"""neorec <-> torch.distributed.checkpoint (DCP) folders in TorchRec's layout, on one process:
`neorec checkpoint export-dcp` / `import-dcp` around a run, TorchRec's Adam state (which FBGEMM's
CPU build cannot train, so it is written here as TorchRec names it), and the errors that name the
key or table. Against TorchRec itself: tests/test_torchrec_dcp.py."""

import pickle
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiny_cli import TINY

from neorec.cli import main
from neorec.embedding.fused.collection import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import NeorecError
from neorec.interop.torchrec import load_dcp, save_dcp
from neorec.sparse import SparseBatch

EBC = "sparse.embedding_bags."


def _collection(optimizer: str = "rowwise_adagrad", rows=(12, 7), seed: int = 0) -> FusedEmbeddingCollection:
    tables = [TableConfig(name=f"t{i}", rows=r, dim=4, features=[f"f{i}"]) for i, r in enumerate(rows)]
    return FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name=optimizer), seed=seed)


def _everything(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, whole (DCP's own loader, one process)."""
    from neorec.interop.torchrec.dcp_io import read_metadata

    entries = read_metadata(folder).state_dict_metadata
    out = {k: torch.empty(tuple(e.size), dtype=e.properties.dtype) for k, e in entries.items()}
    with pytest.warns(UserWarning):  # DCP warns that one process loads alone
        dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


def _save_plain(folder, tensors: dict) -> None:
    with pytest.warns(UserWarning):  # DCP warns that one process saves alone
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)


def test_export_then_import_a_run_and_train_on(tmp_path, capsys):
    """A run's checkpoint out as DCP, back in as step 0 of another run, which trains on from it; what
    it holds is what the first run's checkpoint held."""
    sets = [x for kv in [*TINY, "checkpoint.every_steps=2", "embedding.optimizer.name=rowwise_adagrad"] for x in ("--set", kv)]  # fmt: skip
    assert main(["train", *sets, "--output-dir", str(tmp_path / "run")]) == 0
    out = tmp_path / "dcp"
    assert main(["checkpoint", "export-dcp", str(tmp_path / "run"), "--out", str(out), "--prefix", ""]) == 0
    written = _everything(out)
    assert "sparse_arch.embedding_bag_collection.embedding_bags.C1.weight" in written
    assert "optim.state.sparse_arch.embedding_bag_collection.embedding_bags.C1.weight.C1.momentum1" in written
    assert "dense_arch.model._mlp.0._linear.weight" in written

    again = tmp_path / "again"
    assert main(["checkpoint", "import-dcp", str(out), *sets, "--output-dir", str(again)]) == 0
    assert main(["checkpoint", "import-dcp", str(out), *sets, "--output-dir", str(again)]) == 2  # not over it
    capsys.readouterr()
    assert main(["export", str(again), "--out", str(tmp_path / "x.nrx")]) == 2  # no config.yaml
    assert f"give {again / 'checkpoints'} and the run's config with --config" in capsys.readouterr().err
    for command in (["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.nrx")],
                    ["checkpoint", "export-dcp", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]):
        assert main(command) == 2
        assert f"{tmp_path / 'nothing'}: no such file or folder" in capsys.readouterr().err
    assert main(["checkpoint", "export-dcp", str(again / "checkpoints"), "--out", str(tmp_path / "dcp2"),
                 "--config", str(tmp_path / "run" / "config.yaml"), "--prefix", ""]) == 0  # fmt: skip
    back = _everything(tmp_path / "dcp2")
    assert back.keys() == written.keys()
    for key, value in written.items():
        assert torch.equal(back[key], value), key
    assert main(["train", *sets, "--output-dir", str(again), "--resume"]) == 0
    assert (again / "model.pt").is_file()

    # for a TorchRec DLRM of another feature order: its top MLP's columns follow that order, and an
    # import in that order gives back the same model
    order = ["--feature-names", "C4,C3,C2,C1"]
    reordered = tmp_path / "dcp3"
    assert main(["checkpoint", "export-dcp", str(tmp_path / "run"), "--out", str(reordered), "--prefix", "",
                 *order]) == 0  # fmt: skip
    top = "over_arch.model.0._mlp.0._linear.weight"
    assert not torch.equal(_everything(reordered)[top], written[top])
    third = tmp_path / "third"
    assert main(["checkpoint", "import-dcp", str(reordered), *sets, "--output-dir", str(third), *order]) == 0
    assert main(["checkpoint", "export-dcp", str(third / "checkpoints"), "--out", str(tmp_path / "dcp4"),
                 "--config", str(tmp_path / "run" / "config.yaml"), "--prefix", ""]) == 0  # fmt: skip
    assert torch.equal(_everything(tmp_path / "dcp4")[top], written[top])
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        main(["checkpoint", "import-dcp", str(out), *sets, "--output-dir", str(tmp_path / "bad"),
              "--feature-names", "C1,C1"])  # fmt: skip
    # an order that contradicts the one the checkpoint records is refused
    assert main(["checkpoint", "import-dcp", str(reordered), *sets, "--output-dir", str(tmp_path / "bad"),
                 "--feature-names", "C1,C2,C3,C4"]) == 2  # fmt: skip


def test_import_never_goes_into_a_finished_run_or_the_dcp_folder(tmp_path, capsys):
    """import-dcp into the folder of a finished run wrote step 0 beside its model.pt, which the next
    `--resume` then replaced; into the DCP folder, it mixed a run into the checkpoint."""
    sets = [x for kv in [*TINY, "checkpoint.every_steps=2"] for x in ("--set", kv)]
    assert main(["train", *sets, "--output-dir", str(tmp_path / "run")]) == 0
    out = tmp_path / "dcp"
    assert main(["checkpoint", "export-dcp", str(tmp_path / "run"), "--out", str(out)]) == 0
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a finished run that kept no checkpoint
    model = (tmp_path / "run" / "model.pt").read_bytes()
    capsys.readouterr()
    for folder, words in [(tmp_path / "run", "holds a run already (summary.json, model.pt)"),
                          (out, "is the DCP folder read")]:  # fmt: skip
        assert main(["checkpoint", "import-dcp", str(out), *sets, "--output-dir", str(folder)]) == 2
        err = capsys.readouterr().err
        assert f"--output-dir {folder}: {words}" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists() and not (out / "checkpoints").exists()
    assert (tmp_path / "run" / "model.pt").read_bytes() == model


def test_row_wise_state_in_column_blocks_reads_back(tmp_path):
    """Exported with row_state_columns (t0 as TorchRec splits it, in two column shards), the state is
    one [rows] block per shard and the weight comes in chunks of the same columns, as TorchRec writes
    a table split by columns: read back, the same rows and the state the blocks hold (one block per
    shard, of one accumulator per row here: the same value twice)."""
    source = _collection()
    ones = torch.ones(12, dtype=torch.int64)
    batch = SparseBatch.from_features({"f0": (torch.arange(12), ones), "f1": (torch.arange(12) % 7, ones)})
    source(batch).sum().backward()
    save_dcp(source, tmp_path / "blocks", row_state_columns={"t0": [0, 2]})
    from neorec.interop.torchrec.dcp_io import read_metadata

    entries = read_metadata(tmp_path / "blocks").state_dict_metadata
    assert tuple(entries["optim.state.embedding_bags.t0.weight.t0.momentum1"].size) == (24,)
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in entries["model.embedding_bags.t0.weight"].chunks]
    assert sorted(chunks) == [((0, 0), (12, 2)), ((0, 2), (12, 2))]
    back = _collection(seed=3)
    load_dcp(back, tmp_path / "blocks")
    for key, value in source.state_dict().items():
        assert key.endswith(".step") or torch.equal(back.state_dict()[key], value), key  # steps: not in DCP


def test_inspect_takes_the_folder_import_dcp_writes(tmp_path, capsys):
    """checkpoints/ and no config.yaml: `neorec checkpoint inspect FOLDER` finds its checkpoint."""
    from neorec.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "imported" / "checkpoints", 0, _collection())
    assert main(["checkpoint", "inspect", str(tmp_path / "imported")]) == 0
    assert "imported/checkpoints/step-00000000" in capsys.readouterr().out


def test_adam_moments_in_torchrecs_names(tmp_path):
    """TorchRec keeps Adam's moments as `<table>.momentum1` and `<table>.exp_avg_sq`: they load into
    neorec's adam state, and neorec writes them under the same names."""
    ours = _collection("adam")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for t in ours.tables:
        key = f"{EBC}{t.name}.weight"
        tensors[f"model.{key}"] = torch.randn(t.rows, t.dim, generator=g)
        tensors[f"optim.state.{key}.{t.name}.momentum1"] = torch.randn(t.rows, t.dim, generator=g)
        tensors[f"optim.state.{key}.{t.name}.exp_avg_sq"] = torch.rand(t.rows, t.dim, generator=g)
    _save_plain(tmp_path / "adam", tensors)
    report = load_dcp(ours, tmp_path / "adam")
    assert report.optimizer_state["t1"] == [f"optim.state.{EBC}t1.weight.t1.exp_avg_sq", f"optim.state.{EBC}t1.weight.t1.momentum1"]  # fmt: skip
    gi, index = ours.layout.table_slot["t1"]
    start = ours.layout.groups[gi].row_starts[index]
    assert torch.equal(ours.weights[gi].tensor[start : start + 7], tensors[f"model.{EBC}t1.weight"])
    assert torch.equal(ours.states[gi]["momentum2"].tensor[start : start + 7], tensors[f"optim.state.{EBC}t1.weight.t1.exp_avg_sq"])  # fmt: skip
    save_dcp(ours, tmp_path / "back", module_prefix="sparse.")
    assert _everything(tmp_path / "back").keys() == tensors.keys()


def test_mistakes_name_the_key_or_table(tmp_path):
    source = _collection()
    save_dcp(source, tmp_path / "ok", module_prefix="sparse.")
    with pytest.raises(NeorecError, match=r"missing in the state_dict: \['t2'\]"):
        load_dcp(_collection(rows=(12, 7, 3)), tmp_path / "ok")
    with pytest.raises(NeorecError, match=r"not in the model: \['t1'\]"):
        load_dcp(_collection(rows=(12,)), tmp_path / "ok")
    with pytest.raises(
        NeorecError, match=r"'model.sparse.embedding_bags.t1.weight' is \[7, 4\].*'t1' is \[8, 4\]"
    ):
        load_dcp(_collection(rows=(12, 8)), tmp_path / "ok")
    with pytest.raises(NeorecError, match=r"table 't0'.* state of rowwise_adagrad .* optimizer is adam"):
        load_dcp(_collection("adam"), tmp_path / "ok")
    weights_only = _collection("adam", seed=3)
    report = load_dcp(weights_only, tmp_path / "ok", optimizer_state=False)  # weights alone
    assert not report.optimizer_state
    assert torch.equal(weights_only.table_weights()["t0"], source.table_weights()["t0"])
    report = load_dcp(_collection("sgd"), tmp_path / "ok")
    assert "sgd keeps no state" in report.not_carried["t0"]

    with pytest.raises(NeorecError, match="no .metadata file"):
        load_dcp(source, tmp_path)
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(print))  # names builtins.print: never run
    with pytest.raises(
        NeorecError, match=r"evil/\.metadata: not a readable DCP metadata file.*builtins\.print"
    ):
        load_dcp(source, tmp_path / "evil")
    _save_plain(tmp_path / "odd", {f"{EBC}t0.weight": torch.zeros(12, 4), f"{EBC}t1.weight": torch.zeros(7, 4),
                                   f"x.{EBC}t0.weight.t0.momentum1": torch.zeros(13)})  # fmt: skip
    with pytest.raises(
        NeorecError, match=r"'x.sparse.embedding_bags.t0.weight.t0.momentum1' holds 13 values"
    ):
        load_dcp(_collection(), tmp_path / "odd")
    with pytest.raises(NeorecError, match=r"row_state_columns\['t0'\] = \[0, 4\]"):
        save_dcp(source, tmp_path / "no", row_state_columns={"t0": [0, 4]})
    with pytest.raises(NeorecError, match=r"names tables \['nope'\]"):
        save_dcp(source, tmp_path / "no", row_state_columns={"nope": [0]})
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    "key, index, shown",
    [
        (f"model.{EBC}t1.weight", (5, 2), "nan at row 5, column 2"),
        (f"optim.state.{EBC}t0.weight.t0.momentum1", (9,), "inf at row 9"),
    ],
    ids=["weight", "row_state"],
)
def test_a_checkpoint_holding_nan_or_inf_is_refused_naming_key_and_row(tmp_path, key, index, shown):
    """A checkpoint of a TorchRec run that diverged: loaded, its NaN would train to a NaN loss that
    names the learning rates, not the checkpoint."""
    source = _collection()
    save_dcp(source, tmp_path / "ok", module_prefix="sparse.")
    tensors = _everything(tmp_path / "ok")
    tensors[key][index] = float("nan") if "nan" in shown else float("inf")
    _save_plain(tmp_path / "bad", tensors)
    message = re.escape(f"{tmp_path / 'bad'}: '{key}' holds {shown}: not a finite number")
    with pytest.raises(NeorecError, match=message):
        load_dcp(_collection(), tmp_path / "bad")
    if key.startswith("optim."):  # the weights alone load: the bad state is not read
        load_dcp(_collection(), tmp_path / "bad", optimizer_state=False)
    else:
        with pytest.raises(NeorecError, match=message):
            load_dcp(_collection(), tmp_path / "bad", optimizer_state=False)


def test_a_truncated_or_missing_data_file_is_one_error(tmp_path, monkeypatch):
    """DCP wraps what fails in a CheckpointException, a BaseException that the command line printed as
    a traceback: a truncated data file is an error naming the folder, a missing one names the file,
    and a save that fails (a full disk) reports the failing write and leaves no temporary folder."""
    import errno

    save_dcp(_collection(), tmp_path / "ckpt", module_prefix="sparse.")
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(NeorecError, match=re.escape(f"{tmp_path / 'ckpt'}: its data files cannot be read (")):
        load_dcp(_collection(), tmp_path / "ckpt")
    data.unlink()
    with pytest.raises(FileNotFoundError) as missing:
        load_dcp(_collection(), tmp_path / "ckpt")
    assert str(data) in str(missing.value)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "some.distcp")

    monkeypatch.setattr("torch.distributed.checkpoint.filesystem._write_files_from_queue", full)
    with pytest.raises(OSError, match="No space left on device"):
        save_dcp(_collection(), tmp_path / "new", module_prefix="sparse.")
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new*"))


def test_a_checkpoint_replaces_only_an_earlier_checkpoint(tmp_path):
    """The checkpoint replaces its folder whole: given a run's folder (or any other) by mistake, it
    removed everything in it. Only an absent or empty folder, or an earlier DCP checkpoint, is taken."""
    source = _collection()
    save_dcp(source, tmp_path / "ckpt", module_prefix="sparse.")
    save_dcp(source, tmp_path / "ckpt", module_prefix="sparse.")  # an earlier checkpoint: replaced
    (tmp_path / "empty").mkdir()
    save_dcp(source, tmp_path / "empty", module_prefix="sparse.")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "model.pt", "summary.json", "notes.txt"):
        (run / name).write_text(name)
    with pytest.raises(
        NeorecError, match=r"run holds other files \(config.yaml, model.pt, notes.txt and 1 more\)"
    ):
        save_dcp(source, run, module_prefix="sparse.")
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "model.pt", "notes.txt", "summary.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NeorecError, match="file: is a file; a DCP checkpoint is a folder"):
        save_dcp(source, tmp_path / "file", module_prefix="sparse.")


def test_export_dcp_into_another_runs_folder_is_refused_before_any_work(tmp_path, capsys):
    sets = [x for kv in [*TINY, "checkpoint.every_steps=2"] for x in ("--set", kv)]
    assert main(["train", *sets, "--output-dir", str(tmp_path / "a")]) == 0
    assert main(["train", *sets, "--output-dir", str(tmp_path / "b")]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "b").iterdir()}
    capsys.readouterr()
    assert main(["checkpoint", "export-dcp", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"neorec: error: {tmp_path / 'b'} holds other files (") and "give a new folder" in err
    ), err
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "b").iterdir()} == before
