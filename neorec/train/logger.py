"""Where metrics go: one JSON object per line (always), TensorBoard events (when installed); on
ranks other than 0, nowhere (NoLogger).

Each line is strict JSON: a value that is not a finite number (an AUC of a one-class set, say) is
written as null, so any JSON reader can read the file.

A resumed run continues the same metrics.jsonl: it keeps the lines written up to the checkpoint it
resumed from (the checkpoint records how many there were) and drops the lines written after it, which
the resumed run writes again. TensorBoard hides the events from the checkpoint's step on (purge_step)
and is given the kept lines of that step again, so that both hold the same records.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from neorec.utils.files import write_atomic
from neorec.utils.json_values import strict_dumps

log = logging.getLogger(__name__)

_RECORD_KEYS = ("split", "step", "time")  # a metrics.jsonl record's own, not metrics


class MetricsLogger:
    def __init__(self, out_dir: Path, tensorboard: bool | str = "auto", resume: dict | None = None) -> None:
        """resume: {"step": the checkpoint's step, "lines": metrics lines written when it was saved
        (None: keep the lines of steps up to "step")}; None starts a new file."""
        self.path = out_dir / "metrics.jsonl"
        self.num_lines = 0  # lines in the file, for the checkpoint
        self._start = time.time()
        kept: list[str] = []
        if resume is not None and self.path.is_file():
            kept = _kept_lines(self.path, resume["step"], resume.get("lines"))
            text = "".join(line + "\n" for line in kept)
            write_atomic(self.path, lambda f: f.write(text.encode()), "metrics file")
            self.num_lines = len(kept)
            if kept:  # times go on from where the kept lines end
                self._start -= json.loads(kept[-1]).get("time") or 0.0
        self._file = self.path.open("a" if resume is not None else "w")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # resumed: TensorBoard hides the events of the checkpoint's step and after; those of its
                # step that metrics.jsonl keeps (logged before the checkpoint) are written again
                purge = resume["step"] if resume is not None else None
                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=purge)
                for line in kept:
                    record = json.loads(line)
                    if record.get("step") == purge:
                        self._add_scalars(record["split"], purge, record)
            except ImportError as e:  # tensorboard is optional: "auto" goes without it quietly
                if tensorboard is True:
                    log.warning(
                        f"logging.tensorboard is true but TensorBoard cannot be imported ({e}); metrics go "
                        "to metrics.jsonl only (pip install tensorboard, or set logging.tensorboard: auto)"
                    )
                self._tb = None

    def log(self, split: str, step: int, values: dict[str, float]) -> None:
        record = {"split": split, "step": step, "time": round(time.time() - self._start, 3)}
        record.update(values)
        self._file.write(strict_dumps(record) + "\n")
        self._file.flush()
        self.num_lines += 1
        self._add_scalars(split, step, values)

    def _add_scalars(self, split: str, step: int, values: dict) -> None:
        if self._tb is not None:
            for k, v in values.items():
                if k not in _RECORD_KEYS and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class NoLogger:
    """What ranks other than 0 log to."""

    num_lines = 0

    def log(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def _kept_lines(path: Path, step: int, lines: int | None) -> list[str]:
    """The first `lines` complete lines of `path` (all of them with a step <= `step` when `lines` is
    None, as in checkpoints that did not record it); a line cut off by a crash is dropped."""
    out = []
    for line in path.read_text().splitlines():
        if lines is not None and len(out) >= lines:
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if lines is None and record.get("step", 0) > step:
            break
        out.append(line)
    return out


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
