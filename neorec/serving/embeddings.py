"""The embedding collection of an exported model: lookups only, no optimizer, no gradients.

Each table is either float rows in its training storage dtype (fp32, fp16 or bf16) or row-wise
quantized codes of 8, 4 or 2 bits (quantize.py). Lookups go feature by feature and pool in fp32 with
the per-id factors of the fused training engine (weight, times 1 / bag length for mean pooling), so
an fp32 export scores exactly as the trained model does. Tables with `pooling: none` (DIN's history) give one fp32 row per
id, times the id's weight, as the fused engine's sequences do.

A table with managed collision takes raw ids and keeps its id map (the row of each raw id, `mc_keys`
as trained): ids are mapped as evaluation maps them during training (neorec/embedding/remap.py with
train=False), so an id the map does not hold is left out of its bag and the map never changes.

Every batch's ids are checked against their tables first, as in training (`bounds_check`,
neorec/sparse/bounds.py): error (default), warn (dropped and counted) or off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.id_map import IdMap, MapShard
from neorec.embedding.remap import MappedTable, remap_batch
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import NeorecError
from neorec.serving.quantize import QuantizedRows, bag_scales, dequantize_rows, pooled_lookup
from neorec.sparse import JaggedRows, SparseBatch, lengths_to_offsets

TableWeights = torch.Tensor | QuantizedRows


class InferenceEmbeddings(EmbeddingCollection):
    """Pooled lookups from fixed tables (float or row-wise quantized), in feature_names order."""

    def __init__(
        self,
        tables: list[TableConfig],
        weights: dict[str, TableWeights],
        id_maps: dict[str, torch.Tensor] | None = None,
        bounds_check: str = "error",
    ) -> None:
        """id_maps: for each managed-collision table, its `mc_keys` (the raw id on each row, -1: free).
        bounds_check: what an id outside its table does: "error", "warn" or "off"."""
        super().__init__(tables, EmbeddingOptimizerConfig(), bounds_check)
        self.mapped = [
            mapped_table(t, (id_maps or {}).get(t.name)) for t in self.tables if t.managed_collision
        ]
        for m in self.mapped:  # a buffer, so .to(device) moves the map with the rows
            self.register_buffer(f"mc_keys_{m.name}", m.id_map.keys.tensor, persistent=False)
        self._table_of = {f: i for i, t in enumerate(self.tables) for f in t.features}
        self._quantized: list[tuple[int, int] | None] = []  # per table: (bits, dim) of quantized rows
        # Buffers (not saved in state_dict: the export file holds the tables) so .to(device) moves them.
        for i, t in enumerate(self.tables):
            if t.name not in weights:
                raise NeorecError(f"table {t.name!r} has no weights")
            w = weights[t.name]
            shape = (w.num_rows, w.dim) if isinstance(w, QuantizedRows) else tuple(w.shape)
            if shape != (t.rows, t.dim):
                raise NeorecError(f"table {t.name!r} is {t.rows} x {t.dim} but its weights are {shape}")
            if isinstance(w, QuantizedRows):
                self.register_buffer(f"codes_{i}", w.codes, persistent=False)
                self.register_buffer(f"scale_{i}", w.scale, persistent=False)
                self.register_buffer(f"bias_{i}", w.bias, persistent=False)
            else:
                self.register_buffer(f"weight_{i}", w, persistent=False)
            self._quantized.append((w.bits, w.dim) if isinstance(w, QuantizedRows) else None)

    def table(self, i: int) -> TableWeights:
        """Table i's weights (QuantizedRows for a quantized table)."""
        if (spec := self._quantized[i]) is not None:
            codes, scale, bias = (getattr(self, f"{n}_{i}") for n in ("codes", "scale", "bias"))
            return QuantizedRows(codes, scale, bias, *spec)
        return getattr(self, f"weight_{i}")

    def table_weights(self) -> dict[str, TableWeights]:
        return {t.name: self.table(i) for i, t in enumerate(self.tables)}

    def id_maps(self) -> dict[str, torch.Tensor]:
        """{managed-collision table: its mc_keys}."""
        return {m.name: getattr(self, f"mc_keys_{m.name}") for m in self.mapped}

    def _remap(self, sparse: SparseBatch) -> SparseBatch:
        """Raw ids of the managed-collision tables -> rows; ids the maps do not hold are left out."""
        for m in self.mapped:
            keys = getattr(self, f"mc_keys_{m.name}")
            if m.id_map.keys.tensor is not keys:  # moved by .to(device): rebuild the sorted index there
                m.id_map.keys.tensor = keys
                m.id_map._index = None
        return remap_batch(sparse, self.mapped, 0, train=False)

    @torch.no_grad()
    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        """[B, output_dim] fp32 pooled vectors."""
        return self._pooled(self._remap(self.bounds.check(sparse)))

    def _pooled(self, sparse: SparseBatch) -> torch.Tensor:
        out = []
        for f in self.feature_names:
            i = self._table_of[f]
            ids, lengths, weights = sparse.feature(f)
            out.append(self._pool(self.table(i), ids, lengths, weights, self.tables[i].pooling))
        if not out:
            return torch.zeros(sparse.batch_size, 0, device=sparse.values.device)
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def embed(self, sparse: SparseBatch) -> tuple[torch.Tensor, dict[str, JaggedRows]]:
        """(pooled [B, output_dim], {sequence feature: its fp32 rows, one per id})."""
        sparse = self._remap(self.bounds.check(sparse))
        sequences = {}
        for f in self.sequence_names:
            if f not in sparse.keys:
                raise NeorecError(
                    f"the model reads the sequence feature {f!r} (pooling none, e.g. a user's history), which "
                    f"this batch does not have (features: {sparse.keys}); score data that carries it"
                )
            ids, lengths, weights = sparse.feature(f)
            table = self.table(self._table_of[f])
            if isinstance(table, QuantizedRows):
                rows = dequantize_rows(table, ids)
            else:
                rows = table.index_select(0, ids).to(torch.float32)
            if weights is not None:
                rows = rows * weights.to(torch.float32).unsqueeze(1)
            sequences[f] = JaggedRows(rows, lengths)
        return self._pooled(sparse), sequences

    @staticmethod
    def _pool(
        table: TableWeights, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, mode: str
    ) -> torch.Tensor:
        offsets = lengths_to_offsets(lengths)
        if isinstance(table, QuantizedRows):
            return pooled_lookup(table, ids, offsets, weights, mode)
        scales = bag_scales(lengths, weights, mode)
        if scales is None and ids.numel() == lengths.numel() and bool((lengths == 1).all()):
            return table.index_select(0, ids).to(torch.float32)  # one-hot: a gather, as in training
        if table.dtype == torch.float32:
            return F.embedding_bag(
                ids, table, offsets, mode="sum", per_sample_weights=scales, include_last_offset=True
            )
        rows = table.index_select(0, ids).to(torch.float32)  # fp16/bf16 rows are widened, then pooled in fp32
        return F.embedding_bag(
            torch.arange(ids.numel(), device=ids.device), rows, offsets, mode="sum",
            per_sample_weights=scales, include_last_offset=True,
        )  # fmt: skip

    def build_optimizer(self) -> torch.optim.Optimizer:
        raise NeorecError("an exported model is for inference only; train from the run's checkpoints instead")


def mapped_table(table: TableConfig, keys: torch.Tensor | None) -> MappedTable:
    """The id map of a managed-collision table at inference: its trained `mc_keys`, read only."""
    mc = table.managed_collision
    assert mc is not None
    if keys is None:
        raise NeorecError(f"table {table.name!r} has managed collision but no id map (mc_keys)")
    if keys.dtype != torch.int64 or tuple(keys.shape) != (table.rows,):
        raise NeorecError(
            f"table {table.name!r}: its id map must be int64 [{table.rows}], got {keys.dtype} {list(keys.shape)}"
        )
    id_map = IdMap(table.rows, mc.eviction, MapShard(0, mc.buckets, mc.buckets, table, 0, mc.eviction))
    id_map.keys.tensor = keys

    def no_evictions(rows: torch.Tensor) -> None:
        raise AssertionError(f"an inference lookup evicted rows {rows.tolist()} of table {table.name!r}")

    return MappedTable(table.name, id_map, list(table.features), no_evictions, mean=table.pooling == "mean")
