"""A lower bound on the most loaded rank's cost, over every plan the planner could make, and so on
the step cost (the sum over phases of the slowest rank in each), which no rank's total exceeds.

Costs are those of options.py, taken so that they bound the cost model (cost.estimate_plan), which
`neorec plan` reports next to the bound, as well as the additive model the partitioner balances: where
the additive model spreads a rank's link bytes over its links by their share of the peers, the cost
model charges each to the link it crosses, so one rank may pay less than its additive share
(`Option.everyone_low`); all ranks together pay the same bytes (`Option.total_low`).
1. The slowest rank is at least the mean: (sum over tables of the chosen option's total cost) / W.
   Each table picks one option; options differ in cost and in the device memory they take, and all
   tables together cannot take more device memory than all ranks have. Choosing the options is a
   multiple-choice knapsack; its linear relaxation (each table may mix two neighbouring options of
   its cost/memory lower convex hull) is solved exactly by the greedy over hull segments, and no
   integral choice can cost less.
2. Some rank holds the most expensive piece of each table's chosen option, and every rank pays at
   least each table's smallest `everyone_low` share.
Both add the collective latencies that every plan pays.
The bound is the larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from neorec.planner.options import Option


@dataclass
class LowerBound:
    value: float
    mean_bound: float
    piece_bound: float

    def describe(self) -> str:
        which = "mean load, knapsack relaxation" if self.mean_bound >= self.piece_bound else "largest piece"
        return (
            f"max(mean-load bound {self.mean_bound * 1e3:.3f} ms, largest-piece bound {self.piece_bound * 1e3:.3f} ms)"
            f" = {self.value * 1e3:.3f} ms ({which})"
        )


def lower_bound(
    options: dict[str, list[Option]], world_size: int, device_capacity: float, fixed: float = 0.0
) -> LowerBound:
    """`options`: the feasible options of every table; `device_capacity`: device bytes of all ranks
    together that tables may use; `fixed`: seconds every rank pays whatever the plan (latencies)."""
    W = world_size
    total, used, segments = 0.0, 0.0, []
    for opts in options.values():
        hull = lower_hull([(o.memory_total("device", W), o.total_low(W)) for o in opts])
        total += hull[0][1]
        used += hull[0][0]
        segments += [(b[0] - a[0], a[1] - b[1]) for a, b in zip(hull, hull[1:], strict=False)]
    room = device_capacity - used
    for extra, saved in sorted(segments, key=lambda s: -s[1] / s[0]):  # most seconds saved per byte first
        if room <= 0:
            break
        take = min(1.0, room / extra)
        total -= saved * take
        room -= extra * take
    mean_bound = total / W + fixed
    shares = fixed + sum(min(o.least_share for o in opts) for opts in options.values())
    piece_bound = shares + max((min(o.max_piece for o in opts) for opts in options.values()), default=0.0)
    return LowerBound(max(mean_bound, piece_bound), mean_bound, piece_bound)


def lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(memory, cost) points -> the lower-left convex hull from the least memory to the least cost:
    memory increasing, cost strictly decreasing, slopes increasing (less and less saved per byte)."""
    pts = sorted(set(points))
    front: list[tuple[float, float]] = []
    for m, c in pts:  # drop options that need more memory and cost no less
        if front and c >= front[-1][1]:
            continue
        front.append((m, c))
    hull: list[tuple[float, float]] = []
    for p in front:
        while len(hull) >= 2:
            (m1, c1), (m2, c2) = hull[-2], hull[-1]
            # keep hull[-1] only if it lies strictly below the line from hull[-2] to p
            if (c2 - c1) * (p[0] - m1) < (p[1] - c1) * (m2 - m1):
                break
            hull.pop()
        hull.append(p)
    return hull
