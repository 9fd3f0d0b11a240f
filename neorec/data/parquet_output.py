"""The Parquet copy of preprocessed shards (`neorec data preprocess --parquet-output`, any input).

Each shard's samples of a split are also written to `<out>/parquet/<split>/<shard>.parquet`: `label`, the
dense columns (Criteo's I1..I13, the input's dense names, else d0, d1, ...), one ids column per feature
(int32, int64 for tables of 2^31 rows or more, a list of them for multi-hot features) and `w_<feature>`
weights (float32, or lists). Files sort in shard order, so a `data.parquet` section with
`paths: [<out>/parquet/train]`, `eval_paths: [<out>/parquet/eval]`, `hashing: none` and
`shuffle: false` reads the samples the shards hold, in the same order.

The folders hold every shard only once `<out>/manifest.json` says the preprocessing is complete: until
then (an interrupted run, or a rerun writing damaged shards again) a Parquet reader given them, or a file
in them, is refused (`check_finished`, called by neorec/data/parquet.py's `list_files`); Parquet folders
that no `neorec data preprocess` wrote read as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from neorec.data.manifest import FORMAT, MANIFEST, SPLITS, shard_name
from neorec.errors import DataError
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


def check_finished(path: str) -> None:
    """DataError when `path` (a local file or folder a Parquet reader is given) lies in the Parquet copy,
    <out>/parquet/, of a `neorec data preprocess --parquet-output` that has not finished: its folders
    hold only the shards written so far. Anything else (no <out>/manifest.json of a preprocessing with
    a Parquet copy next to a `parquet` folder) passes."""
    if "://" in path:
        return
    given = Path(path).resolve()  # a relative path (`train` from <out>/parquet), a link: named alike
    folder = given if given.is_dir() else given.parent
    for parquet in (folder, folder.parent):
        inside = parquet == folder or folder.name in SPLITS
        if parquet.name == "parquet" and inside and (parquet.parent / MANIFEST).is_file():
            _check_manifest(path, parquet.parent)
            return


def _check_manifest(path: str, out: Path) -> None:
    try:  # written atomically, never seen half-written; "complete" is set once the last shard is
        manifest = json.loads((out / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return  # not ours to judge: `data.source: preprocessed` names a damaged manifest
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("complete") is True:
        return
    settings, shards = manifest.get("settings"), manifest.get("shards")
    if not isinstance(settings, dict) or not settings.get("parquet_output") or not isinstance(shards, list):
        return
    done = sum((out / "shards" / shard_name(i)).is_dir() for i in range(len(shards)))
    raise DataError(
        f"{path}: part of the Parquet copy of a `neorec data preprocess --parquet-output` that did not "
        f"finish ({out / MANIFEST} says complete: false; {done} of {len(shards)} shards written), so it "
        f"holds only some of the data; finish it by running the same preprocess command again (same "
        f"inputs, flags and --out {out}): it resumes, writing only the missing shards"
    )
