"""What a reader yields: dense features, categorical ids and labels of one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.sparse import SparseBatch


@dataclass
class Batch:
    dense: torch.Tensor  # [B, num_dense] float32
    sparse: SparseBatch  # feature-major keyed jagged ids
    labels: torch.Tensor  # [B] float32 in {0, 1}; [B, T] with one column per task (multi-task heads)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def slice(self, start: int, end: int) -> Batch:
        """Samples [start, end)."""
        return Batch(self.dense[start:end], self.sparse.slice_samples(start, end), self.labels[start:end])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device`; the batch itself when it is there already (as torch.Tensor.to)."""
        dense = self.dense.to(device, non_blocking=non_blocking)
        sparse = self.sparse.to(device, non_blocking=non_blocking)
        labels = self.labels.to(device, non_blocking=non_blocking)
        if dense is self.dense and sparse is self.sparse and labels is self.labels:
            return self
        return Batch(dense, sparse, labels)

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())
