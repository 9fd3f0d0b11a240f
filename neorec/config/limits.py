"""Bounds of config values that a machine can hold, and an estimate of a run's memory checked against
this machine's before anything is built.

The bounds are the same on every machine (docs/config.md lists them next to each key): every integer
fits int64 and every float is finite and fits float32, because both end up in tensors; sizes stay where
their products (rows x dim x bytes) cannot overflow. Within them, `check_memory` refuses a run whose
embedding tables (when the config knows their rows), dense layers and synthetic teacher need more
memory than this machine has, naming the key to lower; what is only known once data is read is left
to the allocator, whose failure the command line reports as one line (neorec/errors.py).
"""

from __future__ import annotations

import os
from typing import Any

from neorec.errors import ConfigError

MAX_INT = 2**63 - 1  # int64
MAX_FLOAT = 3.4028234663852886e38  # float32
MAX_SEED = 2**63  # seeds lie in [0, 2^63)
MAX_ROWS = 2**40  # rows of one table (1.1e12)
MAX_SAMPLES = 2**40  # samples of a data set
MAX_DIM = 8192  # embedding dimension
MAX_WIDTH = 16384  # units of one MLP layer (a 16384 x 16384 layer with Adam is 4 GiB)
MAX_BATCH = 2**24  # samples per batch
MAX_FEATURES = 1024  # synthetic features (the teacher draws their pairs)
MAX_LAYERS = 256  # cross layers


MAX_RANKS = 4096  # ranks of a cluster the planner plans for (its work grows as ranks^2: 4096 take minutes)


def max_threads() -> int:
    """train.threads: at most 4 threads per core of this machine (more only thrash; far more abort
    OpenMP's thread pool)."""
    return 4 * (os.cpu_count() or 1)


def max_processes() -> int:
    """Processes a command starts on this machine (`neorec train --nproc`, calibration, preprocessing
    workers): at most 4 per core, as threads."""
    return 4 * (os.cpu_count() or 1)


def per_core() -> str:
    """What max_threads and max_processes are, in words."""
    return f" (4 per core of this machine's {os.cpu_count() or 1})"


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown: then nothing is refused)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


TEACHER = "data.synthetic.latent_dim"  # the synthetic teacher's part of the estimate
_OPTIMIZER_STATE = {"sgd": 0.0, "adagrad": 1.0, "rowwise_adagrad": 0.0, "adam": 2.0}  # fp32 per weight
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def memory_estimate(cfg: Any, planned_tiers: bool = False) -> dict[str, float]:
    """Bytes a run of `cfg` (a RunConfig) holds, roughly, by the key to lower: the embedding tables
    (synthetic data only: other sources know their rows once read; tables in tier ssd live on disk,
    and with `planned_tiers` the sharding planner puts tables on disk where memory is short, checking
    every rank's memory itself), the dense layers with their gradients and Adam state and one batch's
    activations, and the synthetic teacher's latent vectors."""
    from neorec.data.synthetic import spec_from_config

    out: dict[str, float] = {}
    e, m, d = cfg.embedding, cfg.model, cfg.data
    num_tables = 26
    if d.source == "synthetic":
        spec = spec_from_config(d.synthetic, cfg.seed)
        num_tables = len(spec.rows)
        if e.tier != "ssd" and not planned_tiers:
            state = _OPTIMIZER_STATE.get(e.optimizer.name, 2.0) * 4
            per_row = e.dim * _DTYPE_BYTES[e.dtype] + (
                4 if e.optimizer.name == "rowwise_adagrad" else e.dim * state
            )
            out["data.synthetic.rows (or max_rows, row_scale) and embedding.dim"] = (
                float(sum(spec.rows)) * per_row
            )
        k, t = d.synthetic.latent_dim, d.synthetic.num_dense
        # float64 latents: the dense projection [tables, dense, k] and about three [tables, n, k] arrays
        # of the 20000 samples the teacher calibrates on (neorec/data/synthetic.py Teacher.logits)
        out[TEACHER] = 8.0 * num_tables * k * (t + 3 * 20000)
    width_in = (num_tables + 1) * e.dim
    for key, widths, first in (
        ("model.bottom_mlp", m.bottom_mlp, 13),
        ("model.top_mlp", [*m.top_mlp, 1], width_in),
    ):
        sizes = [first, *widths]
        params = sum(a * b for a, b in zip(sizes, sizes[1:], strict=False))
        out[key] = 16.0 * params + 8.0 * d.batch_size * sum(widths)
    if m.arch == "dcnv2" or (m.arch == "multitask" and m.trunk == "dcnv2"):
        per_layer = 2 * width_in * m.low_rank if m.low_rank else width_in * width_in
        out["model.cross_layers (or set model.low_rank)"] = 16.0 * m.cross_layers * per_layer
    return out


def check_memory(
    cfg: Any, memory: int | None = None, keys: tuple[str, ...] | None = None, processes: int = 1
) -> None:
    """ConfigError naming the key to lower when `memory_estimate(cfg)` (its `keys` only, when given)
    exceeds this machine's memory (`memory`: bytes, default the machine's), before anything is allocated.
    `processes`: the run's; over several, with embedding.cache.directory set and no plan file, the
    planner chooses which tables live on disk, and checks their memory."""
    memory = machine_memory_bytes() if memory is None else memory
    planned = processes > 1 and cfg.embedding.cache.directory is not None and not cfg.distributed.plan
    parts = {k: v for k, v in memory_estimate(cfg, planned).items() if keys is None or k in keys}
    total = sum(parts.values())
    if memory <= 0 or total <= memory:
        return
    key, largest = max(parts.items(), key=lambda kv: kv[1])
    raise ConfigError(
        f"this run needs about {_gib(total)} of memory ({_gib(largest)} for {key}) but this machine has "
        f"{_gib(memory)}: lower {key.split(' (')[0]}"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"
