"""benchmarks/RESULTS.md and benchmarks/history/*.md are what the records give, and the records are whole.

The benchmark scripts append a record of each run to benchmarks/records/<benchmark>.jsonl
(benchmarks/common.py: append_results) and benchmarks/render_results.py renders the pages from them.
No benchmark runs here: these tests read the committed records and write only to a temporary folder.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import render_results as rr  # noqa: E402

RECORD_FILES = sorted(rr.RECORDS.glob("*.jsonl"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PICTURE = re.compile(r"[\w./*-]*/[\w.*-]+\.png")  # a path to a picture (a bare name is a run's output)


def test_every_record_parses_and_has_command_date_machine_and_a_table_or_text() -> None:
    assert RECORD_FILES, "no records in benchmarks/records/"
    for path in RECORD_FILES:
        for number, record in enumerate(rr.read_records(path), 1):
            where = f"{path.name}:{number}"
            for key in ("title", "date", "command", "machine"):
                assert isinstance(record.get(key), str) and record[key].strip(), f"{where}: no {key}"
            assert re.match(r"\d{4}-\d\d-\d\d", record["date"]), f"{where}: date {record['date']!r}"
            assert set(record.get("versions", {})) <= {"torch", "python", "gpu"}, where
            if rr.by_hand(record):
                assert record["text"].strip() and "tables" not in record, where
                continue
            assert record["tables"], f"{where}: no table"
            for table in record["tables"]:
                if "markdown" in table:
                    assert table["markdown"].strip(), where
                    continue
                assert table["header"] and all(isinstance(c, str) for c in table["header"]), where
                assert all(len(row) == len(table["header"]) for row in table["rows"]), (
                    f"{where}: a row's width"
                )


def test_pages_are_what_the_records_give() -> None:
    pages = rr.render_all()
    for path, text in pages.items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs: python benchmarks/render_results.py"
        )
    assert sorted(rr.HISTORY.glob("*.md")) == sorted(p for p in pages if p.parent == rr.HISTORY)


def test_results_page_is_under_700_lines() -> None:
    assert len(rr.RESULTS.read_text().splitlines()) < 700


def test_a_later_run_of_a_title_replaces_the_earlier_one_per_machine_kind() -> None:
    def run(title: str, date: str, gpu: str | None = None) -> dict:
        table = {"header": ["x"], "rows": [["1"]]}
        return {"title": title, "date": date, "command": "python b.py", "machine": "m",
                "versions": {"torch": "2", "python": "3", "gpu": gpu}, "tables": [table]}  # fmt: skip

    runs = [run("T: a", "1"), run("T: b", "2"), run("T: a", "3", "H100"), run("T: a", "4")]
    by_hand = {"title": "a comparison", "date": "5", "command": "c", "machine": "m", "text": "t"}
    assert [r["date"] for r in rr.latest([*runs, by_hand])] == ["2", "4", "3"]
    page = rr.render_results({"b": [*runs, by_hand]})
    assert "### T: a (4)" in page and "### T: a (1)" not in page and "### T: a (3)" in page
    assert "[a comparison](history/b.md#a-comparison-5)" in page and "### a comparison" not in page


def test_a_cpu_run_on_another_machine_is_a_kind_of_its_own() -> None:
    """Without a GPU in its versions a run is the VM's ("CPU") unless its machine names a GPU (the host
    of a GPU machine, used without its GPU) or more than 2 cores or threads; such a run replaces no
    run of the VM."""

    def run(date: str, machine: str) -> dict:
        table = {"header": ["x"], "rows": [["1"]]}
        versions = {"torch": "2", "python": "3", "gpu": None}
        record = {"title": "T: a", "date": date, "command": "c", "machine": machine}
        return {**record, "versions": versions, "tables": [table]}

    vm = run("1", "x86_64, 2 threads, torch 2.13.0+cpu, python 3.11.7")
    one_thread = run("2", "x86_64, 1 threads, torch 2.13.0+cpu, python 3.11.7")
    host = run("3", "the lent NVIDIA H200 machine's host: x86_64, 16 CPU cores, python 3.12.3")
    big = run("4", "x86_64, 32 threads, torch 2.13.0+cpu, python 3.12.3")
    kinds = ["CPU", "CPU", "CPU of the NVIDIA H200 machine", "CPU, 32 threads"]
    assert [rr.machine_kind(r) for r in (vm, one_thread, host, big)] == kinds
    assert rr.machine_kind({**host, "versions": {"gpu": "NVIDIA H200"}}) == "NVIDIA H200"
    assert [r["date"] for r in rr.latest([vm, one_thread, host, big])] == ["2", "3", "4"]


def test_a_run_under_a_renamed_title_replaces_the_runs_under_the_old_one(monkeypatch) -> None:
    monkeypatch.setattr(rr, "RETITLED", {"T: old": "T: new"})
    runs = [{"title": t, "date": d, "command": "python b.py", "machine": "m", "versions": {},
             "tables": [{"header": ["x"], "rows": [["1"]]}]} for t, d in (("T: old", "1"), ("T: new", "2"))]  # fmt: skip
    assert [r["date"] for r in rr.latest(runs)] == ["2"]
    assert "Command: `python b.py` · Machine: m\n" in rr.render_results({"b": runs})


def test_append_results_records_what_markdown_table_printed(tmp_path: Path) -> None:
    from benchmarks import common

    table = common.markdown_table(["case", "samples/s", ""], [["a", 1234.5, ""], ["b", 7, "x"]])
    common.append_results("Test: a", table, "Some notes.", path=tmp_path / "test.jsonl")
    [record] = rr.read_records(tmp_path / "test.jsonl")
    assert record["tables"] == [
        {"header": ["case", "samples/s", ""], "rows": [["a", "1,234.5", ""], ["b", "7", "x"]]}
    ]
    assert record["command"].startswith("python ") and record["machine"] == common.machine()
    assert record["versions"] == common.versions()
    section = rr.format_record(record)
    assert section == (f"## Test: a ({record['date']})\n\nCommand: `{record['command']}`  \n"
                       f"Machine: {record['machine']}\n\n{table}\n\nSome notes.\n")  # fmt: skip
    titled = f"**one**\n\n{table}\n\n**two**\n\n{table}"  # as dense_step.py joins its two tables
    assert rr.format_tables(rr.parse_tables(titled)) == titled


def test_pictures_the_docs_show_exist_and_live_next_to_them() -> None:
    missing = []
    for page in PAGES:
        for ref in PICTURE.findall(page.read_text()):
            if not any(base.glob(ref) for base in (page.parent, ROOT)):
                missing.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not missing, "pictures referenced but not there:\n" + "\n".join(missing)
    assert not list((ROOT / "benchmarks").glob("*.png")), "benchmark pictures go to docs/img/"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # a markdown link's target, without its anchor


def test_links_in_readme_and_docs_lead_to_files_and_results_sections_that_exist() -> None:
    """Every figure the docs quote points at the page that records it: the link must resolve, and a
    section named after a link to a results page ("Row cache", ...) must be a heading of that page."""
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    for page in PAGES:
        for match in re.finditer(r"\]\(([^)]*benchmarks/[^)]*\.md|[^)]*history/[^)]*\.md|[^)]*RESULTS\.md)\)[,:;]? \(?\"([^\"]+)\"",
                                 page.read_text()):
            target, section = match.group(1), " ".join(match.group(2).split())
            headings = [line for line in (page.parent / target).read_text().splitlines() if line.startswith("#")]
            if not any(section.lower() in h.lower() for h in headings):
                broken.append(f"{page.relative_to(ROOT)}: {target} has no section {section!r}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_runs_under_a_renamed_title_leave_results_for_the_history_page(monkeypatch) -> None:
    monkeypatch.setattr(rr, "RETITLED", {"T: old": "T: new"})
    runs = [{"title": t, "date": d, "command": "python b.py", "machine": "m", "versions": {},
             "tables": [{"header": ["x"], "rows": [["1"]]}]} for t, d in (("T: old", "1"), ("T: new", "2"))]  # fmt: skip
    assert [r["date"] for r in rr.latest(runs)] == ["2"]
    assert "### T: old (1)" not in rr.render_results({"b": runs})
    assert "## T: old (1)" in rr.render_history("b", runs)
