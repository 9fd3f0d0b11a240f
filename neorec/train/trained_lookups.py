"""A trained model scores as trained only when its rows are looked up as in training: the checks that
`neorec eval --set`, `neorec export --config` and `neorec predict --config` make before they use a
run's weights under a config other than the run's own (which features each table looks up, pooled and
weighted as trained; how raw values of the data map to rows, and how the dense inputs are made)."""

from __future__ import annotations

import logging
from pathlib import Path

from neorec.config.schema import RunConfig
from neorec.data.source import SourceInfo
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError, NeorecError
from neorec.train.build import build_source, build_tables, raw_features

log = logging.getLogger(__name__)


def check_trained_lookups(
    run_config: Path,
    tables: list[TableConfig],
    info: SourceInfo,
    now: str,
    *,
    config: RunConfig | None = None,
    weights: Path | None = None,
) -> None:
    """ConfigError when `tables` (of the config `now` names, over the data `info` describes) look up
    rows otherwise than the tables of the run's `run_config` that trained its weights did: other
    features or pooling of a table, or a feature's ids weighted in one and not in the other. The
    shapes stay the same, so the model would load and score as another model. `config`: the config
    `now` names; when its data section differs from the run's, the run's own data source (built, not
    read) tells which features had weighted ids, and when that source cannot be built (its files
    gone) a warning says that they were not compared; and its data must map raw values to the same rows
    (check_same_mapping). None: the same data as the run's. `weights`:
    the trained weights the message names (default: the run's model.pt)."""
    from neorec.config.load import load_config
    from neorec.embedding.tables import lookup_difference, lookups

    trained_cfg = load_config(str(run_config))
    if config is not None and config.data != trained_cfg.data:  # before any of the run's data is read
        check_same_mapping(run_config, trained_cfg, config, now, weights)
    trained_info: SourceInfo | None = info
    if config is not None and config.data != trained_cfg.data:
        try:
            trained_info = build_source(trained_cfg, wait=False).info
        except (NeorecError, OSError) as e:
            log.warning(
                "%s: its data cannot be read (%s), so which features had weighted ids is not compared "
                "with %s",
                run_config, " ".join(str(e).split())[:200], now,
            )  # fmt: skip
            trained_info = None
    trained = build_tables(trained_cfg, trained_info or info)
    weighted = None if trained_info is None else {f.name for f in trained_info.features if f.weighted}
    differs = lookup_difference(
        lookups(trained, weighted), tables, {f.name for f in info.features if f.weighted}
    )
    if differs:
        raise ConfigError(
            f"{weights or run_config.parent / 'model.pt'}: "
            + differs.format(trained=str(run_config), now=now)
            + "; its rows only score as trained under the same lookup"
        )


Mapping = dict[str, tuple[str, object]]  # what decides a row -> (the key that sets it, its value)


def id_mapping(cfg: RunConfig) -> tuple[str, str, Mapping] | None:
    """What decides which row of its table each raw value of `cfg`'s data reaches, and the dense inputs:
    (kind: criteo, parquet, synthetic or movielens; data.source in words; Mapping). Preprocessed data:
    as its manifest.json records (NeorecError or OSError when unreadable). Keys that change no row stay
    out (paths, threads, batch sizes, shuffling, the held-out split, bad lines). None: not known from the
    config (the preprocessed partitions of data.follow)."""
    d = cfg.data
    if d.source == "criteo_tsv" and d.criteo is not None:
        c = d.criteo
        return "criteo", d.source, _criteo_mapping("data.criteo.", c.hashing, c.table_rows, raw_features(cfg))
    if d.source == "parquet" and d.parquet is not None:
        return "parquet", d.source, _parquet_mapping("data.parquet", d.parquet)
    if d.source != "preprocessed":
        return ("synthetic" if d.source == "shards" else d.source), d.source, {}
    if d.preprocessed is None or d.preprocessed.path is None:
        return None
    from neorec.config.data import ParquetConfig
    from neorec.data.manifest import MANIFEST, load_manifest

    where, settings = Path(d.preprocessed.path) / MANIFEST, load_manifest(d.preprocessed.path)["settings"]
    words = f"preprocessed ({settings['input']} input, as {where} records)"
    if settings["input"] == "parquet":
        section = ParquetConfig(**settings["parquet"])
        return "parquet", words, _parquet_mapping(f"{where} data.parquet", section)
    if settings["input"] != "criteo":
        return "synthetic", words, {}
    c = settings["categorical"]
    if "vocab_threshold" in c:  # the vocabularies counted from its training lines: by their contents
        from neorec.data.criteo_lines import CATEGORICAL_NAMES
        from neorec.data.vocab import Vocabularies

        vocabs = Vocabularies(str(Path(d.preprocessed.path) / "vocab"), list(CATEGORICAL_NAMES))
        return "criteo", words, {"hashing": (f"{where} hashing", "vocab"), "vocab": (f"{where} vocab/", vocabs)}
    raw = c.get("raw_features", ())
    return "criteo", words, _criteo_mapping(f"{where} ", c["hashing"], c["table_rows"], raw)


def _criteo_mapping(prefix: str, hashing: str, table_rows, raw) -> Mapping:
    from neorec.data.criteo_lines import CATEGORICAL_NAMES, resolve_table_rows

    out: Mapping = {"hashing": (f"{prefix}hashing", hashing)}
    for name, rows in zip(CATEGORICAL_NAMES, resolve_table_rows(table_rows).tolist(), strict=True):
        out[f"rows {name}"] = (f"{prefix}table_rows of {name}", "raw ids" if name in raw else rows)
    return out


def _parquet_mapping(prefix: str, p) -> Mapping:
    """Each feature's columns and settings (its own or the section's; a vocabulary's size gives its
    rows), the vocabularies where a feature uses them, the dense columns and their transform. A weights
    column only where there is one: weights in one config alone, lookup_difference names."""
    features = p.feature_configs()
    out: Mapping = {"features": (f"{prefix}.features (names, in order)", [f.name for f in features])}
    for f in features:
        for key in ("column", "hashing", "strings", "rows", "weights"):
            if (key != "rows" or f.hashing != "vocab") and (key != "weights" or f.weights is not None):
                out[f"{f.name} {key}"] = (f"{prefix}.{key} of feature {f.name!r}", getattr(f, key))
    if any(f.hashing == "vocab" for f in features):
        from neorec.data.vocab import Vocabularies

        names = [f.name for f in features if f.hashing == "vocab"]
        out["vocab_dir"] = (f"{prefix}.vocab_dir", Vocabularies(p.vocab_dir, names))  # by their contents
    out.update(dense=(f"{prefix}.dense", list(p.dense)), log1p=(f"{prefix}.dense_log1p", p.dense_log1p))
    return out


def check_same_mapping(
    run_config: Path, trained: RunConfig, config: RunConfig, now: str, weights: Path | None = None
) -> None:
    """ConfigError, naming the first key that differs and both values, when `config` (named `now`) maps
    raw values to rows, or makes the dense inputs, otherwise than the run's `run_config` (`trained`)
    did (id_mapping). A preprocessed run whose manifest is unreadable now is not compared (a warning)."""
    try:
        was = id_mapping(trained)
    except (NeorecError, OSError) as e:
        log.warning(
            "%s: its data's manifest cannot be read (%s), so how values map to rows is not compared with %s",
            run_config, " ".join(str(e).split())[:200], now,
        )  # fmt: skip
        return
    is_ = id_mapping(config)
    if was is None or is_ is None:
        return
    differs = f"data.source is {was[1]} in {run_config} but {is_[1]} in {now}" if was[0] != is_[0] else None
    for what, (key, value) in was[2].items():
        if differs is None and what in is_[2] and is_[2][what][1] != value:
            other_key, other = is_[2][what]
            to = f"{other!r}" if other_key == key else f"{other_key} is {other!r}"
            differs = f"{key} is {value!r} in {run_config} but {to} in {now}"
    if differs:
        raise ConfigError(
            f"{weights or run_config.parent / 'model.pt'}: {differs}; raw values would reach other rows (or "
            "make other dense inputs) than in training, so the model would score as another one: --config "
            "may change how the data is read, not how values map to rows"
        )
