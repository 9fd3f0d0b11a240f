"""The fused table-batched embedding collection (single process; the sharded collection uses it too).

All tables live in a few flat buffers (see layout.py), behind storage objects (storage.py). Forward
pools every feature with one `embedding_bag` per group (lookup.py; with the Triton kernels,
triton_kernels.py, one launch for all groups), and gathers one row per id of each sequence feature
(tables with pooling none; `embed` returns them as JaggedRows); backward turns d(pooled) and
d(rows) into one gradient per unique row and applies the update rule (optimizers.py) to those rows
and their state in place. No gradient of a table is ever stored, so `build_optimizer()` returns an
object that only carries learning rates and counts steps (param_groups.py).

Precision: weights are stored as TableConfig.dtype; lookups and updates run in fp32 and updated rows
are rounded back to the storage dtype, to nearest or stochastically (rounding.py). Optimizer state
is always fp32.

Speed on CPU: the work after the lookup runs in blocks of `chunk_elements` (rows x dim, default
2^19: 2 MiB fp32 temporaries) so temporaries stay in cache; results do not depend on the block
size. On a plain fp32 table a rule that does not read the weights (no weight decay) adds its deltas
in place (index_add_, one pass over the touched rows); plain SGD there skips the blocks too: one
scatter_add_ of the rows' sums (see folded_lr). With several
intra-op threads on a machine whose cores are shared with other busy processes, prefer
OMP_WAIT_POLICY=PASSIVE (or one thread): spinning OpenMP barriers then dominate every op.

Checkpoints: `state_dict()` holds, per table, `tables.<name>.weight` (in the storage dtype, so a
round trip is exact), one fp32 tensor per state entry (`momentum1`: adagrad sum [rows, dim] /
rowwise adagrad sum [rows] / adam first moment; `momentum2`: adam second moment) and
`tables.<name>.step` (updates applied so far). Keys do not depend on the layout, so a checkpoint
loads into another grouping, another engine or another sharding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused import triton_kernels
from neorec.embedding.fused.bags import GroupBatch, prepare_group, prepare_sequence_group
from neorec.embedding.fused.layout import TableGroup, build_layout
from neorec.embedding.fused.lookup import FusedLookup
from neorec.embedding.fused.optimizers import RULES, Hparams, folded_sgd, initial_state_value
from neorec.embedding.fused.param_groups import FusedEmbeddingOptimizer
from neorec.embedding.fused.rounding import to_storage, uniform_noise
from neorec.embedding.fused.storage import (
    GroupStorageFactory,
    RowInit,
    RowStorage,
    StorageFactory,
    StorageSpec,
    TensorStorage,
    build_tensor_storage,
)
from neorec.embedding.id_map import IdMap, MapShard
from neorec.embedding.init import init_rows, init_rows_at, table_seed
from neorec.embedding.remap import MappedTable, map_stats, remap_batch
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig, check_tables
from neorec.errors import ConfigError, DataError
from neorec.sparse import JaggedRows, SparseBatch
from neorec.utils.progress import progress_bar

# grad_hook(group, rows, gradients) -> (rows, gradients) to apply, or a function that waits for them
Summed = tuple[torch.Tensor, torch.Tensor]
GradHook = Callable[[int, torch.Tensor, torch.Tensor], Summed | Callable[[], Summed]]


@dataclass
class _GroupConstants:
    """Small per-group tensors on the engine's device (moved with the module)."""

    row_offsets: torch.Tensor  # [F_g] first global row of each feature's table
    mean: torch.Tensor | None  # [F_g] mean pooling per feature; None when all sum
    row_starts: torch.Tensor  # [T_g] first global row of each table
    table_seeds: torch.Tensor  # [T_g] seed of each table, for stochastic rounding


def _counted(init: RowInit, bar) -> RowInit:
    """`init` that advances the progress bar `bar` (None: no bar) by the rows it makes."""
    if bar is None:
        return init

    def counted(start: int, end: int) -> torch.Tensor:
        rows = init(start, end)
        bar.update(end - start)
        return rows

    return counted


class FusedEmbeddingCollection(EmbeddingCollection):
    """Table-batched embedding lookups with the optimizer fused into backward."""

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: EmbeddingOptimizerConfig,
        seed: int = 0,
        device: torch.device | str | None = None,
        stochastic_rounding: bool = False,
        storage_factory: StorageFactory | None = None,
        row_init: Callable[[int, int, int], torch.Tensor] | None = None,
        group_storage_factory: GroupStorageFactory | None = None,
        table_tiers: dict[str, str] | None = None,
        kernels: str = "auto",
        progress: bool = False,
        map_shards: dict[str, MapShard] | None = None,
        bounds_check: str = "error",
    ) -> None:
        """storage_factory builds each row storage (default: a plain tensor on `device`);
        group_storage_factory, when given, builds all storages of a group at once instead (caches).
        table_tiers: storage tier by table name ("memory", "dram", "ssd"; see neorec/embedding/cache):
        tables of different tiers go to different groups, so that each group has one storage.

        row_init(table index, start, end) gives fp32 initial rows [start, end) of a table (default
        init_rows); the sharded collection passes the rows of the unsharded table its shard covers.

        kernels: "torch" (torch ops, any device), "triton" (Triton kernels for the lookup and the fused
        update, triton_kernels.py; needs a GPU or TRITON_INTERPRET=1), or "auto" (Triton on CUDA when
        it is importable, else torch). Groups the kernels do not cover (caches, a gradient hook, dims
        above triton_kernels.MAX_UPDATE_DIM for the update) take the torch path either way.

        progress: a bar of the rows filled while the storages are built (shown when that takes more
        than a second and stderr is a terminal; neorec/utils/progress.py).

        map_shards: for managed-collision tables that are shards of a larger table (the sharded
        collection), which buckets and global rows each holds; default: the whole table.

        bounds_check: what an id outside its table does (neorec/sparse/bounds.py): "error", "warn"
        (dropped from its bag and counted) or "off" (the sharded collection's engines, whose ids were
        checked before the exchange).
        """
        super().__init__(tables, optimizer, bounds_check)
        check_tables(self.tables)
        self.seed = seed
        self.stochastic_rounding = stochastic_rounding
        self.layout = build_layout(self.tables, optimizer, table_tiers)
        self.num_updates = 0
        # Called with (group, unique rows, their summed gradients, times -lr where folded_lr says
        # so) before each update; returns the rows and gradients to apply, or a function that waits
        # for them (an exchange in flight), in which case the update is applied at the end of the
        # backward pass (autograd's queue_callback) and the exchange travels during the rest of it.
        # The sharded collection sums a replicated table's gradients over ranks here. It is called
        # once per group and backward with all the group's rows, even with none; its result is
        # applied in blocks.
        self.grad_hook: GradHook | None = None
        # With a grad_hook: called with (group, the rows just updated) after each group's update.
        self.update_hook: Callable[[int, torch.Tensor], None] | None = None
        # With a grad_hook: the number of unique rows of group gi in the batch being trained, when
        # known ahead (else None). Nothing is then read back to sum its gradients, and the hook may
        # return rows that repeat: copies of one row with the same gradient, updated alike.
        self.counted_ahead: Callable[[int], int | None] | None = None
        self._row_init = row_init
        # seconds spent in lookups ("lookup") and fused backward+updates ("update"), when a dict is set
        self.timings: dict[str, float] | None = None
        # elements (rows x dim) per block of the update and of fp16/bf16 lookups on CPU; None = one block
        self.chunk_elements: int | None = 1 << 19
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.kernels = kernels
        self._configs = [t.optimizer or optimizer for t in self.tables]
        self._optimizer: FusedEmbeddingOptimizer | None = None
        self._feature_cache: dict[tuple, list[tuple[torch.Tensor, list[int]]]] = {}
        device = torch.device(device) if device is not None else torch.device("cpu")
        factory = storage_factory or build_tensor_storage

        self.weights: list[RowStorage] = []
        self.states: list[dict[str, RowStorage]] = []
        self._constants: list[_GroupConstants] = []
        num_rows = sum(g.num_rows for g in self.layout.groups)
        bar = progress_bar(num_rows, "initialising tables", progress, unit="row", delay=1.0, unit_scale=True)
        for g in self.layout.groups:
            specs = {"weight": StorageSpec(g.num_rows, g.dim, g.dtype, _counted(self._weight_init(g), bar))}
            for name, per_element in RULES[g.optimizer].state.items():
                width = g.dim if per_element else 0
                specs[name] = StorageSpec(g.num_rows, width, torch.float32, self._state_init(g, per_element))
            if group_storage_factory is not None:
                members = [
                    (self.tables[ti].name, start, self.tables[ti].rows)
                    for ti, start in zip(g.tables, g.row_starts, strict=True)
                ]
                built = dict(group_storage_factory(members, specs, device))
            else:
                built = {n: factory(s.num_rows, s.width, s.dtype, device, s.init) for n, s in specs.items()}
            self.weights.append(built.pop("weight"))
            self.states.append({name: built[name] for name in RULES[g.optimizer].state})
            self._constants.append(
                _GroupConstants(
                    row_offsets=torch.tensor(g.feature_row_offsets, dtype=torch.int64, device=device),
                    mean=torch.tensor(g.feature_mean, device=device) if any(g.feature_mean) else None,
                    row_starts=torch.tensor(g.row_starts, dtype=torch.int64, device=device),
                    table_seeds=torch.tensor(
                        [table_seed(self.tables[t], seed) for t in g.tables], dtype=torch.int64, device=device
                    ),
                )
            )

        if bar is not None:  # a cache that fills rows later no longer counts them (tqdm: closed = disabled)
            bar.close()
        self._cached = any(hasattr(w, "prefetch") for w in self.weights)
        self.mapped = self._build_maps(map_shards or {}, table_tiers or {}, device)
        # prefetched batches not yet looked up: (as given, as checked, their prepared rows), which the
        # forward of the batch as given reuses
        self._prefetched: deque[tuple[SparseBatch, SparseBatch, list[GroupBatch]]] = deque(maxlen=8)

    # ---- managed-collision tables ------------------------------------------------------------------
    def _build_maps(
        self, shards: dict[str, MapShard], tiers: dict[str, str], device: torch.device
    ) -> list[MappedTable]:
        """An IdMap per managed-collision table; its evicted rows go back to their initial values."""
        out = []
        for ti, t in enumerate(self.tables):
            mc = t.managed_collision
            if mc is None:
                continue
            if tiers.get(t.name, "memory") != "memory" or self._cached:
                raise ConfigError(
                    f"table {t.name!r}: managed-collision tables keep their rows in memory and share no engine "
                    "with cached tables (tier dram/ssd); set the tiers to memory"
                )
            shard = shards.get(t.name) or MapShard(0, mc.buckets, mc.buckets, t, 0, mc.eviction)
            id_map = IdMap(t.rows, mc.eviction, shard, device)
            reset = self._row_reset(ti, shard)
            out.append(MappedTable(t.name, id_map, list(t.features), reset, mean=t.pooling == "mean"))
        return out

    def _row_reset(self, ti: int, shard: MapShard) -> Callable[[torch.Tensor], None]:
        """reset(rows): rows of table ti back to their initial weights and optimizer state."""
        gi, start, _ = self._table_range(self.tables[ti].name)
        g = self.layout.groups[gi]
        value = initial_state_value(g.optimizer, self._configs[ti].initial_accumulator)

        def reset(rows: torch.Tensor) -> None:
            rows = torch.sort(rows).values
            weights = init_rows_at(shard.table, self.seed, rows + shard.row_offset)
            where = rows + start
            self.weights[gi].write(where, to_storage(weights, g.dtype, None))
            for s in self.states[gi].values():
                width = (rows.numel(), s.width) if s.width else (rows.numel(),)
                s.write(where, torch.full(width, value, dtype=s.dtype, device=rows.device))

        return reset

    def id_map_stats(self) -> dict[str, dict[str, float]]:
        """Per managed-collision table (cumulative): hits, misses, inserts, evictions, dropped ids,
        occupied rows and capacity (see neorec/embedding/id_map.py)."""
        return map_stats(self.mapped)

    # ---- initial values -----------------------------------------------------------------------
    def _weight_init(self, g: TableGroup) -> RowInit:
        """Rows [start, end) of a group from init_rows, so every engine starts from the same values."""
        if self._row_init is not None:
            return self._per_table_init(g, self._row_init)
        return self._per_table_init(g, lambda ti, a, b: init_rows(self.tables[ti], self.seed, a, b))

    def _state_init(self, g: TableGroup, per_element: bool) -> RowInit:
        def fill(ti: int, a: int, b: int) -> torch.Tensor:
            value = initial_state_value(g.optimizer, self._configs[ti].initial_accumulator)
            return torch.full((b - a, g.dim) if per_element else (b - a,), value)

        return self._per_table_init(g, fill)

    def _per_table_init(self, g: TableGroup, rows_of: Callable[[int, int, int], torch.Tensor]) -> RowInit:
        """init(start, end) over global rows, split at table boundaries: rows_of(table index, a, b)."""

        def init(start: int, end: int) -> torch.Tensor:
            parts = []
            for slot, ti in enumerate(g.tables):
                first = g.row_starts[slot]
                a, b = max(start, first), min(end, first + self.tables[ti].rows)
                if a < b:
                    parts.append(rows_of(ti, a - first, b - first))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return init

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        """[B, output_dim] fp32 pooled vectors in feature_names order; trains the rows on backward."""
        return self.embed(sparse)[0]

    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """The pooled vectors and, per sequence feature, its fp32 rows (times the ids' weights) from
        one fused lookup; backward trains the rows of both."""
        if not self.layout.groups or sparse.batch_size == 0:  # e.g. a rank that holds no shard
            return self._empty(sparse)
        batches = None
        for i, (ahead, checked, prepared) in enumerate(self._prefetched):
            if ahead is sparse:  # its prefetch checked and prepared it, and counted its rows for the hit rate
                sparse, batches = checked, prepared
                del self._prefetched[i]
                break
        else:
            sparse = self.bounds.check(sparse)
        if self.mapped:  # raw ids -> rows; a training batch's step is the update it will make
            sparse = remap_batch(sparse, self.mapped, self.num_updates + 1, self.training)
        if self._cached:  # bring the whole batch in at once (one eviction round), then read it
            counted = batches is not None
            batches = batches or self._prepare(sparse)
            for storage, gb in zip(self.weights, batches, strict=True):
                if hasattr(storage, "prefetch"):
                    storage.prefetch(gb.rows, lookup=not counted)
        else:
            batches = self._prepare(sparse)
        anchor = torch.empty(0, device=sparse.values.device, requires_grad=True)
        pooled, *rows = FusedLookup.apply(anchor, self, batches, sparse.batch_size)
        if not self.sequence_names:
            return pooled, {}
        return pooled, self._sequences(sparse, batches, rows)

    def _sequences(
        self, sparse: SparseBatch, batches: list[GroupBatch], rows: list[torch.Tensor]
    ) -> dict[str, JaggedRows]:
        """Each sequence feature's rows (views of its group's output) with its lengths."""
        b = sparse.batch_size
        out = {}
        groups = [(g, gb) for g, gb in zip(self.layout.groups, batches, strict=True) if g.sequence]
        for (g, gb), group_rows in zip(groups, rows, strict=True):
            assert gb.sequence_counts is not None
            for f, values in zip(g.features, group_rows.split(gb.sequence_counts), strict=True):
                i = sparse.keys.index(f)
                out[f] = JaggedRows(values, sparse.lengths[i * b : (i + 1) * b])
        return {f: out[f] for f in self.sequence_names}

    def _empty(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """Outputs of a batch without samples, or of an engine without tables."""
        device, b = sparse.values.device, sparse.batch_size
        sequences = {}
        for f, d in zip(self.sequence_names, self.sequence_dims, strict=True):
            lengths = sparse.feature(f)[1] if f in sparse.keys else sparse.lengths.new_zeros(b)
            sequences[f] = JaggedRows(torch.zeros(0, d, device=device), lengths)
        return torch.zeros(b, self.output_dim, device=device), sequences

    def prefetch(self, sparse: SparseBatch) -> None:
        """Bring the rows a coming batch will look up into the cached storages, before its step
        (the training pipeline calls this for batch i+1 before batch i runs). No-op without caches."""
        if sparse.batch_size == 0 or not self._cached:
            return
        checked = self.bounds.check(sparse)
        batches = self._prepare(checked)
        self._prefetched.append((sparse, checked, batches))
        for storage, gb in zip(self.weights, batches, strict=True):
            if hasattr(storage, "prefetch"):  # ahead: a cache may only start reading them now
                storage.prefetch(gb.rows, lookup=True, ahead=True)

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """Per cached table: hit rate, rows and bytes moved from/to its backing tier, evictions."""
        out: dict[str, dict[str, float]] = {}
        for storage in self.weights:
            if hasattr(storage, "stats_by_table"):
                out.update(storage.stats_by_table())
        return out

    def prepare(self, sparse: SparseBatch) -> list[GroupBatch]:
        """Each group's ids of `sparse`, as its lookup takes them (ids of managed-collision tables
        not yet mapped to rows)."""
        return self._prepare(sparse)

    def _prepare(self, sparse: SparseBatch) -> list[GroupBatch]:
        out = []
        groups = zip(self.layout.groups, self._constants, self._group_features(sparse), strict=True)
        for g, c, (features, indices) in groups:
            if g.sequence:
                out.append(prepare_sequence_group(sparse, indices, g.feature_row_offsets))
                continue
            if len(indices) == sparse.num_features:  # the group has every feature of the batch
                num_ids = sparse.values.numel()
            else:  # one host sync per batch (cached on the batch), only with several groups
                per_key = sparse.length_per_key()
                num_ids = sum(per_key[i] for i in indices)
            out.append(prepare_group(sparse, features, c.row_offsets, c.mean, num_ids))
        return out

    def _group_features(self, sparse: SparseBatch) -> list[tuple[torch.Tensor, list[int]]]:
        """Per group, the positions of its features in the batch's keys (cached per key order)."""
        key = (tuple(sparse.keys), sparse.values.device)
        cached = self._feature_cache.get(key)
        if cached is None:
            position = {k: i for i, k in enumerate(sparse.keys)}
            looked_up = self.feature_names + self.sequence_names
            missing = [f for f in looked_up if f not in position]
            if missing:
                raise DataError(
                    f"the batch has no feature(s) {missing}; it has {sparse.keys} and the embedding tables "
                    f"look up {looked_up}"
                )
            cached = []
            for g in self.layout.groups:
                indices = [position[f] for f in g.features]
                cached.append(
                    (torch.tensor(indices, dtype=torch.int64, device=sparse.values.device), indices)
                )
            self._feature_cache[key] = cached
        return cached

    # ---- the fused update (called from FusedLookup.backward) -------------------------------------
    def apply_update(
        self,
        gi: int,
        rows: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        hparams: dict[str, float | torch.Tensor],
        lr_folded: bool = False,
        unique: bool = True,
    ) -> None:
        """Update unique global rows `rows` of group gi with their summed gradients `grads`.

        hparams comes from group_hparams, resolved once per backward rather than once per chunk.
        lr_folded: the sums already carry SGD's -lr (see folded_lr); the step only adds them.
        unique=False: rows may repeat, as copies of one row with the same gradient; every copy is
        then read, updated and written alike (never added in place), which leaves the row as once.
        """
        g = self.layout.groups[gi]
        storage, state_storage = self.weights[gi], self.states[gi]
        if lr_folded and unique and self.adds_in_place(gi):  # w += g in one pass (rows are unique: no order)
            storage.tensor.index_add_(0, rows, grads)
            return
        table = None  # which table of the group each row belongs to, when needed
        per_row: dict[str, float | torch.Tensor] = {}
        for name, value in hparams.items():
            if isinstance(value, torch.Tensor):
                table = self._table_of(gi, rows) if table is None else table
                value = value.index_select(0, table).unsqueeze(1)
            per_row[name] = value
        hp = Hparams(**per_row)
        state = {name: s.read(rows) for name, s in state_storage.items()}
        wd = hp.weight_decay
        if unique and self.adds_in_place(gi) and rows.device.type == "cpu" and isinstance(wd, float) and wd == 0.0:
            # the step does not read the weights: add its deltas in place, one pass over the rows
            # (on CPU index_add_ adds row by row; rows are unique, so no order is involved)
            delta, state = RULES[g.optimizer].delta(grads, state, step, hp)
            storage.tensor.index_add_(0, rows, delta)
            for name, s in state_storage.items():
                s.write(rows, state[name])
            return
        weights = storage.read(rows).to(torch.float32)
        rule = folded_sgd if lr_folded else RULES[g.optimizer].update
        weights, state = rule(weights, grads, state, step, hp)
        noise = None
        if self.stochastic_rounding and g.dtype != torch.float32:
            c = self._constants[gi]
            table = self._table_of(gi, rows) if table is None else table
            noise = uniform_noise(c.table_seeds[table], rows - c.row_starts[table], step, g.dim)
        storage.write(rows, to_storage(weights, g.dtype, noise))
        for name, s in state_storage.items():
            s.write(rows, state[name])

    def group_hparams(self, gi: int, device: torch.device) -> dict[str, float | torch.Tensor]:
        """Current hyper-parameters of group gi: a float where its tables agree (the usual case), else
        a [T_g] tensor with one value per table. Learning rates come from the trainer's optimizer."""
        tables = self.layout.groups[gi].tables
        lrs = self._optimizer.lrs() if self._optimizer is not None else [c.lr for c in self._configs]
        out: dict[str, float | torch.Tensor] = {}
        for f in fields(Hparams):
            values = [float(lrs[t] if f.name == "lr" else getattr(self._configs[t], f.name)) for t in tables]
            if all(v == values[0] for v in values):
                out[f.name] = values[0]
            else:
                out[f.name] = torch.tensor(values, dtype=torch.float32, device=device)
        return out

    def folded_lr(
        self, gi: int, hparams: dict[str, float | torch.Tensor], device: torch.device
    ) -> float | None:
        """-lr when group gi's step is plain SGD (one learning rate, no weight decay) on CPU, else None.

        Then every path multiplies each id's gradient term by -lr while summing (free: the sums
        take per-id weights anyway) and adds the sums to the rows, so that plain fp32 tables can
        take the in-place path (row_gradients.add_row_gradients) and a cache or any other storage in
        front of the same rows stays bitwise equal to it. A gradient hook (the sharded
        collection's replica sum) then sums the -lr-weighted sums over ranks.
        """
        lr, wd = hparams["lr"], hparams["weight_decay"]
        if self.layout.groups[gi].optimizer != "sgd" or device.type != "cpu":
            return None
        if not isinstance(lr, float) or not isinstance(wd, float) or wd != 0.0:
            return None
        return -lr

    def adds_in_place(self, gi: int) -> bool:
        """Group gi's weights are one plain fp32 tensor (no cache, no rounding), which an SGD step
        with a folded learning rate can add to directly."""
        storage = self.weights[gi]
        return isinstance(storage, TensorStorage) and storage.dtype == torch.float32

    def _table_of(self, gi: int, rows: torch.Tensor) -> torch.Tensor:
        """Position in the group of the table that holds each global row."""
        return torch.searchsorted(self._constants[gi].row_starts, rows, right=True) - 1

    def _triton(self, device: torch.device) -> bool:
        if self.kernels == "torch":
            return False
        if self.kernels == "auto":
            return device.type == "cuda" and triton_kernels.usable(device)
        if not triton_kernels.usable(device):
            raise RuntimeError(
                f"kernels='triton' but Triton cannot run on {device}: it needs a CUDA device and the "
                "triton package (or TRITON_INTERPRET=1 to interpret the kernels on the CPU)"
            )
        return True

    def triton_lookup(self, gi: int, device: torch.device) -> bool:
        """Whether group gi is pooled by the Triton kernel (plain storage; one launch for all such)."""
        return isinstance(self.weights[gi], TensorStorage) and self._triton(device)

    def triton_update(self, gi: int, device: torch.device) -> bool:
        """Whether group gi's backward runs in the fused Triton update kernel: plain storage, a rule the
        kernel has, rows it can hold, no gradient hook (whose exchange needs the sums by themselves)."""
        g = self.layout.groups[gi]
        return (
            g.optimizer in triton_kernels.RULE_IDS
            and g.dim <= triton_kernels.MAX_UPDATE_DIM
            and self.grad_hook is None
            and isinstance(self.weights[gi], TensorStorage)
            and all(isinstance(s, TensorStorage) for s in self.states[gi].values())
            and self._triton(device)
        )

    def cached_kernels(self, gi: int, device: torch.device, update: bool = False) -> bool:
        """Whether group gi is held in a row cache and goes through the Triton kernels (update: its
        backward too: a rule the kernel has, rows it can hold, no gradient hook). The kernels then
        read and update the cache's records in place at the rows' slots, or, for a batch whose rows
        do not all have one, copies of its rows read and written through the cache (lookup.py)."""
        storage = self.weights[gi]
        if not hasattr(storage, "resident_slots") or storage.cache.device != device:
            return False
        if not self._triton(device):
            return False
        if not update:
            return True
        g = self.layout.groups[gi]
        return (
            g.optimizer in triton_kernels.RULE_IDS
            and g.dim <= triton_kernels.MAX_UPDATE_DIM
            and self.grad_hook is None
            and all(getattr(s, "cache", None) is storage.cache for s in self.states[gi].values())
        )

    def triton_update_args(self, gi: int) -> dict[str, torch.Tensor | None]:
        """What triton_kernels.fused_update needs of group gi beyond the batch: its buffers' tensors
        (a row cache's views of its records), each table's first row and, with stochastic rounding of
        fp16/bf16 rows, each table's seed."""
        c = self._constants[gi]
        rounds = self.stochastic_rounding and self.layout.groups[gi].dtype != torch.float32
        field = "view" if hasattr(self.weights[gi], "cache") else "tensor"  # a cache's records, in place
        return {
            "weight": getattr(self.weights[gi], field),
            "state": {name: getattr(s, field) for name, s in self.states[gi].items()},
            "row_starts": c.row_starts,
            "table_seeds": c.table_seeds if rounds else None,
        }

    def chunk_rows(self, gi: int, device: torch.device) -> int | None:
        """Rows per block of work on CPU, so temporaries stay cache-sized (see row_gradients.py);
        None (one block, no host syncs) on GPU."""
        if device.type == "cuda" or self.chunk_elements is None:
            return None
        return max(1, self.chunk_elements // self.layout.groups[gi].dim)

    def build_optimizer(self) -> FusedEmbeddingOptimizer:
        """The object the trainer schedules and steps; the engine reads its learning rates."""
        self._optimizer = FusedEmbeddingOptimizer(
            [t.name for t in self.tables], [c.lr for c in self._configs]
        )
        return self._optimizer

    # ---- reading and checkpointing --------------------------------------------------------------
    def _table_range(self, name: str) -> tuple[int, int, int]:
        gi, slot = self.layout.table_slot[name]
        start = self.layout.groups[gi].row_starts[slot]
        return gi, start, start + self.tables[self.layout.groups[gi].tables[slot]].rows

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's rows in the storage dtype (views of the buffers when storage is plain)."""
        out = {}
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            out[t.name] = _read_range(self.weights[gi], start, end, copy=False)
        return out

    def range_sources(self, prefix: str = "") -> dict[str, tuple[RowStorage, int, int]]:
        """state_dict keys whose rows a storage reads in ranges rather than holding them (cached
        tables): key -> (storage, start, end). Writers of large states read these in windows
        (neorec/checkpoint/stream.py) instead of through the state_dict's views."""
        out: dict[str, tuple[RowStorage, int, int]] = {}
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            for name, s in [("weight", self.weights[gi]), *self.states[gi].items()]:
                if not isinstance(s, TensorStorage) and hasattr(s, "read_range"):
                    out[f"{prefix}tables.{t.name}.{name}"] = (s, start, end)
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            key = f"{prefix}tables.{t.name}."
            destination[key + "weight"] = _read_range(self.weights[gi], start, end, copy=True)
            for name, s in self.states[gi].items():
                destination[key + name] = _read_range(s, start, end, copy=True)
            destination[key + "step"] = torch.tensor(self.num_updates, dtype=torch.int64)
        for m in self.mapped:
            for name, storage in m.id_map.storages().items():
                destination[f"{prefix}tables.{m.name}.{name}"] = storage.tensor.clone()

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        expected: set[str] = set()
        steps = []
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            key = f"{prefix}tables.{t.name}."
            for name, storage in [("weight", self.weights[gi]), *self.states[gi].items()]:
                expected.add(key + name)
                if key + name not in state_dict:
                    missing_keys.append(key + name)
                    continue
                value = state_dict[key + name]
                shape = (end - start, storage.width) if storage.width else (end - start,)
                if tuple(value.shape) != shape:
                    error_msgs.append(
                        f"{key + name}: shape {tuple(value.shape)} in the checkpoint, table needs {shape}"
                    )
                    continue
                _write_range(storage, start, end, value)
            expected.add(key + "step")
            if key + "step" in state_dict:
                steps.append(int(state_dict[key + "step"]))
        for m in self.mapped:
            for name, storage in m.id_map.storages().items():
                key = f"{prefix}tables.{m.name}.{name}"
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                elif tuple(state_dict[key].shape) != tuple(storage.tensor.shape):
                    error_msgs.append(f"{key}: shape {tuple(state_dict[key].shape)}, the map needs {tuple(storage.tensor.shape)}")
                else:
                    storage.tensor.copy_(state_dict[key])
        if steps:
            self.num_updates = max(steps)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> FusedEmbeddingCollection:
        """Move buffers with the module (.to, .cuda), keeping each one's dtype: storage precision is
        a per-table setting, not something model.half() should change."""
        super()._apply(fn, recurse)

        def keep(t: torch.Tensor) -> torch.Tensor:
            new = fn(t)
            return new if new.dtype == t.dtype else new.to(t.dtype)

        for storage in [*self.weights, *(s for st in self.states for s in st.values())]:
            if isinstance(storage, TensorStorage):
                storage.tensor = keep(storage.tensor)
        for m in self.mapped:
            m.id_map.to(keep(m.id_map.keys.tensor).device)
        for c in self._constants:
            for f in fields(c):
                value = getattr(c, f.name)
                if value is not None:
                    setattr(c, f.name, keep(value))
        self._feature_cache.clear()
        return self


def _read_range(storage: RowStorage, start: int, end: int, copy: bool) -> torch.Tensor:
    """Rows [start, end); plain storage slices (a copy only when asked and the slice is partial:
    torch.save would otherwise write the whole buffer behind a view)."""
    if isinstance(storage, TensorStorage):
        rows = storage.tensor[start:end]
        return rows.clone() if copy and end - start != storage.num_rows else rows
    if hasattr(storage, "view_range"):  # a cached table: a view of its file where it has one
        return storage.view_range(start, end)
    if hasattr(storage, "read_range"):
        return storage.read_range(start, end)
    return storage.read(torch.arange(start, end))


def _write_range(storage: RowStorage, start: int, end: int, value: torch.Tensor) -> None:
    if isinstance(storage, TensorStorage):
        storage.tensor[start:end].copy_(value)
    elif hasattr(storage, "write_range"):
        storage.write_range(start, end, value.to(storage.dtype))
    else:
        storage.write(torch.arange(start, end), value.to(storage.dtype))
