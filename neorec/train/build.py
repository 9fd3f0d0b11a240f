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
from neorec.errors import ConfigError, DataError
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
