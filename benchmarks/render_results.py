"""Render benchmarks/RESULTS.md and benchmarks/history/*.md from the records in benchmarks/records/.

Each benchmark script appends one JSON record per run to records/<benchmark>.jsonl (benchmarks/common.py,
`append_results`): title, date, command, machine, versions, tables (header and rows) and notes. A record
taken by hand (a comparison of two commits, a run of several commands) has its `text` in place of the
tables and notes.

RESULTS.md shows, per benchmark and kind of machine, the latest run of each title (a title a script has
renamed counts as its new one, RETITLED), command and machine on one line; history/<benchmark>.md
shows every run of the benchmark in the order recorded. Both come from the records only, so they are
never edited by hand (tests/test_results.py checks that they are what the records give).

    python benchmarks/render_results.py           # rewrite RESULTS.md and history/*.md
    python benchmarks/render_results.py --check   # write nothing; exit 1 if a page is not up to date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records"
HISTORY = HERE / "history"
RESULTS = HERE / "RESULTS.md"

# benchmark (records/<name>.jsonl, named after its script) -> what it measures, in the order RESULTS.md
# shows them; a records file not named here comes after these, under its own name
BENCHMARKS = {
    "end_to_end": "End-to-end runs of `neorec train` (by hand)",
    "train_throughput": "Training throughput and scaling over processes (`train_throughput.py`)",
    "dense_step": "The dense half on the CPU (`dense_step.py`)",
    "vs_torchrec": "neorec against TorchRec (`vs_torchrec.py`)",
    "embedding_ops": "Embedding operators on the CPU (`embedding_ops.py`)",
    "index_sorts": "Index sorts on the CPU (`index_sorts.py`)",
    "embedding_ops_gpu": "Embedding operators on a GPU (`embedding_ops_gpu.py`)",
    "embedding_stages": "The embedding step stage by stage, on the CPU and a GPU (`embedding_stages.py`)",
    "comms_precision": "Communication precision (`comms_precision.py`)",
    "cache": "Row cache: DRAM and SSD tiers, the cache in GPU memory (`cache.py`)",
    "ssd_io": "SSD backing (`ssd_io.py`)",
    "init_memory": "Memory after building the model (`init_memory.py`)",
    "planner_validation": "Planner validation (`planner_validation.py`)",
    "planner_shared_gpu": "Planner estimate for ranks sharing one GPU (`planner_shared_gpu.py`)",
    "planner_dry_run": "Planner dry run of the 12-trillion-parameter model (`neorec plan`, by hand)",
    "ingestion": "Data ingestion (`ingestion.py`)",
    "data_sources": "Training from files on a GPU (`data_sources.py`)",
    "bounds_check": "The id check's cost (`bounds_check.py`)",
    "managed_collision": "Managed-collision tables (`managed_collision.py`)",
    "continuous": "Continuous training on a drifting stream (`continuous.py`)",
    "movielens": "MovieLens held-out AUC by split (`movielens.py`)",
    "models": "MovieLens: the model architectures (`models.py`)",
    "export_formats": "Export formats and quantized tables (`export_formats.py`)",
    "design_choices": "Measurements behind design choices (by hand)",
}

# a title a script has renamed -> its new title: the runs under the old one are earlier runs of the new
RETITLED = {
    # its preprocessing table measured the line-by-line TSV parser that block parsing replaced; its reader
    # table, the .npy shards' reader that "readers of .npy shards and of Parquet" measures again
    "Data ingestion: reader and preprocessing throughput": (
        "Data ingestion: Criteo-layout TSV preprocessing against pyarrow and TorchRec"
    ),
    "Export formats: nrx vs pt2, default config with 100000 rows per table": (
        "Export formats: nrx, pt2, aoti, default config with 100000 rows per table"
    ),
}

HEADER = """\
# Benchmark results

The latest figures of each benchmark, rendered by `python benchmarks/render_results.py` from the records
that the benchmark scripts append, a JSON line a run, to `benchmarks/records/<benchmark>.jsonl` (command,
date, machine, versions, table, notes): do not edit this page by hand. Per benchmark and kind of
machine (this project's 2-core CPU VM, a GPU, or the CPU of another machine), a run replaces the earlier
runs of the same title; the scripts name the config, preset or mode in the title, so each of those keeps
its latest run. Every run, the replaced ones and the records taken by hand (comparisons of commits, runs
of several commands) included, is in the benchmark's history page, `benchmarks/history/<benchmark>.md`.
Figures are from the CPU VM unless a run names another machine; run-to-run noise there is about
+-10-20%. The plots that older notes place in `benchmarks/` (`cache*.png`) are in `docs/img/`.
"""


def read_records(path: Path) -> list[dict]:
    """The records of one benchmark, in the order they were appended (a JSON object a line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_records(directory: Path = RECORDS) -> dict[str, list[dict]]:
    """Every benchmark's records: benchmarks in the order of BENCHMARKS, then by name."""
    names = sorted(p.stem for p in directory.glob("*.jsonl"))
    order = [n for n in BENCHMARKS if n in names] + [n for n in names if n not in BENCHMARKS]
    return {name: read_records(directory / f"{name}.jsonl") for name in order}


def parse_tables(text: str) -> list[dict]:
    """Markdown tables as benchmarks/common.py's markdown_table writes them, each under an optional
    bold title line, separated by blank lines -> [{"title" (if any), "header", "rows"}]."""
    tables, title = [], None
    for block in text.strip("\n").split("\n\n"):
        lines = block.split("\n")
        if len(lines) == 1 and re.fullmatch(r"\*\*[^*]+\*\*", lines[0]):
            title = lines[0][2:-2]
            continue
        if len(lines) < 2 or not all(line.startswith("|") and line.endswith("|") for line in lines):
            raise ValueError(f"not a markdown table: {block[:80]!r}")
        cells = [[c.strip() for c in line[1:-1].split("|")] for line in lines]
        tables.append({**({"title": title} if title else {}), "header": cells[0], "rows": cells[2:]})
        title = None
    return tables


def format_tables(tables: list[dict]) -> str:
    """The markdown of parse_tables' tables (a table kept as {"markdown": text} as it is)."""
    out = []
    for table in tables:
        if "markdown" in table:
            out.append(table["markdown"])
            continue
        lines = ["| " + " | ".join(table["header"]) + " |", "|" + "---|" * len(table["header"])]
        lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
        out.append((f"**{table['title']}**\n\n" if "title" in table else "") + "\n".join(lines))
    return "\n\n".join(out)


def format_record(record: dict, level: str = "##", compact: bool = False) -> str:
    """A run as a markdown section: heading, command, machine, tables and notes, or the text of a
    record taken by hand. `compact`: command and machine on one line."""
    text = f"{level} {record['title']} ({record['date']})\n\n"
    if by_hand(record):
        return text + record["text"] + "\n"
    where = " · " if compact else "  \n"
    text += f"Command: `{record['command']}`{where}Machine: {record['machine']}\n\n"
    text += format_tables(record["tables"]) + "\n"
    return text + (f"\n{record['notes']}\n" if record.get("notes") else "")


def by_hand(record: dict) -> bool:
    """A record taken by hand: its text in place of tables and notes."""
    return "text" in record


def machine_kind(record: dict) -> str:
    """The kind of machine a run is compared within: its GPU; without one, "CPU" for this project's
    2-core VM, or another machine's CPU where the record's machine names a GPU (a GPU machine's host
    used without its GPU) or more than 2 cores or threads. The scripts write the machine as
    common.machine() gives it ("x86_64, 2 threads, ..."); a record written by hand may name it."""
    gpu = (record.get("versions") or {}).get("gpu")
    if gpu:
        return gpu
    machine = record["machine"]
    if named := re.search(r"NVIDIA [\w-]+", machine):
        return f"CPU of the {named.group(0)} machine"
    counts = [(int(n), what) for n, what in re.findall(r"(\d+) (?:CPU )?(cores|threads)\b", machine)]
    return "CPU, {} {}".format(*max(counts)) if counts and max(counts)[0] > 2 else "CPU"


def latest(records: list[dict]) -> list[dict]:
    """The last run of each title and machine kind among the runs the scripts recorded, grouped by
    machine kind (in order of first appearance), each group in the order recorded."""
    last = sorted(
        {
            (machine_kind(r), RETITLED.get(r["title"], r["title"])): i
            for i, r in enumerate(records)
            if not by_hand(r)
        }.values()
    )
    kinds = list(dict.fromkeys(machine_kind(records[i]) for i in last))
    return [records[i] for i in sorted(last, key=lambda i: kinds.index(machine_kind(records[i])))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def history_anchors(records: list[dict]) -> list[str]:
    """Each record's anchor in its history page (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = []
    for record in records:
        base = anchor(f"{record['title']} ({record['date']})")
        anchors.append(base + (f"-{seen[base]}" if base in seen else ""))
        seen[base] = seen.get(base, 0) + 1
    return anchors


def render_results(benchmarks: dict[str, list[dict]]) -> str:
    text = HEADER
    for name, records in benchmarks.items():
        page = f"history/{name}.md"
        hand = [f"[{r['title']}]({page}#{a}) ({r['date']}, {machine_kind(r)})"
                for r, a in zip(records, history_anchors(records), strict=True) if by_hand(r)]  # fmt: skip
        text += f"\n## {BENCHMARKS.get(name, name)}\n\nEvery run ({len(records)}): [{page}]({page})"
        text += ("; there only, those taken by hand: " + "; ".join(hand) if hand else "") + ".\n"
        text += "".join("\n" + format_record(r, "###", compact=True) for r in latest(records))
    return text


def render_history(name: str, records: list[dict]) -> str:
    text = f"# History: {BENCHMARKS.get(name, name)}\n\n"
    text += (f"Every run recorded in `benchmarks/records/{name}.jsonl`, oldest first, rendered by "
             "`python benchmarks/render_results.py`; the latest run of each title a script recorded is also in "
             "[RESULTS.md](../RESULTS.md).\n")  # fmt: skip
    return text + "".join("\n" + format_record(r) for r in records)


def render_all(directory: Path = RECORDS) -> dict[Path, str]:
    """Every page (RESULTS.md, history/<benchmark>.md) -> its text, from the records in `directory`."""
    benchmarks = load_records(directory)
    pages = {RESULTS: render_results(benchmarks)}
    pages.update({HISTORY / f"{name}.md": render_history(name, r) for name, r in benchmarks.items()})
    return pages


def stale_pages(pages: dict[Path, str]) -> list[Path]:
    """The pages whose file is not their text, and history pages of benchmarks without records."""
    stale = [path for path, text in pages.items() if not path.exists() or path.read_text() != text]
    return stale + [path for path in sorted(HISTORY.glob("*.md")) if path not in pages]


def write_pages() -> list[Path]:
    """Bring RESULTS.md and the history pages up to date with the records; returns what changed."""
    pages = render_all()
    stale = stale_pages(pages)
    HISTORY.mkdir(exist_ok=True)
    for path in stale:
        if path in pages:
            path.write_text(pages[path])
        else:
            path.unlink()
    return stale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not up to date")
    args = p.parse_args()
    stale = stale_pages(render_all()) if args.check else write_pages()
    for path in stale:
        print(f"{path.relative_to(HERE.parent)}: {'not up to date' if args.check else 'written'}")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
