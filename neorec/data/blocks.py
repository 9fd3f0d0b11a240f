"""Runs of samples held as tensors, and re-cutting a stream of them into batches of any size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from neorec.data.batch import Batch
from neorec.sparse import SparseBatch


@dataclass
class Block:
    """A run of samples held as tensors: the unit the generator makes and caches."""

    dense: torch.Tensor  # [n, d] float32, log(1 + count) like preprocessed Criteo
    labels: torch.Tensor  # [n] float32
    probs: torch.Tensor  # [n] float32: the teacher's click probability
    values: list[torch.Tensor]  # per feature, int64 ids
    lengths: list[torch.Tensor]  # per feature, [n] int64
    weights: list[torch.Tensor] | None

    def __len__(self) -> int:
        return self.labels.numel()

    def take(self, idx: torch.Tensor) -> Block:
        """Samples `idx` (in that order)."""
        values, lengths, weights = [], [], [] if self.weights is not None else None
        for f, (v, ln) in enumerate(zip(self.values, self.lengths, strict=True)):
            if bool((ln == 1).all()):
                sel = idx
            else:  # multi-hot: gather each chosen sample's run of ids
                offsets = torch.zeros(ln.numel() + 1, dtype=torch.int64)
                torch.cumsum(ln, 0, out=offsets[1:])
                new_len = ln[idx]
                starts = torch.repeat_interleave(offsets[idx], new_len)
                within = torch.arange(int(new_len.sum())) - torch.repeat_interleave(
                    torch.cumsum(new_len, 0) - new_len, new_len
                )
                sel = starts + within
            values.append(v[sel])
            lengths.append(ln[idx])
            if weights is not None:
                weights.append(self.weights[f][sel])
        return Block(self.dense[idx], self.labels[idx], self.probs[idx], values, lengths, weights)

    def slice(self, start: int, end: int) -> Block:
        """Samples [start, end) without gathering: views of one-hot features, one cumsum for multi-hot."""
        values, lengths, weights = [], [], [] if self.weights is not None else None
        for f, (v, ln) in enumerate(zip(self.values, self.lengths, strict=True)):
            if v.numel() == ln.numel():  # one id per sample: sample i's id is at position i
                a, b = start, end
            else:
                a = int(ln[:start].sum())
                b = a + int(ln[start:end].sum())
            values.append(v[a:b])
            lengths.append(ln[start:end])
            if weights is not None:
                weights.append(self.weights[f][a:b])
        return Block(self.dense[start:end], self.labels[start:end], self.probs[start:end], values, lengths, weights)

    @staticmethod
    def cat(blocks: list[Block]) -> Block:
        if len(blocks) == 1:
            return blocks[0]
        nf = len(blocks[0].values)
        weights = None
        if blocks[0].weights is not None:
            weights = [torch.cat([b.weights[f] for b in blocks]) for f in range(nf)]
        return Block(
            torch.cat([b.dense for b in blocks]),
            torch.cat([b.labels for b in blocks]),
            torch.cat([b.probs for b in blocks]),
            [torch.cat([b.values[f] for b in blocks]) for f in range(nf)],
            [torch.cat([b.lengths[f] for b in blocks]) for f in range(nf)],
            weights,
        )

    def to_batch(self, keys: list[str]) -> Batch:
        weights = torch.cat(self.weights) if self.weights is not None else None
        sparse = SparseBatch(keys, torch.cat(self.values), torch.cat(self.lengths), weights)
        return Batch(self.dense, sparse, self.labels)


def rebatch(
    blocks: Iterable[Block], batch_size: int, keys: list[str], rank: int = 0, world_size: int = 1
) -> Iterator[Batch]:
    """Batches of exactly `batch_size` samples (the last one may be smaller) from blocks of any size.

    Batches are cut as contiguous slices (views for one-hot features), so re-batching costs about one
    copy of the data, not one per batch. With `world_size` > 1, only rank `rank`'s slice of every batch
    is made: samples [rank b, (rank + 1) b) with b = len(batch) // world_size (the remainder of a last
    batch that does not divide is dropped; a slice of no samples is not yielded).
    """
    pending: Block | None = None
    for block in blocks:
        if pending is not None:
            block = Block.cat([pending, block])
        pos = 0
        while len(block) - pos >= batch_size:
            if world_size == 1:
                yield block.slice(pos, pos + batch_size).to_batch(keys)
            else:
                b = batch_size // world_size
                yield block.slice(pos + rank * b, pos + (rank + 1) * b).to_batch(keys)
            pos += batch_size
        pending = block.slice(pos, len(block)) if pos < len(block) else None
    if pending is not None:
        if world_size == 1:
            yield pending.to_batch(keys)
        elif (b := len(pending) // world_size) > 0:
            yield pending.slice(rank * b, (rank + 1) * b).to_batch(keys)
