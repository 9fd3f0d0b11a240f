"""The run configuration: every field typed, bounded and documented; checked before any work starts.
The data sections live in neorec/config/data.py and the distributed section in distributed.py, both
re-exported here; the bounds in limits.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from neorec.config import limits
from neorec.config.base import Strict
from neorec.config.continuous import FollowConfig, SnapshotConfig  # noqa: F401 - re-exported
from neorec.config.data import (  # noqa: F401 - re-exported: the data sections are part of the schema
    CriteoConfig,
    DataConfig,
    MovieLensConfig,
    ParquetConfig,
    ParquetFeatureConfig,
    PreprocessedConfig,
    SyntheticConfig,
)
from neorec.config.din import DINConfig, check_din
from neorec.config.distributed import (  # noqa: F401 - re-exported: the distributed section is part of the schema
    DistributedConfig,
    TableShardingConfig,
)
from neorec.embedding.tables import EmbeddingOptimizerConfig, ManagedCollisionConfig


# ---- model ---------------------------------------------------------------------------------------
class TaskConfig(Strict):
    """One head of a multi-task model: a label the data source makes, and its weight in the loss."""

    name: str = Field(min_length=1, description="the label (movielens: like, love, ok; synthetic: click, conversion)")
    weight: float = Field(1.0, ge=0, description="weight of this task's mean BCE in the summed loss")


class TwoTowerConfig(Strict):
    """Which features feed which tower of `model.arch: two_tower`, and the softmax's settings."""

    user_features: list[str] = Field(["user"], min_length=1, description="features of the user tower")
    item_features: list[str] = Field(
        ["movie", "genres", "year"], min_length=1, description="features of the item tower"
    )
    item_id: str | None = Field(
        None, description="the feature whose id names the item (logQ counts, recall); default: the first item feature"
    )
    user_id: str | None = Field(
        None, description="the feature whose id names the user (exclude_seen); default: the first user feature"
    )
    exclude_seen: bool = Field(
        True, description="recall ranks only the items a user did not rate in training (besides the held-out one)"
    )
    tower_mlp: list[int] = Field([64, 32], min_length=1, description="layer sizes of each tower (the last: output dim)")
    temperature: float = Field(0.05, gt=0, description="scores are cosine similarities divided by this")

    @model_validator(mode="after")
    def _towers(self) -> TwoTowerConfig:
        both = sorted(set(self.user_features) & set(self.item_features))
        if both:
            raise ValueError(f"features {both} are in both user_features and item_features; give each to one tower")
        if self.item_id is not None and self.item_id not in self.item_features:
            raise ValueError(f"item_id {self.item_id!r} must be one of item_features {self.item_features}")
        if self.user_id is not None and self.user_id not in self.user_features:
            raise ValueError(f"user_id {self.user_id!r} must be one of user_features {self.user_features}")
        if any(not 0 < s <= limits.MAX_WIDTH for s in self.tower_mlp):
            raise ValueError(f"tower_mlp layer sizes must be in [1, {limits.MAX_WIDTH}]")
        return self


class ModelConfig(Strict):
    arch: Literal["dlrm", "dcnv2", "deepfm", "multitask", "two_tower", "din"] = Field(
        "dlrm",
        description="dot-interaction DLRM, DCNv2 cross network, DeepFM, multi-task heads on a dlrm/dcnv2 trunk, "
        "two-tower retrieval, or DIN target attention over a history",
    )
    # the models that read each key: neorec/config/model_keys.py, which refuses a key set for another one
    bottom_mlp: list[int] = Field(
        [512, 256, 64, 16], min_length=1, description="bottom MLP layer sizes (every model but two_tower)"
    )
    top_mlp: list[int] = Field(
        [512, 256], description="top MLP hidden sizes, a final 1-unit layer added (every model but two_tower)"
    )
    self_interaction: bool = Field(
        False, description="dlrm, multitask with trunk dlrm: include each vector's dot with itself"
    )
    cross_layers: int = Field(
        3, gt=0, le=limits.MAX_LAYERS, description="dcnv2, multitask with trunk dcnv2: number of cross layers"
    )
    low_rank: int | None = Field(
        None, gt=0, le=limits.MAX_WIDTH,
        description="dcnv2, multitask trunk dcnv2, din's cross layers: rank of cross weights (null: full)",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="MLP and interaction math: fp32, or bf16 autocast (fp32 weights, grads); not two_tower",
    )
    trunk: Literal["dlrm", "dcnv2"] = Field("dlrm", description="multitask: the shared trunk's architecture")
    tasks: list[TaskConfig] = Field([], description="multitask: one head per task, in this order")
    two_tower: TwoTowerConfig = Field(default_factory=TwoTowerConfig, description="two_tower: towers and loss")
    din: DINConfig = Field(default_factory=DINConfig, description="din: the target and history features")

    @model_validator(mode="after")
    def _positive(self) -> ModelConfig:
        if any(not 0 < s <= limits.MAX_WIDTH for s in self.bottom_mlp + self.top_mlp):
            raise ValueError(f"layer sizes must be in [1, {limits.MAX_WIDTH}]")
        if self.arch == "multitask":
            names = [t.name for t in self.tasks]
            if not names:
                raise ValueError("model.arch multitask needs model.tasks, e.g. [{name: like}, {name: ok, weight: 0.5}]")
            if len(set(names)) != len(names):
                raise ValueError(f"model.tasks names must be unique, got {names}")
            if not any(t.weight > 0 for t in self.tasks):
                raise ValueError("model.tasks: at least one task needs a weight > 0")
        elif self.tasks:
            raise ValueError(f"model.tasks is for model.arch multitask, not {self.arch}")
        return self

    @property
    def interaction(self) -> str:
        """The interaction that sets the embedding dim rules: the trunk's for multitask."""
        return self.trunk if self.arch == "multitask" else self.arch


# the architectures that read pooled embeddings only (no table with pooling none)
POOLED_ARCHS = ("dlrm", "dcnv2", "deepfm", "multitask", "two_tower")


class TableOverride(Strict):
    """Per-table settings that differ from the `embedding` defaults."""

    dim: int | None = Field(None, gt=0, le=limits.MAX_DIM, description="embedding dimension")
    pooling: Literal["sum", "mean", "none"] | None = Field(
        None, description="bag pooling; none: one row per id (a sequence feature, for sequential models)"
    )
    dtype: Literal["fp32", "fp16", "bf16"] | None = Field(None, description="weight storage type")
    optimizer: EmbeddingOptimizerConfig | None = Field(
        None, description="optimizer keys that differ for this table; the others are embedding.optimizer's"
    )
    tier: Literal["memory", "dram", "ssd"] | None = Field(None, description="where this table's rows live")
    managed_collision: ManagedCollisionConfig | None = Field(
        None, description="the reader passes raw ids and an id map gives each its own row (docs/managed-collision.md)"
    )
    rows: int | None = Field(
        None, gt=0, le=limits.MAX_ROWS, description="managed-collision tables: rows (the id map's capacity; default: the data's id count)"
    )


class CacheConfig(Strict):
    """The RAM row cache of tables in tier dram or ssd (neorec/embedding/cache)."""

    policy: Literal["lru", "lfu"] = Field("lru", description="which rows the cache evicts first")
    fraction: float | None = Field(
        None, gt=0, le=1, description="share of each cached table group's rows kept in RAM (default 0.2)"
    )
    size_mib: float | None = Field(
        None, gt=0, description="or: MiB of cache (rows + optimizer state) shared by all cached tables"
    )
    directory: str | None = Field(None, description="folder for the files of ssd tables (created afresh)")
    release_mib: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="ssd: drop the file maps' resident pages (they count in RSS) once they have grown by this "
        "many MiB; auto: a quarter of the machine's memory shared by the processes on this node (the pages "
        "are the kernel's page cache, mapped or not: this bounds what RSS counts). Set a number to keep RSS "
        "within a memory budget",
    )
    ssd_reads: Literal["map", "pread"] = Field(
        "map",
        description="ssd: read missed rows from the file's map (least CPU when the page cache holds the file) "
        "or with positioned reads on 16 I/O threads (deeper disk queue when it does not)",
    )

    ssd_log: float = Field(
        1.0,
        ge=0,
        le=1,
        description="ssd: rows written back are appended to a write log of this share of the table's rows "
        "(disk: the table plus the log), folded into the table file in sequential windows; 0 writes them "
        "in place through the file's map (a page fault per row)",
    )
    io_thread: bool | Literal["auto"] = Field(
        "auto",
        description="ssd, or dram behind a cache on a GPU: read coming batches' rows ahead and write "
        "evicted rows back on a worker thread "
        "(true/on), or on the training thread (false/off); auto: on only when the machine has a core that "
        "torch's threads (x the processes on this node) leave free, since otherwise the worker takes "
        "cores from the intra-op threads and every parallel operator waits for the one it displaced; "
        "with train.device: cuda auto is on (the step runs on the GPU)",
    )

    @model_validator(mode="after")
    def _one_size(self) -> CacheConfig:
        if self.fraction is not None and self.size_mib is not None:
            raise ValueError("set embedding.cache.fraction or embedding.cache.size_mib, not both")
        return self


class EmbeddingConfig(Strict):
    engine: Literal["fused", "reference"] = Field("fused", description="fused table-batched engine, or per-table nn.EmbeddingBag")
    dim: int = Field(16, gt=0, le=limits.MAX_DIM, description="default embedding dimension")
    pooling: Literal["sum", "mean"] = Field("sum", description="default bag pooling")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="default weight storage type")
    stochastic_rounding: bool = Field(False, description="fp16/bf16 weights: round updates stochastically (seeded)")
    optimizer: EmbeddingOptimizerConfig = Field(
        default_factory=lambda: EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05),
        description="default optimizer of the embedding rows",
    )
    tables: dict[str, TableOverride] = Field(default_factory=dict, description="overrides by feature/table name")
    tier: Literal["memory", "dram", "ssd"] = Field(
        "memory", description="where rows live: RAM (no cache), or behind a RAM cache in host memory or on disk"
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="the row cache of dram/ssd tables")
    bounds_check: Literal["error", "warn", "off"] = Field(
        "error",
        description="ids outside their table (< 0 or >= rows): stop naming feature, table, id and where; warn: drop "
        "each such id from its bag, counted per feature and logged; off: no check (docs/data.md)",
    )

    @field_validator("bounds_check", mode="before")
    @classmethod
    def _bounds_check_off(cls, v):
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @field_validator("tables")
    @classmethod
    def _table_optimizers(cls, tables: dict[str, TableOverride], info: ValidationInfo) -> dict:
        """A table's optimizer section merged over embedding.optimizer, key by key (validated before it)."""
        base = info.data.get("optimizer")  # absent when it failed validation (that error is reported)
        if base is None:
            return tables
        return {n: o if o.optimizer is None else o.model_copy(update={"optimizer": o.optimizer.over(base)})
                for n, o in tables.items()}  # fmt: skip

    @property
    def ssd_tables(self) -> list[str]:
        """The tables embedding.tables puts on ssd (all of them when embedding.tier is ssd, besides)."""
        return [n for n, o in self.tables.items() if o.tier == "ssd"]

    @property
    def uses_ssd(self) -> bool:
        """Whether any table's files go into cache.directory (the plan's tiers aside)."""
        return self.tier == "ssd" or bool(self.ssd_tables)

    @model_validator(mode="after")
    def _managed_collision_in_memory(self) -> EmbeddingConfig:
        for name, o in self.tables.items():
            if o.managed_collision is not None and (o.tier or self.tier) != "memory":
                which = f"embedding.tables.{name}.tier" if o.tier else "embedding.tier"
                raise ValueError(
                    f"table {name!r} has managed collision, whose rows live in memory, but {which} is "
                    f"{o.tier or self.tier}: set embedding.tables.{name}.tier to memory"
                )
        return self

    @model_validator(mode="after")
    def _cache_directory(self) -> EmbeddingConfig:
        ssd = self.ssd_tables
        if self.uses_ssd and self.cache.directory is None:
            which = "embedding.tier is ssd" if self.tier == "ssd" else f"embedding.tables {ssd} have tier ssd"
            raise ValueError(f"{which}: set embedding.cache.directory to a folder for their files")
        return self


# ---- training ------------------------------------------------------------------------------------
class DenseOptimizerConfig(Strict):
    name: Literal["adam", "adagrad", "sgd"] = Field("adam", description="optimizer of the MLPs")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty")
    eps: float = Field(1e-8, gt=0, description="adam/adagrad epsilon")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd momentum")


class ScheduleConfig(Strict):
    """Learning-rate multiplier over steps, applied to dense and embedding optimizers alike."""

    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0")
    decay: Literal["none", "linear", "cosine"] = Field("none", description="decay after decay_start")
    decay_start: int = Field(0, ge=0, description="step where decay begins")
    min_ratio: float = Field(0.0, ge=0, le=1, description="the multiplier never drops below this")


class TrainConfig(Strict):
    epochs: int = Field(1, gt=0, description="passes over the training data")
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps (None: all epochs)")
    eval_every: int | Literal["auto"] | None = Field(
        "auto",
        description="evaluate every N steps; auto: about 5 times per run (mid-run on about "
        "32k samples unless eval_max_batches is set); None: after each epoch",
    )
    eval_max_batches: int | None = Field(None, gt=0, description="cap on mid-training evaluation batches")
    log_every: int = Field(50, gt=0, description="write a metrics line every N steps")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads, at most 4 per core (None: torch's default)")
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where the model trains: cpu, or cuda (each process on GPU LOCAL_RANK; ranks share GPUs over gloo)",
    )
    progress: bool = Field(True, description="show a tqdm progress bar")
    prefetch: int = Field(4, ge=0, le=1024, description="batches made ahead by a background thread (0: none)")
    pipeline: bool = Field(
        True, description="multi-process: start the next batch's id exchange while this batch computes"
    )
    keep_freed_memory: bool = Field(
        True, description="glibc keeps freed memory for reuse instead of page-faulting it in anew (neorec/utils/host.py)"
    )
    compile: bool = Field(
        False,
        description="compile the dense stages (MLPs, interaction) with torch.compile; the embeddings stay eager "
        "(needs a C++ compiler on CPU; the first steps wait for compilation)",
    )
    kernel_cache: str | None = Field(
        None,
        min_length=1,
        description="a folder that keeps compiled kernels between runs: Triton's (the fused engine's GPU "
        "kernels) and torch.compile's, in its triton/ and inductor/ (null: their own, ~/.triton/cache and "
        "<tmp>/torchinductor_<user>)",
    )
    dense_optimizer: DenseOptimizerConfig = Field(default_factory=DenseOptimizerConfig, description="MLP optimizer")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="learning-rate schedule")

    @field_validator("eval_every", mode="before")
    @classmethod
    def _eval_every(cls, v):
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("expected a number of steps (> 0), 'auto' or null")

    @field_validator("threads")
    @classmethod
    def _threads(cls, v: int | None) -> int | None:
        if v is not None and v > limits.max_threads():
            raise ValueError(f"at most {limits.max_threads()} (4 per core of this machine's {limits.max_threads() // 4})")
        return v


class CheckpointConfig(Strict):
    """Sharded checkpoints during training (neorec/checkpoint); `neorec train --resume` continues."""

    dir: str | None = Field(
        None, description="folder of the step-XXXXXXXX checkpoints (default: <output_dir>/checkpoints)"
    )
    every_steps: int | None = Field(None, gt=0, description="save every N training steps (None: not by steps)")
    every_minutes: float | None = Field(
        None, gt=0, description="save when this many minutes passed since the last save"
    )
    keep: int = Field(3, gt=0, description="keep the newest K checkpoints, delete older ones")

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_minutes is not None


class LoggingConfig(Strict):
    tensorboard: bool | Literal["auto"] = Field(
        "auto",
        description="write TensorBoard events: auto (when tensorboard is installed), true (and warn when "
        "it is not), false",
    )
    plot: bool = Field(True, description="write curves.png at the end")


class RunConfig(Strict):
    name: str = Field("default", min_length=1, description="run name: a plain folder name (no '/'), at most 255 bytes")
    seed: int = Field(0, ge=0, lt=limits.MAX_SEED, description="seed of everything: data, init, shuffling")
    output_dir: str = Field("runs/{name}", description="where logs, plots and the model go ({name} is replaced)")
    data: DataConfig = Field(default_factory=DataConfig, description="data source and batching")
    model: ModelConfig = Field(default_factory=ModelConfig, description="network architecture")
    embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig, description="embedding tables")
    train: TrainConfig = Field(default_factory=TrainConfig, description="training loop")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="logs and plots")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="multi-process training (torchrun): sharding and comms"
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="periodic sharded checkpoints and resume"
    )
    snapshot: SnapshotConfig = Field(
        default_factory=SnapshotConfig, description="exports published for serving during training (docs/continuous.md)"
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if v in (".", "..") or any(c in v for c in "/\\\0") or len(v.encode()) > 255:
            raise ValueError("must be a plain folder name (no '/', '\\', '..'), at most 255 bytes")
        return v

    @model_validator(mode="after")
    def _dlrm_dims(self) -> RunConfig:
        if self.model.interaction in ("dlrm", "deepfm"):
            arch = self.model.arch
            dims = {self.embedding.dim} | {o.dim for o in self.embedding.tables.values() if o.dim is not None}
            if len(dims) > 1:
                other = [f"embedding.tables.{n}.dim {o.dim}" for n, o in self.embedding.tables.items()
                         if o.dim is not None and o.dim != self.embedding.dim]  # fmt: skip
                raise ValueError(
                    f"model.arch {arch} needs one embedding dim for all tables, got {sorted(dims)}: "
                    f"{', '.join(other[:5])} against embedding.dim {self.embedding.dim}"
                )
            if self.model.bottom_mlp[-1] != self.embedding.dim:
                raise ValueError(
                    f"model.bottom_mlp must end in embedding.dim ({self.embedding.dim}) for {arch}'s pairwise "
                    f"interaction, got {self.model.bottom_mlp}"
                )
        if self.model.arch == "din":
            check_din(self.model.din, self.data, self.embedding)
        return self

    @model_validator(mode="after")
    def _sharding_tiers(self) -> RunConfig:
        """A table's tier in distributed.sharding against its storage (embedding.tables, embedding.cache)."""
        storage = {"device": "memory", "host": "memory", "cached": "dram", "ssd": "ssd"}  # plan.STORAGE_TIERS
        e = self.embedding
        for name, entry in self.distributed.sharding.items():
            where = f"distributed.sharding.{name}"
            own = e.tables[name].tier if name in e.tables else None
            if entry.tier is not None and own is not None and storage[entry.tier] != own:
                raise ValueError(
                    f"{where}.tier {entry.tier} is stored as {storage[entry.tier]}, but embedding.tables.{name}.tier "
                    f"is {own}: drop one of them or make them agree"
                )
            if entry.tier == "ssd" and e.cache.directory is None:
                raise ValueError(f"{where}.tier is ssd: set embedding.cache.directory to a folder for its files")
            if entry.cache_fraction is not None and e.cache.size_mib is not None:
                raise ValueError(
                    f"{where}.cache_fraction sizes its cache by a share of its rows, but embedding.cache.size_mib "
                    "shares one size among all cached tables: use embedding.cache.fraction instead of size_mib"
                )
        return self

    @model_validator(mode="after")
    def _pooled_models(self) -> RunConfig:
        sequences = sorted(n for n, o in self.embedding.tables.items() if o.pooling == "none")
        if sequences and self.model.arch in POOLED_ARCHS:
            raise ValueError(
                f"model.arch {self.model.arch} reads pooled embeddings only, but embedding.tables {sequences} "
                "have pooling none; set their pooling to sum or mean"
            )
        return self

    @model_validator(mode="after")
    def _continuous(self) -> RunConfig:
        """A followed stream is one pass: each batch is scored (one probability per sample) before it trains."""
        if self.data.follow is not None:
            if self.train.epochs != 1:
                raise ValueError(f"data.follow trains each partition once: train.epochs must be 1 (it is {self.train.epochs})")
            if not self.checkpoint.enabled:
                raise ValueError(
                    "data.follow continues from its newest checkpoint when started again: set checkpoint.every_steps "
                    "or checkpoint.every_minutes"
                )
            if self.model.arch in ("two_tower", "multitask"):
                raise ValueError(
                    f"data.follow scores one probability per sample (progressive validation); model.arch "
                    f"{self.model.arch} has no such output: use dlrm, dcnv2, deepfm or din"
                )
            f = self.data.follow
            expiry = [k for k in ("expire_after_partitions", "expire_after_steps") if getattr(f, k) is not None]
            if expiry and not any(o.managed_collision is not None for o in self.embedding.tables.values()):
                raise ValueError(
                    f"data.follow.{expiry[0]} frees rows of managed-collision tables, and embedding.tables has none: "
                    "give tables a managed_collision section, or set it to null"
                )
        if self.snapshot.enabled and self.snapshot.format == "pt2" and self.model.arch not in ("dlrm", "dcnv2", "deepfm"):
            raise ValueError(f"snapshot.format pt2 serves dlrm, dcnv2 and deepfm, not {self.model.arch}: use nrx")
        return self

    @property
    def resolved_output_dir(self) -> str:
        return self.output_dir.replace("{name}", self.name)
