"""Data ingestion: preprocessing throughput (MB/s of Criteo TSV) and reader throughput (samples/s).

Preprocessing: a synthetic Criteo-format TSV of `--tsv-mb` MB (random labels, dense counts and 8-digit
hex values with some empty fields, as in the real files) is preprocessed with `neorec data preprocess`
(hashing into the Kaggle-like table sizes) with 1 and with `--workers` processes; the raw streaming TSV
reader (neorec/data/criteo.py) over the same file is shown for reference.

Reader: the Kaggle-like config's synthetic data (neorec/configs/criteo_kaggle.yaml, `--samples`
training samples) is preprocessed once, with a Parquet copy of the same samples next to the .npy shards
(`--parquet-output`), then read with the config's batch size and shuffling on by PreprocessedSource (the
.npy shards) and by ParquetSource (the Parquet copy, ids read as they are: `hashing: none`): one rank,
and each rank of 2 (as two ranks of one machine would read, one at a time here). Besides samples/s,
samples per CPU-second of the whole process (all its threads) compare the readers per core. The rate is
compared with the training consumption rate of the Kaggle-like config (`--train-rate`, samples/s
measured by benchmarks/train_throughput.py with 2 threads).

Criteo layout (`--criteo-lines 1000000 4000000`): a generated file of that many lines in the Criteo
layout (200,000 lines drawn as above, repeated) is preprocessed by `neorec data preprocess FILE
--table-rows 40000000` as a command (hashing, the split, the shards), with 1 and 2 `--workers`, and as
two 1-worker commands run at once on the two halves of its lines (the work divided perfectly: what the
machine gives two cores of it), next to pyarrow's streaming CSV reader parsing the same file on one
thread (parse only: the floor any reader of this format pays), `--repeats` rounds of the four in turn
(medians; speedups are medians of the rounds' ratios), with the command's fixed cost measured on a
1-line file, and, where
torchrec is installed and for files of at most `--torchrec-max-lines` lines, TorchRec's
`BinaryCriteoUtils.tsv_to_npys` once (parse and write .npy, no hashing; it needs iopath). Each runs as its
own process: CPU seconds are those of the process and its workers (user + system), peak memory the
largest of them (ru_maxrss), MB per CPU-second the file's size over those seconds (less disturbed by a
shared machine than the wall-clock rate).

    python benchmarks/ingestion.py                       # ~300 MB TSV, 2M samples
    python benchmarks/ingestion.py --tsv-mb 50 --samples 500000 --no-append
    python benchmarks/ingestion.py --reader-only         # the readers (.npy shards, Parquet) only
    python benchmarks/ingestion.py --criteo-lines 1000000 4000000   # Criteo layout, against pyarrow and TorchRec
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import append_results, markdown_table, peak_rss_mib  # noqa: E402


def write_tsv(path: Path, megabytes: float, seed: int = 0) -> int:
    """A Criteo-format TSV of about `megabytes` MB; returns its line count."""
    rng = np.random.default_rng(seed)
    lines_per_chunk, written, lines = 20000, 0, 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            n = lines_per_chunk
            labels = (rng.random(n) < 0.25).astype(int)
            dense = np.floor(np.exp(rng.normal(1.5, 1.5, (n, 13)))).astype(np.int64) - 1
            dense_empty = rng.random((n, 13)) < 0.2
            hexes = rng.integers(0, 1 << 32, (n, 26), dtype=np.uint64)
            hex_empty = rng.random((n, 26)) < 0.1
            rows = []
            for i in range(n):
                d = ["" if dense_empty[i, j] else str(dense[i, j]) for j in range(13)]
                c = ["" if hex_empty[i, j] else f"{int(hexes[i, j]):08x}" for j in range(26)]
                rows.append("\t".join([str(labels[i]), *d, *c]))
            text = "\n".join(rows) + "\n"
            f.write(text)
            written += len(text)
            lines += n
    return lines


def bench_preprocess(args, tmp: Path) -> tuple[list[list[object]], str]:
    from neorec.data.criteo import CriteoTSVReader
    from neorec.data.preprocess import preprocess_criteo
    from neorec.data.synthetic import CRITEO_KAGGLE_ROWS

    tsv = tmp / "criteo_like.tsv"
    t0 = time.perf_counter()
    num_lines = write_tsv(tsv, args.tsv_mb)
    mb = tsv.stat().st_size / 1e6
    print(f"wrote {tsv} ({mb:.0f} MB, {num_lines:,} lines) in {time.perf_counter() - t0:.1f} s", flush=True)
    rows_per_table = [min(r, 1_000_000) for r in CRITEO_KAGGLE_ROWS]
    rows = []
    for workers in sorted({1, args.workers}):
        out = tmp / f"pre-{workers}"
        t0 = time.perf_counter()
        result = preprocess_criteo([tsv], out, table_rows=rows_per_table, shard_lines=args.shard_lines,
                                   workers=workers, progress=False)  # fmt: skip
        s = time.perf_counter() - t0
        n = sum(result.num_samples.values())
        rows.append([f"preprocess, {workers} worker(s)", f"{s:.1f}", f"{mb / s:.1f}", f"{n / s:,.0f}"])
        print(rows[-1], flush=True)
        if workers != max({1, args.workers}):
            shutil.rmtree(out)
    t0 = time.perf_counter()
    reader = CriteoTSVReader([tsv], rows_per_table)
    n = sum(len(b) for b in reader.batches(2048))
    s = time.perf_counter() - t0
    rows.append(["raw TSV reader (streaming, reference)", f"{s:.1f}", f"{mb / s:.1f}", f"{n / s:,.0f}"])
    print(rows[-1], flush=True)
    out_mb = (
        sum(p.stat().st_size for p in (tmp / f"pre-{max(1, args.workers)}").rglob("*") if p.is_file()) / 1e6
    )
    note = (f"TSV: {mb:.0f} MB, {num_lines:,} lines (synthetic Criteo format), shards of {args.shard_lines:,} "
            f"lines; output {out_mb:.0f} MB of .npy columns (int32 ids).")  # fmt: skip
    return rows, note


def write_criteo_layout(path: Path, num_lines: int, base_lines: int = 200_000) -> None:
    """`num_lines` lines in the Criteo layout: `base_lines` drawn by write_tsv, repeated."""
    base = path.with_suffix(".base")
    write_tsv(base, base_lines * 243 / 1e6 + 1)
    lines = base.read_bytes().splitlines(keepends=True)[:base_lines]
    base.unlink()
    block = b"".join(lines)
    with path.open("wb") as f:
        for start in range(0, num_lines, base_lines):
            f.write(block if start + base_lines <= num_lines else b"".join(lines[: num_lines - start]))


# pyarrow's fastest block size here, its default: 512 KiB and 1 MiB parse the 1M-line file in about
# 1.2 CPU-s, 2 MiB in 1.2-1.4, 4 MiB in 1.5, 8 MiB in 2.4 (2026-11-27, 2-core VM, loaded); every column
# as binary, as neorec parses them (inferring types, int64 and UTF-8 strings, costs more)
_PYARROW_BLOCK = 1 << 20
_PYARROW_PARSE = f"""
import sys, pyarrow as pa, pyarrow.csv as pcsv
names = ["label"] + [f"I{{i}}" for i in range(1, 14)] + [f"C{{i}}" for i in range(1, 27)]
reader = pcsv.open_csv(
    sys.argv[1],
    read_options=pcsv.ReadOptions(column_names=names, use_threads=False, block_size={_PYARROW_BLOCK}),
    parse_options=pcsv.ParseOptions(delimiter="\\t", quote_char=False),
    convert_options=pcsv.ConvertOptions(column_types={{c: pa.binary() for c in names}}),
)
print(sum(b.num_rows for b in reader))
"""
_TORCHREC = """
import sys
from torchrec.datasets.criteo import BinaryCriteoUtils
BinaryCriteoUtils.tsv_to_npys(sys.argv[1], *(sys.argv[2] + s for s in ("_dense.npy", "_sparse.npy", "_labels.npy")))
"""


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Run a command; (wall s, CPU s, peak MiB) of it and its workers (see measure_together)."""
    return measure_together([cmd], env)


def measure_together(cmds: list[list[str]], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Run commands at once; (wall s until the last one ends, CPU s of them all, the largest peak MiB).
    A command's resources are those wait4 gives: its own with those of the workers it waited for. Each
    starts under /usr/bin/time, a small process: Linux carries a parent's peak memory into a child it
    forks, and this process's peak would hide the command's."""
    launcher = ["/usr/bin/time", "-f", "%M"] if Path("/usr/bin/time").is_file() else []
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([*launcher, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        for cmd in cmds
    ]
    cpu, peak_kib = 0.0, 0
    for cmd, proc in zip(cmds, procs, strict=True):
        _, status, usage = os.wait4(proc.pid, 0)
        assert proc.stderr is not None
        with proc.stderr:
            err = proc.stderr.read().decode()
        if os.waitstatus_to_exitcode(status):
            raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd, stderr=err)
        cpu += usage.ru_utime + usage.ru_stime
        peak_kib = max(peak_kib, int(err.split()[-1]) if launcher else usage.ru_maxrss)
    return time.perf_counter() - t0, cpu, peak_kib / 1024


def write_halves(path: Path, first: Path, second: Path) -> None:
    """The lines of `path` in two files: those that start before its middle byte, and the rest."""
    size = path.stat().st_size
    with path.open("rb") as src:
        src.seek(size // 2)
        src.readline()
        cut = src.tell()
        src.seek(0)
        for dest, length in ((first, cut), (second, size - cut)):
            with dest.open("wb") as out:
                while length:
                    chunk = src.read(min(length, 8 << 20))
                    out.write(chunk)
                    length -= len(chunk)


def summary(measured: list[tuple[float, float, float]], mb: float) -> list[str]:
    """[wall s, MB/s, CPU s, MB per CPU-second, peak MiB]: the medians of the runs."""
    wall, cpu, peak = (float(np.median(column)) for column in zip(*measured, strict=True))
    rate, cpu_rate = (f"{mb / wall:.0f}", f"{mb / cpu:.0f}") if mb else ("-", "-")
    return [f"{wall:.2f}", rate, f"{cpu:.2f}", cpu_rate, f"{peak:,.0f}"]


def bench_criteo_layout(args, tmp: Path) -> tuple[list[list[object]], str]:
    """neorec's preprocessing with 1 and 2 workers and pyarrow's parse, `--repeats` rounds in turn
    (medians), the command's fixed cost (a 1-line file), and TorchRec's tsv_to_npys once."""
    rows: list[list[object]] = []
    speedups = []
    load_before = os.getloadavg()[0]
    # the commands start with compiled bytecode, as an installed package does (pip compiles it), also
    # where the environment turns writing it off (PYTHONDONTWRITEBYTECODE): it is kept in `tmp`
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    one_line = tmp / "one-line.tsv"
    write_criteo_layout(one_line, 1, base_lines=1)
    fixed = []
    for i in range(args.repeats + 1):  # the first run compiles the bytecode and is not counted
        measured = measure(_neorec_command(one_line, tmp / "one-line", 1), env)
        fixed += [measured] if i else []
        shutil.rmtree(tmp / "one-line")
    rows.append(["neorec preprocess, 1 worker, a 1-line file (the command's fixed cost)", "1", "0",
                 *summary(fixed, 0.0)])  # fmt: skip
    print(rows[-1], flush=True)
    fixed_wall = float(np.median([f[0] for f in fixed]))
    for num_lines in args.criteo_lines:
        tsv = tmp / f"day-{num_lines}.tsv"
        write_criteo_layout(tsv, num_lines)
        mb = tsv.stat().st_size / 1e6
        halves = [tmp / f"day-{num_lines}-half{i}.tsv" for i in (1, 2)]
        write_halves(tsv, *halves)
        for path in (tsv, *halves):  # into the page cache
            subprocess.run(["cat", str(path)], check=True, stdout=subprocess.DEVNULL)
        runs: dict[str, list[tuple[float, float, float]]] = {}
        pyarrow = f"pyarrow.csv streaming reader, 1 thread, {_PYARROW_BLOCK >> 20} MiB blocks (parse only)"
        for _ in range(args.repeats):
            for workers in (1, 2):
                out = tmp / f"criteo-{num_lines}-{workers}"
                runs.setdefault(f"neorec preprocess, {workers} worker(s)", []).append(
                    measure(_neorec_command(tsv, out, workers), env)
                )
                shutil.rmtree(out)
            outs = [tmp / f"criteo-{num_lines}-half{i}" for i in (1, 2)]
            runs.setdefault(_HALVES, []).append(
                measure_together([_neorec_command(h, o, 1) for h, o in zip(halves, outs, strict=True)], env)
            )
            for out in outs:
                shutil.rmtree(out)
            runs.setdefault(pyarrow, []).append(
                measure([sys.executable, "-c", _PYARROW_PARSE, str(tsv)], env)
            )
        for label, measured in runs.items():
            rows.append([label, f"{num_lines:,}", f"{mb:.0f}", *summary(measured, mb)])
            print(rows[-1], flush=True)
        speedups.append(f"{num_lines:,} lines: " + _scaling(runs, fixed_wall))
        if num_lines <= args.torchrec_max_lines:
            try:  # TorchRec's dataset scripts read files through iopath
                import iopath  # noqa: F401
                import torchrec  # noqa: F401
            except ImportError:
                pass
            else:
                cmd = [sys.executable, "-c", _TORCHREC, str(tsv), str(tmp / "torchrec")]
                rows.append(["TorchRec BinaryCriteoUtils.tsv_to_npys (no hashing), one run", f"{num_lines:,}",
                             f"{mb:.0f}", *summary([measure(cmd, env)], mb)])  # fmt: skip
                print(rows[-1], flush=True)
                for p in tmp.glob("torchrec_*"):
                    p.unlink()
        for path in (tsv, *halves):
            path.unlink()
    note = (f"Criteo layout: generated files ({', '.join(f'{n:,}' for n in args.criteo_lines)} lines; 200,000 lines "
            "drawn as in the TSV note, repeated), in the page cache before each run. neorec: `neorec data preprocess "
            "FILE --table-rows 40000000` (modulo hashing, every 10th line held out, shards of 1,000,000 lines, "
            "fsync'd .npy columns). CPU: user + system seconds of the command and its workers; peak: the largest "
            f"of their resident sizes. Medians of {args.repeats} rounds; a round runs its commands one after the "
            "other, each with Python's compiled bytecode at hand, as an installed package has it. The fixed cost (interpreter, imports, a 1-line shard written and fsync'd) is paid once per "
            "command whatever the file's size. Two 1-worker commands at once, each on one half of the file's lines: "
            "the same work divided perfectly, with nothing shared but the machine, so their wall clock against "
            "one command's is what this machine gives two cores of this work. Medians of the rounds' wall-clock "
            f"ratios: {'; '.join(speedups)}. TorchRec runs only on files of at most "
            f"{args.torchrec_max_lines:,} lines (it holds the whole file in memory). Load average (1 min) "
            f"{load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after: other processes share the "
            "cores, wall-clock figures are only as good as that.")  # fmt: skip
    return rows, note


_HALVES = "two 1-worker commands at once, each on half of the lines (the work divided perfectly)"


def _scaling(runs: dict[str, list[tuple[float, float, float]]], fixed_wall: float) -> str:
    """The 2-worker speedup, that of the halves run at once, and the first against the second, as medians
    of the rounds' ratios (every round's shown), with the bound the fixed cost puts on perfect scaling."""
    one, two = runs["neorec preprocess, 1 worker(s)"], runs["neorec preprocess, 2 worker(s)"]
    halves = runs[_HALVES]

    def ratios(a: list, b: list) -> str:
        r = [x[0] / y[0] for x, y in zip(a, b, strict=True)]
        return f"{np.median(r):.2f}x (rounds {', '.join(f'{v:.2f}' for v in r)})"

    work = float(np.median([a[0] for a in one])) - fixed_wall
    bound = (fixed_wall + work) / (fixed_wall + work / 2)
    return (
        f"one worker's time over two workers' {ratios(one, two)}, over the halves' at once "
        f"{ratios(one, halves)}; the halves' over two workers' {ratios(halves, two)} (1.00: two workers as "
        f"fast as the work divided perfectly); perfect scaling of all but the fixed cost would give {bound:.2f}x"
    )


def _neorec_command(tsv: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "neorec", "data", "preprocess", str(tsv), "--out", str(out),
            "--table-rows", "40000000", "--no-progress", "--workers", str(workers)]  # fmt: skip


def bench_reader(args, tmp: Path) -> tuple[list[list[object]], str]:
    from neorec.config.load import load_config
    from neorec.config.schema import ParquetConfig
    from neorec.data.parquet import ParquetSource
    from neorec.data.preprocess import preprocess_synthetic
    from neorec.data.sharded_reader import PreprocessedSource
    from neorec.data.synthetic import spec_from_config

    cfg = load_config("criteo_kaggle", [f"data.synthetic.train_samples={args.samples}"])
    out = tmp / "kaggle"
    t0 = time.perf_counter()
    result = preprocess_synthetic(
        spec_from_config(cfg.data.synthetic, cfg.seed), out, workers=args.workers, progress=False,
        parquet_output=True,
    )  # fmt: skip
    print(
        f"preprocessed {args.samples:,} Kaggle-like samples in {time.perf_counter() - t0:.1f} s", flush=True
    )
    features = [{"name": f.name, "rows": f.num_ids, "hashing": "none"}
                for f in PreprocessedSource(out).info.features]  # fmt: skip
    parquet = ParquetConfig(paths=[str(out / "parquet" / "train")], eval_paths=[str(out / "parquet" / "eval")],
                            dense=[f"d{j}" for j in range(cfg.data.synthetic.num_dense)], features=features)  # fmt: skip
    readers = {
        f".npy shards (PreprocessedSource, {args.reader_threads} gathering thread(s))": lambda rank, world: (
            PreprocessedSource(out, rank=rank, world_size=world, seed=cfg.seed, threads=args.reader_threads)
        ),
        "Parquet (ParquetSource)": lambda rank, world: ParquetSource(
            parquet, rank=rank, world_size=world, seed=cfg.seed
        ),
    }
    batch = args.batch_size or cfg.data.batch_size
    rows = []
    for name, make in readers.items():
        for world_size in (1, 2):
            rates, cpu_rates = [], []
            for rank in range(world_size):
                source = make(rank, world_size)
                for epoch in range(args.epochs):
                    t0, c0 = time.perf_counter(), time.process_time()
                    n = sum(len(b) for b in source.train_batches(batch // world_size, epoch + 1))
                    rates.append(n / (time.perf_counter() - t0))
                    cpu_rates.append(n / (time.process_time() - c0))
            rate, cpu_rate = float(np.median(rates)), float(np.median(cpu_rates))
            label = (
                "1 rank"
                if world_size == 1
                else f"each of {world_size} ranks (local batch {batch // world_size})"
            )
            rows.append(
                [f"{name}, {label}", f"{rate:,.0f}", f"{cpu_rate:,.0f}", f"{rate / args.train_rate:.1f}x"]
            )
            print(rows[-1], flush=True)
    npy_mb = sum(p.stat().st_size for p in (out / "shards").rglob("*.npy")) / 1e6
    parquet_mb = sum(p.stat().st_size for p in (out / "parquet").rglob("*.parquet")) / 1e6
    note = (f"Reader: {args.samples:,} training samples of the criteo_kaggle config preprocessed (26 int32 id "
            f"columns, 13 dense) into {result.num_shards} shards: {npy_mb:.0f} MB of .npy columns, and a Parquet "
            f"copy of {parquet_mb:.0f} MB (pyarrow's defaults: snappy, dictionary encoding; one row group per "
            f"shard); global batch {batch}, shuffled (.npy: shard order + windows of 131,072; Parquet: row-group "
            f"order + rows within a row group), median of {args.epochs} epoch(s) per rank; ratio against "
            f"{args.train_rate:,.0f} samples/s, the Kaggle-like training rate with 2 threads; glibc keeps freed "
            f"memory, as in training.")  # fmt: skip
    return rows, note


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tsv-mb", type=float, default=300.0, help="size of the generated TSV")
    p.add_argument("--shard-lines", type=int, default=200_000, help="preprocess: lines per shard")
    p.add_argument("--samples", type=int, default=2_000_000, help="reader: Kaggle-like training samples")
    p.add_argument("--epochs", type=int, default=2, help="reader: epochs timed per rank")
    p.add_argument("--batch-size", type=int, help="reader: global batch (default: criteo_kaggle's, 2048)")
    p.add_argument("--reader-threads", type=int, default=1, help="reader: threads gathering .npy batches")
    p.add_argument("--workers", type=int, default=2, help="preprocess: worker processes")
    p.add_argument("--train-rate", type=float, default=23000.0, help="training samples/s to compare with")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a new temporary one, removed)")
    p.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    p.add_argument("--reader-only", action="store_true", help="time the readers only, not the preprocessing")
    p.add_argument(
        "--criteo-lines",
        type=int,
        nargs="+",
        default=None,
        help="only the Criteo-layout comparison, on generated files of these many lines",
    )
    p.add_argument(
        "--torchrec-max-lines", type=int, default=1_000_000, help="largest file TorchRec's script reads"
    )
    p.add_argument("--repeats", type=int, default=3, help="Criteo layout: rounds of the commands, in turn")
    args = p.parse_args()
    if args.criteo_lines:
        tmp = Path(args.tmp or tempfile.mkdtemp(prefix="neorec-ingestion-"))
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            rows, note = bench_criteo_layout(args, tmp)
        finally:
            if args.tmp is None:
                shutil.rmtree(tmp, ignore_errors=True)
        header = ["what", "lines", "MB", "wall s", "MB/s", "CPU s", "MB per CPU-second", "peak MiB"]
        table = markdown_table(header, rows)
        print(table + "\n\n" + note)
        if not args.no_append:
            append_results(
                "Data ingestion: Criteo-layout TSV preprocessing against pyarrow and TorchRec", table, note
            )
        return
    from neorec.utils.host import keep_freed_memory

    keep_freed_memory()  # as the trainer does (train.keep_freed_memory, default on)
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="neorec-ingestion-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        reader_rows, reader_note = bench_reader(args, tmp)
        pre_rows, pre_note = bench_preprocess(args, tmp) if not args.reader_only else ([], "")
    finally:
        if args.tmp is None:
            shutil.rmtree(tmp, ignore_errors=True)
    table = markdown_table(["reader", "samples/s", "samples per CPU-second", "vs training rate"], reader_rows)
    if pre_rows:
        table += "\n\n" + markdown_table(["preprocessing", "seconds", "MB/s of TSV", "lines/s"], pre_rows)
    notes = "\n".join(n for n in (reader_note, pre_note) if n)
    notes += f"\nPeak RSS of the benchmark process: {peak_rss_mib():,.0f} MiB."
    print(table + "\n\n" + notes)
    if not args.no_append:
        title = (
            "readers of .npy shards and of Parquet"
            if args.reader_only
            else "reader and preprocessing throughput"
        )
        append_results(f"Data ingestion: {title}", table, notes)


if __name__ == "__main__":
    main()
