"""Criteo TSV preprocessing: the indexing pass, the vocabulary's counting pass and the writing of the
shards, each over pieces of the files run by `workers` processes (neorec/data/preprocess.py has the
command's entry point; tsv_pieces.py the pieces, tsv_shards.py the files of a shard). Torch-free.

A job is one piece of a plain file, or every piece of a .gz file (read once, in order). Under
bad_lines="fail" a job stops at the end of the chunk of its first bad line; the jobs that come later in
the file order are not started, and of the bad lines met, the first in the order of the line-by-line
preprocessing is reported (tsv_pieces.error_key), so the error names the line it always named.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from neorec.data import tsv_index
from neorec.data import vocab as vocab_io
from neorec.data.criteo_lines import CATEGORICAL_NAMES
from neorec.data.manifest import ShardPlan
from neorec.data.tsv_index import BlockScan, FileIndex, combine_scans, reread_offsets, scan_range, scan_stream
from neorec.data.tsv_pieces import Piece, PieceParse, error_key, parse_pieces, plan_pieces
from neorec.data.tsv_shards import assemble_shard, piece_job, start_job
from neorec.data.workers import run_jobs
from neorec.errors import DataError
from neorec.utils.malloc import keep_freed_memory


def index_job(job: tuple[str, int, int, int | None, int]) -> tuple[str, int, list[BlockScan]]:
    """(path, start, scans) of the blocks of a byte range of a plain file, or of a whole .gz file."""
    path, shard_lines, start, stop, block_bytes = job
    if path.endswith(".gz"):
        return path, start, scan_stream(path, shard_lines, block_bytes)
    return path, start, scan_range(path, start, stop, block_bytes)


def reread_job(job: tuple[int, str, int, list[tuple[BlockScan, int]]]) -> tuple[int, list[int]]:
    """(job number, the offsets of the shard starts in these blocks of a file, read again)."""
    number, path, shard_lines, reread = job
    return number, reread_offsets(path, shard_lines, reread)


def index_files(paths: list[str], shard_lines: int, workers: int, progress: bool) -> dict[str, FileIndex]:
    """The index of every file; a plain file is scanned in byte ranges of whole blocks, about two per
    worker, so that the workers share one big file, and the blocks that hold its shard starts are read
    again by the workers too (neorec/data/tsv_index.py)."""
    block_bytes = tsv_index.INDEX_BLOCK
    jobs: list[tuple[str, int, int, int | None, int]] = []
    for path in dict.fromkeys(paths):
        num_blocks = -(-Path(path).stat().st_size // block_bytes)
        num_ranges = 1 if path.endswith(".gz") else max(1, min(num_blocks, 2 * workers))
        cuts = [round(i * num_blocks / num_ranges) * block_bytes for i in range(num_ranges)]
        for start, stop in zip(cuts, [*cuts[1:], None], strict=True):
            jobs.append((path, shard_lines, start, stop, block_bytes))
    scans: dict[str, dict[int, list[BlockScan]]] = defaultdict(dict)
    for path, start, part in run_jobs(
        index_job, jobs, workers, progress, "indexing", initializer=keep_freed_memory
    ):
        scans[path][start] = part

    def find_offsets(path: str | Path, shard_lines: int, reread: list[tuple[BlockScan, int]]) -> list[int]:
        reread_jobs = [(i, str(path), shard_lines, [block]) for i, block in enumerate(reread)]
        found = dict(run_jobs(reread_job, reread_jobs, workers, False, "indexing", initializer=keep_freed_memory))
        return [offset for i in range(len(reread_jobs)) for offset in found[i]]

    return {
        path: combine_scans(
            path, shard_lines, [s for start in sorted(parts) for s in parts[start]], find_offsets
        )
        for path, parts in scans.items()
    }


def criteo_plan(
    roles: list[tuple[str, str]], index: dict[str, FileIndex], shard_lines: int
) -> list[ShardPlan]:
    """Shard k of a file is lines [k * shard_lines + 1, ...] of it, in the order of `roles`."""
    plan: list[ShardPlan] = []
    for path, role in roles:
        entry = index[path]
        gz = path.endswith(".gz")
        for k, off in enumerate(entry.shard_offsets):
            first = k * shard_lines + 1
            count = min(shard_lines, entry.num_lines - first + 1)
            plan.append(ShardPlan(len(plan), path, role, first, count, -1 if gz else off))
    return plan


def _jobs(shards: list[ShardPlan], index: dict[str, FileIndex]) -> list[list[Piece]]:
    """One job per piece of a plain file, one per .gz file (its shards in order)."""
    by_file: dict[str, list[ShardPlan]] = defaultdict(list)
    for s in shards:
        by_file[s.file].append(s)
    jobs: list[list[Piece]] = []
    for path, file_shards in by_file.items():
        pieces = plan_pieces(file_shards, index[path])
        jobs += [pieces] if path.endswith(".gz") else [[p] for p in pieces]
    return jobs


def _first_key(job: list[Piece]) -> tuple[int, int]:
    return error_key(job[0].shard, job[0].first, True)[:2]


def _stop_key(result: tuple[object, PieceParse]) -> tuple | None:
    error = result[1].error
    return None if error is None else error[0][:2]


def _raise_first(errors: list[tuple[tuple, str]]) -> None:
    if errors:
        raise DataError(min(errors)[1])


def write_criteo_shards(
    out: Path, manifest: dict, todo: list[ShardPlan], workers: int, progress: bool, index: dict | None = None
) -> int:
    """Write the shards `todo` of a Criteo manifest (`index`: of its files, else they are indexed
    again, as a resumed run does); returns how many were written."""
    settings, features = manifest["settings"], manifest["features"]
    if index is None:
        index = index_files(sorted({s.file for s in todo}), settings["shard_lines"], workers, progress)
    jobs = _jobs(todo, index)
    starts = [(str(out), shard, settings, features) for shard in todo]  # the shards' files, by the workers
    for _ in run_jobs(start_job, starts, workers, False, "shards", initializer=keep_freed_memory):
        pass
    pieces_left = Counter(p.shard.index for job in jobs for p in job)
    pieces: dict[int, list[dict]] = defaultdict(list)
    skipped: dict[int, Counter] = defaultdict(Counter)
    by_index = {s.index: s for s in todo}
    errors: list[tuple[tuple, str]] = []
    written = 0
    work = [(str(out), settings, features, job) for job in jobs]
    results = run_jobs(piece_job, work, workers, progress, "pieces", initializer=keep_freed_memory,
                       keys=[_first_key(j) for j in jobs], stop_key=_stop_key)  # fmt: skip
    for done, outcome in results:
        if outcome.error is not None:
            errors.append(outcome.error)
        for shard_index, counts in outcome.skipped.items():
            skipped[shard_index].update(counts)
        for piece in done:
            shard_index = piece["shard"]
            pieces[shard_index].append(piece)
            pieces_left[shard_index] -= 1
            if not pieces_left[shard_index] and not errors:  # its last piece: finish the shard
                assemble_shard(
                    out, by_index[shard_index], settings, features, pieces.pop(shard_index), skipped[shard_index],
                    threads=max(4, 2 * workers),  # mostly waits for fsync: more threads than cores
                )  # fmt: skip
                written += 1
    _raise_first(errors)
    return written


def count_job(job: tuple[dict, list[Piece]]) -> tuple[list[vocab_io.Counts], PieceParse]:
    """Per feature: distinct raw values of the training lines of these pieces and their counts."""
    settings, pieces = job
    outcome = PieceParse()
    parts: list[list[vocab_io.Counts]] = [[] for _ in CATEGORICAL_NAMES]
    lines = parse_pieces(
        pieces, settings["eval_every"], settings["bad_lines"], settings["max_line_bytes"], outcome
    )
    for _, split, (labels, _, raw) in lines:
        if split == "train" and len(labels):
            for f in range(len(CATEGORICAL_NAMES)):
                parts[f].append(vocab_io.count_values(raw[f]))
        if sum(len(p) for p in parts) > 64 * len(parts):  # bound memory: fold the parts
            parts = [[vocab_io.merge_counts(p)] for p in parts]
    return [vocab_io.merge_counts(p) for p in parts], outcome


def build_vocab(
    out: Path, settings: dict, plan: list[ShardPlan], index: dict[str, FileIndex], threshold: int, workers: int,
    progress: bool,
) -> None:  # fmt: skip
    """Count the raw values of the training lines (counts spill to disk past a budget, vocab.py) and
    save the vocabularies of the values seen at least `threshold` times."""
    jobs = _jobs([s for s in plan if s.role != "eval"], index)
    counts = vocab_io.SpillingCounts(out / "vocab.counts", CATEGORICAL_NAMES)
    errors = []
    work = [(settings, job) for job in jobs]
    for per_feature, outcome in run_jobs(count_job, work, workers, progress, "counting", initializer=keep_freed_memory,
                                         keys=[_first_key(j) for j in jobs], stop_key=_stop_key):  # fmt: skip
        if outcome.error is not None:
            errors.append(outcome.error)
        counts.add(per_feature)
    _raise_first(errors)
    vocabs = [counts.vocab(f, threshold) for f in range(len(CATEGORICAL_NAMES))]
    counts.remove()
    vocab_io.save_vocabs(out / "vocab", CATEGORICAL_NAMES, [np.asarray(v) for v in vocabs], settings)
