"""The held-out data `neorec export` measures and `neorec predict` (without --data) scores are the run's
(see neorec/train/eval_data.py, which `neorec eval` checks with): the run records in summary.json
("eval_data") the settings, seed and working folder its held-out data were read with and a digest of
the samples its final evaluation scored (neorec/data/sample_digest.py).

`neorec export` compares the settings before reading and the digest of the samples it measured after,
and refuses another set (files rewritten, moved or grown, a relative path read from another folder);
the export's header keeps the record ("eval_data": samples_digest, seed, settings; recorded_by "run"),
so that `neorec predict` compares the held-out data it scores with it too. A run without the record
(of an earlier neorec, or stopped before its final evaluation) is measured with a note that it could
not be checked; so is predict with an export without one. A --config whose data settings choose
other held-out data is measured on them on purpose. Without a run's record the header keeps the
digest of the samples the export measured (recorded_by "export"), which predict then compares with.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from neorec.data.batch import Batch
from neorec.data.reader_position import data_settings, first_data_change
from neorec.data.sample_digest import SampleDigest
from neorec.errors import ConfigError, DataError, NeorecError
from neorec.train.eval_data import check_eval_samples, check_eval_settings, other_held_out, recorded_eval_data

RECORD_KEYS = ("samples_digest", "seed", "settings")  # of the export header's "eval_data", with recorded_by
EXPORT_WAY_OUT = (
    "Export without measuring (--no-eval), or measure other data on purpose: a --config naming other "
    "held-out files, or `neorec predict FILE --data DATA --with-labels` on the export"
)
_NO_RECORD = "a run of an earlier neorec, or one stopped before its final evaluation"


@dataclass
class HeldOut:
    """What an export knows of its run's held-out data before measuring."""

    record: dict | None = None  # the run's eval_data, which the samples measured must match
    run: Path | None = None  # the run folder whose summary.json records it
    note: str = ""  # with no record: why the held-out data measured could not be checked


def run_held_out(path: Path, trained, config: str | Path | None, measure: bool) -> HeldOut:
    """The record of the run `path` (a run folder, or a checkpoint inside one) of its held-out data,
    its data settings checked against those of the model's config when the export measures (before
    any data is read)."""
    from neorec.config.load import changed_keys, load_config

    run = path if (path / "config.yaml").is_file() else _run_folder(trained.origin)
    if run is None:
        return HeldOut(note=f"not checked: {path} lies in no run folder, whose summary.json records them")
    changed: list[str] = []
    if config is not None:  # another config than the run's may read other held-out data, on purpose
        try:
            was = load_config(str(run / "config.yaml")).model_dump(mode="json")
        except NeorecError:
            return HeldOut(run=run, note=f"not checked: {run / 'config.yaml'} cannot be read any more")
        changed = changed_keys(was, trained.config.model_dump(mode="json"))
        if other := other_held_out(changed):
            return HeldOut(
                run=run, note=f"of --config {config}, not the run's (it changes {', '.join(other)})"
            )
    record = recorded_eval_data(run, changed)
    if record is None:
        summary = run / "summary.json"
        return HeldOut(run=run, note=f"not checked against the run's: {summary} records none ({_NO_RECORD})")
    if measure:
        check_eval_settings(record, trained.config, run, "neorec export")
    return HeldOut(record, run)


def _run_folder(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint lies in (its config.yaml up to three levels above), None outside one."""
    for folder in [checkpoint, *list(checkpoint.resolve().parents)[:3]]:
        if (folder / "config.yaml").is_file():
            return folder
    return None


def header_record(held: HeldOut, digest: str | None, cfg) -> dict | None:
    """The export header's "eval_data": the run's record, the samples measured (`digest`, None: none
    measured) checked against it; without a record, the digest of the samples measured and the
    settings they were read with; None when neither is known."""
    if held.record is not None:
        if digest is not None:
            assert held.run is not None
            check_eval_samples(held.record, digest, held.run, EXPORT_WAY_OUT)
        return {**{k: held.record[k] for k in RECORD_KEYS if k in held.record}, "recorded_by": "run"}
    if digest is not None:
        return {
            "samples_digest": digest,
            "seed": cfg.seed,
            "settings": data_settings(cfg.data),
            "recorded_by": "export",
        }
    return None


def held_out_line(held: HeldOut, record: dict | None) -> str:
    """What the export report says of the held-out data measured."""
    if held.record is not None and record is not None:
        return f"the run's (samples digest {record['samples_digest']}, as {held.run}/summary.json records)"
    return held.note


# ---- neorec predict, without --data --------------------------------------------------------------
def predict_record(exported) -> dict | None:
    """The export header's record of its run's held-out data (None: an export without one), its
    settings checked against those its config gives read from this folder, before anything is read."""
    record = exported.header.get("eval_data")
    if not isinstance(record, dict) or not isinstance(record.get("samples_digest"), str):
        return None
    saved = record.get("settings")
    change = None
    if isinstance(saved, dict):
        change = first_data_change(saved, data_settings(exported.config.data), by_place=True)
    if change is not None:
        key, was, now = change
        where = saved.get("working_folder")
        raise ConfigError(
            f"model {exported.path}: its run read its held-out data with data.{key} {was!r} from the folder "
            f"{where}; read from here ({os.getcwd()}), its config gives {now!r} in another place: other "
            f"held-out data, and predictions that are not of the run's. Run `neorec predict` from {where} "
            "(relative paths start there), or give the data to score with --data"
        )
    return record


def digested(batches: Iterator[Batch], digest: SampleDigest) -> Iterator[Batch]:
    """`batches`, each added to `digest` as it is read."""
    digest.started = True
    for batch in batches:
        digest.add(batch)
        yield batch


def check_predicted(exported, record: dict, digest: SampleDigest) -> None:
    """The samples predict scored (`digest`) against those the export records of its run."""
    now, was = digest.hex(), record["samples_digest"]
    if now != was:
        raise DataError(
            f"model {exported.path}: the held-out samples its config names here differ from those its run "
            f"scored (digest {now}, the export records {was}): the data changed since (files rewritten, "
            "moved or grown; synthetic data drawn by another generator), so these would not be predictions "
            "of the run's held-out data; give the data to score with --data"
        )


def predict_line(record: dict | None, path: Path) -> str:
    """What predict says of the held-out data it scored."""
    if record is not None and record.get("recorded_by") == "export":  # its run recorded none
        return f"those the export measured (samples digest {record['samples_digest']})"
    if record is not None:
        return f"the run's (samples digest {record['samples_digest']}, as the export records)"
    return (
        f"not checked: {path} records no digest of its run's held-out data (exported by an earlier "
        "neorec, or from a run that records none)"
    )
