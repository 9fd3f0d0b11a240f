"""The smallest synthetic run the CLI tests start (four tables, two steps, no pictures or TensorBoard),
and Criteo TSV lines for the tests of commands that read files."""

from __future__ import annotations

import random

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=1000", "data.synthetic.eval_samples=500", "data.batch_size=250",
    "train.max_steps=2", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip


def sets(items: list[str]) -> list[str]:
    """`--set` before every override, as the command line takes them."""
    return [x for kv in items for x in ("--set", kv)]


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """`n` Criteo TSV lines (label, 13 counts, 26 8-digit hex ids), each ending in a newline, in the
    form of the raw data: about a quarter clicks, one field in ten empty, and each id column drawing
    from 8 values, so that values repeat (vocabularies count them)."""
    rng = random.Random(seed)

    def cell(value: str) -> str:
        return "" if rng.random() < 0.1 else value

    lines = []
    for _ in range(n):
        dense = [cell(str(rng.randrange(100))) for _ in range(13)]
        ids = [cell(f"{rng.randrange(8) * 0x1F3A5C7 + c:08x}") for c in range(26)]
        lines.append("\t".join([str(int(rng.random() < 0.25)), *dense, *ids]) + "\n")
    return lines
