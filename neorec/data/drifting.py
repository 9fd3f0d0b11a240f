"""A synthetic stream of daily Parquet partitions whose vocabulary and teacher move day by day
(`neorec data stream`): the data of continuous training (docs/continuous.md, benchmarks/continuous.py).

Day d, feature f (c0, c1, ...): the ids in use are a window of `vocab` consecutive id numbers starting
at d * shift, so each day `shift` ids leave and `shift` new ones come; an id number g is written as the
raw id g * 7919 + f (large, sparse values: a table needs an id map or hashing). Within the window, ids
are drawn with Zipf(1.05) popularity over an order fixed by a hash of the id, so new ids are as likely
to be popular as old ones.

The teacher: logit = bias + sum_f e_f(g, d) + dense . w(d), with e_f(g, d) = a cos(omega d) + b sin(omega d)
(a, b ~ N(0, effect_std) drawn from a hash of (f, g)) and w(d) = dense_weight (cos(omega d), sin(omega d)):
what an id means turns slowly, and new ids bring effects no model has seen. Dense values are N(0, 1);
the label is Bernoulli(sigmoid(logit)).

Every partition is written as DIR/day-NNN/part-0.parquet, then DIR/day-NNN/_SUCCESS (a producer's
marker, written last), each through neorec's atomic writer. Everything is a pure function of the
seed and the day, so partitions can be written in any order and rewritten identically.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.utils.files import write_atomic, write_text
from neorec.utils.hashing import splitmix64

ID_STRIDE = 7919  # raw id = id number * ID_STRIDE + feature


@dataclass(frozen=True)
class DriftSpec:
    rows: int = 20_000  # samples per day
    num_features: int = 4
    num_dense: int = 2
    vocab: int = 2000  # ids in use per feature and day
    shift: int = 500  # ids replaced per day
    omega: float = 0.3  # radians per day the teacher turns
    effect_std: float = 0.8
    dense_weight: float = 0.5
    bias: float = -1.0
    row_group: int = 4096
    seed: int = 0


def partition_name(day: int) -> str:
    return f"day-{day:03d}"


def _hash_uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """Uniforms in (0, 1) from a hash of integer `keys` and `salt`."""
    bits = splitmix64(splitmix64(keys.astype(np.uint64)) ^ np.uint64(salt))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _hash_normal(keys: np.ndarray, salt: int) -> np.ndarray:
    u1, u2 = _hash_uniform(keys, 2 * salt + 1), _hash_uniform(keys, 2 * salt + 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)


def day_table(spec: DriftSpec, day: int) -> pa.Table:
    """The samples of one day, as a table: label, d0.., c0.. (raw int64 ids)."""
    rng = np.random.default_rng([spec.seed, day])
    n = spec.rows
    angle = spec.omega * day
    logit = np.full(n, spec.bias)
    columns: dict[str, np.ndarray] = {}
    dense = rng.standard_normal((n, spec.num_dense)).astype(np.float32)
    turn = np.array([np.cos(angle), np.sin(angle)] * spec.num_dense)[: spec.num_dense]
    logit += dense.astype(np.float64) @ (spec.dense_weight * turn)
    zipf = 1.0 / np.arange(1, spec.vocab + 1) ** 1.05
    zipf /= zipf.sum()
    for f in range(spec.num_features):
        window = np.arange(day * spec.shift, day * spec.shift + spec.vocab, dtype=np.int64)
        keys = window * 64 + f
        by_popularity = window[np.argsort(_hash_uniform(keys, spec.seed * 8 + 1), kind="stable")]
        g = by_popularity[rng.choice(spec.vocab, size=n, p=zipf)]
        key = g * 64 + f
        seed = spec.seed * 8 + 2
        effect = _hash_normal(key, seed) * np.cos(angle) + _hash_normal(key, seed + 1) * np.sin(angle)
        logit += spec.effect_std * effect
        columns[f"c{f}"] = g * ID_STRIDE + f
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    out = {"label": labels, **{f"d{j}": dense[:, j] for j in range(spec.num_dense)}, **columns}
    return pa.table(out)


def write_day(spec: DriftSpec, out: str | Path, day: int, marker: str = "_SUCCESS") -> Path:
    """Write the partition of `day` (data file, then the marker); returns its folder."""
    folder = Path(out) / partition_name(day)
    folder.mkdir(parents=True, exist_ok=True)
    table = day_table(spec, day)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=spec.row_group)
    write_atomic(folder / "part-0.parquet", lambda f: f.write(buf.getvalue()), "Parquet partition file")
    write_text(folder / marker, "", "partition marker")
    return folder


def stream_config_lines(spec: DriftSpec) -> dict:
    """The data.parquet section that reads these partitions (raw ids, for managed-collision tables)."""
    return {
        "label": "label",
        "dense": [f"d{j}" for j in range(spec.num_dense)],
        "features": [f"c{f}" for f in range(spec.num_features)],
        "hashing": "none",
        "table_rows": 1 << 40,
        "shuffle": True,
    }
