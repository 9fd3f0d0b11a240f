"""Synthetic Criteo-like click data with a hidden teacher model.

What it imitates: 13 dense count features (heavy-tailed, fed as log(1+x) like Criteo) and 26
categorical features whose ids follow a power law (Zipf) per table, with the popular ids scattered
over the table by a bijective hash (so "popular" does not mean "small id"). Features can be multi-hot
with fixed or Poisson bag sizes (the MLPerf DLRM-DCNv2 sizes are a preset).

Labels come from a teacher: a logit made of a dense linear part, a bias per id, dot products between
the latent vectors of the ids of chosen feature pairs, and dense x id interactions. A model must learn
the embeddings to do well. The teacher's own AUC on the held-out set (scoring with the true click
probabilities) is the ceiling a model can reach; it is reported in `info.notes["teacher_auc"]`.

Labels by name (`labels`, for multi-task heads; default: the click label alone, [n]): `click` is the
teacher's label; `conversion` is a click followed by a second, independent draw at the same
probability (a purchase needs the click and a second decision driven by the same taste: P = p^2).
Asked for by name, labels are [n, T] in the order given; the second draw comes after all other
draws of a block, so the samples and click labels do not change.

Everything is a pure function of (seed, split, block index): data is made in fixed blocks of
`BLOCK` samples, so the samples do not depend on the batch size or on how many processes read them.
Per-id teacher parameters are hashed from (seed, table, id), never stored, so tables of any size cost
no memory.

Under W processes (`train_slices`) each rank makes only its slice of every global batch into a
`Batch`, but every rank still draws whole blocks: a block's samples come from one sequential random
stream (normal dense values by rejection sampling, Poisson bag sizes, Zipf ids, then labels), so where
sample k's draws start depends on how many draws the samples before it used, and making rows [a, b)
costs making rows [0, b). Drawing per sample would change the data. Blocks are cached, so each one is
drawn once per process.

Managed-collision tables (`raw_features`): their ids are not reduced to [0, rows) but passed as raw
63-bit ids, a bijection of the in-table id (`raw_ids`), so the data, the labels and the number of
distinct ids are the same and only the id values differ.

Resume: `load_state({"epoch": e, "samples": s})` makes the next `train_batches`/`train_slices` of
epoch e start after its first s samples without drawing the blocks before them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.blocks import Block, rebatch
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.errors import ConfigError, DataError
from neorec.utils.hashing import splitmix64

BLOCK = 16384

# Cardinalities of the 26 categorical features of the Criteo Kaggle (Display Advertising) data set,
# as counted by facebookresearch/dlrm's preprocessing.
CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
# Criteo 1TB table sizes used by the MLPerf DLRM-DCNv2 benchmark (40M-capped).
MLPERF_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
# Multi-hot bag sizes of the MLPerf DLRM-DCNv2 benchmark's synthetic multi-hot Criteo.
MLPERF_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_CALIBRATED: dict[str, tuple[float, float]] = {}  # a teacher's spec -> its fitted (scale, bias)
_SCATTER = 2654435761  # a prime: id = (rank * _SCATTER + shift) mod rows is a bijection for rows < it


@dataclass
class SyntheticSpec:
    """Everything that determines the synthetic data (the config's `data.synthetic` section)."""

    rows: list[int]
    num_dense: int = 13
    zipf_alpha: float = 1.05
    bag_sizes: list[int] | None = None  # None: one-hot; else mean ids per sample per feature
    variable_bags: bool = False  # bag sizes ~ Poisson(mean) (empty bags happen) instead of fixed
    weighted: bool = False  # ids carry random weights in (0, 1]
    latent_dim: int = 8
    num_pairs: int = 26  # feature pairs whose latent dot products enter the logit
    logit_scale: float = 2.0  # std of the teacher logit: larger -> easier, higher ceiling AUC
    part_weights: tuple[float, float, float, float] = (1.0, 1.0, 0.5, 0.3)  # dense, id bias, pairs, dense x id
    base_ctr: float = 0.25
    train_samples: int = 1_000_000
    eval_samples: int = 100_000
    seed: int = 0
    labels: tuple[str, ...] | None = None  # None: the click label [n]; else these by name, [n, T]

    @property
    def num_sparse(self) -> int:
        return len(self.rows)


def _hash_uniform(ids: np.ndarray, key: int, width: int) -> np.ndarray:
    """[n] ids -> [n, width] values uniform in [-sqrt(3), sqrt(3)) (mean 0, variance 1), fixed per (key, id)."""
    base = splitmix64(ids.astype(np.uint64) * np.uint64(0x100000001B3) + np.uint64(key & 0xFFFFFFFF) * np.uint64(1 << 32))
    comp = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
    with np.errstate(over="ignore"):
        h = splitmix64(base[:, None] ^ comp[None, :])
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return ((u * 2.0 - 1.0) * math.sqrt(3.0)).astype(np.float32)


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, alpha: float) -> np.ndarray:
    """n popularity ranks in [0, rows) with P(rank r) roughly proportional to (r + 1)^-alpha."""
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(rows + 1.0))
    else:
        a = 1.0 - alpha
        x = ((math.pow(rows + 1.0, a) - 1.0) * u + 1.0) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, rows - 1).clip(0)


class Teacher:
    """The hidden click model. Its parameters are a function of the seed alone."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 7])
        t, d, k = spec.num_sparse, spec.num_dense, spec.latent_dim
        # dense counts: log-normal with per-feature location/scale, standardised by the teacher
        self.dense_mu = rng.uniform(0.0, 3.0, d)
        self.dense_sigma = rng.uniform(0.5, 1.5, d)
        self.w_dense = rng.normal(0.0, 1.0, d) / math.sqrt(max(d, 1))
        pairs = [(i, j) for i in range(t) for j in range(i + 1, t)]
        order = rng.permutation(len(pairs))[: spec.num_pairs] if pairs else []
        self.pairs = [pairs[p] for p in order]
        self.dense_to_latent = rng.normal(0.0, 1.0, (t, d, k)) / math.sqrt(max(d, 1) * k)
        self.shift = [int(rng.integers(0, r)) for r in spec.rows]
        self.key = [int(rng.integers(0, 2**31)) for _ in range(t)]
        # relative weights of the four parts (dense, id bias, pair interactions, dense x id), each
        # normalised by its number of terms; then one scale is fitted so the logit has std `logit_scale`.
        # Interactions weigh less than the per-id effects: learning a factorisation from scratch needs
        # far more samples than a quick run has, and the ceiling should be reachable by a good model.
        w = spec.part_weights
        self.part_scale = np.array(
            [w[0], w[1] / math.sqrt(t), w[2] / math.sqrt(max(len(self.pairs), 1)), w[3] / math.sqrt(t)]
        )
        self.scale, self.bias = 1.0, 0.0
        self._calibrate()

    def scatter(self, table: int, ranks: np.ndarray) -> np.ndarray:
        rows = self.spec.rows[table]
        if rows >= _SCATTER:  # pragma: no cover - tables this large never reach the prime
            return (ranks + self.shift[table]) % rows
        return (ranks * _SCATTER + self.shift[table]) % rows

    def logits(self, dense_std: np.ndarray, bags: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> np.ndarray:
        """dense_std [n, d] standardised dense; bags[t] = (ids, lengths [n], weights) -> logits [n]."""
        n, k = dense_std.shape[0], self.spec.latent_dim
        bias = np.zeros(n, np.float64)
        latent = np.zeros((self.spec.num_sparse, n, k), np.float64)
        for t, (ids, lengths, _) in enumerate(bags):
            params = _hash_uniform(ids, self.key[t], k + 1).astype(np.float64)
            if ids.size == n and (lengths == 1).all():
                pooled = params
            else:  # mean over the bag: the teacher sees a bag as its average id (empty bag: zeros)
                seg = np.repeat(np.arange(n), lengths)
                pooled = np.stack([np.bincount(seg, params[:, c], minlength=n) for c in range(k + 1)], 1).astype(np.float64)
                pooled /= np.maximum(lengths, 1)[:, None]
            bias += pooled[:, 0]
            latent[t] = pooled[:, 1:]
        inter = np.zeros(n)
        for i, j in self.pairs:
            inter += (latent[i] * latent[j]).sum(1) / math.sqrt(k)
        t = self.spec.num_sparse  # dense x id: a per-table projection of the dense vector meets the id's latent
        proj = dense_std @ self.dense_to_latent.transpose(1, 0, 2).reshape(dense_std.shape[1], t * k)
        cross = (proj.reshape(n, t, k) * latent.transpose(1, 0, 2)).sum((1, 2))
        parts = np.stack([dense_std @ self.w_dense, bias, inter, cross], 1) * self.part_scale
        return parts.sum(1) * self.scale + self.bias

    def _calibrate(self) -> None:
        """Fit the logit's scale (std = logit_scale) and offset (mean CTR = base_ctr) on a fixed sample.
        The fit is a function of the spec's teacher settings alone, so it is made once per process
        (a multi-hot teacher takes seconds: a run that plans builds its data twice)."""
        key = repr(replace(self.spec, train_samples=0, eval_samples=0, labels=None))
        if key not in _CALIBRATED:
            _CALIBRATED[key] = self._fit()
        self.scale, self.bias = _CALIBRATED[key]

    def _fit(self) -> tuple[float, float]:
        """(scale, bias) fitted on the calibration sample."""
        self.scale, self.bias = 1.0, 0.0
        dense, _, bags = _draw(self, np.random.default_rng([self.spec.seed, 99]), 20000)
        raw = self.logits(dense, bags)  # scale 1, bias 0 here
        scale = self.spec.logit_scale / max(float(raw.std()), 1e-9)
        z = raw * scale
        lo, hi = -30.0, 30.0  # bisection: mean CTR grows with the offset
        for _ in range(60):
            mid = (lo + hi) / 2
            if (1 / (1 + np.exp(-(z + mid)))).mean() < self.spec.base_ctr:
                lo = mid
            else:
                hi = mid
        return scale, lo


def _draw(teacher: Teacher, rng: np.random.Generator, n: int):
    """n samples of features: (standardised dense [n, d], raw log1p dense [n, d], bags)."""
    spec = teacher.spec
    z = rng.standard_normal((n, spec.num_dense))
    counts = np.floor(np.exp(teacher.dense_mu + teacher.dense_sigma * z)) - 1.0
    dense_log = np.log1p(np.maximum(counts, 0.0))
    # the teacher sees exactly what the model sees (the log counts), only centred and scaled
    dense_std = (dense_log - teacher.dense_mu) / teacher.dense_sigma
    bags = []
    for t, rows in enumerate(spec.rows):
        if spec.bag_sizes is None:
            lengths = np.ones(n, np.int64)
        elif spec.variable_bags:
            lengths = rng.poisson(spec.bag_sizes[t], n).astype(np.int64)
        else:
            lengths = np.full(n, spec.bag_sizes[t], np.int64)
        ids = teacher.scatter(t, zipf_ranks(rng, int(lengths.sum()), rows, spec.zipf_alpha))
        w = rng.uniform(0.0, 1.0, ids.size).astype(np.float32) + np.float32(1e-3) if spec.weighted else None
        bags.append((ids.astype(np.int64), lengths, w))
    return dense_std, dense_log.astype(np.float32), bags


_SPLITS = {"train": 1, "eval": 2}
_RAW_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: x -> x * m + k is a bijection modulo 2^63


def raw_ids(ids: np.ndarray, key: int) -> np.ndarray:
    """In-table ids -> distinct raw ids in [0, 2^63), scattered over the whole range."""
    with np.errstate(over="ignore"):
        raw = ids.astype(np.uint64) * _RAW_MULTIPLIER + np.uint64(key)
    return (raw & np.uint64((1 << 63) - 1)).astype(np.int64)


class SyntheticSource:
    """A DataSource of synthetic Criteo-like data (see the module docstring)."""

    def __init__(
        self,
        spec: SyntheticSpec,
        cache: bool = True,
        device: torch.device | str = "cpu",
        raw_features: set[str] | frozenset[str] = frozenset(),
        generator: str = "host",
    ) -> None:
        """cache: keep every block once drawn. device: where the kept blocks live, so that on a GPU
        batches are cut from device memory with no host-to-device copy per step. generator: host
        draws each block with numpy (the same samples on every device; on a GPU the first pass
        moves each block there once); device draws it with torch on `device`
        (neorec/data/synthetic_device.py: the same distribution, another random stream).
        raw_features: features that carry raw 63-bit ids (managed-collision tables) instead of ids
        in [0, rows)."""
        if generator not in ("host", "device"):
            raise ConfigError(f"data.synthetic.generator must be host or device, got {generator!r}")
        self.spec = spec
        self.device = torch.device(device)
        self.teacher = Teacher(spec)
        self.generator = generator
        self._draw = None
        if generator == "device":
            from neorec.data.synthetic_device import DeviceDraw

            self._draw = DeviceDraw(self.teacher, self.device)
        self.cache = cache
        self._blocks: dict[tuple[str, int], Block] = {}
        self.keys = [f"C{i + 1}" for i in range(spec.num_sparse)]
        unknown = sorted(set(raw_features) - set(self.keys))
        if unknown:
            raise ConfigError(f"raw-id features {unknown} are not features of the synthetic data: {self.keys}")
        self.raw = [k in raw_features for k in self.keys]
        multi = spec.bag_sizes is not None
        features = [FeatureSpec(k, r, multi_hot=multi, weighted=spec.weighted) for k, r in zip(self.keys, spec.rows, strict=True)]
        self.info = SourceInfo(num_dense=spec.num_dense, features=features, num_train_samples=spec.train_samples)
        # every drawn id lies in its table (raw ids: in [0, 2^63)), which the engines' id check trusts
        highs = [(1 << 63) - 1 if raw else rows - 1 for raw, rows in zip(self.raw, spec.rows, strict=True)]
        self._id_limits = ([0] * spec.num_sparse, highs)
        self._teacher_auc: float | None = None
        self._resume: tuple[int, int] | None = None  # (epoch, samples) to start the next pass of that epoch at

    def block(self, split: str, index: int) -> Block:
        """Block `index` of `split`: a pure function of (seed, split, index)."""
        key = (split, index)
        if key in self._blocks:
            return self._blocks[key]
        total = self.spec.train_samples if split == "train" else self.spec.eval_samples
        n = min(BLOCK, total - index * BLOCK)
        if n <= 0:
            raise IndexError(f"{split} block {index} is past the end ({total} samples)")
        if self._draw is not None:
            block = self._draw.block(_SPLITS[split], index, n, self.raw)
            block.id_limits = self._id_limits
            if self.cache:
                self._blocks[key] = block
            return block
        rng = np.random.default_rng([self.spec.seed, _SPLITS[split], index])
        dense_std, dense_log, bags = _draw(self.teacher, rng, n)
        probs = 1.0 / (1.0 + np.exp(-self.teacher.logits(dense_std, bags)))
        labels = (rng.random(n) < probs).astype(np.float32)
        if self.spec.labels is not None:
            labels = task_labels(self.spec.labels, labels, rng.random(n) < probs)
        block = Block(
            torch.from_numpy(dense_log),
            torch.from_numpy(labels),
            torch.from_numpy(probs.astype(np.float32)),
            [
                torch.from_numpy(raw_ids(ids, self.teacher.key[t]) if self.raw[t] else ids)
                for t, (ids, _, _) in enumerate(bags)
            ],
            [torch.from_numpy(ln) for _, ln, _ in bags],
            [torch.from_numpy(w) for _, _, w in bags] if self.spec.weighted else None,
        )
        block.id_limits = self._id_limits
        if self.device.type != "cpu":
            block = block.to(self.device)
        if self.cache:
            self._blocks[key] = block
        return block

    def num_blocks(self, split: str) -> int:
        total = self.spec.train_samples if split == "train" else self.spec.eval_samples
        return (total + BLOCK - 1) // BLOCK

    def _block_size(self, split: str, index: int) -> int:
        total = self.spec.train_samples if split == "train" else self.spec.eval_samples
        return min(BLOCK, total - index * BLOCK)

    def _blocks_in_order(self, split: str, epoch: int | None, start: int = 0) -> Iterator[Block]:
        """The epoch's samples from sample `start` on; blocks wholly before it are not drawn."""
        order = list(range(self.num_blocks(split)))
        gen = None
        if epoch:  # epoch 0 reads in order: the samples are i.i.d. already
            gen = torch.Generator().manual_seed(self.spec.seed * 7919 + epoch)
            order = torch.randperm(len(order), generator=gen).tolist()
        pos = 0
        for b in order:
            n = self._block_size(split, b)
            # the permutation is drawn for skipped blocks too, so the generator's sequence is unchanged
            perm = torch.randperm(n, generator=gen) if gen is not None else None
            skip, pos = max(start - pos, 0), pos + n
            if skip >= n:
                continue
            block = self.block(split, b)
            if perm is not None:
                yield block.take(perm[skip:] if skip else perm)
            else:
                yield block.slice(skip, n) if skip else block

    def _train_blocks(self, epoch: int) -> Iterator[Block]:
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start, self._resume = self._resume[1], None
        return self._blocks_in_order("train", epoch, start)

    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        return rebatch(self._train_blocks(epoch), batch_size, self.keys)

    def train_slices(self, batch_size: int, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s slice of every training batch of `batch_size` (see `rebatch`)."""
        return rebatch(self._train_blocks(epoch), batch_size, self.keys, rank, world_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        return rebatch(self._blocks_in_order("eval", None), batch_size, self.keys)

    # ---- resume --------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What resuming checks besides the position: the data's seed and size, and where its samples are
        drawn (a device generator's random stream is not the host's)."""
        return {"seed": self.spec.seed, "train_samples": self.spec.train_samples, "generator": self.generator}

    def load_state(self, state: dict) -> None:
        """Make the next training pass over `state["epoch"]` start after `state["samples"]` samples."""
        for key, now in self.state().items():
            if key in state and state[key] != now:
                raise ConfigError(
                    f"data position was saved with synthetic {key}={state[key]!r}, this data has {now!r}: "
                    "resuming exactly needs the same data.synthetic settings and seed"
                )
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if not 0 <= samples <= self.spec.train_samples:
            raise DataError(f"data position: samples {samples} is outside [0, {self.spec.train_samples}]")
        self._resume = (epoch, samples)

    def teacher_auc(self) -> float | None:
        """AUC of the teacher's true probabilities on the held-out set: the ceiling for any model. The
        teacher's are the click label's: None where the primary label (a multi-task run's first) is
        another, whose ceiling it is not."""
        names = list(self.spec.labels or ())
        if names and names[0] != "click":
            return None
        if self._teacher_auc is None:
            from neorec.metrics.auc import auc

            blocks = [self.block("eval", i) for i in range(self.num_blocks("eval"))]
            probs, labels = (torch.cat([getattr(b, k) for b in blocks]).cpu() for k in ("probs", "labels"))
            if labels.dim() == 2:  # the teacher's probabilities are the click label's, the first
                labels = labels[:, 0]
            self._teacher_auc = auc(probs, labels)
            self.info.notes["teacher_auc"] = self._teacher_auc
        return self._teacher_auc


LABELS = ("click", "conversion")


def task_labels(names: tuple[str, ...], click: np.ndarray, again: np.ndarray) -> np.ndarray:
    """Labels [n, T] of `names` (see the module docstring) from the click labels and a second draw."""
    columns = {"click": click, "conversion": click * again.astype(np.float32)}
    return np.stack([columns[name] for name in names], axis=1).astype(np.float32)


def spec_from_config(c, seed: int, labels: list[str] | None = None) -> SyntheticSpec:
    """SyntheticSpec from the config's `data.synthetic` section (a neorec.config.schema.SyntheticConfig)."""
    if c.preset == "criteo_kaggle":
        rows = list(CRITEO_KAGGLE_ROWS)
    elif c.preset == "mlperf":
        rows = list(MLPERF_ROWS)
    else:
        rows = list(c.rows) if isinstance(c.rows, list) else [c.rows] * c.num_sparse
    rows = [max(1, int(r * c.row_scale)) for r in rows]
    if c.max_rows is not None:
        rows = [min(r, c.max_rows) for r in rows]
    if c.multi_hot == "none":
        bags = None
    elif c.multi_hot == "mlperf":
        bags = list(MLPERF_MULTI_HOT)
    else:
        bags = list(c.multi_hot)
    return SyntheticSpec(
        rows=rows,
        num_dense=c.num_dense,
        zipf_alpha=c.zipf_alpha,
        bag_sizes=bags,
        variable_bags=c.variable_bags,
        weighted=c.weighted,
        latent_dim=c.latent_dim,
        num_pairs=c.num_pairs,
        logit_scale=c.logit_scale,
        base_ctr=c.base_ctr,
        train_samples=c.train_samples,
        eval_samples=c.eval_samples,
        seed=seed,
        labels=tuple(labels) if labels is not None else None,
    )
