"""The documentation cannot drift from the code: every `neorec ...` command in a shell block of README.md
and docs/*.md runs, and the repository describes the project, not rounds of work on it.

Commands run page by page, in the page's order, each page in a temporary folder of its own (so a page's
`neorec export runs/default` finds the run its `neorec train` wrote). Long runs get small `--set`
overrides appended (a few steps, small synthetic data); a YAML block whose first line is `# NAME.yaml`
is written to NAME.yaml before the page's commands run. Blocks marked `text` are shown, not run: that is
how the docs show commands that need several machines, real Criteo files or minutes of work.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from forked import run_neorec

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\s*$")

# appended to commands that read synthetic data: seconds instead of minutes, same code paths
SMALL_DATA = [
    "--set", "data.synthetic.train_samples=8192",
    "--set", "data.synthetic.eval_samples=2048",
    "--set", "data.synthetic.max_rows=1000",
]  # fmt: skip
SMALL_RUN = ["--set", "train.max_steps=3", "--set", "train.progress=false"]  # to every training command
# appended to commands that train on Criteo TSV files: tables of 1000 rows, as max_rows caps synthetic ones
SMALL_TSV = ["--set", "data.criteo.table_rows=1000"]
COMMAND_TIMEOUT_S = 240
# pages whose commands need inputs another test makes, and which that test runs
RUN_ELSEWHERE = {
    "docs/data-parquet.md": "tests/test_preprocess_parquet.py runs this page on the Parquet files it writes",
}
# a command another test runs, with checks of its own (a launch of 2 workers costs seconds: once is enough)
BY_HAND = "tests/test_launch.py runs this command and checks its logs, summary and model"


def by_hand_command() -> str:
    """docs/sharding.md's `neorec train --nproc 2` that places tables by hand (BY_HAND)."""
    commands = parse_page(ROOT / "docs" / "sharding.md").commands
    return next(c for c in commands if c.startswith("neorec train --nproc 2 --set 'distributed.sharding="))


@dataclass
class Page:
    path: Path
    commands: list[str] = field(default_factory=list)  # shell command lines, continuations joined
    files: dict[str, str] = field(default_factory=dict)  # name -> text of `# NAME.yaml` blocks


def parse_page(path: Path) -> Page:
    """The `neorec ...` commands of a page's shell blocks, and the YAML files it names."""
    page = Page(path)
    lang, block = None, []
    for line in path.read_text().splitlines():
        m = FENCE.match(line.strip())
        if m and lang is None:
            lang, block = m.group(1).lower() or "none", []
        elif m:
            _collect(page, lang, block)
            lang = None
        elif lang is not None:
            block.append(line)
    return page


def _collect(page: Page, lang: str, block: list[str]) -> None:
    if lang in ("yaml", "yml") and block and re.fullmatch(r"#\s*(\S+\.ya?ml)\s*", block[0].strip()):
        page.files[block[0].strip().lstrip("#").strip()] = "\n".join(block[1:]) + "\n"
    if lang not in SHELL_LANGS:
        return
    joined, pending = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((pending + line).strip())
        pending = ""
    for line in joined:
        line = line.removeprefix("$ ")
        if line.startswith("neorec "):
            page.commands.append(line)


def small_overrides(argv: list[str], workdir: Path = ROOT) -> list[str]:
    """The `--set` overrides that keep one command short (argv without the leading `neorec`, run in
    `workdir`). The synthetic data's go to a command that reads the config's data only where its
    data.source is synthetic: another source refuses them (its data is small already: a few files, or
    what an earlier command of the page wrote from small synthetic data)."""
    verb = argv[:2]
    if verb == ["data", "generate"] or (verb == ["data", "preprocess"] and "--synthetic" in argv):
        return SMALL_DATA  # they read the synthetic data whatever data.source is
    reads_data = verb[0] in ("train", "plan") or verb in (["data", "inspect"], ["checkpoint", "import-dcp"])
    data = SMALL_DATA if reads_data and data_source(argv, workdir) == "synthetic" else []
    if verb[0] == "train":
        return [*SMALL_RUN, *data, *SMALL_TSV] if "data.source=criteo_tsv" in argv else [*SMALL_RUN, *data]
    if verb[0] == "plan":
        return [*data, "--time-budget", "0.5"]
    return data  # data inspect, and checkpoint import-dcp, which builds the config's model over its data


def data_source(argv: list[str], workdir: Path) -> str | None:
    """The data.source of the config a command gives (`--config`, its `--set`s), resolved as neorec
    resolves it in `workdir`; None where it does not resolve (the command then says why)."""
    from neorec.config.load import load_config
    from neorec.errors import NeorecError

    config, sets = "default", []
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in ("--config", "-c"):
            config = str(workdir / value) if (workdir / value).is_file() else value
        elif flag == "--set":
            sets.append(value)
        elif flag == "--follow" and argv[0] == "train":
            sets.append(f"data.follow.dir={value}")
    try:
        return load_config(config, sets).data.source
    except NeorecError:
        return None


def needs_gpu(argv: list[str]) -> bool:
    return any(a.endswith("device=cuda") for a in argv)


def _cases() -> list:
    cases = []
    for path in PAGES:
        page = parse_page(path)
        for i, command in enumerate(page.commands):
            rel = path.relative_to(ROOT).as_posix()
            cases.append(pytest.param(rel, i, id=f"{rel}: {' '.join(command.split())}"))
    return cases


_PAGES: dict[str, Page] = {}
_DONE: dict[str, dict[int, subprocess.CompletedProcess]] = {}


def _run_upto(rel: str, index: int, workdir: Path) -> subprocess.CompletedProcess | None:
    """Run the page's commands up to `index` that have not run yet (later ones use earlier outputs)."""
    page = _PAGES.setdefault(rel, parse_page(ROOT / rel))
    done = _DONE.setdefault(rel, {})
    if not done:
        for name, text in page.files.items():
            (workdir / name).write_text(text)
        (workdir / "tests").mkdir(exist_ok=True)
        (workdir / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for i in range(index + 1):
        if i in done:
            continue
        argv = shlex.split(page.commands[i], comments=True)[1:]
        if (needs_gpu(argv) and not torch.cuda.is_available()) or page.commands[i] == by_hand_command():
            done[i] = None
            continue
        # `python -m neorec ...` in a process forked from one that has imported neorec once
        small = small_overrides(argv, workdir)
        done[i] = run_neorec([*argv, *small], cwd=workdir, env=env, timeout=COMMAND_TIMEOUT_S)
    return done[index]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory) -> dict[str, Path]:
    return {str(p.relative_to(ROOT).as_posix()): tmp_path_factory.mktemp(p.stem) for p in PAGES}


@pytest.mark.parametrize(("page", "index"), _cases())
def test_documented_command_runs(page: str, index: int, workdirs: dict[str, Path]) -> None:
    if page in RUN_ELSEWHERE:
        pytest.skip(RUN_ELSEWHERE[page])
    command = parse_page(ROOT / page).commands[index]
    if needs_gpu(shlex.split(command, comments=True)) and not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch.cuda is not available)")
    if command == by_hand_command():
        pytest.skip(BY_HAND)
    result = _run_upto(page, index, workdirs[page])
    assert result.returncode == 0, (
        f"{page}: `{command}` exited with {result.returncode}\n"
        f"--- stdout (tail)\n{result.stdout[-3000:]}\n--- stderr (tail)\n{result.stderr[-3000:]}"
    )


def test_docs_show_runnable_commands() -> None:
    """The docs keep commands a test runs (a page turned all into `text` blocks would test nothing)."""
    commands = [c for p in PAGES for c in parse_page(p).commands]
    assert len(commands) >= 20, commands
    verbs = {c.split()[1] for c in commands}
    assert {"train", "eval", "export", "predict", "plan", "data", "checkpoint"} <= verbs, verbs


def test_parse_page_joins_continuations_and_skips_text_blocks(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "```bash\nneorec train --set a=1 \\\n    --set b=2   # comment\necho hi\n```\n"
        "```text\nneorec plan --calibrate\n```\n"
        "```yaml\n# my.yaml\nname: x\n```\n"
    )
    parsed = parse_page(page)
    assert parsed.commands == ["neorec train --set a=1      --set b=2   # comment"]
    assert shlex.split(parsed.commands[0], comments=True) == ["neorec", "train", "--set", "a=1", "--set", "b=2"]
    assert parsed.files == {"my.yaml": "name: x\n"}


# Words that number rounds of work on the project: a sitting of work with its number or as "this"
# or "last" one, "round" or "iteration" with a number. The process sense of the word (setsid) is not.
# Built from pieces so that this file does not match itself.
_SITTING = "sess" + "ions?"
_WORK = "|".join([
    _SITTING + r"\s+\d+",
    r"(this|that|last|previous|next|earlier|later)\s+" + _SITTING,
    _SITTING + r"\s+(notes?|summary|summaries)",
    "rou" + r"nd\s+\d+",
    "itera" + r"tion\s+\d+",
    "spr" + "ints?",
])  # fmt: skip
HISTORY = re.compile(r"\b(" + _WORK + r")\b", re.IGNORECASE)
CHECKED = ["README.md", "docs", "benchmarks", "neorec", "tests", "examples"]


def test_no_development_history_in_the_repository() -> None:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *CHECKED],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in listed:
        path = ROOT / name
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (plots) and files deleted from the work tree
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "the repository speaks of the project, not of rounds of work on it:\n" + "\n".join(hits)


def test_history_pattern_catches_numbered_rounds_but_not_rounding() -> None:
    numbered = ["measured in " + "Sess" + "ion 9", "earlier in this " + "sess" + "ion", "rou" + "nd 2 of the work"]
    assert all(HISTORY.search(text) for text in numbered)
    plain = [
        "stochastic rounding", "a round trip through the file", "round-robin plans", "one eviction round",
        "torchrun starts every worker in a " + "sess" + "ion of its own",
    ]  # fmt: skip
    assert not any(HISTORY.search(text) for text in plain)
