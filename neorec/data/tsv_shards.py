"""The shards of Criteo TSV preprocessing, written in place by pieces (torch-free: workers import it).

Before any line is parsed, `start_shard` creates each column file of a shard
(`shards/.tmp-<k>/<split>/<column>.npy`) at the size it has when every line of the shard is a good
line: the header np.save writes for that many rows, then room for the rows, reserved with
posix_fallocate (a full disk stops the command before any parsing). The place of a piece's rows
(neorec/data/tsv_pieces.py: a run of whole lines of one shard) in each split follows from line numbers
alone: after the rows of that split among the shard's lines before the piece. A worker parses a piece,
maps its raw values to ids, writes each column's rows at their place with os.pwrite and returns the
crc32 of what it wrote per column. When every piece of a shard is done, `assemble_shard`:
- when no line was skipped (always under bad_lines="fail"), takes each file's crc32 from its header's
  and its pieces' (neorec/utils/crc.py, in line order) and fsyncs the files;
- when lines were skipped (bad_lines="skip"), writes each column again without the rows left unused,
  under the header for the rows kept, through write_atomic (size and crc32 taken as it is written);
then writes meta.json and the Parquet copy when asked for, and renames the shard into place. The files
are those np.save writes for the whole columns, byte for byte. An interrupted run leaves the temporary
folder, which the next run removes: the shard is written again from its input.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import shutil
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from neorec.data import vocab as vocab_io
from neorec.data.criteo_lines import CATEGORICAL_NAMES, NUM_DENSE, map_categorical
from neorec.data.manifest import META, SPLITS, ShardPlan, publish_shard, shard_name
from neorec.data.tsv_pieces import Piece, PieceParse, parse_pieces
from neorec.errors import DataError
from neorec.utils.crc import crc32_combine
from neorec.utils.files import fsync_dir, write_atomic, write_error, write_json

_WHAT = "preprocessed shard file"
_KEEPS = "the shards written before it are intact; rerun the same command to resume"
_START_WRITEBACK = hasattr(os, "posix_fadvise")  # Linux: DONTNEED on dirty pages starts their writeback
_COPY_BYTES = 8 << 20  # bytes copied at a time when a column is written again without unused rows


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


def split_rows(role: str, first: int, count: int, eval_every: int | None) -> dict[str, int]:
    """Rows per split of lines [first, first + count) of a shard of `role` when all are good lines (a
    "split" shard holds out the lines whose number is a multiple of eval_every)."""
    if role != "split":
        return {split: count if split == role else 0 for split in SPLITS}
    assert eval_every
    held_out = (first + count - 1) // eval_every - (first - 1) // eval_every
    return {"train": count - held_out, "eval": held_out}


class _Layout:
    """Where the rows of a shard go: per split, each column's file, header and row width."""

    def __init__(self, out: Path, shard: ShardPlan, settings: dict, features: list[dict]) -> None:
        self.shard, self.eval_every = shard, settings["eval_every"]
        self.folder = _tmp(out, shard.index)
        self.types = column_types(settings, features)
        self.names = list(self.types)
        self.widths = [dtype.itemsize * int(np.prod(shape)) for dtype, shape in self.types.values()]
        self.rows = split_rows(shard.role, shard.first, shard.count, self.eval_every)
        self.headers = {
            split: [_npy_header(dtype, (rows, *shape)) for dtype, shape in self.types.values()]
            for split, rows in self.rows.items()
        }

    def path(self, split: str, column: int) -> Path:
        return self.folder / split / f"{self.names[column]}.npy"

    def start(self, first: int) -> dict[str, int]:
        """The row of each split where the rows of line `first` on begin."""
        return split_rows(self.shard.role, self.shard.first, first - self.shard.first, self.eval_every)


def _tmp(out: Path, shard: int) -> Path:
    return out / "shards" / f".tmp-{shard_name(shard)}"


def start_shard(out: Path, shard: ShardPlan, settings: dict, features: list[dict]) -> None:
    """The temporary folder of a shard (one left by an interrupted run is removed) with its column files
    at their full size: the header for every line a good line, then room for the rows."""
    layout = _Layout(out, shard, settings, features)
    if layout.folder.exists():
        shutil.rmtree(layout.folder)
    layout.folder.mkdir(parents=True)
    for split, rows in layout.rows.items():
        if not rows:
            continue
        (layout.folder / split).mkdir()
        for column, (header, width) in enumerate(zip(layout.headers[split], layout.widths, strict=True)):
            path = layout.path(split, column)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _write_at(fd, header, 0)
                    try:
                        os.posix_fallocate(fd, 0, len(header) + rows * width)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
                            raise
                        os.ftruncate(fd, len(header) + rows * width)
                finally:
                    os.close(fd)
            except OSError as e:
                raise write_error(path, e, _WHAT, _KEEPS) from e


def start_job(job: tuple[str, ShardPlan, dict, list[dict]]) -> None:
    """start_shard in a worker: (output folder, shard, settings, features)."""
    out, shard, settings, features = job
    start_shard(Path(out), shard, settings, features)


def _write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _PieceWriter:
    """Writes the rows of one piece at their place in the shard's column files; crc32 per column."""

    def __init__(self, out: Path, piece: Piece, settings: dict, features: list[dict]) -> None:
        self.piece, self.layout = piece, _Layout(out, piece.shard, settings, features)
        self.start = self.layout.start(piece.first)
        self.room = split_rows(piece.shard.role, piece.first, piece.count, self.layout.eval_every)
        self.rows = dict.fromkeys(SPLITS, 0)
        self.crcs = {split: [0] * len(self.layout.types) for split in SPLITS}
        self.files: dict[str, list[int]] = {}

    def write(self, split: str, columns: list[np.ndarray]) -> None:
        n = len(columns[0])
        if not n:
            return
        if self.rows[split] + n > self.room[split]:
            raise DataError(
                f"{self.piece.shard.file}: changed since it was indexed (lines {self.piece.first}..); "
                "preprocess it again"
            )
        if split not in self.files:
            self.files[split] = [
                os.open(self.layout.path(split, c), os.O_WRONLY) for c in range(len(self.layout.types))
            ]
        row = self.start[split] + self.rows[split]
        crcs = self.crcs[split]
        for c, (values, (dtype, _)) in enumerate(zip(columns, self.layout.types.values(), strict=True)):
            data = np.ascontiguousarray(values, dtype=dtype)
            offset = len(self.layout.headers[split][c]) + row * self.layout.widths[c]
            try:
                _write_at(self.files[split][c], data, offset)
                if _START_WRITEBACK:  # the kernel starts writing these pages now, not at the fsync
                    os.posix_fadvise(self.files[split][c], offset, data.nbytes, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                raise write_error(self.layout.path(split, c), e, _WHAT, _KEEPS) from e
            crcs[c] = zlib.crc32(data, crcs[c])
        self.rows[split] += n

    def close(self) -> dict:
        for fds in self.files.values():
            for fd in fds:
                os.close(fd)
        self.files = {}
        return {
            "shard": self.piece.shard.index,
            "first": self.piece.first,
            "rows": self.rows,
            "crcs": self.crcs,
        }


def piece_job(job: tuple[str, dict, list[dict], list[Piece]]) -> tuple[list[dict], PieceParse]:
    """Parse pieces of one file and write their rows in place; returns per piece its shard, first line,
    rows per split and crc32 per split and column, and the lines skipped and the first bad line met."""
    out_str, settings, features, pieces = job
    out = Path(out_str)
    outcome = PieceParse()
    done: list[dict] = []
    writer: _PieceWriter | None = None
    try:
        for piece, split, (labels, dense, raw) in parse_pieces(
            pieces, settings["eval_every"], settings["bad_lines"], settings["max_line_bytes"], outcome
        ):
            if writer is None or writer.piece is not piece:
                if writer is not None:
                    done.append(writer.close())
                writer = _PieceWriter(out, piece, settings, features)
            if len(labels):
                writer.write(split, [dense, labels, *map_ids(out, settings, raw)])
    finally:
        if writer is not None:
            done.append(writer.close())
    return done, outcome


def assemble_shard(
    out: Path, shard: ShardPlan, settings: dict, features: list[dict], pieces: list[dict], skipped: Counter,
    threads: int = 1,
) -> dict:  # fmt: skip
    """Finish a shard whose pieces (piece_job's records) are all written (see the module's docstring):
    its column files, meta.json and Parquet copy; rename it into place; returns its meta dict. The
    column files are finished by `threads` threads: reads, writes, crc32 and fsync release the GIL."""
    layout = _Layout(out, shard, settings, features)
    pieces = sorted(pieces, key=lambda p: p["first"])
    rows = {split: sum(p["rows"][split] for p in pieces) for split in SPLITS}
    jobs = [(split, c) for split in SPLITS if layout.rows[split] for c in range(len(layout.types))]

    def finish(job: tuple[str, int]) -> tuple[int, int]:
        split, c = job
        if rows[split] == layout.rows[split]:
            return _seal(layout, split, c, pieces)
        return _rewrite(layout, split, c, pieces, rows[split])

    with ThreadPoolExecutor(max(1, threads)) as pool:
        written = dict(zip(jobs, pool.map(finish, jobs), strict=True))
    files: dict[str, list[int]] = {}
    samples: dict[str, int] = {}
    for split in SPLITS:
        if not rows[split]:
            if layout.rows[split]:
                shutil.rmtree(layout.folder / split)
            continue
        samples[split] = rows[split]
        for c, key in enumerate(layout.types):
            files[f"{split}/{key}.npy"] = list(written[split, c])
    meta = {"samples": samples, "skipped": dict(sorted(skipped.items())), "files": files}
    for split in samples:
        fsync_dir(layout.folder / split)
    write_json(layout.folder / META, meta, _WHAT)
    if settings.get("parquet_output"):
        from neorec.data.parquet_output import write_parquet_copy

        for split in samples:
            columns = {
                key: np.load(layout.folder / split / f"{key}.npy", mmap_mode="r") for key in layout.types
            }
            write_parquet_copy(out / "parquet" / split / f"{shard.name}.parquet", columns, features, settings)
    publish_shard(layout.folder, out / "shards" / shard.name)
    return meta


def _seal(layout: _Layout, split: str, c: int, pieces: list[dict]) -> tuple[int, int]:
    """A column file whose rows are all written: fsync it; (its size, its crc32 from its parts')."""
    header = layout.headers[split][c]
    crc, size = zlib.crc32(header), len(header)
    for p in pieces:
        length = p["rows"][split] * layout.widths[c]
        crc, size = crc32_combine(crc, p["crcs"][split][c], length), size + length
    path = layout.path(split, c)
    try:
        with open(path, "rb+") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise DataError(
                    f"{path}: {os.fstat(f.fileno()).st_size} bytes, not {size}; rerun the same command"
                )
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(path, e, _WHAT, _KEEPS) from e
    return size, crc


def _rewrite(layout: _Layout, split: str, c: int, pieces: list[dict], rows: int) -> tuple[int, int]:
    """A column file with unused rows (lines skipped) written again without them, under the header for
    `rows` rows (nothing when no row is kept); (its size, its crc32)."""
    path = layout.path(split, c)
    if not rows:
        return 0, 0
    dtype, shape = list(layout.types.values())[c]
    width, reserved = layout.widths[c], len(layout.headers[split][c])
    header = _npy_header(dtype, (rows, *shape))
    crc, num_bytes = zlib.crc32(header), len(header)

    def write(f: BinaryIO) -> None:
        nonlocal crc, num_bytes
        f.write(header)
        with open(path, "rb") as src:
            for p in pieces:
                offset = reserved + layout.start(p["first"])[split] * width
                left = p["rows"][split] * width
                while left:
                    data = os.pread(src.fileno(), min(left, _COPY_BYTES), offset)
                    if not data:
                        raise DataError(f"{path}: shorter than its rows; rerun the same command")
                    f.write(data)
                    crc, num_bytes = zlib.crc32(data, crc), num_bytes + len(data)
                    offset, left = offset + len(data), left - len(data)

    write_atomic(path, write, _WHAT, _KEEPS)
    return num_bytes, crc


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The header np.save writes for an array of this dtype and shape (format 1.0); every piece of a
    shard asks for the same ones."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()
