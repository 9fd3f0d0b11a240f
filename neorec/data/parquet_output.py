"""The Parquet copy of preprocessed shards (`neorec data preprocess --parquet-output`, any input).

Each shard's samples of a split are also written to `<out>/parquet/<split>/<shard>.parquet`: `label`, the
dense columns (Criteo's I1..I13, the input's dense names, else d0, d1, ...), one ids column per feature
(int32, int64 for tables of 2^31 rows or more, a list of them for multi-hot features) and `w_<feature>`
weights (float32, or lists). Files sort in shard order, so a `data.parquet` section with
`paths: [<out>/parquet/train]`, `eval_paths: [<out>/parquet/eval]`, `hashing: none` and
`shuffle: false` reads the samples the shards hold, in the same order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.utils.files import write_atomic


def parquet_dense_names(settings: dict, num_dense: int) -> list[str]:
    """Names of the dense columns in Parquet output."""
    if settings["input"] == "criteo":
        from neorec.data.criteo import DENSE_NAMES

        return DENSE_NAMES
    if settings["input"] == "parquet":
        return list(settings["parquet"]["dense"])
    return [f"d{j}" for j in range(num_dense)]


def write_parquet_copy(path: Path, columns: dict[str, np.ndarray], features: list[dict], settings: dict) -> None:
    """One split of one shard as a Parquet file (written under a temporary name, then renamed)."""
    dense = np.asarray(columns["dense"], np.float32)
    table = {"label": np.asarray(columns["labels"], np.float32)}
    for j, name in enumerate(parquet_dense_names(settings, dense.shape[1])):
        table[name] = dense[:, j]
    for f in features:
        name = f["name"]
        ids = np.asarray(columns[f"ids_{name}"], np.int32 if f["num_ids"] < 2**31 else np.int64)
        lengths = columns.get(f"lengths_{name}")
        offsets = None if lengths is None else np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        table[name] = ids if offsets is None else pa.LargeListArray.from_arrays(offsets, ids)
        if f"weights_{name}" in columns:
            w = np.asarray(columns[f"weights_{name}"], np.float32)
            table[f"w_{name}"] = w if offsets is None else pa.LargeListArray.from_arrays(offsets, w)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = pa.table(table)  # through .NAME.tmp: pyarrow's listing of the folder skips hidden files
    write_atomic(path, lambda f: pq.write_table(written, f), "Parquet copy", hidden=True)
