"""Synthetic blocks drawn with torch where training runs (data.synthetic.generator: device).

The host generator (neorec/data/synthetic.py) draws a block with numpy in ~0.1 s (one-hot Kaggle
sizes) to ~1 s (MLPerf multi-hot) per 16,384 samples on one core: a GPU that trains a batch in
milliseconds would wait on it. This module draws the same kind of block with torch on the training
device, all tables at once, in a few dozen kernel launches and no host synchronisation (except one
read of the bag sizes when they are random).

What is the same as the host generator: the teacher (its parameters, the per-id hashes, bitwise: the
hash below is the numpy one in two's-complement int64), the distributions (log-normal counts, Zipf
ids scattered by the same bijection, bag sizes, weights, labels drawn from the teacher's
probability), block boundaries and everything built on them (batching, ranks, resume). What differs:
the random stream. torch's generators (Philox on CUDA) replace numpy's PCG64, so the samples are
another draw from the same distribution, a pure function of (seed, split, block index, device type).
Runs that must see identical data on the CPU and a GPU use the host generator.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from neorec.data.blocks import Block
from neorec.utils.hashing import MASK63, shift_right, signed, splitmix64, splitmix64_torch


def hash_uniform(ids: torch.Tensor, keys: torch.Tensor | int, width: int) -> torch.Tensor:
    """synthetic._hash_uniform on the device: [n] ids (with [n] or one key) -> [n, width] float64
    values uniform in [-sqrt(3), sqrt(3)), bitwise the host's values (before its float32 cast)."""
    key = keys & 0xFFFFFFFF if isinstance(keys, torch.Tensor) else torch.tensor(keys & 0xFFFFFFFF)
    base = splitmix64_torch(ids * 0x100000001B3 + key * (1 << 32))
    comp = torch.arange(1, width + 1, dtype=torch.int64, device=ids.device) * signed(0xD6E8FEB86659FD93)
    h = splitmix64_torch(base[:, None] ^ comp[None, :])
    u = shift_right(h, 11).to(torch.float64) * (1.0 / (1 << 53))
    return (u * 2.0 - 1.0) * math.sqrt(3.0)


def raw_ids(ids: torch.Tensor, key: int) -> torch.Tensor:
    """synthetic.raw_ids on the device: the same raw 63-bit ids."""
    return (ids * signed(0x9E3779B97F4A7C15) + key) & MASK63


class DeviceDraw:
    """Draws blocks for one SyntheticSource on `device` (the teacher's constants moved there once)."""

    def __init__(self, teacher, device: torch.device) -> None:
        spec = teacher.spec
        self.teacher, self.spec, self.device = teacher, spec, device
        f64 = {"dtype": torch.float64, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        self.mu = torch.tensor(teacher.dense_mu, **f64)
        self.sigma = torch.tensor(teacher.dense_sigma, **f64)
        self.w_dense = torch.tensor(teacher.w_dense, **f64)
        t, d, k = spec.num_sparse, spec.num_dense, spec.latent_dim
        self.dense_to_latent = torch.tensor(
            teacher.dense_to_latent.transpose(1, 0, 2).reshape(d, t * k), **f64
        )  # [d, T k]
        self.part_scale = torch.tensor(teacher.part_scale, **f64)
        self.rows = torch.tensor(spec.rows, **i64)
        self.shift = torch.tensor(teacher.shift, **i64)
        self.keys = torch.tensor(teacher.key, **i64)
        self.pair_i = torch.tensor([i for i, _ in teacher.pairs], **i64)
        self.pair_j = torch.tensor([j for _, j in teacher.pairs], **i64)
        self.bags = torch.tensor(spec.bag_sizes, **f64) if spec.bag_sizes is not None else None

    def generator(self, seed: int, split: int, index: int) -> torch.Generator:
        """The block's own random stream: seeded by a hash of (seed, split, index)."""
        x = np.array([seed], np.uint64)
        for part in (split, index):
            x = splitmix64(x ^ np.uint64(part))
        g = torch.Generator(device=self.device)
        g.manual_seed(int(splitmix64(x)[0]) & MASK63)
        return g

    def block(self, split: int, index: int, n: int, raw: list[bool]) -> Block:
        """Block `index` (n samples) of split number `split`."""
        spec, teacher, dev = self.spec, self.teacher, self.device
        t, k = spec.num_sparse, spec.latent_dim
        g = self.generator(spec.seed, split, index)
        # dense counts, as the model sees them (log1p) and as the teacher does (standardised)
        z = torch.randn((n, spec.num_dense), generator=g, dtype=torch.float64, device=dev)
        counts = torch.floor(torch.exp(self.mu + self.sigma * z)) - 1.0
        dense_log = torch.log1p(counts.clamp_min(0.0))
        dense_std = (dense_log - self.mu) / self.sigma
        # bag sizes [T, n]: one id, a fixed size per table, or Poisson; per table on the host as well
        if spec.bag_sizes is None:
            lengths = torch.ones((t, n), dtype=torch.int64, device=dev)
            host_lengths = None
        elif spec.variable_bags:
            rates = self.bags[:, None].expand(t, n).contiguous()
            lengths = torch.poisson(rates, generator=g).to(torch.int64)
            host_lengths = lengths.cpu().numpy()  # the one host read: sizes of the ids to draw
        else:
            lengths = self.bags.to(torch.int64)[:, None].expand(t, n).contiguous()
            host_lengths = np.repeat(np.asarray(spec.bag_sizes, np.int64)[:, None], n, axis=1)
        per_table = [n] * t if host_lengths is None else [int(x) for x in host_lengths.sum(1)]
        total = sum(per_table)
        # each id's table, from sizes already on the device (a host list would be a synchronous copy)
        table_of_id = torch.repeat_interleave(torch.arange(t, device=dev), lengths.sum(1), output_size=total)
        # Zipf ranks scattered over each table, all tables in one flat run (table-major)
        rows = self.rows.index_select(0, table_of_id)
        u = torch.rand(total, generator=g, dtype=torch.float64, device=dev)
        alpha = spec.zipf_alpha
        rows_f = rows.to(torch.float64)
        if abs(alpha - 1.0) < 1e-9:
            x = torch.exp(u * torch.log(rows_f + 1.0))
        else:
            a = 1.0 - alpha
            x = ((torch.pow(rows_f + 1.0, a) - 1.0) * u + 1.0) ** (1.0 / a)
        ranks = torch.minimum(x.to(torch.int64) - 1, rows - 1).clamp_min(0)
        ids = (ranks * 2654435761 + self.shift.index_select(0, table_of_id)) % rows
        weights = None
        if spec.weighted:
            weights = torch.rand(total, generator=g, dtype=torch.float64, device=dev).to(torch.float32) + 1e-3
        # the teacher: mean of each bag's hashed parameters (empty bag: zeros), then the four parts
        params = hash_uniform(ids, self.keys.index_select(0, table_of_id), k + 1)
        if host_lengths is None:
            pooled = params.view(t, n, k + 1)
        elif not spec.variable_bags:  # fixed sizes: each table's ids are [n, size] bags
            pooled = torch.stack([
                part.view(n, size, k + 1).mean(1) if size else part.new_zeros(n, k + 1)
                for part, size in zip(params.split(per_table), spec.bag_sizes, strict=True)
            ])  # fmt: skip
        else:  # bag sums as differences of running sums; scanned along the last dim, which CUDA
            # runs in parallel (a scan along dim 0 of [ids, k + 1] runs k + 1 threads down the ids)
            ends = torch.cumsum(lengths.reshape(-1), 0)
            sums = torch.cat([params.new_zeros(k + 1, 1), torch.cumsum(params.t(), 1)], 1)
            pooled = (sums.index_select(1, ends) - sums.index_select(1, ends - lengths.reshape(-1))).t()
            pooled = (pooled / lengths.reshape(-1, 1).clamp_min(1)).view(t, n, k + 1)
        bias = pooled[:, :, 0].sum(0)
        latent = pooled[:, :, 1:]  # [T, n, k]
        inter = (latent.index_select(0, self.pair_i) * latent.index_select(0, self.pair_j)).sum((0, 2))
        inter = inter / math.sqrt(k)
        proj = (dense_std @ self.dense_to_latent).view(n, t, k)
        cross = (proj * latent.transpose(0, 1)).sum((1, 2))
        parts = torch.stack([dense_std @ self.w_dense, bias, inter, cross], 1) * self.part_scale
        logits = parts.sum(1) * teacher.scale + teacher.bias
        probs = 1.0 / (1.0 + torch.exp(-logits))
        click = (torch.rand(n, generator=g, dtype=torch.float64, device=dev) < probs).to(torch.float32)
        labels = click
        if spec.labels is not None:
            again = (torch.rand(n, generator=g, dtype=torch.float64, device=dev) < probs).to(torch.float32)
            columns = {"click": click, "conversion": click * again}
            labels = torch.stack([columns[name] for name in spec.labels], 1)
        values = list(ids.split(per_table))
        values = [raw_ids(v, teacher.key[f]) if raw[f] else v for f, v in enumerate(values)]
        offsets: list[np.ndarray | None] = []
        for f in range(t):
            if host_lengths is None:
                offsets.append(None)
            else:
                off = np.zeros(n + 1, np.int64)
                np.cumsum(host_lengths[f], out=off[1:])
                offsets.append(off)
        return Block(
            dense_log.to(torch.float32), labels, probs.to(torch.float32), values, list(lengths.unbind(0)),
            list(weights.split(per_table)) if weights is not None else None, offsets,
        )  # fmt: skip
