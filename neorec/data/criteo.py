"""Streaming reader for raw Criteo TSV files (plain or .gz), with the preprocessing of facebookresearch/dlrm.

The rules of a line, of its values and of bad lines are in neorec/data/criteo_lines.py; lines are read
in blocks and parsed by neorec/data/tsv_blocks.py (pyarrow's CSV parser and numpy), a block that holds
anything unusual line by line by criteo_lines.parse_lines, so that the batches, the bad lines reported
and the counts of skipped lines are those of the line parser. Memory is bounded by the block whatever the
input: a line longer than `max_line_bytes` is a bad line, never held whole.

Bad lines raise a DataError naming `path:line` (the first bad line read) under `bad_lines="fail"`, or are
skipped and counted per reason under `bad_lines="skip"`. Blank lines at the end of a file are ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.criteo_lines import (  # noqa: F401 (the rules of the format, imported from here by callers)
    BAD_LINE_POLICIES,
    CATEGORICAL_NAMES,
    DEFAULT_MAX_LINE_BYTES,
    DENSE_NAMES,
    FAIL_HINT,
    HASHINGS,
    MAX_HEX_DIGITS,
    NUM_CATEGORICAL,
    NUM_DENSE,
    NUM_FIELDS,
    BadLine,
    LongLine,
    Parsed,
    check_reader_options,
    check_tsv_file,
    map_categorical,
    open_tsv,
    parse_dense,
    parse_hex,
    parse_lines,
    read_lines,
    resolve_table_rows,
    select,
    splitmix64,
    with_label,
)
from neorec.data.file_roles import FileRoles
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.data.tsv_blocks import LineBlock, line_blocks, parse_fast
from neorec.data.tsv_index import READ_ERRORS, read_error
from neorec.errors import ConfigError, DataError
from neorec.sparse import SparseBatch

PathLike = str | Path


@dataclass(frozen=True)
class EveryNth:
    """A `keep_line` that keeps the line numbers that are multiples of `every` (held_out=True) or the
    others; `mask` answers for an array of line numbers at once."""

    every: int
    held_out: bool

    def __call__(self, number: int) -> bool:
        return (number % self.every == 0) == self.held_out

    def mask(self, numbers: np.ndarray) -> np.ndarray:
        return (numbers % self.every == 0) == self.held_out


class CriteoTSVReader:
    """One pass over Criteo TSV files, yielding preprocessed Batches; counts the lines it skipped.

    `keep_line(line_number)` (1-based, per file) selects the lines of this pass before they are
    parsed, e.g. to hold out every 10th line for evaluation.
    """

    def __init__(
        self,
        paths: Sequence[PathLike],
        table_rows: int | Sequence[int],
        hashing: str = "modulo",
        bad_lines: str = "fail",
        keep_line: Callable[[int], bool] | None = None,
        chunk_lines: int = 16384,
        raw_features: Sequence[str] = (),
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        block_bytes: int | None = None,
        labeled: bool = True,
        fail_hint: str = FAIL_HINT,
    ) -> None:
        """max_line_bytes: longer lines (without the newline) are bad lines, never held whole; block_bytes:
        lines are parsed in blocks of about this many bytes (None:
        tsv_blocks.BLOCK_BYTES); chunk_lines: lines per chunk parsed line
        by line (blocks the fast parser leaves, neorec/data/tsv_blocks.py); labeled=False: lines
        without the label field (39 fields, Criteo's test files), read with label 0; fail_hint: what
        the error of a bad line (bad_lines "fail") says to do after naming it."""
        self.paths = [Path(p) for p in paths]
        unknown = sorted(set(raw_features) - set(CATEGORICAL_NAMES))
        if unknown:
            raise ConfigError(f"raw-id features {unknown} are not Criteo features {CATEGORICAL_NAMES}")
        self.keep_raw = np.array([n in raw_features for n in CATEGORICAL_NAMES])
        self.table_rows = resolve_table_rows(table_rows)
        check_reader_options(hashing, bad_lines, max_line_bytes)
        if chunk_lines < 1:
            raise ConfigError(f"chunk_lines must be >= 1, got {chunk_lines}")
        self.hashing = hashing
        self.bad_lines = bad_lines
        self.fail_hint = fail_hint
        self.keep_line = keep_line
        self.chunk_lines = chunk_lines
        self.max_line_bytes = max_line_bytes
        self.block_bytes = block_bytes
        self.labeled = labeled
        self.skipped: Counter[str] = Counter()  # reason -> lines skipped so far in this pass

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Batches of `batch_size` samples across file boundaries; the last one may be smaller."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        num_pending = 0
        for chunk in self.chunks():
            pending.append(chunk)
            num_pending += len(chunk[0])
            if num_pending < batch_size:
                continue
            labels, dense, ids = (np.concatenate(parts) for parts in zip(*pending, strict=True))
            full = num_pending - num_pending % batch_size
            for start in range(0, full, batch_size):
                end = start + batch_size
                yield _to_batch(labels[start:end], dense[start:end], ids[start:end])
            pending = [(labels[full:], dense[full:], ids[full:])]
            num_pending -= full
        if num_pending:
            labels, dense, ids = (np.concatenate(parts) for parts in zip(*pending, strict=True))
            yield _to_batch(labels, dense, ids)

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(labels [n] f32, dense [n, 13] f32, ids [n, 26] int64) per block of kept, valid lines."""
        for path in self.paths:
            for labels, dense, raw in self._parsed(path):
                if len(labels):
                    yield labels, dense, map_categorical(raw.T, self.table_rows, self.hashing, self.keep_raw)

    def _parsed(self, path: Path) -> Iterator[Parsed]:
        """The kept, valid lines of a file, block by block; bad lines by the policy."""
        number = 0
        with open_tsv(path) as f:
            try:
                for block in without_blank_tail(
                    line_blocks(f, self.max_line_bytes, block_bytes=self.block_bytes)
                ):
                    number = block.first + block.num_lines - 1
                    kept = None if self.keep_line is None else _keep_mask(self.keep_line, block.numbers())
                    if kept is not None and not kept.any():
                        continue
                    data = block.data
                    if not self.labeled and block.long_line is None:
                        data = with_label(data)
                    parsed = parse_fast(data, block.num_lines, self.max_line_bytes)
                    if parsed is not None:
                        yield parsed if kept is None else select(parsed, kept)
                        continue
                    lines = list(zip(block.numbers().tolist(), block.lines(self.max_line_bytes), strict=True))
                    if kept is not None:
                        lines = [line for line, k in zip(lines, kept, strict=True) if k]
                    for start in range(0, len(lines), self.chunk_lines):
                        parsed, bad = parse_lines(path, lines[start : start + self.chunk_lines], self.labeled)
                        if bad:
                            if self.bad_lines == "fail":
                                raise DataError(min(bad)[2] + self.fail_hint)
                            self.skipped.update(reason for _, reason, _ in bad)
                        yield parsed
            except READ_ERRORS as e:  # a failing disk, a truncated or damaged .gz file
                raise read_error(path, f"after line {number}", e) from e


def _keep_mask(keep: Callable[[int], bool], numbers: np.ndarray) -> np.ndarray:
    mask = getattr(keep, "mask", None)
    if mask is not None:
        return mask(numbers)
    return np.fromiter(map(keep, numbers.tolist()), bool, len(numbers))


def without_blank_tail(blocks: Iterator[LineBlock]) -> Iterator[LineBlock]:
    """The blocks of a file less its blank lines (empty or whitespace) at the end: blank lines are held
    back until a line that is not blank follows them."""
    held: list[LineBlock] = []
    for block in blocks:
        if block.long_line is not None:
            if block.long_line.blank:
                held.append(block)
                continue
        else:
            end = _end_of_filled_lines(block.data)
            if end < len(block.data):  # blank lines end the block
                if end:
                    head = LineBlock(block.first, block.data[:end], block.data.count(b"\n", 0, end))
                    yield from held
                    yield head
                    held = []
                    block = LineBlock(
                        head.first + head.num_lines, block.data[end:], block.num_lines - head.num_lines
                    )
                held.append(block)
                continue
        yield from held
        held = []
        yield block


_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")  # what bytes.isspace() and bytes.rstrip() call blank


def _end_of_filled_lines(data: bytes) -> int:
    """The end of the last line of `data` that is not blank (after its newline), 0 if every line is."""
    if data and (
        data[-1] not in _WHITESPACE
        or (data[-1] == ord("\n") and len(data) > 1 and data[-2] not in _WHITESPACE)
    ):
        return len(data)
    filled = len(data.rstrip())
    if not filled:
        return 0
    newline = data.find(b"\n", filled)
    return len(data) if newline < 0 else newline + 1


def _to_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> Batch:
    sparse = SparseBatch.from_dense_ids(CATEGORICAL_NAMES, torch.from_numpy(ids))
    return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))


class CriteoTSVSource:
    """DataSource over raw Criteo TSV files, read as a stream on every pass.

    Held-out set: the lines of `eval_paths` when given; otherwise every line whose 1-based line
    number within its file is a multiple of `eval_every` (10 -> lines 10, 20, ...) is held out for
    evaluation and never used for training. Files are read in the given order on every epoch (no
    shuffling: shuffle when preprocessing), so `epoch` does not change the batches.

    `skipped` holds, per split ("train", "eval"), the bad lines skipped per reason during the latest
    pass over that split (only with bad_lines="skip"; with "fail" the first bad line raises).
    """

    def __init__(
        self,
        train_paths: PathLike | Sequence[PathLike],
        eval_paths: PathLike | Sequence[PathLike] | None = None,
        *,
        table_rows: int | Sequence[int],
        hashing: str = "modulo",
        bad_lines: str = "fail",
        eval_every: int = 10,
        chunk_lines: int = 16384,
        raw_features: Sequence[str] = (),
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        """raw_features: features of managed-collision tables, which get the raw hash value as id;
        max_line_bytes: longer lines are bad lines."""
        self.raw_features = sorted(raw_features)
        self.train_paths = _as_paths(train_paths)
        self.eval_paths = _as_paths(eval_paths) if eval_paths is not None else None
        if not self.train_paths:
            raise ConfigError("train_paths is empty: give at least one Criteo TSV file")
        if self.eval_paths is None and eval_every < 2:
            raise ConfigError(f"eval_every must be >= 2 when no eval_paths are given, got {eval_every}")
        once = FileRoles()
        for role, key, paths in (
            ("train", "train_paths", self.train_paths),
            ("eval", "eval_paths", self.eval_paths),
        ):
            for path in paths or []:
                check_tsv_file(path, f"data.criteo.{key}")
                once.add(str(path), role, f"data.criteo.{key}")
        self.table_rows = resolve_table_rows(table_rows)
        self.hashing = hashing
        self.bad_lines = bad_lines
        self.eval_every = eval_every
        self.chunk_lines = chunk_lines
        self.max_line_bytes = max_line_bytes
        self.skipped: dict[str, Counter[str]] = {"train": Counter(), "eval": Counter()}
        self._reader("train", [], None)  # checks hashing, bad_lines, chunk_lines and max_line_bytes now
        self.info = SourceInfo(
            num_dense=NUM_DENSE,
            features=[
                FeatureSpec(n, int(r)) for n, r in zip(CATEGORICAL_NAMES, self.table_rows, strict=True)
            ],
            notes={"dense": DENSE_NAMES, "hashing": hashing},
        )

    @property
    def num_skipped(self) -> int:
        """Bad lines skipped in the latest train and eval passes together."""
        return sum(sum(c.values()) for c in self.skipped.values())

    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        keep = None if self.eval_paths is not None else EveryNth(self.eval_every, held_out=False)
        yield from self._reader("train", self.train_paths, keep).batches(batch_size)

    def training_file_bytes(self) -> list[int]:
        """The size of each training file, in order: saved with a checkpoint, so that a resume over
        files written again or grown since is refused (this source re-reads the trained lines)."""
        return [path.stat().st_size for path in self.train_paths]

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        if self.eval_paths is not None:
            reader = self._reader("eval", self.eval_paths, None)
        else:
            reader = self._reader("eval", self.train_paths, EveryNth(self.eval_every, held_out=True))
        yield from reader.batches(batch_size)

    def _reader(self, split: str, paths: list[Path], keep: Callable[[int], bool] | None) -> CriteoTSVReader:
        reader = CriteoTSVReader(
            paths, self.table_rows.tolist(), self.hashing, self.bad_lines, keep, self.chunk_lines, self.raw_features,
            self.max_line_bytes,
        )  # fmt: skip
        self.skipped[split] = reader.skipped  # the reader counts into it as the pass goes
        return reader


def _as_paths(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    if isinstance(paths, str | Path):
        return [Path(paths)]
    return [Path(p) for p in paths]
