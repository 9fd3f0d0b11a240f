"""The fused table-batched embedding collection (single process; the sharded collection uses it too).

All tables live in a few flat buffers (see layout.py), behind storage objects (storage.py). Forward
pools every feature with one `embedding_bag` per group (lookup.py; with the Triton kernels,
triton_pool.py, one launch for all groups), and gathers one row per id of each sequence feature
(tables with pooling none; `embed` returns them as JaggedRows); backward turns d(pooled) and
d(rows) into one gradient per unique row and applies the update rule (optimizers.py) to those rows
and their state in place. No gradient of a table is ever stored, so `build_optimizer()` returns an
object that only carries learning rates and counts steps (param_groups.py).

Precision: weights are stored as TableConfig.dtype; lookups and updates run in fp32 and updated rows
are rounded back to the storage dtype, to nearest or stochastically (rounding.py). Optimizer state
is always fp32.

FusedEmbeddingCollection is put together from one base class per job:

- this file: building the groups' storages and their initial values, managed-collision maps, and
  moving the buffers with the module (.to, .cuda);
- collection_forward.py: the forward pass (a batch's ids to pooled vectors and sequence rows) and
  prefetching a coming batch's rows into cached storages;
- collection_update.py: the optimizer step fused into backward (the update of a group's rows, its
  hyper-parameters, CPU block sizes);
- collection_kernels.py: which groups the Triton kernels take, and what they need of a group;
- collection_checkpoint.py: state_dict, loading it, and reading tables' rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused.bags import GroupBatch
from neorec.embedding.fused.collection_checkpoint import CollectionCheckpoint
from neorec.embedding.fused.collection_forward import CollectionForward
from neorec.embedding.fused.collection_kernels import CollectionKernels
from neorec.embedding.fused.collection_update import CollectionUpdate
from neorec.embedding.fused.layout import TableGroup, build_layout
from neorec.embedding.fused.optimizers import RULES, initial_state_value
from neorec.embedding.fused.param_groups import FusedEmbeddingOptimizer
from neorec.embedding.fused.rounding import to_storage
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
from neorec.embedding.remap import MappedTable, map_stats
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig, check_tables
from neorec.errors import ConfigError
from neorec.sparse import SparseBatch
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


class FusedEmbeddingCollection(
    CollectionForward, CollectionUpdate, CollectionKernels, CollectionCheckpoint, EmbeddingCollection
):
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
        table_cache_fractions: dict[str, float] | None = None,
    ) -> None:
        """storage_factory builds each row storage (default: a plain tensor on `device`);
        group_storage_factory, when given, builds all storages of a group at once instead (caches).
        table_tiers: storage tier by table name ("memory", "dram", "ssd"; see neorec/embedding/cache):
        tables of different tiers go to different groups, so that each group has one storage.
        table_cache_fractions: cached tables whose cache holds a share of rows of their own
        (CacheSettings.fractions): tables of different fractions go to different groups too.

        row_init(table index, start, end) gives fp32 initial rows [start, end) of a table (default
        init_rows); the sharded collection passes the rows of the unsharded table its shard covers.

        kernels: "torch" (torch ops, any device), "triton" (Triton kernels for the lookup and the fused
        update, triton_pool.py and triton_fused_update.py; needs a GPU or TRITON_INTERPRET=1), or
        "auto" (Triton on CUDA when it is importable, else torch). Groups the kernels do not cover
        (caches, a gradient hook, dims above triton_fused_update.MAX_UPDATE_DIM for the update) take
        the torch path either way; collection_kernels.py makes that choice per group.

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
        self.layout = build_layout(self.tables, optimizer, table_tiers, table_cache_fractions)
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
        self.weights: list[RowStorage] = []
        self.states: list[dict[str, RowStorage]] = []
        self._constants: list[_GroupConstants] = []
        self._build_storages(device, storage_factory or build_tensor_storage, group_storage_factory, progress)
        self._cached_groups = [hasattr(w, "prefetch") for w in self.weights]  # a cache over DRAM or SSD
        self._cached = any(self._cached_groups)
        self.mapped = self._build_maps(map_shards or {}, table_tiers or {}, device)
        # prefetched batches not yet looked up: (as given, as checked, their prepared rows), which the
        # forward of the batch as given reuses
        # batches prefetched: (the batch, its stamp then, as its id check left it, its groups' ids)
        self._prefetched: deque[tuple[SparseBatch, tuple, SparseBatch, list[GroupBatch]]] = deque(maxlen=8)

    def _build_storages(
        self,
        device: torch.device,
        factory: StorageFactory,
        group_storage_factory: GroupStorageFactory | None,
        progress: bool,
    ) -> None:
        """Each group's weight and optimizer-state storages, filled with their initial values, and its
        constants (feature row offsets, mean pooling, table row starts and seeds)."""
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
                        [table_seed(self.tables[t], self.seed) for t in g.tables],
                        dtype=torch.int64,
                        device=device,
                    ),
                )
            )
        if bar is not None:  # a cache that fills rows later no longer counts them (tqdm: closed = disabled)
            bar.close()

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
            if tiers.get(t.name, "memory") != "memory":
                table = t.name.split("#")[0]  # a shard's table ("C1#1": shard 1 of C1) is named by its own
                raise ConfigError(
                    f"table {table!r}: managed-collision tables keep their rows in memory (its tier is "
                    f"{tiers[t.name]}); set embedding.tables.{table}.tier to memory"
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

    # ---- where each table's rows are --------------------------------------------------------------
    def _table_range(self, name: str) -> tuple[int, int, int]:
        gi, slot = self.layout.table_slot[name]
        start = self.layout.groups[gi].row_starts[slot]
        return gi, start, start + self.tables[self.layout.groups[gi].tables[slot]].rows

    # ---- moving with the module ------------------------------------------------------------------
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
