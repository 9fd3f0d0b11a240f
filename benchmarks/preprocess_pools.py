"""How long Parquet preprocessing with vocabularies takes to start its workers: `preprocess_parquet`
of a small Parquet file with `--vocab-threshold` and 2 workers, end to end in a fresh interpreter that
has imported torch (as `neorec data preprocess` on Parquet has), so the workers are spawned and each
imports torch. The data is tiny: what is timed is the workers' start, once per pool.

    python benchmarks/preprocess_pools.py                       # this checkout
    python benchmarks/preprocess_pools.py --against 1d65700     # and another revision, in turns

With --against, the revision is checked out in a temporary git worktree (removed at the end) and the
two trees take turns within every round. Recorded in records/design_choices.jsonl, shown in
history/design_choices.md and linked from RESULTS.md.
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

# run by each tree: its rows of tests/fixtures/criteo_20.tsv as Parquet (row groups of 3), vocabularies
# of the values seen twice, shards of 7 rows, 2 workers
JOB = """
import sys
import torch  # as the command line has, before its workers start
from pathlib import Path
from neorec.data.preprocess_parquet import preprocess_parquet
sys.path.insert(0, sys.argv[1] + "/tests")
from test_parquet import FIXTURE, criteo_config, tsv_to_parquet

if __name__ == "__main__":
    out = Path(sys.argv[2])
    path = tsv_to_parquet(FIXTURE, out.parent / "c.parquet", 3)
    cfg = criteo_config([path], hashing="vocab", vocab_dir=str(out / "vocab"))
    preprocess_parquet(cfg, out, shard_rows=7, progress=False, vocab_threshold=2, workers=2)
"""


def run_once(tree: Path, folder: Path) -> float:
    """Seconds of the job with `tree` first on the path, into a new folder under `folder`."""
    out = Path(tempfile.mkdtemp(dir=folder)) / "out"
    script = folder / "job.py"
    script.write_text(JOB)
    start = time.perf_counter()
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(folder)}
    subprocess.run([sys.executable, str(script), str(tree), str(out)], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git revision whose code is timed beside this checkout's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this checkout": ROOT}
        if args.against:
            old = Path(tmp) / "against"
            add = ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old), args.against]
            subprocess.run(add, check=True, capture_output=True)
            trees = {args.against: old, **trees}
        try:
            for r in range(args.rounds):
                for label, tree in list(trees.items())[:: 1 if r % 2 == 0 else -1]:
                    times.setdefault(label, []).append(run_once(tree, Path(tmp)))
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    rows = [[label, ", ".join(f"{s:.2f}" for s in times[label]), f"{statistics.median(times[label]):.2f}"]
            for label in trees]  # fmt: skip
    table = markdown_table(["code of", "seconds, round by round", "median s"], rows)
    print(table)
    if not args.no_record:
        notes = f"{args.rounds} rounds, a fresh interpreter each; trees in turns within a round"
        path = RECORDS / "design_choices.jsonl"
        append_results("Parquet preprocessing: workers started per run", table, notes, path=path, history_only=True)


if __name__ == "__main__":
    main()
