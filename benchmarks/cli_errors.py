"""How long a user waits to be told a mistake: `neorec` commands that fail on their input, timed end to
end as a user runs them (a fresh interpreter each time).

    python benchmarks/cli_errors.py                          # this checkout
    python benchmarks/cli_errors.py --against c27252c        # and the code of another revision, side by side
    python benchmarks/cli_errors.py --rounds 9 --no-record

Each command runs in a process of its own, `python -m neorec ...` in an empty folder, with PYTHONPATH
pointing at the tree measured. With --against, the revision is checked out in a temporary git
worktree (removed at the end), and the two trees take turns within every round, so the machine's
drift hits both alike. The table gives each command's median wall-clock time over the rounds, and the
exit code (2: a user's mistake, told in one line). Recorded in records/design_choices.jsonl,
shown in history/design_choices.md and linked from RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from benchmarks.render_results import RECORDS  # noqa: E402

MISTAKES = {
    "config value (`train --set train.max_steps=`)": ["train", "--set", "train.max_steps="],
    "unknown key (`train --set train.max_step=5`)": ["train", "--set", "train.max_step=5"],
    "missing export file (`predict missing.nrx`)": ["predict", "missing.nrx", "--out", "p.txt"],
}


def run_once(tree: Path, argv: list[str], folder: Path) -> tuple[float, int]:
    """Seconds and exit code of `python -m neorec *argv` with `tree` first on the path, in `folder`."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(folder), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    command = [sys.executable, "-m", "neorec", *argv]
    p = subprocess.run(command, cwd=folder, env=env, capture_output=True, timeout=300)
    return time.perf_counter() - start, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git revision whose code is timed beside this checkout's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this checkout": ROOT}
        if args.against:
            old = Path(tmp) / "against"
            add = ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old), args.against]
            subprocess.run(add, check=True, capture_output=True)
            trees = {args.against: old, **trees}
        try:
            times: dict[tuple[str, str], list[float]] = {}
            codes: dict[tuple[str, str], int] = {}
            for r in range(args.rounds):
                order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
                for name, argv in MISTAKES.items():
                    for label, tree in order:
                        folder = Path(tmp) / "cwd"
                        folder.mkdir(exist_ok=True)
                        seconds, code = run_once(tree, argv, folder)
                        times.setdefault((name, label), []).append(seconds)
                        codes[(name, label)] = code
        finally:
            if args.against:
                remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)]
                subprocess.run(remove, check=False)
    rows = [[name, label, f"{statistics.median(times[(name, label)]):.2f}", codes[(name, label)]]
            for name in MISTAKES for label in trees]  # fmt: skip
    table = markdown_table(["mistake", "code of", "median s", "exit code"], rows)
    print(table)
    if not args.no_record:
        notes = f"median of {args.rounds} rounds, a fresh interpreter each; trees alternate within a round"
        # a comparison of two trees: kept with the measurements behind design choices, in their history
        # page (RESULTS.md links it)
        path = RECORDS / "design_choices.jsonl"
        append_results("How long a mistake takes to be told", table, notes, path=path, history_only=True)


if __name__ == "__main__":
    main()
