"""The scoring program of a pt2 export: the trained model over plain tensors and standard torch ops,
ready for `torch.export`.

Inputs (every list in the model's feature order, `feature_names` in the export's metadata):

    dense    [B, num_dense] float32
    ids      list of [N_f] int64: feature f's ids of samples 0..B-1, one bag after the other
    offsets  list of [B + 1] int64: where each sample's bag starts in ids[f]; the last entry is N_f
    weights  list of [N_f] float32 per-id weights when the model was trained with them, else []

Output: click probabilities [B] float32.

Lookups are `embedding_bag` sums with per-id factors (weight, times 1 / bag length for mean
pooling), the same ops in the same order as neorec's inference embeddings, so an fp32 program
scores bitwise as `neorec predict` does. fp16/bf16 rows are gathered, widened and pooled in fp32;
quantized rows (8, 4 or 2 bits) are unpacked and dequantized (scale * code + bias, fp32) and pooled
the same way, by the same function as neorec's own lookups (quantize.dequantize). Nothing depends on
the values of the inputs, so one exported program takes any batch size.

Every feature's ids are checked against its table first (`torch._assert_async`, which the exported
graph keeps): an id outside [0, rows) stops the program with a RuntimeError naming the feature, its
table and the rows (on a GPU, a device-side assertion), never a read of another row. `neorec
predict` checks the batch before the program runs, with the id and sample in its message.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.tables import TableConfig, feature_order
from neorec.serving.embeddings import TableWeights
from neorec.serving.quantize import QuantizedRows, dequantize
from neorec.sparse import lengths_to_offsets

PT2_FORMAT = "neorec-pt2"  # the "format" of a pt2 export's header


def program_inputs(batch: Batch, feature_names: list[str], weighted: bool) -> tuple:
    """(dense, ids, offsets, weights) of a neorec Batch in the program's layout."""
    ids, offsets, weights = [], [], []
    for f in feature_names:
        values, lengths, w = batch.sparse.feature(f)
        ids.append(values)
        offsets.append(lengths_to_offsets(lengths))
        if weighted:
            weights.append(w if w is not None else torch.ones(values.numel(), device=values.device))
    return batch.dense, ids, offsets, weights


class TableLookups(nn.Module):
    """Pooled vectors [B, sum of feature dims] from per-feature ids and offsets."""

    def __init__(self, tables: list[TableConfig], weights: dict[str, TableWeights]) -> None:
        super().__init__()
        self.feature_names = feature_order(tables)
        table_of = {f: i for i, t in enumerate(tables) for f in t.features}
        self.table_index = [table_of[f] for f in self.feature_names]
        self.pooling = [t.pooling for t in tables]
        self.rows = [tables[i].rows for i in self.table_index]  # per feature
        self.outside = [
            f"feature {f!r} (table {tables[i].name!r}, {tables[i].rows:,} rows): an id is outside [0, {tables[i].rows:,})"
            for f, i in zip(self.feature_names, self.table_index, strict=True)
        ]
        self.kinds: list[str] = []  # per table: "fp32", "widen" (fp16/bf16 rows) or "quantized"
        self.packing: dict[int, tuple[int, int]] = {}  # quantized table -> (bits, dim)
        for i, t in enumerate(tables):
            w = weights[t.name]
            if isinstance(w, QuantizedRows):
                self.register_buffer(f"codes_{i}", w.codes)
                self.register_buffer(f"scale_{i}", w.scale)
                self.register_buffer(f"bias_{i}", w.bias)
                self.kinds.append("quantized")
                self.packing[i] = (w.bits, w.dim)
            else:
                self.register_buffer(f"weight_{i}", w)
                self.kinds.append("fp32" if w.dtype == torch.float32 else "widen")

    def forward(
        self, ids: list[torch.Tensor], offsets: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> torch.Tensor:
        out = []
        for k, i in enumerate(self.table_index):
            torch._assert_async(((ids[k] >= 0) & (ids[k] < self.rows[k])).all(), self.outside[k])
            w = weights[k] if weights else None
            out.append(self._pool(i, ids[k], offsets[k], w))
        return torch.cat(out, dim=1)

    def _pool(
        self, i: int, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        scales = weights.to(torch.float32) if weights is not None else None
        if self.pooling[i] == "mean":
            lengths = offsets[1:] - offsets[:-1]
            inv = lengths.clamp(min=1).to(torch.float32).reciprocal()
            # each id's bag: the last offset at or before its position (empty bags are skipped)
            bag = torch.searchsorted(offsets, torch.arange(ids.shape[0], device=ids.device), right=True) - 1
            scales = inv[bag] if scales is None else scales * inv[bag]
        if self.kinds[i] == "fp32":
            table = getattr(self, f"weight_{i}")
            return F.embedding_bag(
                ids, table, offsets, mode="sum", per_sample_weights=scales, include_last_offset=True
            )
        if self.kinds[i] == "widen":
            rows = getattr(self, f"weight_{i}").index_select(0, ids).to(torch.float32)
        else:
            codes, scale, bias = (getattr(self, f"{n}_{i}") for n in ("codes", "scale", "bias"))
            rows = dequantize(codes.index_select(0, ids), scale[ids], bias[ids], *self.packing[i])
        return F.embedding_bag(
            torch.arange(ids.shape[0], device=ids.device), rows, offsets, mode="sum",
            per_sample_weights=scales, include_last_offset=True,
        )  # fmt: skip


class _Pooled:
    """A batch whose sparse part is already pooled: what the model's forward reads (dense, sparse)."""

    def __init__(self, dense: torch.Tensor, pooled: torch.Tensor) -> None:
        self.dense = dense
        self.sparse = pooled


class _PooledInput(nn.Module):
    """Stands in for the model's embedding collection: the pooled vectors arrive with the batch."""

    def pooled_after(self, prefix: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return torch.cat([prefix, pooled], dim=1)

    def start_pooled(self, pooled: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda prefix: self.pooled_after(prefix, pooled)


class ScoringProgram(nn.Module):
    """Lookups, then the trained model's own dense layers (so the dense math is the very same ops),
    then the sigmoid: probabilities [B]."""

    def __init__(self, model: nn.Module, lookups: TableLookups) -> None:
        super().__init__()
        self.lookups = lookups
        self.model = model
        self.model.embeddings = _PooledInput()

    def forward(
        self,
        dense: torch.Tensor,
        ids: list[torch.Tensor],
        offsets: list[torch.Tensor],
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        pooled = self.lookups(ids, offsets, weights)
        return torch.sigmoid(self.model(_Pooled(dense, pooled)))
