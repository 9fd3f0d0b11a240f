"""`neorec data ...`: download, generate, preprocess, stream or inspect data. Each command imports
what it runs only when it runs, so that building the parser (every `neorec` command) imports none of it."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from neorec.cli_args import MAX_BATCHES_READ, output_folder, whole_number
from neorec.config.limits import MAX_ROWS, MAX_SAMPLES, max_processes, per_core
from neorec.errors import NeorecError

MAX_LINE_BYTES = 64 << 20  # --max-line-bytes: a block of lines holds one such line, read at once
STREAM_DAYS = 1000  # a stream's partitions, day-000 .. day-999: their names sort in day order


def cmd_data_generate(args: argparse.Namespace) -> int:
    from neorec.config.limits import TEACHER, check_memory
    from neorec.config.load import load_config
    from neorec.data.shards import check_shards_folder, write_shards
    from neorec.data.synthetic import SyntheticSource, spec_from_config

    cfg = load_config(args.config or "default", args.overrides, reads=("synthetic",))
    output_folder(args.out, "--out")
    check_shards_folder(Path(args.out))
    check_memory(cfg, keys=(TEACHER,))
    source = SyntheticSource(spec_from_config(cfg.data.synthetic, cfg.seed), cache=False)
    paths = write_shards(source, Path(args.out))
    print(f"wrote {len(paths)} shard files to {args.out} (teacher AUC on eval: {source.teacher_auc():.4f})")
    return 0


def cmd_data_preprocess(args: argparse.Namespace) -> int:
    from neorec.utils.malloc import keep_freed_memory

    _load_numpy_single_threaded()
    keep_freed_memory()  # the same temporaries for every block: kept for reuse, not page-faulted in again
    from neorec.data.preprocess import preprocess_criteo, preprocess_synthetic

    common = {
        "workers": args.workers,
        "progress": not args.no_progress,
        "parquet_output": args.parquet_output,
    }
    output_folder(args.out, "--out")
    if args.synthetic and args.parquet:
        raise NeorecError("give --synthetic or --parquet, not both")
    if args.synthetic or args.parquet:
        _refuse_tsv_flags(args, "--synthetic" if args.synthetic else "--parquet")
    if args.parquet:
        from neorec.config.load import load_config
        from neorec.data.preprocess_parquet import preprocess_parquet

        if args.inputs:
            raise NeorecError("--parquet takes no input files; set data.parquet.paths with --config/--set")
        cfg = load_config(args.config or "default", args.overrides, reads=("parquet",))
        if cfg.data.parquet is None:
            raise NeorecError(
                "--parquet needs a data.parquet section (paths, features, ...) in --config or --set"
            )
        result = preprocess_parquet(
            cfg.data.parquet,
            args.out,
            shard_rows=args.shard_lines,
            vocab_threshold=args.vocab_threshold,
            **common,
        )
    elif args.synthetic:
        from neorec.config.limits import TEACHER, check_memory
        from neorec.config.load import load_config
        from neorec.data.synthetic import spec_from_config

        if args.inputs:
            raise NeorecError("--synthetic takes no input files; the data comes from --config/--set")
        if args.shard_lines != 1_000_000:  # the generator's blocks make the shards
            raise NeorecError(
                "--shard-lines applies to Criteo TSV and Parquet input; leave it out with --synthetic"
            )
        if args.vocab_threshold is not None:
            raise NeorecError(
                "--vocab-threshold applies to Criteo TSV and Parquet input; synthetic ids need no vocabulary"
            )
        cfg = load_config(args.config or "default", args.overrides, reads=("synthetic",))
        check_memory(cfg, keys=(TEACHER,))
        result = preprocess_synthetic(spec_from_config(cfg.data.synthetic, cfg.seed), args.out, **common)
    else:
        if not args.inputs:
            raise NeorecError("give Criteo TSV files to preprocess, or --synthetic")
        if args.config is not None or args.overrides:  # nothing of a config applies: the flags say it all
            given = "--config" if args.config is not None else "--set"
            raise NeorecError(
                f"{given} describes the data of --synthetic or --parquet preprocessing; Criteo TSV files are "
                "preprocessed as their flags say (--table-rows, --hashing, --vocab-threshold, ...): leave it out"
            )
        _refuse_unused_tsv_flags(args)
        rows = _table_rows(args.table_rows)
        result = preprocess_criteo(
            args.inputs, args.out, eval_paths=args.eval_paths, eval_every=args.eval_every, hashing=args.hashing,
            table_rows=rows[0] if len(rows) == 1 else rows, vocab_threshold=args.vocab_threshold,
            bad_lines=args.bad_lines, max_line_bytes=args.max_line_bytes, shard_lines=args.shard_lines,
            raw_features=[f for f in args.raw_features.split(",") if f], **common,
        )  # fmt: skip
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(result.skipped.items())) or "none"
    samples = ", ".join(f"{k} {v}" for k, v in sorted(result.num_samples.items()))
    print(f"{result.out}: {result.num_shards} shards ({result.written} written now); samples: {samples}; "
          f"bad lines skipped: {skipped}")  # fmt: skip
    return 0


# flags that describe Criteo TSV preprocessing only, and their defaults
_TSV_FLAGS = {
    "eval_paths": None, "eval_every": 10, "hashing": "modulo", "table_rows": "100000", "raw_features": "",
    "bad_lines": "fail", "max_line_bytes": 4096,
}  # fmt: skip


def _refuse_unused_tsv_flags(args: argparse.Namespace) -> None:
    """Flags of Criteo TSV preprocessing that another flag given with them switches off are refused,
    naming both: --eval-every with --eval-paths, --hashing and --table-rows with --vocab-threshold."""
    if args.eval_paths and args.eval_every != _TSV_FLAGS["eval_every"]:
        raise NeorecError(
            "--eval-every holds out lines of the training files; with --eval-paths none are: leave it out"
        )
    if args.vocab_threshold is not None:
        flags = ("hashing", "table_rows")
        given = [f"--{k.replace('_', '-')}" for k in flags if getattr(args, k) != _TSV_FLAGS[k]]
        if given:
            raise NeorecError(
                f"{' and '.join(given)} hash values into tables; --vocab-threshold gives ids from a "
                "vocabulary instead: leave one of them out"
            )


def _refuse_tsv_flags(args: argparse.Namespace, mode: str) -> None:
    """A flag of Criteo TSV preprocessing given to --synthetic or --parquet preprocessing, which would
    not use it, is a mistake: refused, naming it (their data is described by --config/--set)."""
    given = [f"--{k.replace('_', '-')}" for k, default in _TSV_FLAGS.items() if getattr(args, k) != default]
    if given:
        raise NeorecError(
            f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} Criteo TSV preprocessing; {mode} "
            "preprocessing takes its data's description from --config/--set: leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def _load_numpy_single_threaded() -> None:
    """Import numpy with its OpenBLAS on one thread, unless told otherwise (OPENBLAS_NUM_THREADS): it
    starts a thread per core when it loads, about 0.15 CPU-seconds on a 2-core VM, and preprocessing does
    no linear algebra. The caller's environment is put back."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


def _table_rows(text: str) -> list[int]:
    """--table-rows: one number or 26, comma-separated, each from 1 to MAX_ROWS."""
    shown = text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:  # not integers, or one of more than 4300 digits
        raise NeorecError(
            f"--table-rows: expected one integer or 26 comma-separated ones, got {shown!r}"
        ) from None
    if not all(1 <= r <= MAX_ROWS for r in rows):
        raise NeorecError(f"--table-rows {shown}: every count must be from 1 to {MAX_ROWS} (2^40)")
    return rows


def _same_stream(out: Path, settings: dict) -> None:
    """The days added to a stream folder continue its stream: its --seed and --rows, recorded in
    OUT/_stream.json (a name a follower skips) when its first days were written, must be these."""
    from neorec.utils.files import read_json, write_json

    path = out / "_stream.json"
    if path.is_file():
        hint = "remove it only if every partition here was written with the settings you give"
        earlier = read_json(path, "stream description", hint, NeorecError)
        differs = [f"--{k} {earlier.get(k)}" for k in settings if earlier.get(k) != settings[k]]
        if differs:
            raise NeorecError(
                f"--out {out}: its partitions were written with {', '.join(differs)}; the next days of one "
                "stream need the same (or give another --out)"
            )
    elif not (out.is_dir() and any(p.name.startswith("day-") for p in out.iterdir())):
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, settings, "stream description")


def _only_stream_files(out: Path) -> None:
    """The stream folder holds its partitions (day-NNN), _stream.json and hidden files alone: a folder
    holding other files (a run's, a data set's) is refused, as `data generate` refuses one."""
    from neorec.utils.files import foreign_files

    others = foreign_files(out, lambda name: re.fullmatch(r"day-\d{3}|_stream\.json|\..*", name) is not None)
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise NeorecError(
            f"--out {out}: holds files that `neorec data stream` does not write ({shown}); a stream's "
            "partitions go in a folder of their own: give a new or empty folder, or an earlier stream's"
        )


def cmd_data_stream(args: argparse.Namespace) -> int:
    from neorec.data.drifting import DriftSpec, partition_name, write_day

    output_folder(args.out, "--out")
    if args.first_day + args.days > STREAM_DAYS:  # names sort in day order up to day-999
        raise NeorecError(
            f"--first-day {args.first_day} --days {args.days}: partitions are named day-000 .. day-999, in "
            f"the order a follower trains them; the last day must be at most {STREAM_DAYS - 1}"
        )
    spec = DriftSpec(rows=args.rows, seed=args.seed)
    days = range(args.first_day, args.first_day + args.days)
    # a complete partition is published: a follower may have trained on it, so it is never written again
    done = [partition_name(d) for d in days if (Path(args.out) / partition_name(d) / "_SUCCESS").exists()]
    if done:
        raise NeorecError(
            f"--out {args.out}: partition {done[0]} is complete already (it has _SUCCESS); partitions are "
            f"written once: start after the last one with --first-day"
        )
    _only_stream_files(Path(args.out))
    _same_stream(Path(args.out), {"seed": args.seed, "rows": args.rows})
    for day in days:
        write_day(spec, args.out, day)
    last = partition_name(args.first_day + args.days - 1)
    print(
        f"{args.out}: wrote partitions {partition_name(args.first_day)} .. {last} ({args.rows:,} samples each)"
    )
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from neorec.data.inspect import inspect_source

    print(inspect_source(args.config or "default", args.overrides, args.batches))
    return 0


def cmd_data_download(args: argparse.Namespace) -> int:
    from neorec.data.download import archive_at, download_movielens, result_text
    from neorec.data.locations import criteo_hint, data_home

    if args.dataset == "criteo":
        raise NeorecError(
            f"Criteo's data cannot be downloaded by neorec: {criteo_hint('data.criteo.train_paths')}"
        )
    dest = args.dest or str(data_home())
    output_folder(
        dest, "--dest" if args.dest else "the data folder ($NEOREC_DATA, default ~/.cache/neorec/data)"
    )
    result = download_movielens(dest, archive_at(args.url), progress=not args.no_progress)
    print(result_text(result))
    return 0


def add_data_commands(sub: argparse._SubParsersAction, add_config_args: Callable) -> None:
    """The `data` command and its subcommands, on the top-level parser's subparsers `sub`."""
    data = sub.add_parser("data", help="download, generate, preprocess or inspect data").add_subparsers(
        dest="data_command", required=True
    )
    p = data.add_parser("generate", help="write the synthetic data set of a config to .npz shards")
    add_config_args(p)
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_data_generate)
    p = data.add_parser(
        "preprocess", help="Criteo TSV, Parquet or synthetic data -> sharded .npy columns, resumable"
    )
    p.add_argument("inputs", nargs="*", help="Criteo TSV files, plain or .gz (training data)")
    p.add_argument("--out", required=True, help="output folder (rerun the same command to resume)")
    p.add_argument(
        "--eval-paths",
        nargs="+",
        default=None,
        help="held-out TSV files (default: every --eval-every-th line)",
    )
    p.add_argument(
        "--eval-every",
        type=whole_number(2, MAX_SAMPLES),
        default=10,
        help="without --eval-paths, hold out lines whose number is a multiple of this",
    )
    p.add_argument(
        "--hashing", default="modulo", choices=["modulo", "hash"], help="how a hex value maps into its table"
    )
    p.add_argument("--table-rows", default="100000", help="rows per table: one number or 26, comma-separated")
    p.add_argument("--vocab-threshold", type=whole_number(1, MAX_SAMPLES), default=None,
                   help="instead of hashing: ids for values seen at least this often in training lines, 0 for the rest "
                        "(Parquet: the features with hashing vocab, counted into OUT/vocab = data.parquet.vocab_dir)")  # fmt: skip
    p.add_argument(
        "--raw-features",
        default="",
        help="features kept as raw hash values for managed-collision tables, comma-separated (e.g. C3,C12)",
    )
    p.add_argument(
        "--bad-lines", default="fail", choices=["fail", "skip"], help="stop with file:line, or skip and count"
    )
    p.add_argument("--max-line-bytes", type=whole_number(1, MAX_LINE_BYTES), default=4096,
                   help="longer lines are bad lines (--bad-lines), never read whole; a Criteo line is under 500 bytes")  # fmt: skip
    p.add_argument(
        "--shard-lines", type=whole_number(1, MAX_SAMPLES), default=1_000_000, help="input lines per shard"
    )
    p.add_argument("--workers", type=whole_number(1, max_processes, per_core()), default=1,
                   help="processes that write shards in parallel (at most 4 per core)")  # fmt: skip
    p.add_argument(
        "--synthetic", action="store_true", help="preprocess the synthetic data set of --config instead"
    )
    p.add_argument(
        "--parquet",
        action="store_true",
        help="preprocess the Parquet files of --config's data.parquet section instead (--shard-lines: rows per shard)",
    )
    p.add_argument(
        "--parquet-output",
        action="store_true",
        help="also write every shard's samples as Parquet files under OUT/parquet/<split>/",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(p)
    p.set_defaults(func=cmd_data_preprocess)
    p = data.add_parser(
        "stream", help="write daily Parquet partitions of a synthetic stream whose ids and teacher drift"
    )
    p.add_argument(
        "--out", required=True, help="the folder of partitions (day-NNN/part-0.parquet, then _SUCCESS)"
    )
    p.add_argument("--days", type=whole_number(1, STREAM_DAYS), default=4, help="partitions to write")
    p.add_argument("--first-day", type=whole_number(0, STREAM_DAYS - 1), default=0,
                   help="the first day's number (to add later days)")  # fmt: skip
    p.add_argument("--rows", type=whole_number(1, MAX_SAMPLES), default=20000, help="samples per day")
    p.add_argument("--seed", type=whole_number(0, 2**32 - 1), default=0, help="the stream's seed")
    p.set_defaults(func=cmd_data_stream)
    p = data.add_parser("inspect", help="summarise the data a config reads (features, sizes, id statistics)")
    add_config_args(p)
    p.add_argument("--batches", type=whole_number(0, MAX_BATCHES_READ), default=4,
                   help="training batches to sample for statistics")  # fmt: skip
    p.set_defaults(func=cmd_data_inspect)
    p = data.add_parser(
        "download", help="download MovieLens latest-small, verified (Criteo: says where to get it)"
    )
    p.add_argument("dataset", choices=["movielens", "criteo"], help="the data set")
    p.add_argument("--dest", default=None, help="folder that gets ml-latest-small/ (default: $NEOREC_DATA, else "
                   "~/.cache/neorec/data, where configs look when data.movielens.root is unset)")  # fmt: skip
    p.add_argument(
        "--url", default=None, help=argparse.SUPPRESS
    )  # a mirror or a test's server: checked against <url>.md5
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data_download)
