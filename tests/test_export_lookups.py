"""What `neorec export --config` may change, and what the report of a quantized export says: a config
whose features pool their ids with per-id weights where training did not (or the other way) is
refused before anything is written, for .nrx and pt2 and from model.pt or a checkpoint, as other
lookups are; the table bytes are those of the tables as trained (their dtypes named); and the int8
header the docs say loads without `bits` does."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from neorec.cli import main as cli_main
from neorec.config.load import dump_config, load_config
from neorec.embedding.tables import TableConfig, lookup_difference, lookups
from neorec.errors import ConfigError
from neorec.serving import ExportError, export_model, load_export
from neorec.serving.export import report_text
from neorec.serving.file_format import read_export, write_export
from neorec.train.build import build_source, build_tables
from neorec.train.trained_lookups import check_trained_lookups
from neorec.train.trainer import Trainer

DOCS = Path(__file__).resolve().parent.parent / "docs" / "export.md"
# weighted multi-hot ids, one table of each dtype, a checkpoint every two steps
SMALL = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 80, 30]", "data.synthetic.num_sparse=3",
    "data.synthetic.multi_hot=[3, 1, 2]", "data.synthetic.variable_bags=true", "data.synthetic.weighted=true",
    "embedding.dim=8", "model.bottom_mlp=[16, 8]", "model.top_mlp=[16]",
    "embedding.tables={C2: {dtype: fp16}, C3: {dtype: bf16}}", "data.synthetic.train_samples=1000",
    "data.synthetic.eval_samples=500", "data.batch_size=250", "train.max_steps=4", "checkpoint.every_steps=2",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip
REFUSED = (
    r"feature 'C1' \(table 'C1'\) pools its ids with per-id weights in .*config\.yaml but without them in "
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lookups")
    Trainer(load_config("default", SMALL), root / "run").fit()
    assert (root / "run" / "model.pt").is_file() and list((root / "run" / "checkpoints").glob("step-*"))
    return root / "run"


def changed_config(run: Path, out: Path, **synthetic) -> Path:
    """The run's config.yaml with keys of data.synthetic changed, written to `out`."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["synthetic"].update(synthetic)
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_lookup_difference_names_a_feature_weighted_in_one_only():
    tables = [TableConfig(name=n, rows=5, dim=2, features=[n]) for n in ("a", "b")]
    trained = lookups(tables, {"b"})
    assert lookup_difference(trained, tables, {"b"}) is None
    for now, feature, was, is_ in (({"a", "b"}, "a", "without", "with"), (set(), "b", "with", "without")):
        text = lookup_difference(trained, tables, now)
        assert text == (
            f"feature {feature!r} (table {feature!r}) pools its ids {was} per-id weights in {{trained}} but "
            f"{is_} them in {{now}}"
        )
    # a manifest's lookups (features and pooling only) compare as before: weights are not known there
    assert lookup_difference(lookups(tables), tables, set()) is None
    assert lookup_difference({"a": (["a"], "sum")}, tables, {"a"}) is None


@pytest.mark.parametrize("format", ["nrx", "pt2"])
@pytest.mark.parametrize("origin", ["model.pt", "checkpoints", "run without model.pt"])
def test_a_config_without_the_id_weights_is_refused(run, tmp_path, format, origin):
    other = changed_config(run, tmp_path / "other.yaml", weighted=False)
    path = run
    if origin == "checkpoints":
        path = run / "checkpoints"
    elif origin == "run without model.pt":
        path = tmp_path / "copy"
        shutil.copytree(run, path, ignore=shutil.ignore_patterns("model.pt"))
    out = tmp_path / ("m.nrx" if format == "nrx" else "m")
    with pytest.raises(ConfigError, match=REFUSED + re.escape(str(other))) as e:
        export_model(path, out, config=other, format=format, measure=False)
    where = "model.pt" if origin == "model.pt" else "step-00000004"
    assert str(e.value).startswith(str(path)) and f"{where}: feature 'C1'" in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and not out.exists()


def test_cli_refuses_it_on_one_line_and_the_reverse_too(run, tmp_path, capsys):
    other = changed_config(run, tmp_path / "other.yaml", weighted=False)
    argv = ["export", str(run), "--config", str(other), "--no-eval", "--out", str(tmp_path / "m.nrx")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1 and re.search(REFUSED, err), err
    # trained without weights, exported with them: as much another model
    unweighted = tmp_path / "unweighted"
    cfg = load_config("default", [*SMALL, "data.synthetic.weighted=false", "train.max_steps=1"])
    Trainer(cfg, unweighted).fit()
    weighted = changed_config(unweighted, tmp_path / "weighted.yaml", weighted=True)
    with pytest.raises(ConfigError, match="pools its ids without per-id weights in .* but with them in "):
        export_model(unweighted, tmp_path / "w.nrx", config=weighted, measure=False)
    assert not (tmp_path / "m.nrx").exists() and not (tmp_path / "w.nrx").exists()


def test_a_config_with_the_same_lookups_exports(run, tmp_path):
    """Other held-out data (the data section differs, so the run's own data tells its weights): the same
    model, from model.pt and from the checkpoint."""
    other = changed_config(run, tmp_path / "other.yaml", eval_samples=300)
    export_model(run, tmp_path / "a.nrx", config=other, measure=False)
    export_model(run / "checkpoints", tmp_path / "b.nrx", config=other, measure=False)
    assert load_export(tmp_path / "a.nrx").config.data.synthetic.eval_samples == 300


def test_quantized_report_gives_the_tables_as_trained(run, tmp_path):
    r = export_model(run, tmp_path / "m.int8.nrx", int8=True, measure=False)
    trained = {"C1": 50 * 8 * 4, "C2": 80 * 8 * 2, "C3": 30 * 8 * 2}  # fp32, fp16, bf16
    assert r.table_bytes["fp32"] == sum(trained.values()) and r.trained_dtypes == ["fp32", "fp16", "bf16"]
    text = report_text(r)
    assert re.search(r"tables as trained \(fp32, fp16, bf16\) / int8 +\| 3,360 / 2,560 bytes", text), text
    assert re.search(r"bytes per row as trained / int8 +\| 21\.0 / 16\.0", text), text  # fp32: 32 a row
    assert "unquantized export size" in text and "fp32 /" not in text, text


def test_the_int8_header_the_docs_quote_without_bits_loads(run, tmp_path):
    docs = " ".join(DOCS.read_text().split())
    quoted = re.search(r'`(\{"kind": "int8_rowwise", "scale_dtype": "fp32"\})`', docs)
    assert quoted, "docs/export.md quotes the int8 header without bits"
    export_model(run, tmp_path / "m.int8.nrx", int8=True, measure=False)
    header, tensors = read_export(tmp_path / "m.int8.nrx")
    write_export(tmp_path / "old.nrx", {**header, "quantization": json.loads(quoted.group(1))}, tensors)
    old, new = load_export(tmp_path / "old.nrx"), load_export(tmp_path / "m.int8.nrx")
    assert old.quantization == "int8"
    cfg = load_config(str(run / "config.yaml"))
    batch = next(iter(build_source(cfg).eval_batches(100)))
    assert torch.equal(old.probabilities(batch), new.probabilities(batch))
    write_export(tmp_path / "kind.nrx", {**header, "quantization": {"kind": "int8_rowwise"}}, tensors)
    with pytest.raises(ExportError, match=r"kind\.nrx: the header's quantization is malformed .*_dtype None"):
        load_export(tmp_path / "kind.nrx")


def parquet_config(folder: Path, weights: bool) -> list[str]:
    """--set items of a Parquet source reading `folder`, feature tags with or without its weights."""
    tags = "{name: tags, weights: tag_weights, rows: 50}" if weights else "{name: tags, rows: 50}"
    return [
        "data.source=parquet", "embedding.dim=8", "model.bottom_mlp=[8, 8]",
        f"data.parquet={{paths: [{folder / 'train'}], eval_paths: [{folder / 'eval'}], label: clicked, "
        f"table_rows: 100, hashing: none, features: [user_id, {tags}]}}",
    ]  # fmt: skip


def test_parquet_weights_compared_with_the_runs_own_data_or_a_warning(tmp_path, neorec_warnings):
    g = np.random.default_rng(0)
    tags = [g.integers(0, 50, 2).tolist() for _ in range(20)]
    table = pa.table({
        "clicked": g.integers(0, 2, 20), "user_id": g.integers(0, 100, 20),
        "tags": pa.array(tags, pa.list_(pa.int64())),
        "tag_weights": pa.array([[0.5, 2.0]] * 20, pa.list_(pa.float32())),
    })  # fmt: skip
    for role in ("train", "eval"):
        (tmp_path / "data" / role).mkdir(parents=True)
        pq.write_table(table, tmp_path / "data" / role / "a.parquet")
    now = load_config("default", parquet_config(tmp_path / "data", weights=False))
    info = build_source(now, wait=False).info
    tables = build_tables(now, info)
    trained = tmp_path / "run" / "config.yaml"
    trained.parent.mkdir()
    for folder in (tmp_path / "data", tmp_path / "moved"):  # the trained data there, then gone
        trained.write_text(dump_config(load_config("default", parquet_config(folder, weights=True))))
        if folder.name == "data":
            refused = (
                r"run/model\.pt: feature 'tags' \(table 'tags'\) pools its ids with per-id weights in "
                r".*config\.yaml but without them in other\.yaml"
            )
            with pytest.raises(ConfigError, match=refused):
                check_trained_lookups(trained, tables, info, "other.yaml", config=now)
            continue
        check_trained_lookups(trained, tables, info, "other.yaml", config=now)
    assert "which features had weighted ids is not compared with other.yaml" in neorec_warnings.text
