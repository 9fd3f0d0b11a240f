"""Helpers shared by the benchmark scripts: tables in markdown, a record of each run, peak memory."""

from __future__ import annotations

import datetime
import json
import platform
import resource
import sys
from pathlib import Path

import torch

if __package__:  # imported as benchmarks.common
    from .render_results import RECORDS, format_tables, parse_tables, write_pages
else:  # as common, by a script in benchmarks/
    from render_results import RECORDS, format_tables, parse_tables, write_pages


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB.

    Linux: VmHWM of /proc/self/status, which starts afresh at exec; getrusage's ru_maxrss would carry
    over the parent's peak into a child started with subprocess."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {torch.get_num_threads()} threads{gpu}, torch {torch.__version__}, python {platform.python_version()}"


def versions() -> dict:
    """The versions a run's figures depend on: torch, python and the GPU (None without one)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "python": platform.python_version(), "gpu": gpu}


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(x: object) -> str:
        return f"{x:,.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def append_results(
    title: str, table: str, notes: str = "", path: Path | None = None, history_only: bool = False
) -> None:
    """Record this run: its title, date, command, machine, versions, tables (header and rows, from
    `table` as markdown_table wrote it) and notes, as a JSON line of benchmarks/records/<script>.jsonl
    (or of `path`), then render RESULTS.md and the history pages again (benchmarks/render_results.py).
    `history_only`: table and notes as the record's text, as a comparison taken by hand is kept: its
    history page shows it, RESULTS.md links it."""
    try:
        tables = parse_tables(table)
        if format_tables(tables) != table.strip("\n"):
            raise ValueError("not as markdown_table writes it")
    except ValueError:
        tables = [{"markdown": table.strip("\n")}]  # kept as written
    command = "python " + " ".join(sys.argv)
    text = f"Command: `{command}` · Machine: {machine()}\n\n{table.strip()}"
    text += f"\n\n{notes}" if notes else ""
    shown = {"text": text} if history_only else {"tables": tables, **({"notes": notes} if notes else {})}
    record = {
        "title": title,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "machine": machine(),
        "versions": versions(),
        **shown,
    }
    path = Path(path) if path else RECORDS / f"{Path(sys.argv[0]).stem}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    if path.resolve().parent == RECORDS:
        write_pages()
