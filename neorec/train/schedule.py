"""Learning-rate multiplier per step: linear warm-up, then optional linear or cosine decay."""

from __future__ import annotations

import math

from neorec.config.schema import ScheduleConfig


def lr_multiplier(s: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier for step `step` (0-based) of `total_steps`."""
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.decay == "none" or step < s.decay_start:
        return 1.0
    span = max(total_steps - s.decay_start, 1)
    t = min((step - s.decay_start) / span, 1.0)
    shape = 1.0 - t if s.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return s.min_ratio + (1.0 - s.min_ratio) * shape
