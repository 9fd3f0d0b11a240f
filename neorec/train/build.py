"""Turn a validated RunConfig into the pieces of a run: data source, tables, model, optimizers (its
embeddings: neorec/train/embeddings.py; its sharding plan: neorec/train/run_plan.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from neorec.config.schema import DenseOptimizerConfig, RunConfig
from neorec.data.source import DataSource, SourceInfo
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.tables import TableConfig, check_tables
from neorec.errors import ConfigError, DataError, NeorecError
from neorec.utils.cores import processes_on_node, usable_cores

log = logging.getLogger(__name__)


def build_source(
    cfg: RunConfig, topo=None, device_of_rank: torch.device | None = None, *, wait: bool = True
) -> DataSource:
    """The configured source; with `topo` (a Topology), a per-rank reader where the source has one
    (`preprocessed`, `parquet`: this rank's part of the data only). `device_of_rank`: the rank's training
    device, where the synthetic source keeps its samples (data.synthetic.on_device). `wait=False`: a
    followed stream with no complete partition is a DataError at once (commands that read its schema
    or first batches and end: export, plan, inspect), where training waits for one."""
    d = cfg.data
    labels = task_labels(cfg)
    if d.follow is not None:
        if not wait:
            _check_has_partition(cfg)
        return _follow_source(cfg, topo)
    if d.source == "synthetic":
        from neorec.data.synthetic import SyntheticSource, spec_from_config

        device = torch.device(device_of_rank if d.synthetic.on_device and device_of_rank is not None else "cpu")
        generator = d.synthetic.generator
        if generator == "auto":
            generator = "device" if device.type == "cuda" else "host"
        spec = spec_from_config(d.synthetic, cfg.seed, labels)
        return SyntheticSource(spec, device=device, raw_features=raw_features(cfg), generator=generator)
    if d.source == "criteo_tsv":
        from neorec.data.criteo import CriteoTSVSource

        c = d.criteo
        assert c is not None  # checked by the config validator
        return CriteoTSVSource(
            train_paths=c.train_paths,
            eval_paths=c.eval_paths,
            table_rows=c.table_rows,
            hashing=c.hashing,
            bad_lines=c.bad_lines,
            eval_every=c.eval_every,
            raw_features=sorted(raw_features(cfg)),
            max_line_bytes=c.max_line_bytes,
        )
    if d.source == "preprocessed":
        return _preprocessed_source(cfg, topo)
    if raw_features(cfg):  # ids arrive reduced into [0, num_ids): valid raw ids, but collided already
        log.warning(
            "data.source %s reduces ids modulo the data's table sizes before the tables; the managed-collision "
            "tables %s then give each reduced id its own row (only the synthetic and criteo_tsv sources pass "
            "raw ids)", d.source, sorted(raw_features(cfg)),
        )
    if d.source == "shards":
        from neorec.data.shards import ShardSource

        return ShardSource(d.shards_dir, bounds_check=cfg.embedding.bounds_check)
    if d.source == "parquet":
        from neorec.data.parquet import ParquetSource

        assert d.parquet is not None  # checked by the config validator
        rank, world = (topo.rank, topo.world_size) if topo is not None else (0, 1)
        return ParquetSource(
            d.parquet, rank=rank, world_size=world, seed=cfg.seed, bounds_check=cfg.embedding.bounds_check
        )
    if d.source == "movielens":
        from neorec.data.movielens import MovieLensSource

        m = d.movielens
        return MovieLensSource(
            m.root, seed=cfg.seed, val_fraction=m.val_fraction, split=m.split, labels=labels, history=m.history,
            history_from=m.history_from,
        )  # fmt: skip
    raise ConfigError(f"data.source {d.source!r} is not known")  # pragma: no cover - Literal checked


def reader_threads(threads: int | str) -> int:
    """data.preprocessed.threads: "auto" is one thread per 4 cores this process may use, shared by the
    run's processes on this machine, at least 1 and at most 4."""
    if threads != "auto":
        return int(threads)
    return max(1, min(4, usable_cores() // processes_on_node() // 4))


def _preprocessed_source(cfg: RunConfig, topo) -> DataSource:
    """Preprocessed shards; features stored as raw hash values must be (and only they may be) the
    features of managed-collision tables."""
    from neorec.data.sharded_reader import PreprocessedSource

    p = cfg.data.preprocessed
    assert p is not None  # checked by the config validator
    if not (Path(p.path) / "manifest.json").is_file():
        raise ConfigError(
            f"data.preprocessed.path: {p.path} has no manifest.json; write it with `neorec data preprocess`"
        )
    rank, world = (topo.rank, topo.world_size) if topo is not None else (0, 1)
    source = PreprocessedSource(
        p.path, rank=rank, world_size=world, seed=cfg.seed, shuffle=p.shuffle,
        shuffle_window=p.shuffle_window, prefetch=p.prefetch, bounds_check=cfg.embedding.bounds_check,
        threads=reader_threads(p.threads),
    )  # fmt: skip
    stored = set(source.info.notes.get("settings", {}).get("categorical", {}).get("raw_features", ()))
    mapped = raw_features(cfg)
    if stored - mapped:
        raise ConfigError(
            f"data.preprocessed.path {p.path} holds raw ids for {sorted(stored - mapped)}: give their tables "
            "embedding.tables.<name>.managed_collision (and rows)"
        )
    if mapped - stored:
        log.warning(
            "data.preprocessed.path %s holds ids reduced modulo the table sizes for %s; preprocess with "
            "--raw-features to give the managed-collision tables raw ids", p.path, sorted(mapped - stored),
        )
    return source


def _check_has_partition(cfg: RunConfig) -> None:
    from neorec.data.partitions import completion_text, list_partitions

    follow = cfg.data.follow
    assert follow is not None
    if not list_partitions(follow.dir, cfg.data.source, follow.marker, follow.order):
        what = completion_text(cfg.data.source, follow.marker)
        raise DataError(
            f"data.follow.dir {follow.dir}: holds no complete partition (a subfolder with {what}), whose "
            "schema and batches this command reads; it does not wait for one as training does"
        )


def _follow_source(cfg: RunConfig, topo) -> DataSource:
    """The partitions of data.follow.dir, each read by the source of data.source for this rank."""
    from neorec.data.follow import FollowSource

    d = cfg.data
    follow = d.follow
    assert follow is not None
    rank, world = (topo.rank, topo.world_size) if topo is not None else (0, 1)
    bounds = cfg.embedding.bounds_check
    if d.source == "parquet":
        from neorec.data.parquet import ParquetSource

        assert d.parquet is not None  # checked by the config validator
        parquet = d.parquet

        def open_partition(path: Path, seed: int) -> DataSource:
            config = parquet.model_copy(update={"paths": [str(path)]})
            return ParquetSource(config, rank=rank, world_size=world, seed=seed, bounds_check=bounds)

        shuffle = parquet.shuffle
    else:
        from neorec.config.data import PreprocessedConfig
        from neorec.data.sharded_reader import PreprocessedSource

        p = d.preprocessed or PreprocessedConfig()

        def open_partition(path: Path, seed: int) -> DataSource:
            return PreprocessedSource(
                path, rank=rank, world_size=world, seed=seed, shuffle=p.shuffle, shuffle_window=p.shuffle_window,
                prefetch=p.prefetch, bounds_check=bounds, threads=reader_threads(p.threads),
            )  # fmt: skip

        shuffle = p.shuffle
    return FollowSource(follow, d.source, open_partition, rank=rank, world_size=world, seed=cfg.seed, shuffle=shuffle)


def raw_features(cfg: RunConfig) -> set[str]:
    """Features whose tables have managed collision: their readers pass raw ids, not ids modulo rows."""
    return {name for name, o in cfg.embedding.tables.items() if o.managed_collision is not None}


def task_labels(cfg: RunConfig) -> list[str] | None:
    """The labels a multi-task model asks its source for, by name (None: the source's one label);
    checked against what the source can make before it reads anything."""
    if cfg.model.arch != "multitask":
        return None
    names = [t.name for t in cfg.model.tasks]
    if cfg.data.source == "synthetic":
        from neorec.data.synthetic import LABELS

        unknown = [n for n in names if n not in LABELS]
        if unknown:
            raise ConfigError(f"model.tasks names labels {unknown} that synthetic data does not make; it has {list(LABELS)}")
    elif cfg.data.source != "movielens":
        raise ConfigError(
            f"model.arch multitask needs a source that makes several labels (synthetic, movielens); "
            f"data.source {cfg.data.source} has one"
        )
    return names


def build_tables(cfg: RunConfig, info: SourceInfo) -> list[TableConfig]:
    """One table per feature, named like the feature, with `embedding.tables` overrides applied."""
    e = cfg.embedding
    names = set(info.feature_names)
    for key, named in (("embedding.tables", e.tables), ("distributed.sharding", cfg.distributed.sharding)):
        unknown = sorted(set(named) - names)
        if unknown:  # checked with one process too, so a config that fails on many fails here first
            raise ConfigError(
                f"{key} names {unknown}, which are not tables of this data; tables: {info.feature_names}"
            )
    tables = []
    for f in info.features:
        o = e.tables.get(f.name)
        if o is not None and o.rows is not None and o.managed_collision is None:
            raise ConfigError(
                f"embedding.tables.{f.name}.rows: only managed-collision tables set their rows (the others "
                f"take the data's {f.num_ids} ids); set embedding.tables.{f.name}.managed_collision or drop rows"
            )
        tables.append(
            TableConfig(
                name=f.name,
                rows=(o.rows if o and o.rows else f.num_ids),
                dim=(o.dim if o and o.dim else e.dim),
                features=[f.name],
                pooling=(o.pooling if o and o.pooling else e.pooling),
                dtype=(o.dtype if o and o.dtype else e.dtype),
                optimizer=(o.optimizer if o else None),
                managed_collision=(o.managed_collision if o else None),
            )
        )
    check_tables(tables)
    return tables


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
    if "vocab_threshold" in c:
        return "criteo", words, {"hashing": (f"{where} hashing", f"vocab (threshold {c['vocab_threshold']})")}
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


def check_before_launch(cfg: RunConfig, num_processes: int) -> None:
    """What every process of a one-machine run of `num_processes` would fail on, checked once before
    they start: the batch divides over them, the data files of a Parquet or Criteo TSV source exist and
    have one role each, train.kernel_cache is a folder they can write,
    train.compile finds its compiler, `embedding.tables` and `distributed.sharding` name tables of
    the data, and the sharding holds: the plan file under the constraints, or the constraints the
    planner would refuse (run_constraints.py; the data's feature list is read only where the config
    names a plan, constraints or tables)."""
    if cfg.data.batch_size % num_processes:
        raise ConfigError(
            f"data.batch_size {cfg.data.batch_size} is the global batch and must divide over {num_processes} processes"
        )
    task_labels(cfg)
    if cfg.data.follow is None and cfg.data.source == "parquet" and cfg.data.parquet is not None:
        from neorec.data.parquet import listed_files

        listed_files(cfg.data.parquet)  # each file in one role (listed, not opened: each process reads them)
    elif cfg.data.follow is None and cfg.data.source == "criteo_tsv":
        build_source(cfg)  # its files: present, readable, each in one role
    if cfg.train.kernel_cache is not None:
        from neorec.utils.kernel_cache import check_kernel_cache

        check_kernel_cache(cfg.train.kernel_cache)
    if cfg.train.compile:
        from neorec.model.compile import check_compiler

        if cfg.model.arch not in ("dlrm", "dcnv2"):
            raise ConfigError(
                f"train.compile: true compiles the dense stages of model.arch dlrm and dcnv2, not {cfg.model.arch}; "
                "set train.compile: false"
            )
        check_compiler(torch.device(cfg.train.device))
    d = cfg.distributed
    if not (d.plan or d.sharding or cfg.embedding.tables):
        return
    tables = build_tables(cfg, build_source(cfg).info)
    if (d.plan or d.sharding) and num_processes > 1:  # one process trains unsharded: a plan does not apply
        from neorec.train.run_constraints import check_before_launch as check_sharding

        check_sharding(cfg, tables, num_processes, run_wire_precisions(cfg, one_machine=True))


def run_wire_precisions(cfg: RunConfig, one_machine: bool) -> tuple[str, str]:
    """The run's exchange codecs, "auto" resolved (distributed/codecs.wire_precisions): shared
    memory when every rank is on one machine, with CPU tensors and the shm transport. Training and
    the planner both ask here, so the planner costs the codecs training uses."""
    from neorec.distributed.codecs import wire_precisions
    from neorec.distributed.shm import available

    d = cfg.distributed
    in_shm = one_machine and d.transport == "shm" and cfg.train.device == "cpu" and available()
    return wire_precisions(d.forward_precision, d.backward_precision, in_shm)


def build_model(
    cfg: RunConfig, info: SourceInfo, embeddings: EmbeddingCollection, source: DataSource | None = None,
    comms=None,
) -> nn.Module:  # fmt: skip
    """The configured architecture over `embeddings`. `source`: the training data, which two_tower
    counts its items in (without it, the counts stay zero until a state dict loads them). `comms`:
    the run's processes (a Comms; None: one), which two_tower gathers its in-batch negatives over.
    The layers' initial values depend on `cfg.seed` alone; the caller's global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):  # the layers are built on the CPU
        torch.random.default_generator.manual_seed(cfg.seed)
        return _build_model(cfg, info, embeddings, source, comms)


def _build_model(
    cfg: RunConfig, info: SourceInfo, embeddings: EmbeddingCollection, source: DataSource | None, comms
) -> nn.Module:
    from neorec.model.dlrm import DLRM, DCNv2

    m = cfg.model
    if m.arch == "din":
        from neorec.model.din import DIN

        d = m.din
        return DIN(
            info.num_dense, embeddings, m.bottom_mlp, m.top_mlp, d.target, d.history, d.history_side, d.max_len,
            d.attention_mlp, d.cross_layers, m.precision, m.low_rank,
        )  # fmt: skip
    if m.arch == "deepfm":
        from neorec.model.deepfm import DeepFM

        return DeepFM(info.num_dense, embeddings, m.bottom_mlp, m.top_mlp, m.precision)
    if m.arch == "two_tower":
        from neorec.model.two_tower import build_two_tower

        return build_two_tower(m.two_tower, embeddings, info, source, comms)
    dlrm, dcnv2, outputs = DLRM, DCNv2, 1
    if m.arch == "multitask":  # the same trunk with one output per task, and the tasks' loss and metrics
        from neorec.model.multitask import MultiTaskDCNv2, MultiTaskDLRM

        dlrm, dcnv2, outputs = MultiTaskDLRM, MultiTaskDCNv2, len(m.tasks)
    if m.interaction == "dlrm":
        model = dlrm(info.num_dense, embeddings, m.bottom_mlp, m.top_mlp, m.self_interaction, m.precision, outputs)
    else:
        model = dcnv2(
            info.num_dense, embeddings, m.bottom_mlp, m.top_mlp, m.cross_layers, m.low_rank, m.precision, outputs
        )
    if m.arch == "multitask":
        model.set_tasks([t.name for t in m.tasks], [t.weight for t in m.tasks])
    return model


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every trainable parameter that is not embedding storage (those have their own optimizer)."""
    emb = {id(p) for m in model.modules() if isinstance(m, EmbeddingCollection) for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in emb]


def build_dense_optimizer(c: DenseOptimizerConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if c.name == "adam":
        return torch.optim.Adam(params, lr=c.lr, eps=c.eps, weight_decay=c.weight_decay)
    if c.name == "adagrad":
        return torch.optim.Adagrad(params, lr=c.lr, eps=c.eps, weight_decay=c.weight_decay)
    return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
