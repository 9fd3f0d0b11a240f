"""Choosing one option per table before placement: the cheapest option whose pieces are small
enough to balance, then device memory to the tables that save the most seconds per byte."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from neorec.planner.bounds import lower_hull
from neorec.planner.options import Option


def total_size(o: Option, most: float) -> float:
    """Its largest piece's whole cost against `most`."""
    return o.max_piece / most


def choose_options(
    feasible: dict[str, list[Option]],
    size: Callable[[Option], float],
    capacity: dict[str, np.ndarray],
    W: int,
    device_room: float,
) -> dict[str, Option]:
    """Per table the cheapest option small enough to balance (`size` at most 1), then `device_room`
    bytes of device memory to the tables that save the most per byte (greedy multiple-choice
    knapsack over each table's cost/memory hull)."""
    hulls: dict[str, list[tuple[float, float, Option]]] = {}
    for name, opts in feasible.items():
        fine = [o for o in opts if size(o) <= 1] or [min(opts, key=size)]
        by_point = {}
        for o in fine:
            key = (o.memory_total("device", W), o.total(W))
            by_point.setdefault(key, o)
        hull = lower_hull(list(by_point))
        hulls[name] = [(m, c, by_point[(m, c)]) for m, c in hull]
    choice = {name: h[0][2] for name, h in hulls.items()}
    room = device_room - sum(h[0][0] for h in hulls.values())
    steps = []
    for name, h in hulls.items():
        for k in range(1, len(h)):
            extra, saved = h[k][0] - h[k - 1][0], h[k - 1][1] - h[k][1]
            steps.append((saved / max(extra, 1.0), name, k, extra))
    level = dict.fromkeys(hulls, 0)
    for _, name, k, extra in sorted(steps, key=lambda s: (-s[0], s[1], s[2])):
        if level[name] != k - 1 or extra > room:
            continue
        level[name] = k
        choice[name] = hulls[name][k][2]
        room -= extra
    return choice
