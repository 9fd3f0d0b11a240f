"""`neorec eval` scores the run's own held-out samples or says why not (neorec/train/eval_data.py):
data files rewritten since the run, a relative path read from another folder and a config.yaml
edited by hand each gave metrics of another held-out set, with exit status 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from neorec.cli import main
from neorec.data.sample_digest import SampleDigest, sample_hashes
from tests.tiny_cli import TINY, criteo_lines, sets

CRITEO = ["data.source=criteo_tsv", "data.criteo.train_paths=[crit.tsv]", "data.batch_size=16",
          "data.eval_batch_size=7", "data.criteo.table_rows=1000", "train.progress=false", "logging.plot=false",
          "logging.tensorboard=false"]  # fmt: skip


def eval_lines(capsys, run: Path) -> tuple[int, dict[str, str]]:
    capsys.readouterr()
    code = main(["eval", str(run)])
    out, err = capsys.readouterr()
    rows = dict(line.split(" | ") for line in out.splitlines() if " | " in line)
    return code, {k.strip(): v.strip() for k, v in rows.items()} or {"error": err}


def test_eval_refuses_data_changed_since_the_run(tmp_path, capsys, monkeypatch):
    """The run's Criteo file, read with a relative path: eval from the same folder reproduces the
    run's metrics; from another folder (holding a file of that name), or after the file was written
    again with its lines in another order (same size), it is refused naming the cause."""
    monkeypatch.chdir(tmp_path)
    lines = criteo_lines(200)
    Path("crit.tsv").write_text("".join(lines))
    assert main(["train", *sets(CRITEO), "--output-dir", "run"]) == 0
    summary = json.loads(Path("run/summary.json").read_text())
    code, rows = eval_lines(capsys, Path("run"))
    assert code == 0 and float(rows["auc"]) == pytest.approx(summary["eval_auc"], abs=1e-6), rows
    Path("other").mkdir()
    Path("other/crit.tsv").write_text("".join(reversed(lines)))
    monkeypatch.chdir(tmp_path / "other")
    code, rows = eval_lines(capsys, Path("../run"))
    assert code == 2 and "data.criteo.train_paths ['crit.tsv'] (from the folder " in rows["error"], rows
    assert f"Run `neorec eval` from {tmp_path}" in rows["error"]
    monkeypatch.chdir(tmp_path)
    Path("crit.tsv").write_text("".join(reversed(lines)))
    code, rows = eval_lines(capsys, Path("run"))
    assert code == 2 and "the held-out samples its config names now differ from those" in rows["error"], rows
    Path("held.tsv").write_text("".join(criteo_lines(50, seed=1)))
    assert main(["eval", "run", "--set", "data.criteo.eval_paths=[held.tsv]"]) == 0  # other data, on purpose


def test_eval_refuses_a_config_yaml_edited_by_hand(tmp_path, capsys):
    """A seed or a data setting changed in config.yaml (as --set would, which was refused)."""
    run = tmp_path / "run"
    assert main(["train", *sets(TINY), "--output-dir", str(run)]) == 0
    assert eval_lines(capsys, run)[0] == 0
    original = (run / "config.yaml").read_text()
    for key, value, words in (("seed", 5, "trained with seed 0, its config.yaml now has 5"),
                              ("zipf_alpha", 1.5, "data.synthetic.zipf_alpha 1.1 (from the folder")):  # fmt: skip
        cfg = yaml.safe_load(original)
        (cfg if key == "seed" else cfg["data"]["synthetic"])[key] = value
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        code, rows = eval_lines(capsys, run)
        assert code == 2 and words in rows["error"], rows


def test_the_digest_is_the_samples_whatever_their_order_or_batches():
    """Equal for the same samples cut into other batches and orders (another number of processes),
    different when one id, one dense value, one label or one bag length differs."""
    import torch

    from neorec.data.batch import Batch
    from neorec.data.ranks import take
    from neorec.sparse import SparseBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (9,), generator=g)
    sparse = SparseBatch.from_features({"a": (torch.randint(0, 50, (int(lengths.sum()),), generator=g), lengths),
                                        "b": (torch.arange(9), torch.ones(9, dtype=torch.int64))})  # fmt: skip
    batch = Batch(torch.randn(9, 3, generator=g), sparse, (torch.rand(9, generator=g) < 0.5).float())

    def digest(*parts) -> str:
        d = SampleDigest()
        d.started = True
        for part in parts:
            d.add(*part)
        return d.hex()

    whole = digest((batch,))
    padded = take(batch, torch.tensor([5, 6, 7, 8, 8]))  # a rank's share, the last sample repeated
    assert digest((take(batch, torch.tensor([4, 0, 2, 1, 3])),), (padded, 4)) == whole
    hashes = sample_hashes(batch)
    for changed in (Batch(batch.dense, sparse, 1 - batch.labels), Batch(batch.dense * 1.5, sparse, batch.labels),
                    Batch(batch.dense, take(batch, torch.tensor([1, 0, *range(2, 9)])).sparse, batch.labels)):  # fmt: skip
        assert not torch.equal(sample_hashes(changed), hashes)


def test_a_damaged_record_of_the_held_out_data_is_named(tmp_path, capsys):
    """summary.json's eval_data carries its own checksum: a digest changed in it is damage, not data
    that changed."""
    run = tmp_path / "run"
    assert main(["train", *sets(TINY), "--output-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    summary["eval_data"]["samples_digest"] = "0" * 16
    (run / "summary.json").write_text(json.dumps(summary))
    code, rows = eval_lines(capsys, run)
    assert code == 2 and "eval_data in" in rows["error"] and "checksum mismatch" in rows["error"], rows
    assert "remove it to evaluate without that check" in rows["error"]
    (run / "summary.json").unlink()
    assert eval_lines(capsys, run)[0] == 0


def _one_bag(ids, weights=None):
    from neorec.data.batch import Batch
    from neorec.sparse import SparseBatch

    feature = (torch.tensor(ids), torch.tensor([len(ids)])) + ((torch.tensor(weights),) if weights else ())
    return Batch(torch.zeros(1, 1), SparseBatch.from_features({"history": feature}), torch.zeros(1))


def test_the_digest_sees_the_order_of_a_bags_ids_and_their_weights():
    """A history in another order (sequence features read it in order) or other weights is other data."""
    assert not torch.equal(sample_hashes(_one_bag([3, 7])), sample_hashes(_one_bag([7, 3])))
    ones, other = _one_bag([3, 7], [1.0, 1.0]), _one_bag([3, 7], [1.0, 2.0])
    assert not torch.equal(sample_hashes(ones), sample_hashes(other))
