"""Jagged rows: one embedding row per id of a feature, with the samples' lengths.

What an embedding collection returns for a table with `pooling: none` (a sequence feature): the
rows of every id, samples in order, the same layout as the feature's ids in a SparseBatch
(`values[offsets[b]:offsets[b + 1]]` are sample b's rows, in the order of its ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.sparse.batch import lengths_to_offsets


@dataclass
class JaggedRows:
    """Rows [N, D] of N ids over B samples; `lengths` [B] (int) counts each sample's ids."""

    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def offsets(self) -> torch.Tensor:
        """[B + 1] first row of each sample (int64), ending in N."""
        return lengths_to_offsets(self.lengths)

    def to_padded(self, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(padded [B, L, D], mask [B, L] bool): sample b's rows in order in padded[b, :n_b], the rest
        zeros with mask False. L = max_len, or the longest sample (one host sync) when None; a sample
        with more than max_len ids keeps its last max_len (the most recent, for histories).
        Differentiable with respect to `values`."""
        b, d = self.batch_size, self.dim
        lengths = self.lengths.to(torch.int64)
        if max_len is None:
            max_len = int(lengths.max()) if b else 0
        elif max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        n = self.values.shape[0]
        device = self.values.device
        offsets = lengths_to_offsets(lengths)
        sample = torch.arange(b, device=device).repeat_interleave(lengths, output_size=n)
        position = torch.arange(n, device=device) - offsets[:-1].index_select(0, sample)
        dropped = (lengths - max_len).clamp(min=0).index_select(0, sample)  # ids cut from the front
        slot = position - dropped
        # ids that are cut all go to one spare row past the end, dropped with it
        flat = torch.where(slot >= 0, sample * max_len + slot, b * max_len)
        padded = self.values.new_zeros(b * max_len + 1, d).index_add(0, flat, self.values)
        kept = lengths.clamp(max=max_len)
        mask = torch.arange(max_len, device=device).view(1, -1) < kept.view(-1, 1)
        return padded[: b * max_len].view(b, max_len, d), mask
