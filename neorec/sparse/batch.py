"""The keyed jagged batch of categorical ids that flows from the reader to the embedding lookup.

Layout is feature-major: `values` holds all ids of feature 0 for samples 0..B-1, then feature 1, and
so on; `lengths[f * B + b]` is the number of ids of feature f in sample b. One-hot features have all
lengths 1, multi-hot features any length >= 0 (an empty bag pools to zeros). Optional `weights` give
one float per id (weighted features). Offsets are derived from lengths when first needed and cached.

Everything that crosses a process boundary is this structure or a plain tensor, so it must stay cheap
to move between devices and to split and concatenate by feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from neorec.errors import DataError


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] offsets starting at 0 (int64)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


class SparseBatch:
    """Categorical ids of a batch for several features, in one flat tensor per field."""

    __slots__ = (
        "keys", "values", "lengths", "weights", "_offsets", "_length_per_key", "_id_limits", "_basis",
        "_host_lengths",
    )  # fmt: skip

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        length_per_key: Sequence[int] | None = None,
        id_limits: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> None:
        """length_per_key: the number of ids of each feature, where whoever made the batch knows them
        on the host (a batch on a GPU then never reads them back). id_limits: (lows, highs), per
        feature bounds its maker knows every id to lie within (see `id_limits()`)."""
        self.keys = list(keys)
        self.values = values
        self.lengths = lengths
        self.weights = weights
        self._offsets: torch.Tensor | None = None
        self._length_per_key: list[int] | None = None
        self._id_limits: tuple[list[int], list[int]] | None = None
        self._basis = self.stamp()
        # the host lengths a device batch was copied from, and their version then
        self._host_lengths: tuple[torch.Tensor, int] | None = None
        if id_limits is not None:
            lows, highs = id_limits
            if len(lows) != len(self.keys) or len(highs) != len(self.keys):
                raise DataError(f"SparseBatch id_limits need one low and one high per feature of {self.keys}")
            self._id_limits = ([int(x) for x in lows], [int(x) for x in highs])
        if length_per_key is not None:
            self._length_per_key = [int(n) for n in length_per_key]
            if len(self._length_per_key) != len(self.keys) or sum(self._length_per_key) != values.numel():
                raise DataError(
                    f"SparseBatch length_per_key {self._length_per_key} does not match the {len(self.keys)} "
                    f"features {self.keys} and their {values.numel()} ids"
                )
        if values.dtype not in (torch.int64, torch.int32):  # ids past int64 (uint64) or floats are no ids
            raise DataError(f"SparseBatch ids are {values.dtype}; ids are int64 (or int32)")
        if lengths.dtype not in (torch.int64, torch.int32):
            raise DataError(f"SparseBatch lengths are {lengths.dtype}; lengths are int64 (or int32)")
        if weights is not None and not weights.is_floating_point():
            raise DataError(f"SparseBatch weights are {weights.dtype}; weights are floats, one per id")
        named = (("ids", values), ("lengths", lengths), ("weights", weights))
        flat = [(n, t) for n, t in named if t is not None]
        if any(t.dim() != 1 for _, t in flat):
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in flat)
            raise DataError(f"SparseBatch ids, lengths and weights are flat (1-D) tensors, not {shapes}")
        if weights is not None and weights.numel() != values.numel():
            raise DataError(f"SparseBatch has {weights.numel()} weights for {values.numel()} ids: one per id")
        if len(set(self.keys)) != len(self.keys):
            twice = sorted({k for k in self.keys if self.keys.count(k) > 1})
            raise DataError(f"SparseBatch features {self.keys} name {twice} twice: one entry a feature")
        if len(self.keys) == 0:
            if lengths.numel() != 0:
                raise DataError("SparseBatch has no features but non-empty lengths")
        elif lengths.numel() % len(self.keys) != 0:
            raise DataError(
                f"SparseBatch lengths has {lengths.numel()} entries, not a multiple of the "
                f"{len(self.keys)} features {self.keys}: every feature needs one length per sample"
            )

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_features(
        cls,
        features: Mapping[str, tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> SparseBatch:
        """Build from {feature: (values, lengths[, weights])}; all features need the same batch size."""
        keys = list(features)
        sizes = {k: v[1].numel() for k, v in features.items()}
        if len(set(sizes.values())) > 1:
            raise DataError(f"features have different batch sizes: {sizes}")
        has_w = [len(v) == 3 and v[2] is not None for v in features.values()]
        for (k, v), weighted in zip(features.items(), has_w, strict=True):
            _check_integer_ids(v[0], k)
            if v[1].is_floating_point() or v[1].dtype == torch.bool:
                raise DataError(f"feature {k!r}: lengths must be an integer tensor, got {v[1].dtype}")
            if any(t.dim() != 1 for t in v[: 2 + weighted]):
                shapes = [tuple(t.shape) for t in v[: 2 + weighted]]
                raise DataError(f"feature {k!r}: ids, lengths and weights are flat (1-D), not {shapes}")
            if weighted and v[2].numel() != v[0].numel():
                raise DataError(f"feature {k!r}: {v[2].numel()} weights for {v[0].numel()} ids: one per id")
        counts = torch.stack([features[k][1].sum() for k in keys]).tolist() if keys else []
        for k, n in zip(keys, counts, strict=True):
            if n != features[k][0].numel():
                raise DataError(f"feature {k!r}: {features[k][0].numel()} ids but its lengths sum to {n}")
        values = torch.cat([features[k][0].to(torch.int64) for k in keys]) if keys else torch.empty(0, dtype=torch.int64)
        lengths = torch.cat([features[k][1].to(torch.int64) for k in keys]) if keys else torch.empty(0, dtype=torch.int64)
        weights = None
        if any(has_w):
            weights = torch.cat(
                [
                    features[k][2].to(torch.float32) if has_w[i] else torch.ones(features[k][0].numel())
                    for i, k in enumerate(keys)
                ]
            )
            weighted = [k for k, w in zip(keys, has_w, strict=True) if w]
            finite = torch.stack([torch.isfinite(features[k][2]).all() for k in weighted]).tolist()
            for k, ok in zip(weighted, finite, strict=True):
                if not ok:
                    raise DataError(f"feature {k!r}: a weight is NaN or infinite; it would train its rows")
        return cls(keys, values, lengths, weights)

    @classmethod
    def from_dense_ids(cls, keys: Sequence[str], ids: torch.Tensor) -> SparseBatch:
        """One-hot features from a [B, F] id matrix (column f is feature keys[f])."""
        if ids.dim() != 2 or ids.shape[1] != len(keys):
            raise DataError(f"expected ids of shape [B, {len(keys)}], got {tuple(ids.shape)}")
        _check_integer_ids(ids, ", ".join(keys))
        values = ids.t().contiguous().reshape(-1).to(torch.int64)
        lengths = torch.ones(values.numel(), dtype=torch.int64, device=ids.device)
        return cls(keys, values, lengths)

    # ---- derived views -------------------------------------------------------------------------
    @property
    def num_features(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    @property
    def device(self) -> torch.device:
        return self.values.device

    def stamp(self) -> tuple:
        """What the ids, lengths and weights are now, for what is derived from them (offsets, counts,
        id limits, a checked copy, a prefetch's prepared ids and weights): the tensors and their
        versions (torch counts every in-place write of a tensor, or of a view of it); `unchanged_since`
        compares."""
        w = self.weights
        return (self.values, self.lengths, w, _version(self.values), _version(self.lengths),
                -2 if w is None else _version(w))  # fmt: skip

    def unchanged_since(self, stamp: tuple) -> bool:
        """Whether the ids, lengths and weights are those `stamp()` saw (the same tensors, not written
        since)."""
        values, lengths, weights, v_values, v_lengths, v_weights = stamp  # called on every derived view
        return (
            values is self.values and lengths is self.lengths and weights is self.weights
            and v_values == _version(values) and v_lengths == _version(lengths)
            and (weights is None or v_weights == _version(weights))
        )  # fmt: skip

    def check_unchanged_since(self, stamp: tuple, when: str) -> None:
        """DataError unless the ids, lengths and weights are those `stamp()` saw `when` (e.g. at a
        prefetch whose work on the old ones would otherwise train this batch)."""
        if not self.unchanged_since(stamp):
            raise DataError(
                f"this SparseBatch's ids, lengths or weights were changed (in place, or replaced) after "
                f"{when}; what was done then holds the old ones: change a copy of a batch after {when}, not "
                "the batch"
            )

    def _derived(self) -> SparseBatch:
        """This batch, its cached offsets, counts and id limits dropped first if its ids or lengths
        changed since they were found (written in place, or replaced): the id check of every engine
        reads the limits, and stale ones would pass an id outside its table."""
        if not self.unchanged_since(self._basis):
            self._offsets = self._length_per_key = self._id_limits = self._host_lengths = None
            self._basis = self.stamp()
        return self

    def offsets(self) -> torch.Tensor:
        """[F * B + 1] offsets of each bag into `values` (cached)."""
        if self._derived()._offsets is None:
            self._offsets = lengths_to_offsets(self.lengths)
        return self._offsets

    def length_per_key(self) -> list[int]:
        """Number of ids of each feature (cached; one host sync the first time). Lengths that are
        negative, or do not add up to the ids, are a DataError: each feature's ids would be read from
        the next one's, past the checks of their tables' bounds."""
        if self._derived()._length_per_key is None:
            if not self.keys:
                self._length_per_key = []
            else:
                per_key = self.lengths.view(len(self.keys), -1)
                least = per_key.min(1).values if per_key.numel() else per_key.new_zeros(len(self.keys))
                found = torch.cat([per_key.sum(1), least]).tolist()  # one host read
                counts, least = found[: len(self.keys)], found[len(self.keys) :]
                if min(least) < 0:
                    key = self.keys[next(f for f, n in enumerate(least) if n < 0)]
                    raise DataError(f"feature {key!r}: a negative length (ids in a bag) in this batch")
                if sum(counts) != self.values.numel():
                    raise DataError(
                        f"lengths sum to {sum(counts)} but there are {self.values.numel()} ids (features "
                        f"{self.keys}, batch size {self.batch_size})"
                    )
                self._length_per_key = counts
        return self._length_per_key

    def id_limits(self) -> tuple[list[int], list[int]]:
        """(lows, highs): every id of feature f lies in [lows[f], highs[f]] (an empty feature has
        (0, -1)). Computed once (a few reductions and one host read, cached on the batch), or known
        already: bounds given by the batch's maker, or kept from the batch it was cut from, which
        hold but need not be the exact extremes. The id check of every engine reads them
        (neorec/sparse/bounds.py); a reader counts them on the host before a batch goes to a GPU."""
        limits = self._derived()._id_limits
        return limits if limits is not None else self.exact_id_limits()

    def exact_id_limits(self) -> tuple[list[int], list[int]]:
        """`id_limits()` computed from the ids themselves, replacing limits a maker gave (bounds that
        may be wider: a slice keeps its batch's)."""
        self._id_limits = _id_limits(self.values, self.length_per_key(), self.weights, self.keys)
        return self._id_limits

    def known_id_limits(self) -> tuple[list[int], list[int]] | None:
        """The id limits if known without any work, else None."""
        return self._derived()._id_limits

    def host_lengths(self, key: str) -> torch.Tensor | None:
        """Feature `key`'s lengths on the host without reading the device: those of a batch on the
        CPU, or those a device batch was copied from (`to`); None when neither is known."""
        if self.lengths.device.type == "cpu":
            lengths = self.lengths
        elif (copied := self._derived()._host_lengths) is None or _version(copied[0]) != copied[1]:
            return None  # not known, or the host tensor was written since (a buffer refilled)
        else:
            lengths = copied[0]
        b = self.batch_size
        f = self._index(key)
        return lengths[f * b : (f + 1) * b]

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def feature(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, lengths, weights) of one feature; views, no copy."""
        f = self._index(key)
        b = self.batch_size
        start, end = self.offset_per_key()[f], self.offset_per_key()[f + 1]
        w = self.weights[start:end] if self.weights is not None else None
        return self.values[start:end], self.lengths[f * b : (f + 1) * b], w

    def _index(self, key: str) -> int:
        try:
            return self.keys.index(key)
        except ValueError:
            raise DataError(f"feature {key!r} is not in this batch; it has {self.keys}") from None

    # ---- checks -------------------------------------------------------------------------------
    def validate(self, num_rows: Mapping[str, int] | None = None) -> None:
        """Raise DataError naming the feature if ids, lengths or weights are inconsistent.

        num_rows maps each feature to the number of rows of the table it looks up; ids must lie in
        [0, rows). The engines check ids on every batch themselves (IdBounds, neorec/sparse/bounds.py,
        with the table and sample named); this is the whole structure's check, for tests and tools.
        """
        if self.values.dtype != torch.int64:
            raise DataError(f"ids must be int64, got {self.values.dtype}")
        if self.lengths.dim() != 1 or self.values.dim() != 1:
            raise DataError("values and lengths must be 1-D tensors")
        if self.keys and (self.lengths < 0).any():
            f = int((self.lengths < 0).nonzero()[0, 0]) // self.batch_size
            raise DataError(f"feature {self.keys[f]!r}: negative length")
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.numel():
            raise DataError(
                f"lengths sum to {total} but there are {self.values.numel()} ids "
                f"(features {self.keys}, batch size {self.batch_size})"
            )
        if self.weights is not None and self.weights.numel() != self.values.numel():
            raise DataError(f"{self.weights.numel()} weights for {self.values.numel()} ids")
        if len(set(self.keys)) != len(self.keys):
            raise DataError(f"duplicate feature names in {self.keys}")
        lows, highs = self.id_limits()
        for f, key in enumerate(self.keys):
            lo, hi = lows[f], highs[f]
            if lo > hi:  # no ids
                continue
            if lo < 0:
                raise DataError(f"feature {key!r}: negative id {lo}")
            if num_rows is not None:
                if key not in num_rows:
                    raise DataError(f"feature {key!r} has no table; tables cover {sorted(num_rows)}")
                if hi >= num_rows[key]:
                    raise DataError(f"feature {key!r}: id {hi} >= table rows {num_rows[key]}")

    # ---- reshaping -----------------------------------------------------------------------------
    def select(self, keys: Sequence[str]) -> SparseBatch:
        """A new batch with only `keys`, in that order (copies the selected ids)."""
        idx = [self._index(k) for k in keys]
        b = self.batch_size
        bounds = self.offset_per_key()
        values = [self.values[bounds[i] : bounds[i + 1]] for i in idx]
        lengths = [self.lengths[i * b : (i + 1) * b] for i in idx]
        weights = None
        if self.weights is not None:
            weights = _cat([self.weights[bounds[i] : bounds[i + 1]] for i in idx], self.weights)
        out = SparseBatch(keys, _cat(values, self.values), _cat(lengths, self.lengths), weights)
        out._length_per_key = [self.length_per_key()[i] for i in idx]
        limits = self.known_id_limits()
        if limits is not None:
            out._id_limits = ([limits[0][i] for i in idx], [limits[1][i] for i in idx])
        return out

    def slice_samples(self, start: int, end: int) -> SparseBatch:
        """Samples [start, end) of every feature (what one rank of a data-parallel group trains on)."""
        b = self.batch_size
        if not 0 <= start <= end <= b:
            raise DataError(f"sample range [{start}, {end}) outside a batch of {b}")
        offsets = self.offsets().view(-1)
        firsts = offsets[torch.arange(self.num_features) * b + start].tolist() if self.keys else []
        lasts = offsets[torch.arange(self.num_features) * b + end].tolist() if self.keys else []
        values = [self.values[a:z] for a, z in zip(firsts, lasts, strict=True)]
        lengths = self.lengths.view(self.num_features, b)[:, start:end].reshape(-1)
        weights = None
        if self.weights is not None:
            weights = _cat([self.weights[a:z] for a, z in zip(firsts, lasts, strict=True)], self.weights)
        per_key = [z - a for a, z in zip(firsts, lasts, strict=True)]
        limits = self.known_id_limits()
        return SparseBatch(self.keys, _cat(values, self.values), lengths, weights, per_key, limits)

    def permute(self, order: Sequence[int]) -> SparseBatch:
        """Reorder features: result feature j is this batch's feature order[j]."""
        return self.select([self.keys[i] for i in order])

    def split(self, groups: Sequence[Sequence[str]]) -> list[SparseBatch]:
        """One batch per group of feature names (e.g. one per rank that owns those tables)."""
        return [self.select(g) for g in groups]

    @staticmethod
    def concat(batches: Sequence[SparseBatch]) -> SparseBatch:
        """Concatenate batches of the same batch size along the feature axis."""
        if not batches:
            return SparseBatch([], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        sizes = {b.batch_size for b in batches if b.keys}
        if len(sizes) > 1:
            raise DataError(f"cannot concatenate batches of different batch sizes {sorted(sizes)}")
        keys = [k for b in batches for k in b.keys]
        if len(set(keys)) != len(keys):
            raise DataError(f"cannot concatenate batches with repeated features: {keys}")
        weights = None
        if any(b.weights is not None for b in batches):
            weights = torch.cat(
                [b.weights if b.weights is not None else torch.ones(b.values.numel(), device=b.device) for b in batches]
            )
        for b in batches:
            b._derived()
        known = all(b._length_per_key is not None for b in batches)
        per_key = [n for b in batches for n in b._length_per_key] if known else None  # type: ignore[union-attr]
        limits = None
        if all(b._id_limits is not None for b in batches):
            limits = ([x for b in batches for x in b._id_limits[0]], [x for b in batches for x in b._id_limits[1]])  # type: ignore[index]
        return SparseBatch(
            keys, torch.cat([b.values for b in batches]), torch.cat([b.lengths for b in batches]), weights, per_key,
            limits,
        )  # fmt: skip

    # ---- devices -------------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseBatch:
        """The batch on `device`; the batch itself when it is there already (as torch.Tensor.to), so
        that a batch prefetched by the embedding cache is recognised at its lookup."""
        values = self.values.to(device, non_blocking=non_blocking)
        lengths = self.lengths.to(device, non_blocking=non_blocking)
        weights = self.weights.to(device, non_blocking=non_blocking) if self.weights is not None else None
        if values is self.values and lengths is self.lengths and weights is self.weights:
            return self
        self._derived()
        out = SparseBatch(self.keys, values, lengths, weights, self._length_per_key, self._id_limits)
        on_host = self._host_lengths
        if self.lengths.device.type == "cpu":
            on_host = (self.lengths, _version(self.lengths))
        out._host_lengths = on_host if lengths.device.type != "cpu" else None
        return out

    def pin_memory(self) -> SparseBatch:
        self._derived()
        return SparseBatch(
            self.keys,
            self.values.pin_memory(),
            self.lengths.pin_memory(),
            self.weights.pin_memory() if self.weights is not None else None,
            self._length_per_key,
            self._id_limits,
        )

    def __repr__(self) -> str:
        w = ", weighted" if self.weights is not None else ""
        return f"SparseBatch(features={self.keys}, batch_size={self.batch_size}, ids={self.values.numel()}{w})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparseBatch):
            return NotImplemented
        same_w = (self.weights is None) == (other.weights is None) and (
            self.weights is None or torch.equal(self.weights, other.weights)
        )
        return (
            self.keys == other.keys
            and torch.equal(self.values, other.values)
            and torch.equal(self.lengths, other.lengths)
            and same_w
        )

    __hash__ = None  # type: ignore[assignment]


def _version(t: torch.Tensor) -> int:
    """The count of in-place writes of `t` (-1 for an inference-mode tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


def _check_integer_ids(ids: torch.Tensor, feature: str) -> None:
    """Ids are integers: a float tensor given as ids would be truncated (1.7 -> row 1) without a word."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise DataError(f"feature {feature!r}: ids must be an integer tensor, got {ids.dtype}")


def _id_limits(
    values: torch.Tensor, per_key: list[int], weights: torch.Tensor | None, keys: list[str]
) -> tuple[list[int], list[int]]:
    """Each feature's smallest and largest id ((0, -1) when it has none), with one host read, which
    also tells whether every weight is finite (else a DataError naming the feature: a NaN weight
    would train its rows NaN)."""
    if not per_key:
        return [], []
    if len(set(per_key)) == 1 and per_key[0]:  # every feature has as many ids (one-hot): one reduction
        low, high = values.view(len(per_key), -1).aminmax(dim=1)
    else:
        parts = [p.aminmax() for p in values.split(per_key) if p.numel()]
        if not parts:
            return [0] * len(per_key), [-1] * len(per_key)
        low, high = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    found = torch.stack([low, high])
    if weights is not None:
        finite = torch.isfinite(weights).all().to(found.dtype).expand(2, 1)
        found = torch.cat([found, finite], dim=1).tolist()
        if not found[0].pop():
            ok = torch.stack([torch.isfinite(w).all() for w in weights.split(per_key)]).tolist()
            key = keys[ok.index(False)]
            raise DataError(f"feature {key!r}: a weight is NaN or infinite; it would train its rows")
        found[1].pop()
    else:
        found = found.tolist()
    if len(found[0]) == len(per_key):
        return found[0], found[1]
    lows, highs, it = [], [], iter(zip(*found, strict=True))
    for n in per_key:
        lo, hi = next(it) if n else (0, -1)
        lows.append(lo)
        highs.append(hi)
    return lows, highs
