"""The 12-trillion-parameter model of the cluster-scale dry run (`neorec plan --model 12t`).

Not trained, only planned: it checks that the planner handles a production-size model on the
paper's cluster (16 nodes x 8 GPUs, 80 GB each, 2 TB host DRAM per node) in seconds. The model,
drawn from a fixed seed:
- 1,000 tables, one feature each;
- sizes skewed like production models: parameters per table log-normal (sigma 2), scaled so that
  the tables hold 12e12 parameters in total (the largest tables have billions of rows);
- dims 64, 128 or 256 (40% / 40% / 20%);
- ids per sample (pooling factor) log-normal with median 8, between 1 and 200;
- fp16 weights, row-wise AdaGrad (4 bytes of state per row), fp16 forward / bf16 backward exchanges;
- a global batch of 65,536 samples (512 per GPU).
Weights alone are 24 TB: the 10.2 TB of GPU memory cannot hold them, so the plan must put the
colder tables in host memory and the hot ones on the GPUs.
"""

from __future__ import annotations

import numpy as np

from neorec.embedding.tables import TableConfig
from neorec.planner.workload import Workload, build_workload

NUM_TABLES = 1000
TOTAL_PARAMETERS = 12e12
BATCH_SIZE = 65536


def twelve_trillion_tables(num_tables: int = NUM_TABLES, total: float = TOTAL_PARAMETERS, seed: int = 12):
    """(tables, ids per sample per feature) of the dry-run model."""
    rng = np.random.default_rng(seed)
    dims = rng.choice([64, 128, 256], size=num_tables, p=[0.4, 0.4, 0.2])
    params = rng.lognormal(mean=0.0, sigma=2.0, size=num_tables)
    params *= total / params.sum()
    rows = np.maximum(1000, (params / dims).astype(np.int64))
    pooling = np.clip(rng.lognormal(mean=np.log(8.0), sigma=1.0, size=num_tables), 1.0, 200.0)
    tables, ids = [], {}
    for i in range(num_tables):
        name = f"t{i:04d}"
        tables.append(
            TableConfig(name=name, rows=int(rows[i]), dim=int(dims[i]), features=[name], dtype="fp16")
        )
        ids[name] = float(round(pooling[i], 2))
    return tables, ids


def twelve_trillion_workload() -> Workload:
    tables, ids = twelve_trillion_tables()
    return build_workload(
        tables, "rowwise_adagrad", BATCH_SIZE, ids, forward_precision="fp16", backward_precision="bf16"
    )


def describe(workload: Workload) -> str:
    t = [x.table for x in workload.tables]
    params = sum(x.rows * x.dim for x in t)
    rows = np.array([x.rows for x in t])
    pool = np.array([x.ids_per_sample for x in workload.tables])
    return (
        f"{len(t)} tables, {params / 1e12:.2f}e12 parameters ({params * 2 / 1e12:.1f} TB fp16 + "
        f"{rows.sum() * 4 / 1e12:.2f} TB row-wise AdaGrad state), rows {rows.min():,}..{rows.max():,} "
        f"(median {int(np.median(rows)):,}), dims 64/128/256, ids per sample {pool.min():.0f}..{pool.max():.0f} "
        f"(median {np.median(pool):.1f}), global batch {workload.batch_size:,}"
    )
