"""Runs of samples held as tensors, and re-cutting a stream of them into batches of any size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.sparse import SparseBatch


@dataclass
class Block:
    """A run of samples held as tensors: the unit the generator makes and caches. The tensors may
    live on a GPU; each multi-hot feature's bag offsets are kept on the host as well, so cutting a
    block into batches never reads a size back from the device."""

    dense: torch.Tensor  # [n, d] float32, log(1 + count) like preprocessed Criteo
    labels: torch.Tensor  # [n] float32, or [n, T] for several tasks
    probs: torch.Tensor  # [n] float32: the teacher's click probability
    values: list[torch.Tensor]  # per feature, int64 ids
    lengths: list[torch.Tensor]  # per feature, [n] int64
    weights: list[torch.Tensor] | None
    # per feature, on the host: [n + 1] cumulative bag sizes, or None where every bag has one id
    offsets: list[np.ndarray | None] | None = None
    # (lows, highs): bounds every id of each feature lies within, where the block's maker knows them
    # (the generator draws ids in their tables), so the engines' id check reads nothing back for its
    # batches on a GPU (SparseBatch.id_limits); any subset of the block keeps them
    id_limits: tuple[list[int], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.offsets is None:
            self.offsets = [_host_offsets(ln) for ln in self.lengths]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str) -> Block:
        """The same samples with their tensors on `device` (host offsets kept)."""
        weights = [w.to(device) for w in self.weights] if self.weights is not None else None
        return Block(
            self.dense.to(device), self.labels.to(device), self.probs.to(device),
            [v.to(device) for v in self.values], [ln.to(device) for ln in self.lengths], weights, self.offsets,
            self.id_limits,
        )  # fmt: skip

    def take(self, idx: torch.Tensor) -> Block:
        """Samples `idx` (a host tensor; in that order)."""
        device = self.labels.device
        on_device = _to(idx, device)
        rows = idx.numpy()
        values, lengths, weights = [], [], [] if self.weights is not None else None
        offsets: list[np.ndarray | None] = []
        for f, (v, ln, off) in enumerate(zip(self.values, self.lengths, self.offsets, strict=True)):
            if off is None:
                sel, new_off = on_device, None
            else:  # multi-hot: gather each chosen sample's run of ids
                starts = off[rows]
                sizes = off[rows + 1] - starts
                new_off = np.zeros(rows.size + 1, np.int64)
                np.cumsum(sizes, out=new_off[1:])
                within = np.arange(new_off[-1], dtype=np.int64) - np.repeat(new_off[:-1], sizes)
                sel = _to(torch.from_numpy(np.repeat(starts, sizes) + within), device)
            values.append(v[sel])
            lengths.append(ln[on_device])
            offsets.append(new_off)
            if weights is not None:
                weights.append(self.weights[f][sel])
        return Block(
            self.dense[on_device], self.labels[on_device], self.probs[on_device], values, lengths, weights, offsets,
            self.id_limits,
        )  # fmt: skip

    def slice(self, start: int, end: int) -> Block:
        """Samples [start, end) without gathering: views of every feature's ids."""
        values, lengths, weights = [], [], [] if self.weights is not None else None
        offsets: list[np.ndarray | None] = []
        for f, (v, ln, off) in enumerate(zip(self.values, self.lengths, self.offsets, strict=True)):
            if off is None:  # one id per sample: sample i's id is at position i
                a, b, new_off = start, end, None
            else:
                a, b = int(off[start]), int(off[end])
                new_off = off[start : end + 1] - a
            values.append(v[a:b])
            lengths.append(ln[start:end])
            offsets.append(new_off)
            if weights is not None:
                weights.append(self.weights[f][a:b])
        return Block(
            self.dense[start:end], self.labels[start:end], self.probs[start:end], values, lengths, weights, offsets,
            self.id_limits,
        )  # fmt: skip

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
            [_cat_offsets([(b.offsets[f], len(b)) for b in blocks]) for f in range(nf)],
            _cat_limits([b.id_limits for b in blocks]),
        )

    def to_batch(self, keys: list[str]) -> Batch:
        weights = torch.cat(self.weights) if self.weights is not None else None
        # each feature's number of ids, from the host offsets: a batch on a GPU never reads them back
        per_key = [len(self) if off is None else int(off[-1]) for off in self.offsets]
        sparse = SparseBatch(keys, torch.cat(self.values), torch.cat(self.lengths), weights, per_key, self.id_limits)
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


def _to(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device`; to a GPU through pinned memory, so the copy does not make
    the host wait for the device."""
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _host_offsets(lengths: torch.Tensor) -> np.ndarray | None:
    """[n + 1] cumulative bag sizes on the host; None when every bag holds exactly one id."""
    ln = lengths.cpu().numpy()
    if bool((ln == 1).all()):
        return None
    out = np.zeros(ln.size + 1, np.int64)
    np.cumsum(ln, out=out[1:])
    return out


def _cat_offsets(parts: list[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """Offsets of blocks laid end to end (None: one id per sample in every part)."""
    if all(off is None for off, _ in parts):
        return None
    out, last = [np.zeros(1, np.int64)], 0
    for off, n in parts:
        off = off if off is not None else np.arange(n + 1, dtype=np.int64)
        out.append(off[1:] + last)
        last += int(off[-1])
    return np.concatenate(out)


def _cat_limits(parts: list[tuple[list[int], list[int]] | None]) -> tuple[list[int], list[int]] | None:
    """Id limits of blocks laid end to end: known when every block's are."""
    if any(p is None for p in parts):
        return None
    lows = [min(col) for col in zip(*(p[0] for p in parts), strict=True)]  # type: ignore[index]
    highs = [max(col) for col in zip(*(p[1] for p in parts), strict=True)]  # type: ignore[index]
    return lows, highs
