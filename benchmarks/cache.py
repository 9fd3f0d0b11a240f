"""Training through the row cache: samples/s and hit rate vs cache size and id skew; a larger-than-memory demo.

Sweep (default): one DLRM (26 tables, dim 64, AdaGrad) trained with all tables in RAM (tier memory)
and with the tables in files (tier ssd) behind a RAM cache of 1%, 5%, 20% and 100% of their rows,
for several Zipf exponents of the ids. Batches are generated before timing; each step first
prefetches the next batch's rows (as the training pipeline does), then trains. Records the table
(benchmarks/records/cache.jsonl, shown in RESULTS.md) and draws a plot into docs/img/ (cache.png).

    python benchmarks/cache.py                                   # the sweep
    python benchmarks/cache.py --demo --table-gib 12 --budget-gib 4 --steps 300
    python benchmarks/cache.py --replot cache.png                # redraw a plot from its recorded table
    python benchmarks/cache.py --device cuda --tier ssd          # the sweep with the cache in GPU memory

Demo: tables + Adam state of `--table-gib` GiB in files under --dir, a cache sized to fit a
`--budget-gib` memory budget, trained for --steps; reports samples/s, hit rate and peak RSS (VmHWM),
then deletes the files.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import RECORDS, append_results, markdown_table, peak_rss_mib  # noqa: E402
from benchmarks.render_results import read_records  # noqa: E402
from neorec.embedding.cache.build import release_bytes, use_io_thread  # noqa: E402

PLOTS = Path(__file__).resolve().parent.parent / "docs" / "img"  # next to the docs that show them


def make_config(
    rows: int, dim: int, zipf: float, batch_size: int, steps: int, optimizer: str, extra: list[str]
):
    from neorec.config.load import load_config

    sets = [
        "data.synthetic.preset=custom", f"data.synthetic.rows={rows}", "data.synthetic.max_rows=null", f"data.synthetic.zipf_alpha={zipf}",
        f"data.synthetic.train_samples={batch_size * steps}", "data.synthetic.eval_samples=1000",
        f"data.batch_size={batch_size}", f"embedding.dim={dim}", f"model.bottom_mlp=[128, {dim}]",
        f"embedding.optimizer={{name: {optimizer}, lr: 0.05}}", "train.progress=false",
    ]  # fmt: skip
    return load_config("default", sets + extra)


def make_batches(cfg, n: int) -> list:
    from neorec.train.build import build_source

    out = []
    for batch in build_source(cfg).train_batches(cfg.data.batch_size, 0):
        out.append(batch)
        if len(out) == n:
            break
    return out


def train(cfg, batches: list, warmup: int, out_dir: Path) -> dict:
    """Warm-up steps, then timed steps; each step prefetches the next batch's rows first."""
    from neorec.embedding.cache import summarize
    from neorec.train.trainer import Trainer

    gc.collect()  # the runs before: their trainers (reference cycles) and the maps of their files
    start = time.perf_counter()
    trainer = Trainer(cfg, out_dir)
    build_s = time.perf_counter() - start
    emb = trainer.embeddings

    def steps(items: list) -> None:
        for i, batch in enumerate(items):
            if i + 1 < len(items):
                emb.prefetch(items[i + 1].sparse)
            trainer.train_step(batch)

    backings = {id(w.cache.backing): w.cache.backing for w in emb.weights if hasattr(w, "cache")}
    io_cpu = [b.cpu_seconds for b in backings.values() if hasattr(b, "cpu_seconds")]
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    batches = [b.to(trainer.device) for b in batches]  # as the trainer moves them before prefetching
    steps(batches[:warmup])
    sync()
    before = summarize(emb.cache_stats())
    io_before = sum(sum(c.values()) for c in io_cpu)
    start, cpu = time.perf_counter(), time.process_time()
    steps(batches[warmup:])
    sync()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    io_seconds = sum(sum(c.values()) for c in io_cpu) - io_before
    logs = [b.log for b in backings.values() if getattr(b, "log", None) is not None]
    log_gib = sum(log.appended * log.record_bytes for log in logs) / 2**30  # since the files were made
    after = summarize(emb.cache_stats())
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k != "hit_rate"}
    # Rows brought in per unique row looked up: above 1 when a cache too small for a batch's rows
    # brings some in more than once in a step; the hit rate is then 0, as the caches report it
    # (neorec/embedding/cache/stats.py).
    brought_in = delta["misses"] / delta["lookups"] if delta.get("lookups") else float("nan")
    hit = max(0.0, 1 - brought_in) if delta.get("lookups") else float("nan")
    samples = sum(len(b) for b in batches[warmup:])
    return {
        "samples_per_s": samples / seconds,
        "cpu_ms_per_step": 1e3 * cpu / max(len(batches) - warmup, 1),  # all threads of the process
        # of which reading and writing the files (ssd; the worker thread's share, mostly)
        "io_cpu_ms_per_step": 1e3 * io_seconds / max(len(batches) - warmup, 1) if io_cpu else None,
        "hit_rate": hit,
        "brought_in_per_lookup": brought_in,
        "mib_from_tier_per_step": sum(v for k, v in delta.items() if k.startswith("mib_from_"))
        / max(len(batches) - warmup, 1),
        "build_s": build_s,
        "log_gib_appended": log_gib,
        "peak_rss_mib": peak_rss_mib(),
    }


def profile(cfg, batches: list, warmup: int, out_dir: Path, title: str) -> None:
    """Print where a step's time goes: the training thread's host syncs (each site's stack, under
    torch.cuda's sync debug mode, over 2 steps), then the operators by host time and the kernels by
    device time over 5 steps (torch.profiler), with the prefetch and the step marked."""
    import collections
    import threading
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    from neorec.train.trainer import Trainer

    gc.collect()
    trainer = Trainer(cfg, out_dir)
    emb = trainer.embeddings
    batches = [b.to(trainer.device) for b in batches]
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    debug = torch.cuda.set_sync_debug_mode if cuda else (lambda mode: None)

    def step(i: int) -> None:
        with record_function("prefetch next"):
            if i + 1 < len(batches):
                emb.prefetch(batches[i + 1].sparse)
        with record_function("train step"):
            trainer.train_step(batches[i])

    for i in range(warmup):
        step(i)
    sync()
    sites: collections.Counter = collections.Counter()
    main = threading.main_thread()

    def seen(message, *args, **kwargs) -> None:
        if threading.current_thread() is main and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/neorec/" in f.filename]
            sites["\n".join(f"    {Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-5:])] += 1

    debug("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        for i in range(warmup, warmup + 2):
            step(i)
    debug("default")
    print(f"-- {title}: host syncs on the training thread over 2 steps, by site (innermost last)")
    for site, n in sites.most_common():
        print(f"  {n} x\n{site}")
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(warmup + 2, min(warmup + 7, len(batches))):
            step(i)
        sync()
    table = prof.key_averages()
    print(f"-- {title}: operators by host time over 5 steps (the worker thread's included)")
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(f"-- {title}: kernels by device time over 5 steps")
    print(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def sweep(args) -> None:
    fractions = args.fractions
    release_mibs = args.release_mib or ["auto"]
    results = []
    for zipf in args.zipf:
        on_device = [f"train.device={args.device}"]
        base = make_config(
            args.rows, args.dim, zipf, args.batch_size, args.steps + args.warmup, args.optimizer, on_device
        )
        batches = make_batches(base, args.steps + args.warmup)
        directory = Path(args.dir) / "cache-bench"
        cases = [(None, base)]
        for fraction in fractions:
            for io_thread in args.io_thread:
                for release in release_mibs:
                    extra = [f"embedding.tier={args.tier}", f"embedding.cache.directory={directory}",
                             f"embedding.cache.ssd_reads={args.ssd_reads}", f"embedding.cache.ssd_log={args.ssd_log}",
                             f"embedding.cache.io_thread={io_thread}", f"embedding.cache.fraction={fraction}",
                             f"embedding.cache.policy={args.policy}", f"embedding.cache.release_mib={release}",
                             *on_device]  # fmt: skip
                    steps = args.steps + args.warmup
                    config = make_config(
                        args.rows, args.dim, zipf, args.batch_size, steps, args.optimizer, extra
                    )
                    cases.append(((fraction, io_thread, release), config))
        best: dict = {}
        for _ in range(args.repeats):  # interleaved; the best of the repeats (other load on the VM)
            for key, cfg in cases:
                r = train(cfg, batches, args.warmup, Path("/tmp/neorec-cache-bench/run"))
                shutil.rmtree(directory, ignore_errors=True)
                if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
                    best[key] = r
        if args.profile:  # the first fraction's cases, and the tables all in GPU memory
            for key, cfg in cases:
                if key is None or key[0] == fractions[0]:
                    title = "all in memory" if key is None else f"{args.tier} + {key[0]:.0%} cached"
                    title += "" if key is None else f", io thread {key[1]}"
                    profile(cfg, batches, args.warmup, Path("/tmp/neorec-cache-bench/run"), title)
                    shutil.rmtree(directory, ignore_errors=True)
        ram = best[None]
        for key, _ in cases:
            r = best[key]
            r["vs_ram"] = r["samples_per_s"] / ram["samples_per_s"]
            every = "all in RAM" if args.device == "cpu" else "all in GPU memory"
            fraction, io_thread, release = key if key is not None else (None, None, None)
            case = every if fraction is None else f"{args.tier} + {fraction:.0%} cached"
            if fraction is not None and len(args.io_thread) > 1:
                case += f", io thread {io_thread}"
            if fraction is not None and len(release_mibs) > 1:
                case += f", release {release}"
            variant = f"{io_thread}/{release}"
            results.append({"zipf": zipf, "case": case, "fraction": fraction, "io_thread": io_thread,
                            "release_mib": release, "variant": variant, **r})  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    header = [
        "Zipf",
        "tables",
        "samples/s",
        "vs all in RAM",
        "hit rate",
        "MiB from tier / step",
        "CPU ms / step",
        "of which file I/O",
    ]
    rows = [
        [str(r["zipf"]), r["case"], r["samples_per_s"], f"{r.get('vs_ram', 1.0):.2f}x",
         "-" if r["fraction"] is None else f"{r['hit_rate']:.3f}",
         "-" if r["fraction"] is None else f"{r['mib_from_tier_per_step']:.2f}", f"{r['cpu_ms_per_step']:.0f}",
         "-" if r.get("io_cpu_ms_per_step") is None else f"{r['io_cpu_ms_per_step']:.1f}"]
        for r in results
    ]  # fmt: skip
    if args.no_append:
        print(markdown_table(header, rows))
        return
    title = plot_title(args.tier, args.policy, args.warmup, args.optimizer, args.device)
    plot(results, title, PLOTS / args.plot)
    table_bytes = 26 * args.rows * args.dim * 4 * (2 if args.optimizer == "adagrad" else 1)
    notes = (
        f"26 tables x {args.rows:,} rows x dim {args.dim}, {args.optimizer} ({table_bytes / 2**30:.2f} GiB of rows "
        f"and state), batch {args.batch_size}, {args.steps} timed steps after {args.warmup}, {args.policy}, best of "
        f"{args.repeats} interleaved repeats; "
        "each step first prefetches the next batch's rows (ssd: with the I/O thread on, their reads start on a "
        f"worker thread; io_thread {'/'.join(args.io_thread)}, auto = {'on' if use_io_thread('auto', args.device) else 'off'} "
        f"here; release_mib {'/'.join(map(str, release_mibs))} (auto = "
        f"{release_bytes('auto') / 2**20:,.0f} MiB here); rows written back go to a write log of {args.ssd_log:g} x the rows, folded into the table file "
        "in windows). Files in "
        f"{args.dir}, dropped from the page cache once written: a miss is a random read from the disk "
        "until the page cache holds the page again. "
        "Hit rate = 1 - rows brought in / unique rows looked up, at least 0 (0 where a batch's unique rows do not "
        "fit in the cache, so some are brought in more than once within the step). CPU ms / step: CPU time of "
        "all the process's threads per timed step (less sensitive than samples/s to other jobs on the machine); "
        "of which file I/O: the part spent reading and writing the ssd files (SsdBacking.cpu_seconds, "
        "folding the write log included). Plot: "
        f"docs/img/{args.plot}. {args.note}"
    )
    append_results(
        "Row cache: samples/s and hit rate vs cache size and Zipf skew", markdown_table(header, rows), notes
    )
    print(markdown_table(header, rows))


def recorded_results(
    plot_name: str, stamp: str | None = None, path: Path = RECORDS / "cache.jsonl"
) -> tuple[list[dict], str]:
    """The rows of the last recorded table plotted to docs/img/<plot_name> (benchmarks/<plot_name> in
    records older than the move; with `stamp`: the one recorded then, e.g. "2026-11-22 16:09"), as
    `plot` takes them, and the plot's title (plot_title of the setup the record's notes name)."""
    for record in reversed(read_records(path)):
        notes = record.get("notes", "")
        named = re.search(rf"Plot: (docs/img|benchmarks)/{re.escape(plot_name)}\b", notes)
        if not named or (stamp and stamp not in record["date"]):
            continue
        table = record["tables"][0]
        rows = []
        for row in table["rows"]:
            cells = dict(zip(table["header"], row, strict=True))
            case = cells["tables"]
            cached = re.search(r"([\d.]+)% cached", case)
            rows.append({
                "zipf": float(cells["Zipf"]), "case": case,
                "fraction": float(cached.group(1)) / 100 if cached else None,
                "variant": case.split(", ", 1)[1] if ", " in case else "",
                "samples_per_s": float(cells["samples/s"].replace(",", "")),
                "hit_rate": float(cells["hit rate"]) if cells["hit rate"] != "-" else None,
            })  # fmt: skip
        tier = next(r["case"].split(" + ")[0] for r in rows if r["fraction"] is not None)
        device = "cuda" if any("GPU memory" in r["case"] for r in rows) else "cpu"
        policy = re.search(r", (lru|lfu), best of", notes)
        warmup = re.search(r"timed steps after (\d+)", notes)
        optimizer = re.search(r"rows x dim \d+, (\w+) \(", notes)
        if not (policy and warmup and optimizer):
            sys.exit(f"{path}: the notes of {record['date']} do not name its policy, warm-up, optimizer")
        return rows, plot_title(tier, policy.group(1), int(warmup.group(1)), optimizer.group(1), device)
    sys.exit(f"{path} has no table plotted to {plot_name}" + (f" at {stamp}" if stamp else ""))


def plot_title(tier: str, policy: str, warmup: int, optimizer: str, device: str = "cpu") -> str:
    """What sets a sweep's plot apart from the others: where the tables and the cache are, the
    eviction policy, the warm-up steps before timing, the embedding optimizer."""
    tables = {"ssd": "tables in files (tier ssd)", "dram": "tables in host memory (tier dram)"}[tier]
    cache = "GPU memory" if device == "cuda" else "RAM"
    return (f"Training through a row cache in {cache} over {tables}\n"
            f"{policy.upper()} eviction, timed after {warmup} warm-up steps, embedding optimizer {optimizer}")


def plot(results: list[dict], title: str, path: Path | None):
    """samples/s and hit rate against the cache size, one line per Zipf exponent (and variant: I/O
    thread, release_mib), ticks at the measured sizes; written to `path` (None: the figure returned).
    A hit rate recorded below 0 (rows brought in more than once in a step, by tables written before it
    was clamped) is drawn as 0, hollow and not joined to the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.3))
    clamped = False
    for zipf in sorted({r["zipf"] for r in results}):
        mine = [r for r in results if r["zipf"] == zipf]
        ram = next(r for r in mine if r["fraction"] is None)
        variants = list(dict.fromkeys(r["variant"] for r in mine if r["fraction"] is not None))
        colors = []
        for variant in variants:
            cached = [r for r in mine if r["fraction"] is not None and r["variant"] == variant]
            x = [100 * r["fraction"] for r in cached]
            label = f"Zipf {zipf}" + (f", {cached[0]['case'].split(', ', 1)[1]}" if len(variants) > 1 else "")
            line = ax1.plot(x, [r["samples_per_s"] for r in cached], "o-", label=f"{label}: cached")[0]
            colors.append(line.get_color())
            hits = [math.nan if r["hit_rate"] is None else r["hit_rate"] for r in cached]
            measured = [h if h >= 0 else math.nan for h in hits]  # NaN: the line breaks there
            ax2.plot(x, measured, "o-", color=line.get_color(), label=label)
            low = [xi for xi, h in zip(x, hits, strict=True) if h < 0]
            if low:
                clamped = True
                ax2.plot(low, [0.0] * len(low), "o", color=line.get_color(), markerfacecolor="white")
        ax1.axhline(ram["samples_per_s"], color=colors[0] if len(colors) == 1 else "grey", ls="--", lw=1,
                    label=f"Zipf {zipf}: {ram['case']}")  # fmt: skip (all in RAM, or in GPU memory)
    ax2.set_ylim(-0.03, 1.03)  # a share of the rows looked up
    if clamped:
        ax2.text(0.98, 0.02, "hollow: recorded below 0, drawn at 0: the cache cannot hold\n"
                 "a batch's rows (some brought in twice in a step)",
                 transform=ax2.transAxes, ha="right", va="bottom", fontsize=7)  # fmt: skip
    sizes = sorted({100 * r["fraction"] for r in results if r["fraction"] is not None})
    for ax, label in ((ax1, "samples/s"), (ax2, "hit rate")):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{s:g}%" for s in sizes])  # the measured sizes, not powers of ten
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("rows cached (% of each table)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo(args) -> None:
    """A model whose rows + optimizer state are >= 3x the memory budget, trained within the budget."""
    bytes_per_row = args.dim * 4 * 3  # adam: weights, first and second moments
    rows = int(args.table_gib * 2**30 / bytes_per_row / 26) + 1
    directory = Path(args.dir) / "cache-demo"
    cache_mib = args.cache_mib
    extra = ["embedding.tier=ssd", f"embedding.cache.directory={directory}", f"embedding.cache.size_mib={cache_mib}",
             f"embedding.cache.ssd_reads={args.ssd_reads}", f"embedding.cache.ssd_log={args.ssd_log}",
             f"embedding.cache.io_thread={args.io_thread[0]}", f"embedding.cache.policy={args.policy}",
             f"embedding.cache.release_mib={(args.release_mib or ['256'])[0]}"]  # fmt: skip
    cfg = make_config(rows, args.dim, args.zipf[0], args.batch_size, args.steps + args.warmup, "adam", extra)
    batches = make_batches(cfg, args.steps + args.warmup)
    try:
        r = train(cfg, batches, args.warmup, Path("/tmp/neorec-cache-bench/demo"))
        on_disk = sum(f.stat().st_size for f in directory.glob("*.rows.bin")) / 2**30
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    r.update(
        rows_per_table=rows,
        gib_on_disk=on_disk,
        budget_gib=args.budget_gib,
        cache_mib=cache_mib,
    )
    print(json.dumps(r), flush=True)
    header = ["tables + Adam state on disk", "budget", "cache", "steps", "samples/s", "hit rate", "peak RSS"]
    row = [f"{on_disk:.1f} GiB (26 x {rows:,} rows x dim {args.dim})", f"{args.budget_gib} GiB",
           f"{cache_mib / 1024:.1f} GiB", args.steps, r["samples_per_s"], f"{r['hit_rate']:.3f}",
           f"{r['peak_rss_mib'] / 1024:.2f} GiB"]  # fmt: skip
    notes = (
        f"Zipf {args.zipf[0]}, batch {args.batch_size}, {args.policy}, files in {args.dir} (deleted afterwards); "
        f"creating the files took {r['build_s']:.0f} s; {r['log_gib_appended']:.1f} GiB of records were appended "
        f"to the write log (ssd_log {args.ssd_log}); io_thread {args.io_thread[0]} (auto = "
        f"{'on' if use_io_thread('auto') else 'off'} here); release_mib {(args.release_mib or ['256'])[0]}. "
        "Peak RSS = VmHWM of the process, including the "
        f"pre-generated batches. {args.note}"
    )
    if not args.no_append:
        append_results("Row cache: tables larger than the memory budget", markdown_table(header, [row]), notes)
    print(markdown_table(header, [row]))
    if r["peak_rss_mib"] > args.budget_gib * 1024:
        sys.exit(f"peak RSS {r['peak_rss_mib']:.0f} MiB is over the budget of {args.budget_gib} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="the larger-than-memory run instead of the sweep")
    p.add_argument("--rows", type=int, default=100_000, help="sweep: rows per table (26 tables)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--optimizer", default="adagrad", help="sweep: embedding optimizer")
    p.add_argument("--zipf", type=float, nargs="+", default=[0.9, 1.05, 1.2])
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.2, 1.0], help="sweep: cache sizes"
    )
    p.add_argument(
        "--tier", default="ssd", choices=["ssd", "dram"], help="sweep: where the cached tables live"
    )
    p.add_argument("--plot", default="cache.png", help="sweep: plot file name, in docs/img/")
    p.add_argument("--repeats", type=int, default=2, help="sweep: interleaved repeats, best kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="sweep: train.device; cuda: the cache in GPU memory over the tables in files (--tier ssd) "
                        "or in host memory (--tier dram)")  # fmt: skip
    p.add_argument("--dir", default="/work/tmp", help="where table files go")
    p.add_argument("--table-gib", type=float, default=12.0, help="demo: GiB of rows + Adam state")
    p.add_argument("--budget-gib", type=float, default=4.0, help="demo: the memory budget")
    p.add_argument("--cache-mib", type=float, default=2048.0, help="demo: RAM for cached rows + state")
    p.add_argument(
        "--ssd-reads",
        default="map",
        choices=["map", "pread"],
        help="how ssd tables read missed rows (embedding.cache.ssd_reads)",
    )
    p.add_argument(
        "--ssd-log",
        type=float,
        default=1.0,
        help="embedding.cache.ssd_log: write log as a share of the rows (0: writes in place)",
    )
    p.add_argument(
        "--io-thread",
        nargs="+",
        default=["auto"],
        choices=["auto", "on", "off"],
        help="embedding.cache.io_thread (sweep: several values are run side by side; demo: the first)",
    )
    p.add_argument(
        "--release-mib",
        nargs="+",
        default=None,
        help="embedding.cache.release_mib (MiB or auto; sweep: several values side by side, default auto; "
        "demo: the first, default 256, so that the maps' pages stay within the budget)",
    )
    p.add_argument("--note", default="", help="appended to the RESULTS notes (e.g. other load seen)")
    p.add_argument("--profile", action="store_true", help="sweep on cuda: also print where the time goes")
    p.add_argument("--no-append", action="store_true", help="print only (no record, no plot)")
    p.add_argument("--replot", default=None, metavar="PNG",
                   help="redraw docs/img/PNG from the last recorded table plotted to it, and stop")  # fmt: skip
    p.add_argument("--replot-stamp", default=None, help="--replot: the table recorded at this date and time")
    args = p.parse_args()
    if args.replot:
        plot(*recorded_results(args.replot, args.replot_stamp), PLOTS / args.replot)
        return
    torch.set_num_threads(args.threads)
    demo(args) if args.demo else sweep(args)


if __name__ == "__main__":
    main()
