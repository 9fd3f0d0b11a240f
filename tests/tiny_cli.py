"""The smallest synthetic run the CLI tests start: four tables, two steps, no pictures or TensorBoard."""

from __future__ import annotations

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=1000", "data.synthetic.eval_samples=500", "data.batch_size=250",
    "train.max_steps=2", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
]  # fmt: skip


def sets(items: list[str]) -> list[str]:
    """`--set` before every override, as the command line takes them."""
    return [x for kv in items for x in ("--set", kv)]
