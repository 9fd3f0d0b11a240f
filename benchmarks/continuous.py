"""Continuous training against training once, on a stream whose vocabulary and teacher drift day by day.

The stream is `neorec data stream`'s (neorec/data/drifting.py): each day a quarter of every feature's
ids are replaced by new ones and what each id means turns a little. Both runs use the `continuous`
config (DLRM, managed-collision tables of raw ids):
- once: trains on the first `--train-days` days (`neorec train --follow DIR --until day-001`), then
  scores every later day with the model as it is (never trained on them; unknown ids left out);
- continuous: follows the whole stream, every day trained after being scored (progressive
  validation), ids not seen for two days expired (data.follow.expire_after_partitions: 2).
Reported: each day's AUC of scores given before training on that day (for "once", the first days'
are its progressive AUC; the later days' its plain AUC).

    python benchmarks/continuous.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from neorec.config.load import load_config  # noqa: E402
from neorec.data.drifting import DriftSpec, partition_name, write_day  # noqa: E402
from neorec.data.parquet import ParquetSource  # noqa: E402
from neorec.train.evaluation import evaluate  # noqa: E402
from neorec.train.trainer import Trainer  # noqa: E402


def run(stream: Path, out: Path, until: str, threads: int) -> Trainer:
    cfg = load_config(
        "continuous",
        [f"data.follow.dir={stream}", f"data.follow.until={until}", f"output_dir={out}", "train.progress=false",
         "logging.plot=false", "logging.tensorboard=false", f"train.threads={threads}", "snapshot.every_steps=null"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.result = trainer.fit()
    return trainer


def day_auc(trainer: Trainer, stream: Path, day: int) -> float:
    """AUC of the trained model, as it is, on one day's samples."""
    parquet = trainer.cfg.data.parquet
    assert parquet is not None
    # the reader needs training files too (not read here): the next day's, or the day before the last
    other = day + 1 if (stream / partition_name(day + 1)).is_dir() else day - 1
    config = parquet.model_copy(
        update={
            "eval_paths": [str(stream / partition_name(day))],
            "paths": [str(stream / partition_name(other))],
        }
    )
    source = ParquetSource(config, seed=trainer.cfg.seed)
    return evaluate(trainer.model, source, 4096)["auc"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--days", type=int, default=8)
    p.add_argument("--train-days", type=int, default=2, help="days the 'once' model trains on")
    p.add_argument("--rows", type=int, default=6000, help="samples per day")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    logging.getLogger("neorec").setLevel(logging.WARNING)
    spec = DriftSpec(rows=args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "daily"
        for day in range(args.days):
            write_day(spec, stream, day)
        start = time.perf_counter()
        once = run(stream, Path(tmp) / "once", partition_name(args.train_days - 1), args.threads)
        once_auc = [p["auc"] for p in once.result.partitions]
        once_auc += [day_auc(once, stream, d) for d in range(args.train_days, args.days)]
        cont = run(stream, Path(tmp) / "continuous", partition_name(args.days - 1), args.threads)
        cont_auc = [p["auc"] for p in cont.result.partitions]
        seconds = time.perf_counter() - start
    later = slice(args.train_days, args.days)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    header = [
        "training",
        *[str(d) for d in range(args.days)],
        f"mean of days {args.train_days}-{args.days - 1}",
    ]
    rows = [
        [
            f"once (days 0-{args.train_days - 1})",
            *[f"{a:.3f}" for a in once_auc],
            f"{mean(once_auc[later]):.4f}",
        ],
        ["continuous", *[f"{a:.3f}" for a in cont_auc], f"{mean(cont_auc[later]):.4f}"],
    ]
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"AUC per day of scores given before training on that day; {args.rows:,} samples a day, 4 features of "
        f"{spec.vocab} ids a day ({spec.shift} replaced daily), managed-collision tables of 4,096 rows; {seconds:.0f} s."
    )
    print(notes)
    if not args.no_record:
        append_results("Continuous training on a drifting stream: AUC per day", table, notes)


if __name__ == "__main__":
    main()
