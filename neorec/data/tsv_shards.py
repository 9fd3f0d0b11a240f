"""The shards of Criteo TSV preprocessing, written by pieces (torch-free: workers import it).

A worker parses pieces (neorec/data/tsv_pieces.py), maps their raw values to ids and appends each
piece's columns, a part of at most FLUSH_ROWS rows at a time, as one scratch file per part and split
(`shards/.tmp-<k>/pieces/<split>/<first line>-<part>`, every column of the part back to back). When all
pieces of a shard are done, `assemble_shard` writes each column as the .npy file np.save would write
for the whole column (its header, then the parts in line order), through write_atomic, with its size
and crc32 taken as it is written, then meta.json, the Parquet copy when asked for, and renames the
shard into place. Scratch files are written without fsync: they live inside the shard's temporary
folder, which an interrupted run removes (the shard is redone from its input), and each is checked by
size when assembled.
"""

from __future__ import annotations

import shutil
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from neorec.data import vocab as vocab_io
from neorec.data.criteo_lines import CATEGORICAL_NAMES, NUM_DENSE, Parsed, map_categorical
from neorec.data.manifest import META, SPLITS, ShardPlan, publish_shard
from neorec.data.tsv_pieces import Piece, PieceParse, parse_pieces
from neorec.errors import DataError
from neorec.utils.files import write_atomic, write_json

FLUSH_ROWS = 1 << 16  # rows of a split held by a worker before they are written
_SCRATCH = "pieces"
_KEEPS = "the shards written before it are intact; rerun the same command to resume"


def column_types(settings: dict, features: list[dict]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Column name -> (dtype, shape of one row) of a Criteo shard, in the order of its files."""
    raw = set(settings["categorical"].get("raw_features", ()))
    types = {"dense": (np.dtype(np.float32), (NUM_DENSE,)), "labels": (np.dtype(np.float32), ())}
    for f in features:
        wide = f["num_ids"] >= 2**31 or f["name"] in raw
        types[f"ids_{f['name']}"] = (np.dtype(np.int64 if wide else np.int32), ())
    return types


_VOCABS: dict[str, list[np.ndarray]] = {}  # per worker process: loaded once


def map_ids(out: Path, settings: dict, raw: np.ndarray) -> list[np.ndarray]:
    """Raw hash values [26, n] (uint32) -> per feature ids, by the hashing or the vocabulary of `settings`."""
    cat = settings["categorical"]
    if "vocab_threshold" in cat:
        key = str(out)
        if key not in _VOCABS:
            _VOCABS[key] = vocab_io.load_vocabs(out / "vocab", CATEGORICAL_NAMES)
        return [vocab_io.apply_vocab(raw[f], v) for f, v in enumerate(_VOCABS[key])]
    rows = np.asarray(cat["table_rows"], np.int64)
    raw_features = set(cat.get("raw_features", ()))
    ids = []
    for f, name in enumerate(CATEGORICAL_NAMES):
        if name in raw_features:
            ids.append(raw[f].astype(np.int64))
        elif cat["hashing"] == "modulo" and rows[f] < 2**32:  # the same ids as map_categorical, in 32 bits
            ids.append(raw[f] % np.uint32(rows[f]))
            if rows[f] <= 2**31:  # ids under 2**31: the int32 column's bits, without a copy
                ids[-1] = ids[-1].view(np.int32)
        else:
            ids.append(map_categorical(raw[f][:, None], rows[f : f + 1], cat["hashing"])[:, 0])
    return ids


def piece_job(job: tuple[str, dict, list[dict], list[Piece]]) -> tuple[list[dict], PieceParse]:
    """Parse pieces of one file and write their scratch files; returns per piece its shard, first line and
    rows per split, and the lines skipped and the first bad line met."""
    out_str, settings, features, pieces = job
    out = Path(out_str)
    types = column_types(settings, features)
    outcome = PieceParse()
    done: list[dict] = []
    pending: dict[str, list[Parsed]] = {split: [] for split in SPLITS}
    current: dict | None = None

    def flush(split: str) -> None:
        assert current is not None
        parts = pending[split]
        if parts:
            labels, dense, raw = (
                (p[0] if len(p) == 1 else np.concatenate(p, axis=-1 if i == 2 else 0))
                for i, p in enumerate(zip(*parts, strict=True))
            )
            columns = {"dense": dense, "labels": labels}
            columns |= {
                f"ids_{n}": ids for n, ids in zip(CATEGORICAL_NAMES, map_ids(out, settings, raw), strict=True)
            }
            name = f"{current['first']:012d}-{current['parts'][split]:05d}"
            _write_scratch(out, current["shard"], split, name, columns, types)
            current["parts"][split] += 1
            current["rows"][split] += len(labels)
        pending[split] = []

    eval_every = settings["eval_every"]
    for piece, split, parsed in parse_pieces(
        pieces, eval_every, settings["bad_lines"], settings["max_line_bytes"], outcome
    ):
        if current is None or current["first"] != piece.first or current["shard"] != piece.shard.index:
            if current is not None:
                for s in SPLITS:
                    flush(s)
            current = {"shard": piece.shard.index, "first": piece.first, "rows": dict.fromkeys(SPLITS, 0),
                       "parts": dict.fromkeys(SPLITS, 0)}  # fmt: skip
            done.append(current)
        if len(parsed[0]):
            pending[split].append(parsed)
            if sum(len(p[0]) for p in pending[split]) >= FLUSH_ROWS:
                flush(split)
    if current is not None:
        for s in SPLITS:
            flush(s)
    return [{"shard": d["shard"], "first": d["first"], "rows": d["rows"]} for d in done], outcome


def _write_scratch(
    out: Path, shard: int, split: str, name: str, columns: dict[str, np.ndarray], types: dict
) -> None:
    folder = _tmp(out, shard) / _SCRATCH / split
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "wb") as f:
        for key, (dtype, _) in types.items():
            f.write(np.ascontiguousarray(columns[key], dtype=dtype).data)


def _tmp(out: Path, shard: int) -> Path:
    from neorec.data.manifest import shard_name

    return out / "shards" / f".tmp-{shard_name(shard)}"


def start_shard(out: Path, shard: ShardPlan) -> None:
    """An empty temporary folder for a shard (one left by an interrupted run is removed)."""
    tmp = _tmp(out, shard.index)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def assemble_shard(
    out: Path, shard: ShardPlan, settings: dict, features: list[dict], rows: dict[str, int], skipped: Counter,
    threads: int = 1,
) -> dict:  # fmt: skip
    """Write the .npy files of a shard from its scratch files (see the module's docstring), its meta.json
    and Parquet copy, and rename it into place; returns its meta dict. The column files are written by
    `threads` threads: reads, writes, crc32 and fsync release the GIL."""
    tmp = _tmp(out, shard.index)
    types = column_types(settings, features)
    row_bytes = sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in types.values())
    files: dict[str, list[int]] = {}
    samples: dict[str, int] = {}
    columns: list[tuple[str, tuple]] = []  # (file name in the shard, arguments of _write_column)
    for split in SPLITS:
        if not rows.get(split):
            continue
        scratch = sorted((tmp / _SCRATCH / split).iterdir())
        sizes = [p.stat().st_size for p in scratch]
        if sum(sizes) != rows[split] * row_bytes or any(s % row_bytes for s in sizes):
            raise DataError(
                f"{tmp / _SCRATCH / split}: scratch files of {sum(sizes)} bytes for {rows[split]} rows; rerun the same command"
            )
        (tmp / split).mkdir()
        start = 0
        for key, (dtype, shape) in types.items():
            width = dtype.itemsize * int(np.prod(shape))
            path = tmp / split / f"{key}.npy"
            columns.append(
                (
                    f"{split}/{key}.npy",
                    (path, scratch, sizes, row_bytes, start, width, dtype, (rows[split], *shape)),
                )
            )
            start += width
        samples[split] = rows[split]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        written = list(pool.map(lambda column: _write_column(*column[1]), columns))
    for (name, _), (size, crc) in zip(columns, written, strict=True):
        files[name] = [size, crc]
    shutil.rmtree(tmp / _SCRATCH, ignore_errors=True)
    meta = {"samples": samples, "skipped": dict(sorted(skipped.items())), "files": files}
    write_json(tmp / META, meta, "preprocessed shard file")
    if settings.get("parquet_output"):
        from neorec.data.parquet_output import write_parquet_copy

        for split in samples:
            columns = {key: np.load(tmp / split / f"{key}.npy", mmap_mode="r") for key in types}
            write_parquet_copy(out / "parquet" / split / f"{shard.name}.parquet", columns, features, settings)
    publish_shard(tmp, out / "shards" / shard.name)
    return meta


def _write_column(
    path: Path, scratch: list[Path], sizes: list[int], row_bytes: int, start: int, width: int, dtype: np.dtype,
    shape: tuple[int, ...],
) -> tuple[int, int]:  # fmt: skip
    """Write one column as np.save would (header, then the rows of every scratch file); (its size, its
    crc32)."""
    crc, num_bytes = 0, 0

    def write(f: BinaryIO) -> None:
        nonlocal crc, num_bytes
        header = _npy_header(dtype, shape)
        f.write(header)
        crc, num_bytes = zlib.crc32(header), len(header)
        for part, size in zip(scratch, sizes, strict=True):
            n = size // row_bytes
            with open(part, "rb") as src:
                src.seek(n * start)
                data = src.read(n * width)
            if len(data) != n * width:
                raise DataError(f"{part}: shorter than its {n} rows; rerun the same command")
            f.write(data)
            crc, num_bytes = zlib.crc32(data, crc), num_bytes + len(data)

    write_atomic(path, write, "preprocessed shard file", _KEEPS)
    return num_bytes, crc


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The header np.save writes for an array of this dtype and shape (format 1.0)."""
    import io

    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()
