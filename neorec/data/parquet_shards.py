"""The samples of one shard of Parquet input (`neorec data preprocess` with a `data.parquet` section), as
the .npy columns the shard writer stores.

A shard is a run of consecutive row groups of one file (planned by neorec/data/preprocess_parquet.py).
Its rows are converted exactly as the Parquet source reads them (neorec/data/parquet_columns.py: the
same id mapping), and split into train and eval by the shard's role: a file of `paths` or `eval_paths`,
or, for role "column", each row's `eval_column` flag.
"""

from __future__ import annotations

import numpy as np

from neorec.config.schema import ParquetConfig
from neorec.data.columns import Columns
from neorec.data.manifest import SPLITS, ShardPlan
from neorec.data.parquet import column_map, open_uri
from neorec.data.parquet_columns import held_out


def parquet_shard_columns(settings: dict, shard: ShardPlan) -> dict[str, dict[str, np.ndarray]]:
    """{split: {column file name: array}} of one shard of Parquet input."""
    config = ParquetConfig(**settings["parquet"])
    cmap = column_map(config)
    pf = open_uri(shard.file)
    by_column = shard.role == "column"
    parts: dict[str, list[Columns]] = {split: [] for split in SPLITS}
    for g in range(shard.first, shard.first + shard.count):
        table = pf.read_row_group(g, columns=cmap.columns(by_column), use_threads=False)
        where = f"{shard.file}, row group {g}"
        cols = cmap.to_columns(table, where)
        if by_column:
            mask = held_out(table.column(cmap.eval_column), where, cmap.eval_column)
            parts["train"].append(cols.take(np.flatnonzero(~mask)))
            parts["eval"].append(cols.take(np.flatnonzero(mask)))
        else:
            parts[shard.role].append(cols)
    out = {}
    for split, pieces in parts.items():
        pieces = [p for p in pieces if len(p)]
        if pieces:
            cols = Columns.cat(pieces)
            arrays = {"dense": cols.dense, "labels": cols.labels}
            for f, ids, ln, w in zip(cmap.features, cols.values, cols.lengths, cols.weights, strict=True):
                arrays[f"ids_{f.name}"] = ids
                if ln is not None:
                    arrays[f"lengths_{f.name}"] = ln
                if w is not None:
                    arrays[f"weights_{f.name}"] = w
            out[split] = arrays
    return out


