"""Ids outside their tables when an exported model scores (.nrx and pt2): the same check as in
training, and a pt2 program that stops on one by itself when loaded without neorec."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neorec.config.load import load_config
from neorec.errors import DataError
from neorec.serving import export_model, load_export
from neorec.serving.pt2_model import program_inputs
from neorec.sparse import SparseBatch
from neorec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_export import TINY  # noqa: E402 - multi-hot, weights, mean pooling, an fp16 table

FORMATS = ["fp32.nrx", "int8.nrx", "pt2"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    trainer = Trainer(load_config("default", TINY), root / "run")
    trainer.fit()
    export_model(root / "run", root / "fp32.nrx", measure=False)
    export_model(root / "run", root / "int8.nrx", int8=True, measure=False)
    export_model(root / "run", root / "pt2", format="pt2", measure=False)
    batch = next(iter(trainer.source.eval_batches(64)))
    return root, batch


def spoiled(batch, feature: str, value: int):
    """(the batch with the first id of `feature` replaced by `value`, the batch without that id)."""
    s = batch.sparse
    dirty, clean = {}, {}
    for k in s.keys:
        ids, lengths, weights = s.feature(k)
        dirty[k] = clean[k] = (ids, lengths, weights)
        if k == feature:
            first = int(torch.nonzero(lengths)[0, 0])  # the sample holding the feature's first id
            bad = ids.clone()
            bad[0] = value
            kept = lengths.clone()
            kept[first] -= 1
            dirty[k] = (bad, lengths, weights)
            clean[k] = (ids[1:], kept, weights[1:])
    return (replace(batch, sparse=SparseBatch.from_features(dirty)), replace(batch, sparse=SparseBatch.from_features(clean)),
            first)  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("feature, value", [("C3", 7), ("C2", -1)])  # C3 has 7 rows, C4 follows it
def test_error_names_the_id(exports, name, feature, value):
    root, batch = exports
    model = load_export(root / name)
    dirty, _, sample = spoiled(batch, feature, value)
    with pytest.raises(
        DataError,
        match=rf"feature '{feature}' \(table '{feature}', [\d,]+ rows\): id {value} of sample {sample}",
    ):
        model.probabilities(dirty)


@pytest.mark.parametrize("name", FORMATS)
def test_warn_scores_the_batch_without_the_id(exports, name):
    root, batch = exports
    model = load_export(root / name, bounds_check="warn")
    dirty, clean, _ = spoiled(batch, "C3", 7)
    assert torch.equal(model.probabilities(dirty), load_export(root / name).probabilities(clean))
    assert model.dropped_ids() == {"C3": 1}


def test_pt2_program_alone_stops_on_an_id_outside(exports):
    """Loaded with plain torch.export (no neorec check in front): the program's own assertion."""
    root, batch = exports
    program = torch.export.load(root / "pt2" / "model.pt2").module()
    dirty, clean, _ = spoiled(batch, "C3", 7)
    header = load_export(root / "pt2").header["inputs"]
    program(*program_inputs(clean, header["feature_names"], header["weighted"]))  # fine
    with pytest.raises(RuntimeError, match=r"feature 'C3' \(table 'C3', 7 rows\): an id is outside \[0, 7\)"):
        program(*program_inputs(dirty, header["feature_names"], header["weighted"]))
