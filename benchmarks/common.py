"""Helpers shared by the benchmark scripts: tables in markdown, appending to RESULTS.md, peak memory."""

from __future__ import annotations

import datetime
import platform
import resource
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "RESULTS.md"


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


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(x: object) -> str:
        return f"{x:,.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def append_results(title: str, table: str, notes: str = "", path: Path = RESULTS) -> None:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python " + " ".join(sys.argv)
    text = f"\n## {title} ({stamp})\n\nCommand: `{cmd}`  \nMachine: {machine()}\n\n{table}\n"
    if notes:
        text += f"\n{notes}\n"
    with Path(path).open("a") as f:
        f.write(text)
