"""`neorec eval` scores the held-out data its run's config names now. That is the run's held-out set
only while the data are as the run read them: files rewritten or moved since, a relative path read
from another working folder, or a config.yaml edited by hand give another set, and metrics that are
not the run's. A run records in summary.json ("eval_data") the settings and working folder its data
were read with and a digest of the samples its final evaluation scored (neorec/data/sample_digest.py);
`neorec eval` compares both, unless its `--set` chooses other held-out data on purpose."""

from __future__ import annotations

from pathlib import Path

from neorec.config.data_keys import is_reader_speed
from neorec.config.schema import RunConfig
from neorec.data.reader_position import data_settings, first_data_change
from neorec.errors import ConfigError, DataError
from neorec.utils.files import check_json, load_json

# data settings an evaluation may change and still score the run's held-out samples
_SAME_SAMPLES = ("data.eval_batch_size", "data.batch_size")
# settings of how the trained model computes its scores, which an evaluation of the run keeps
_THE_MODEL = ("model.", "embedding.dim", "embedding.pooling", "embedding.dtype")
_A_TABLES = (".dim", ".pooling", ".dtype", ".rows", ".features")
# ... except how a two-tower model's recall@K is counted (its held-out items: neorec/model/two_tower.py)
_HOW_SCORED = ("model.two_tower.exclude_seen", "model.two_tower.user_id")


def check_eval_overrides(changed: list[str]) -> None:
    """`neorec eval --set` that changes a setting of the model (its layers, attention, precision, a
    table's dim, pooling or storage dtype) is refused: the shapes may still fit model.pt, and the
    metrics printed as the run's would be another model's. `changed`: the dotted keys the overrides
    change (changed_keys of the run's config and the one evaluated: a section given whole counts)."""
    for key in changed:
        of_a_table = key.startswith("embedding.tables.") and key.endswith(_A_TABLES)
        if (key.startswith(_THE_MODEL) or of_a_table) and key not in _HOW_SCORED:
            raise ConfigError(
                f"--set {key}: changes how the run's model computes its scores, so the metrics would be "
                "another model's; `neorec eval` scores the run as it trained: leave it out"
            )


def other_held_out(changed: list[str]) -> list[str]:
    """The settings among `changed` that choose other held-out data (any of the data but its batch
    sizes and reader speed)."""
    return [k for k in changed if k.startswith("data.") and k not in _SAME_SAMPLES and not is_reader_speed(k)]


def recorded_eval_data(run: Path, changed: list[str]) -> dict | None:
    """The run's record of its held-out data, when `neorec eval` changing the settings `changed`
    should score the same samples: None for a run without one (written before it was kept), or when a
    changed data setting chooses other held-out data."""
    if other_held_out(changed):
        return None
    path = run / "summary.json"
    if not path.is_file():
        return None
    hint = "it records the run's held-out data: remove it to evaluate without that check, or train again"
    record = load_json(path, "run summary", hint)
    found = record.get("eval_data")
    if found is None:
        return None
    if not isinstance(found, dict):
        raise DataError(f"run summary {path}: its eval_data is damaged (not a mapping); {hint}")
    found = check_json(found, path, "run summary's eval_data in", hint, DataError, required=True)
    if not isinstance(found.get("samples_digest"), str):
        raise DataError(f"run summary {path}: its eval_data has no samples_digest; {hint}")
    return found


def check_eval_settings(record: dict, cfg: RunConfig, run: Path, command: str = "neorec eval") -> None:
    """The data settings and seed the run read its held-out data with, against those of `cfg` here
    (relative paths taken from each one's working folder), before anything is read. `command`: the one
    that checks (`neorec export` measures the held-out AUC too)."""
    saved = record.get("settings")
    change = first_data_change(saved, data_settings(cfg.data), by_place=True) if isinstance(saved, dict) else None
    if change is not None:
        key, was, now = change
        where = saved.get("working_folder")
        raise ConfigError(
            f"{run} read its held-out data with data.{key} {was!r} (from the folder {where}); its "
            f"config.yaml here gives {now!r}: another held-out set, and metrics that are not the run's. "
            f"Run `{command}` from {where} (relative paths start there), or put the config back"
        )
    if record.get("seed") is not None and record["seed"] != cfg.seed:
        raise ConfigError(
            f"{run} trained with seed {record['seed']}, its config.yaml now has {cfg.seed}: the seed draws "
            "and splits the data, so another one scores other held-out samples; put the config back"
        )


_EVAL_WAY_OUT = (
    "Evaluate other data on purpose with --set (e.g. the held-out paths), or `neorec predict --data`"
)


def check_eval_samples(record: dict, digest: str | None, run: Path, way_out: str = _EVAL_WAY_OUT) -> None:
    """The digest of the held-out samples scored now against the one the run's final evaluation
    recorded; `way_out`: how to score other data on purpose, with the command that checks."""
    if digest is not None and digest != record["samples_digest"]:
        raise DataError(
            f"{run}: the held-out samples its config names now differ from those the run scored when it "
            f"finished (digest {digest}, summary.json records {record['samples_digest']}): its data changed "
            "since (files rewritten, moved or grown; synthetic data drawn by another generator, as "
            "train.device or data.synthetic.generator choose), so these metrics would not be the run's. "
            + way_out
        )
