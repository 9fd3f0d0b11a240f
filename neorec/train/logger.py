"""Where metrics go: one JSON object per line (always), TensorBoard events (when installed)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, out_dir: Path, tensorboard: bool = True) -> None:
        self.path = out_dir / "metrics.jsonl"
        self._file = self.path.open("w")
        self._start = time.time()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    def log(self, split: str, step: int, values: dict[str, float]) -> None:
        record = {"split": split, "step": step, "time": round(time.time() - self._start, 3)}
        record.update({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
