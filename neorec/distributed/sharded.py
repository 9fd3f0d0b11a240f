"""The sharded embedding collection: the model cannot tell it from the single-process engine.

Per batch (each rank holds B samples of the global batch of W * B):
    input_dist(sparse)            ids to the ranks that hold their rows       (input_dist.py)
    lookup(local batch)           this rank's shards, one fused engine call   (fused engine)
    output_dist(local pooled)     pooled rows back to the samples' ranks      (output_dist.py)
                                  (and sequence features' rows, one per id:   sequence_dist.py)
and in backward the reverse exchange, then the fused update of the owned rows. Replicated (dp)
tables are looked up locally; inside the fused backward their row gradients are summed over ranks
and the copies kept equal (replicas.py: every rank applies the same SGD step, or each row's owner
rank updates it and its optimizer state and sends the new row to the others).

`forward` runs the three stages back to back; `input_dist`, `lookup` and `output` are public so a
pipeline can start batch i+1's input_dist before batch i's lookup.

Cached tables (plan tier "cached" or "ssd", or `tiers`): every shard this rank holds gets its own row
cache and backing store (neorec/embedding/cache), files under `<cache directory>/rank-<rank>/`
named by table and shard (local tables are `<table>#<shard>`). The rows a batch needs are known on a
rank only after its input distribution: when the pipeline calls `prefetch` for batch i+2 (after
batch i's step), the local rows of batch i+1, whose ids were exchanged during batch i's step, are
brought into the caches first; so they come in after batch i's update and before batch i+1's lookup.
Replicated tables look up the rank's own samples, so their rows are prefetched at once.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms, Pending
from neorec.distributed.input_dist import InputDist
from neorec.distributed.layout import ShardLayout
from neorec.distributed.output_dist import Assembly, AwaitGradient, OutputDist, start_flat
from neorec.distributed.plan import STORAGE_TIERS, ShardingPlan
from neorec.distributed.replicas import ReplicaSync
from neorec.distributed.sequence_dist import (
    ScaleGradient,
    assemble_sequences,
    build_routes,
    local_sequence_rows,
)
from neorec.embedding.cache import TIERS as CACHE_TIERS
from neorec.embedding.cache import CacheSettings, cached_storage_factory
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.fused.param_groups import FusedEmbeddingOptimizer
from neorec.embedding.init import init_rows
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.sparse import JaggedRows, SparseBatch
from neorec.utils import streams


class _LearningRates:
    """What a local engine reads its learning rates from: the global optimizer, per local table."""

    def __init__(self, optimizer: FusedEmbeddingOptimizer, tables: list[int]) -> None:
        self.optimizer, self.tables = optimizer, tables

    def lrs(self) -> list[float]:
        lrs = self.optimizer.lrs()
        return [lrs[t] for t in self.tables]


class ShardedEmbeddingCollection(EmbeddingCollection):
    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: EmbeddingOptimizerConfig,
        plan: ShardingPlan,
        comms: Comms,
        seed: int = 0,
        forward_precision: str = "fp32",
        backward_precision: str = "fp32",
        device: torch.device | str | None = None,
        stochastic_rounding: bool = False,
        tiers: dict[str, str] | None = None,
        cache: CacheSettings | None = None,
        progress: bool = False,
        bounds_check: str = "error",
    ) -> None:
        """tiers: storage tier by table name ("memory", "dram", "ssd"), overriding the plan's tier
        (plan.STORAGE_TIERS); cache: size, policy and directory of the cached tables' row caches
        (size_mib is per process here; fractions by table name, given to each of its shards); progress: bars of the rows filled (pass it on rank 0 only).
        bounds_check: what an id outside its table does (neorec/sparse/bounds.py). Each rank checks
        its own batch against the whole tables before the id exchange routes anything, so the shards'
        engines, which see rebased ids of checked batches only, do not check again."""
        super().__init__(tables, optimizer, bounds_check)
        self.comms, self.topo, self.plan = comms, comms.topo, plan
        self.layout = ShardLayout(self.tables, plan, comms.topo)
        self.codecs = (Codec(forward_precision), Codec(backward_precision))
        rank = self.topo.rank
        units = self.layout.units[rank]

        def shard_rows(ti: int, a: int, b: int) -> torch.Tensor:
            u = units[ti]
            r0, (c0, c1) = u.shard.rows[0], u.shard.cols
            return init_rows(u.table, seed, r0 + a, r0 + b)[:, c0:c1]

        self.tiers = self._storage_tiers(tiers or {})
        dp = self.layout.dp_tables
        local_tiers = {u.local_table().name: self.tiers[u.table.name] for u in units}
        dp_tiers = {t.name: self.tiers[t.name] for t in dp}
        # cache fractions of tables (cache.fractions) given to their shards, by local name
        own = cache.fractions if cache is not None else {}
        local_fractions = {u.local_table().name: own[u.table.name] for u in units if u.table.name in own}
        dp_fractions = {t.name: own[t.name] for t in dp if t.name in own}
        if cache is not None:
            cache = replace(cache, fractions={**local_fractions, **dp_fractions})
        factory = self._cache_factory({**local_tiers, **dp_tiers}, cache, units, dp)
        map_shards = {u.local_table().name: u.map_shard() for u in units if u.table.managed_collision is not None}
        self.local = FusedEmbeddingCollection(
            self.layout.local_tables(rank), optimizer, seed, device, stochastic_rounding, row_init=shard_rows,
            group_storage_factory=factory, table_tiers=local_tiers, progress=progress, map_shards=map_shards,
            bounds_check="off", table_cache_fractions=local_fractions,
        )  # fmt: skip
        self.replicated = FusedEmbeddingCollection(
            dp, optimizer, seed, device, stochastic_rounding, group_storage_factory=factory, table_tiers=dp_tiers,
            progress=progress, bounds_check="off", table_cache_fractions=dp_fractions,
        )
        self._local_cached = any(hasattr(w, "prefetch") for w in self.local.weights)
        self._replicas = ReplicaSync(self.replicated, comms, self.codecs[1])
        self.replicated.grad_hook = self._replicas.start_gradients
        self.replicated.update_hook = self._replicas.share_updated
        self.replicated.counted_ahead = self._replicas.unique_count
        self.input_dist_ = InputDist(self.layout, comms)
        self.dp_features = [f for t in dp for f in t.features]
        lay = self.layout
        pieces = lay.flat_width + lay.twrw_width * lay.has_twrw + lay.twcw_width * lay.has_twcw + [lay.dp_width]
        self._assembly = Assembly(lay.assembly(), self.output_dim, pieces)
        index = {t.name: i for i, t in enumerate(self.tables)}
        self._table_index = index
        self._units = units
        # seconds per stage, summed over steps: input_dist, lookup, output_dist, output_dist_bwd, update
        self.timings: dict[str, float] = defaultdict(float)
        self.local.timings = self.replicated.timings = self.timings
        self._pool: ThreadPoolExecutor | None = None
        self._id_stream: torch.cuda.Stream | None = None
        # prefetched batches: [batch, its id exchange, whether its local rows are in the caches yet, its
        # replicated rows counted ahead, the batch as checked (bounds_check warn drops ids), its stamp then]
        self._ahead: deque[list] = deque()

    # ---- cached tables ---------------------------------------------------------------------------
    def _storage_tiers(self, overrides: dict[str, str]) -> dict[str, str]:
        """Storage tier of every table: `overrides`, else the plan's tier as training stores it."""
        unknown = sorted(set(overrides) - {t.name for t in self.tables})
        if unknown:
            raise ConfigError(f"cache tiers name table(s) {unknown} that the model does not have")
        out = {}
        for t in self.tables:
            plan_tier = self.plan.tables[t.name].tier or "device"
            out[t.name] = overrides.get(t.name, STORAGE_TIERS[plan_tier])
            if out[t.name] not in CACHE_TIERS:
                raise ConfigError(f"table {t.name!r}: storage tier must be one of {CACHE_TIERS}, got {out[t.name]!r}")
        return out

    def _cache_factory(self, tiers: dict[str, str], cache: CacheSettings | None, units, dp):
        """The group storage factory of both local engines: plain tensors, or row caches with this
        rank's files in a folder of its own (a replicated table has the same name on every rank)."""
        settings = cache or CacheSettings()
        # checked for every table on every rank alike, so that no rank waits for one that stopped
        ssd = sorted(name for name, tier in self.tiers.items() if tier == "ssd")
        if ssd and settings.directory is None:
            raise ConfigError(
                f"tables {ssd} are in tier ssd: set embedding.cache.directory (a folder for their files)"
            )
        cached = {name for name, tier in tiers.items() if tier != "memory"}
        if not cached:
            return None
        if settings.directory is not None:
            settings = replace(settings, directory=Path(settings.directory) / f"rank-{self.topo.rank:05d}")
        rows = {u.local_table().name: u.shard.rows[1] - u.shard.rows[0] for u in units}
        rows.update({t.name: t.rows for t in dp})
        return cached_storage_factory(tiers, settings, sum(rows[n] for n in cached))

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """This rank's cached shards (`<table>#<shard>`) and replicated tables: hit rate, rows and
        bytes moved from/to the backing tier, evictions (see neorec/embedding/cache/stats.py)."""
        return {**self.local.cache_stats(), **self.replicated.cache_stats()}

    def id_map_stats(self) -> dict[str, dict[str, float]]:
        """This rank's managed-collision shards, summed per table: hits, misses, inserts, evictions,
        dropped ids, occupied rows and capacity (see neorec/embedding/id_map.py)."""
        out: dict[str, dict[str, float]] = {}
        for name, stats in self.local.id_map_stats().items():
            total = out.setdefault(name.split("#")[0], {})
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        return out

    # ---- the three stages ------------------------------------------------------------------------
    def input_dist(self, sparse: SparseBatch) -> Pending:
        return self.input_dist_(self._checked(sparse))

    def lookup(self, local: SparseBatch) -> torch.Tensor:
        return self.local(local)

    def output(
        self, pooled_local: torch.Tensor, sparse: SparseBatch, prefix: torch.Tensor | None = None
    ) -> torch.Tensor:
        """output_dist + assembly: [B, output_dim] in feature order (after `prefix`, if given).
        Pooled outputs only; `embed` exchanges sequence rows too."""
        return self.exchange_outputs(pooled_local, self._checked(sparse), prefix)[0]

    def exchange_outputs(
        self,
        pooled_local: torch.Tensor,
        sparse: SparseBatch,
        prefix: torch.Tensor | None = None,
        local: SparseBatch | None = None,
        rows: dict[str, JaggedRows] | None = None,
    ) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """output_dist + assembly: the pooled [B, output_dim] (after `prefix`, if given) and, when the
        local batch and its looked-up sequence rows are given, every sequence feature's rows."""
        b = sparse.batch_size
        if self.dp_features:
            dp, dp_rows = self.replicated.embed(sparse)
        else:
            dp, dp_rows = torch.zeros(b, 0, device=sparse.values.device), {}
        start = time.perf_counter()
        anchor = torch.empty(0, device=dp.device, requires_grad=True)
        exchanged = self.layout.has_sequences and local is not None and rows is not None
        routes = build_routes(self.layout, sparse, local) if exchanged else None
        sent = local_sequence_rows(self.layout, rows) if exchanged else []
        out = OutputDist.apply(
            anchor, pooled_local, dp, prefix, self.layout, self.comms, self.codecs, b, self.timings, self._assembly,
            None, None, routes, *sent,
        )  # fmt: skip
        sequences: dict[str, JaggedRows] = {}
        if exchanged:
            out, *received = out
            sequences = assemble_sequences(self.layout, routes, received, sparse)
        self.timings["output_dist"] += time.perf_counter() - start
        scale = 1.0 / self.topo.world_size  # as the exchanged outputs' gradients (output_dist.py)
        for f, r in dp_rows.items():
            sequences[f] = JaggedRows(ScaleGradient.apply(r.values, scale), r.lengths)
        return out, {f: sequences[f] for f in self.sequence_names if f in sequences}

    def prefetch(self, sparse: SparseBatch) -> None:
        """Start the id exchange of a coming batch on a background thread (on its own communicator);
        forward(sparse) with this very object then waits for it instead of exchanging. Batches must
        be prefetched in the order they are trained, by every rank alike. Cached tables: the local
        rows of batches prefetched before come into the caches first (their ids have arrived, or
        arrive during the wait), and replicated tables' rows of this batch now (see the module doc)."""
        device = sparse.values.device
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="neorec-input-dist")
            # on a GPU the exchange runs on a stream of its own, after the batch's ids are ready
            self._id_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._prefetch_rows()
        checked = self.bounds.check(sparse)
        ready = streams.mark(device)
        # what each sends is set aside, and counted when the batch is trained (_exchanged, _counted_ahead)
        aside = self.comms.stats.run_aside
        work = self._pool.submit(
            streams.run_on, self._id_stream, ready, partial(aside, lambda: self.input_dist_(checked).wait())
        )
        # then, on the same thread, the rows the replicated tables' backward will exchange (replicas.py)
        count = partial(aside, lambda: self._replicas.count_ahead(checked))
        counts = self._pool.submit(streams.run_on, self._id_stream, ready, count)
        self._ahead.append([sparse, work, False, counts, checked, sparse.stamp()])
        self.replicated.prefetch(checked)  # a no-op without cached replicated tables

    def _checked(self, sparse: SparseBatch) -> SparseBatch:
        """The batch as its id check leaves it: checked when it was prefetched (a DataError if it was
        changed since), or now."""
        for entry in self._ahead:
            if entry[0] is sparse:
                sparse.check_unchanged_since(entry[5], "prefetch(batch)")
                return entry[4]
        return self.bounds.check(sparse)

    def clear_prefetched(self) -> None:
        """Finish and forget prefetched exchanges that will not be trained (a run that stops early)."""
        while self._ahead:
            entry = self._ahead.popleft()
            self._exchanged(entry[1], trained=False)
            entry[3].result()

    def _exchanged(self, work, trained: bool = True) -> SparseBatch:
        """The local batch a prefetched id exchange produced, usable on the current stream; the bytes
        it sent count for the step that trains it (none when it is not trained)."""
        (local, sent), done = work.result()
        streams.hand_over(done, (local.values, local.lengths, local.weights))
        if trained:
            self.comms.stats.add_counts(sent)
        return local

    def _counted_ahead(self, work):
        """The replicated rows a prefetched batch's backward will exchange, counted ahead (replicas.py);
        the bytes counting them sent count now, for the step that trains the batch."""
        rows, sent = work.result()[0]
        self.comms.stats.add_counts(sent)
        return rows

    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """The pooled vectors and the sequences: one id exchange, one lookup, one output exchange."""
        return self._embed(None, sparse)

    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        return self._embed(None, sparse)[0]

    def pooled_after(self, prefix: torch.Tensor | None, sparse: SparseBatch) -> torch.Tensor:
        """[prefix | pooled] assembled in one pass (see EmbeddingCollection.pooled_after)."""
        return self._embed(prefix, sparse)[0]

    def start_pooled(self, sparse: SparseBatch) -> Callable[[torch.Tensor], torch.Tensor]:
        """Look up and start the pooled exchange now; the returned finish(prefix) waits for it and
        assembles [prefix | pooled]. A model runs its bottom MLP in between, so the exchange and,
        in backward, the gradient's exchange travel during it (output_dist.py). Layouts with
        sequence features or two-hop shards exchange at finish instead."""
        if self.sequence_names or self.layout.has_twrw or self.layout.has_twcw:
            return super().start_pooled(sparse)
        checked = self._checked(sparse)
        pooled_local, _ = self.local.embed(self._local_batch(sparse, checked))
        sparse = checked
        b, device = sparse.batch_size, sparse.values.device
        dp = self.replicated.embed(sparse)[0] if self.dp_features else torch.zeros(b, 0, device=device)
        start = time.perf_counter()
        slot: list[Pending] = []
        pooled_local = AwaitGradient.apply(pooled_local, slot, self.timings)
        started = start_flat(pooled_local, self.layout, self.comms, self.codecs[0], b)
        self.timings["output_dist"] += time.perf_counter() - start

        def finish(prefix: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            anchor = torch.empty(0, device=device, requires_grad=True)
            out = OutputDist.apply(
                anchor, pooled_local, dp, prefix, self.layout, self.comms, self.codecs, b, self.timings,
                self._assembly, started, slot, None,
            )  # fmt: skip
            self.timings["output_dist"] += time.perf_counter() - start
            return out

        return finish

    def _local_batch(self, sparse: SparseBatch, checked: SparseBatch) -> SparseBatch:
        """This rank's ids of the batch (`checked`: as its id check left it): its prefetched
        exchange's result, or exchanged now."""
        start = time.perf_counter()
        if self._ahead and self._ahead[0][0] is sparse:
            entry = self._ahead.popleft()
            local = self._exchanged(entry[1])  # "input_dist" is then the time spent waiting
            self._replicas.current = self._counted_ahead(entry[3])  # its replicated rows (or None)
        else:
            # Exchanges already started on the background thread go first, on every rank alike, so
            # that the id communicator sees the same order everywhere (e.g. evaluation mid-training).
            for entry in self._ahead:
                entry[1].result()
                entry[3].result()
            local = self.input_dist_(checked).wait()
            self._replicas.current = None
        self.timings["input_dist"] += time.perf_counter() - start
        return local

    def _embed(
        self, prefix: torch.Tensor | None, sparse: SparseBatch
    ) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        checked = self._checked(sparse)
        local = self._local_batch(sparse, checked)
        pooled_local, rows = self.local.embed(local)
        return self.exchange_outputs(pooled_local, checked, prefix, local, rows)

    def _prefetch_rows(self) -> None:
        """Bring the local rows of every prefetched batch not yet brought in into the shards' caches
        (waiting for its ids if need be). No-op without cached shards."""
        if not self._local_cached:
            return
        for entry in self._ahead:
            if not entry[2]:
                local = self._exchanged(entry[1], trained=False)  # counted when it trains (_local_batch)
                start = time.perf_counter()
                self.local.prefetch(local)
                entry[2] = True
                self.timings["lookup"] += time.perf_counter() - start  # where the cost model counts misses

    # ---- replicated tables ----------------------------------------------------------------------
    def sync_replica_state(self) -> None:
        """Collective: bring the replicated tables' optimizer state up to date on every rank (it is
        kept current on each row's owner only, replicas.py); checkpoints call this first."""
        self._replicas.sync_state()

    # ---- optimizer --------------------------------------------------------------------------------
    def build_optimizer(self) -> FusedEmbeddingOptimizer:
        configs = [t.optimizer or self.optimizer_config for t in self.tables]
        opt = FusedEmbeddingOptimizer([t.name for t in self.tables], [c.lr for c in configs])
        if isinstance(self.local._optimizer, _LearningRates):
            self.local._optimizer.optimizer.replaced = True
        self.local._optimizer = _LearningRates(opt, [self._table_index[u.table.name] for u in self._units])  # type: ignore[assignment]
        self.replicated._optimizer = _LearningRates(  # type: ignore[assignment]
            opt, [self._table_index[t.name] for t in self.layout.dp_tables]
        )
        return opt

    # ---- whole tables (tests, export of small models) ---------------------------------------------
    def gather_tables(self) -> dict[str, dict[str, torch.Tensor]]:
        """Collective: every table's full weight and optimizer state, on every rank. Per-row state
        of a column-split table is the width-weighted mean of its shards' (see docs/checkpoints.md)."""
        import torch.distributed as dist

        mine = []
        local_state = self.local.state_dict()
        for u in self._units:
            key = f"tables.{u.table.name}#{u.index}."
            entry = {
                k[len(key) :]: v.cpu() for k, v in local_state.items() if k.startswith(key) and not k.endswith("step")
            }  # host tensors: the gathered tables are assembled in host memory
            mine.append((u.table.name, u.shard.rows, u.shard.cols, entry))
        everything = [mine]
        if self.topo.world_size > 1:
            everything = [None] * self.topo.world_size
            dist.all_gather_object(everything, mine)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for t in self.tables:
            if t in self.layout.dp_tables:
                continue
            out[t.name] = {}
        for shards in everything:
            for name, (r0, r1), (c0, c1), entry in shards:
                t = self.tables[self._table_index[name]]
                for k, v in entry.items():
                    if k not in out[name]:
                        shape = (t.rows, t.dim) if v.dim() == 2 else (t.rows,)
                        out[name][k] = torch.zeros(shape, dtype=v.dtype)
                    if v.dim() == 2:
                        out[name][k][r0:r1, c0:c1] = v
                    elif not v.is_floating_point():  # id map state of whole rows
                        out[name][k][r0:r1] = v
                    else:
                        out[name][k][r0:r1] += v * ((c1 - c0) / t.dim)
        self.sync_replica_state()
        dp_state = self.replicated.state_dict()
        for t in self.layout.dp_tables:
            key = f"tables.{t.name}."
            out[t.name] = {k[len(key) :]: v for k, v in dp_state.items() if k.startswith(key) and not k.endswith("step")}
        return out
