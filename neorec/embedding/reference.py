"""Reference embedding collection: one nn.EmbeddingBag per table with sparse gradients.

This is the facebookresearch/dlrm way. It stays as the baseline for tests and benchmarks; training
uses the fused table-batched engine by default.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.id_map import IdMap, MapShard
from neorec.embedding.init import init_rows, init_rows_at
from neorec.embedding.remap import MappedTable, map_stats, remap_batch
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.sparse import JaggedRows, SparseBatch


class ReferenceEmbeddingCollection(EmbeddingCollection):
    def __init__(
        self, tables: list[TableConfig], optimizer: EmbeddingOptimizerConfig, seed: int = 0,
        bounds_check: str = "error",
    ) -> None:  # fmt: skip
        super().__init__(tables, optimizer, bounds_check)
        for t in tables:
            if t.dtype != "fp32":
                raise ConfigError(f"table {t.name!r}: the reference engine stores fp32 only, got {t.dtype!r}")
        # a list, not a ModuleDict: table names such as "items" or "keys" would clash with its methods.
        # A sequence table is a bag per id, summed: its row times the id's weight.
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(
                init_rows(t, seed),
                freeze=False,
                mode="sum" if t.pooling == "none" else t.pooling,
                sparse=True,
                include_last_offset=True,
            )
            for t in tables
        )
        self._index = {t.name: i for i, t in enumerate(tables)}
        self._table_of = {f: self._index[t.name] for t in tables for f in t.features}
        self.seed = seed
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self.mapped = [
            MappedTable(
                t.name,
                IdMap(t.rows, t.managed_collision.eviction, MapShard(0, t.managed_collision.buckets,
                                                                    t.managed_collision.buckets, t, 0,
                                                                    t.managed_collision.eviction)),
                list(t.features),
                self._row_reset(i),
                mean=t.pooling == "mean",
            )
            for i, t in enumerate(tables)
            if t.managed_collision is not None
        ]  # fmt: skip
        self.map_step = 0  # training batches remapped so far

    def _row_reset(self, ti: int):
        """reset(rows): rows of table ti back to their initial weights and optimizer state."""
        t = self.tables[ti]

        def reset(rows: torch.Tensor) -> None:
            weight = self.bags[ti].weight
            with torch.no_grad():
                weight[rows] = init_rows_at(t, self.seed, rows)
            state = self._torch_optimizer.state.get(weight, {}) if self._torch_optimizer is not None else {}
            accumulator = (t.optimizer or self.optimizer_config).initial_accumulator
            for name, value in state.items():
                if name == "sum":  # adagrad
                    value[rows] = accumulator
                elif name in ("exp_avg", "exp_avg_sq"):  # sparse adam
                    value[rows] = 0.0

        return reset

    def id_map_stats(self) -> dict[str, dict[str, float]]:
        """Per managed-collision table: hits, misses, inserts, evictions, dropped, occupied, capacity."""
        return map_stats(self.mapped)

    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        sparse = self.bounds.check(sparse)
        if self.mapped:
            if self.training:
                self.map_step += 1
            sparse = remap_batch(sparse, self.mapped, self.map_step, self.training)
        b = sparse.batch_size
        offsets = sparse.offsets()
        bounds = sparse.offset_per_key()
        pooled = []
        for f in self.feature_names:
            i = sparse.keys.index(f)
            values = sparse.values[bounds[i] : bounds[i + 1]]
            off = offsets[i * b : (i + 1) * b + 1] - bounds[i]
            w = sparse.weights[bounds[i] : bounds[i + 1]] if sparse.weights is not None else None
            pooled.append(_pool(self.bags[self._table_of[f]], values, off, w))
        out = torch.cat(pooled, dim=1) if pooled else torch.zeros(b, 0, device=sparse.values.device)
        sequences = {}
        for f in self.sequence_names:
            values, lengths, w = sparse.feature(f)
            one_per_id = torch.arange(values.numel() + 1, device=values.device)
            rows = self.bags[self._table_of[f]](values, one_per_id, per_sample_weights=w)
            sequences[f] = JaggedRows(rows, lengths)
        return out, sequences

    def build_optimizer(self) -> torch.optim.Optimizer:
        configs = {t.name: t.optimizer or self.optimizer_config for t in self.tables}
        names = {c.name for c in configs.values()}
        if len(names) > 1:
            raise ConfigError(f"the reference engine needs one embedding optimizer for all tables, got {sorted(names)}")
        name = names.pop()
        groups = []
        for t in self.tables:
            c = configs[t.name]
            if c.weight_decay:
                raise ConfigError(f"table {t.name!r}: the reference engine has no weight decay for sparse gradients")
            group: dict = {"params": [self.bags[self._index[t.name]].weight], "lr": c.lr}
            if name == "adagrad":
                group.update(eps=c.eps)
            elif name == "adam":
                group.update(eps=c.eps, betas=(c.beta1, c.beta2))
            groups.append(group)
        if name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=self.optimizer_config.lr)
        elif name == "adagrad":
            inits = {c.initial_accumulator for c in configs.values()}
            if len(inits) > 1:
                raise ConfigError("the reference engine needs one adagrad initial_accumulator for all tables")
            # torch.optim.Adagrad reads the starting accumulator from its constructor only
            opt = torch.optim.Adagrad(groups, lr=self.optimizer_config.lr, initial_accumulator_value=inits.pop())
        elif name == "adam":
            opt = torch.optim.SparseAdam(groups, lr=self.optimizer_config.lr)
            opt.register_step_pre_hook(_eps_after_bias_correction)
        else:
            raise ConfigError(f"the reference engine has no {name!r} optimizer; use embedding.engine: fused")
        self._torch_optimizer = opt  # evictions reset the state of their rows
        return opt

    def table_weights(self) -> dict[str, torch.Tensor]:
        return {t.name: self.bags[i].weight.detach() for i, t in enumerate(self.tables)}


def _eps_after_bias_correction(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """torch.optim.SparseAdam adds eps to sqrt(v) before its bias correction, the fused engine (and
    torch.optim.Adam) after it: lr / c1 * m / (sqrt(v / c2) + eps), c = 1 - beta^t. SparseAdam with eps
    times sqrt(c2) for this step's t is that rule, so both engines train the same one (a group per
    table: one weight, one step count). The configured eps is kept as the group's `textbook_eps`
    before the first step scales `eps`, and goes with the optimizer's state into checkpoints."""
    for group in opt.param_groups:
        eps = group.setdefault("textbook_eps", group["eps"])
        (weight,) = group["params"]
        t = int(opt.state[weight].get("step", 0)) + 1
        group["eps"] = eps * math.sqrt(1.0 - group["betas"][1] ** t)


def _pool(
    bag: nn.EmbeddingBag, values: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor | None
) -> torch.Tensor:
    """One feature's pooled bags. A weighted mean bag is computed as the fused engine computes it:
    the sum of its ids' rows times their weights, divided by its number of ids (an empty bag gives
    zeros); nn.EmbeddingBag's mean mode takes no per-id weights."""
    if w is None or bag.mode != "mean":
        return bag(values, offsets, per_sample_weights=w)
    lengths = offsets[1:] - offsets[:-1]
    inv = lengths.clamp(min=1).to(torch.float32).reciprocal()
    inv = inv.repeat_interleave(lengths, output_size=values.numel())
    return F.embedding_bag(
        values, bag.weight, offsets, mode="sum", per_sample_weights=w.to(torch.float32) * inv,
        sparse=bag.sparse, include_last_offset=True,
    )  # fmt: skip
