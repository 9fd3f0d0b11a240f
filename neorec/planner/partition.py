"""Placing pieces on ranks so that the most loaded rank is as light as possible, within memory.

Pieces have a cost (seconds per step, additive) and memory per tier; every rank has a capacity per
tier and a base load (what it pays whatever the placement). Node pieces (twrw, twcw) take one rank
of every local index of one node. Pieces of one row- or column-split table must land on different
ranks (`group`).

0. Pinned pieces (a table's ranks or node constraint: constraints.py) go where they are pinned,
   first, and never move; everything below balances the other pieces around them.
1. Longest processing time first: node pieces, then rank pieces, most expensive first, each onto the
   least loaded rank (node) where it fits. LPT is within 4/3 of optimal without memory limits.
2. Improvement: while the most loaded rank can give a piece to another rank, or swap one for a
   cheaper piece, so that both end below its load, do the best such move. Each move lowers the sum
   of squared loads, so this ends.
3. Small instances (few pieces and ranks, no node pieces) are solved exactly by branch and bound,
   which is what the brute-force tests check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from neorec.errors import ConfigError


class PlacementError(ConfigError):
    """No rank (or node) has room for a piece: the message names the table and the shortfall."""

    def __init__(self, message: str, table: str | None = None) -> None:
        super().__init__(message)
        self.table = table


@dataclass
class Piece:
    name: str  # "<table> shard i/k" for messages
    cost: float
    memory: dict[str, float]
    group: str | None = None  # pieces of one group go to different ranks
    table: str | None = None
    pinned: int | None = None  # the rank it must go to (None: the partitioner chooses)


@dataclass
class NodePiece:
    name: str
    costs: list[float]  # per local rank of the node
    memory: list[dict[str, float]]
    table: str | None = None
    pinned: int | None = None  # the node it must go to (None: the partitioner chooses)


@dataclass
class Assignment:
    ranks: list[int]  # rank of each piece
    nodes: list[int]  # node of each node piece
    loads: np.ndarray  # per rank, base load included
    used: dict[str, np.ndarray]  # bytes per tier per rank

    @property
    def max_load(self) -> float:
        return float(self.loads.max())


def partition(
    pieces: list[Piece],
    num_ranks: int,
    capacity: dict[str, np.ndarray],
    base_load: np.ndarray | None = None,
    base_memory: dict[str, np.ndarray] | None = None,
    node_pieces: list[NodePiece] | None = None,
    ranks_per_node: int = 1,
    exact_limit: int = 200_000,
    improve_seconds: float = 2.0,
) -> Assignment:
    """Place every piece (and node piece); raises PlacementError when one fits nowhere."""
    node_pieces = node_pieces or []
    loads = np.zeros(num_ranks) if base_load is None else np.asarray(base_load, dtype=float).copy()
    used = {t: np.zeros(num_ranks) for t in capacity}
    for t, m in (base_memory or {}).items():
        used[t] = used[t] + m
    L = ranks_per_node
    nodes = [-1] * len(node_pieces)
    ranks = [-1] * len(pieces)
    for i, p in enumerate(node_pieces):  # pinned pieces first, where they are pinned
        if p.pinned is not None:
            for local, r in enumerate(range(p.pinned * L, (p.pinned + 1) * L)):
                part = Piece(f"{p.name} local rank {local}", p.costs[local], p.memory[local], table=p.table)
                _pin(part, r, loads, used, capacity, "node", p.pinned)
            nodes[i] = p.pinned
    for i, p in enumerate(pieces):
        if p.pinned is not None:
            _pin(p, p.pinned, loads, used, capacity, "rank", p.pinned)
            ranks[i] = p.pinned
    free_nodes = [i for i, p in enumerate(node_pieces) if p.pinned is None]
    placed_nodes = _place_nodes([node_pieces[i] for i in free_nodes], loads, used, capacity, L)
    for i, n in zip(free_nodes, placed_nodes, strict=True):
        nodes[i] = n
    free = [i for i, p in enumerate(pieces) if p.pinned is None]
    rest = [pieces[i] for i in free]
    if not node_pieces and rest and num_ranks ** len(rest) <= exact_limit:
        placed = _exact(rest, loads, used, capacity)
    else:
        placed = _greedy(rest, loads, used, capacity)
        _improve(rest, placed, loads, used, capacity, time.perf_counter() + improve_seconds)
    for i, r in zip(free, placed, strict=True):
        ranks[i] = r
    return Assignment(ranks, nodes, loads, used)


def _pin(p: Piece, r: int, loads, used, capacity, what: str, where: int) -> None:
    """Put a pinned piece on rank `r` (of its pinned `what` `where`), or say it has no room there."""
    if not _can_take(p, r, used, capacity):
        parts = [
            f"{tier} memory: needs {need:,.0f} bytes, rank {r} has {capacity[tier][r] - used[tier][r]:,.0f} "
            f"free (shortfall {need - capacity[tier][r] + used[tier][r]:,.0f} bytes)"
            for tier, need in p.memory.items()
            if used[tier][r] + need > capacity[tier][r] * (1 + 1e-12)
        ]
        raise PlacementError(
            f"{p.name} is pinned to {what} {where} (its constraint), which has no room for it: {'; '.join(parts)}",
            p.table,
        )
    _put(p, r, loads, used)


# ---- helpers ----------------------------------------------------------------------------------------
def _fits(
    p_mem: dict[str, float], used: dict[str, np.ndarray], capacity: dict[str, np.ndarray]
) -> np.ndarray:
    ok = np.ones(len(next(iter(capacity.values()))), dtype=bool)
    for tier, need in p_mem.items():
        if need > 0:
            ok &= used[tier] + need <= capacity[tier] * (1 + 1e-12)
    return ok


def _shortfall(
    name: str, mem: dict[str, float], used, capacity, why: str = "", table: str | None = None
) -> PlacementError:
    parts = []
    for tier, need in mem.items():
        if need > 0:
            room = float((capacity[tier] - used[tier]).max())
            if need > room:
                parts.append(
                    f"{tier} memory: needs {need:,.0f} bytes, the roomiest rank has {room:,.0f} (shortfall {need - room:,.0f} bytes)"
                )
    detail = "; ".join(parts) or why
    return PlacementError(f"{name} fits on no rank: {detail}", table)


def _place_nodes(node_pieces, loads, used, capacity, L) -> list[int]:
    num_nodes = len(loads) // L
    out = [0] * len(node_pieces)
    order = sorted(range(len(node_pieces)), key=lambda i: -max(node_pieces[i].costs))
    for i in order:
        p = node_pieces[i]
        best, best_score = None, None
        fits = [_fits(p.memory[i], used, capacity) for i in range(L)]  # local index l -> ranks
        for n in range(num_nodes):
            ranks = range(n * L, (n + 1) * L)
            if not all(fits[local][r] for local, r in enumerate(ranks)):
                continue
            score = max(loads[r] + p.costs[local] for local, r in enumerate(ranks))
            if best_score is None or score < best_score - 1e-15:
                best, best_score = n, score
        if best is None:
            worst = max(range(L), key=lambda i: sum(p.memory[i].values()))
            raise _shortfall(
                p.name, p.memory[worst], used, capacity, "no node has room on all its ranks", p.table
            )
        for local, r in enumerate(range(best * L, (best + 1) * L)):
            loads[r] += p.costs[local]
            for tier, need in p.memory[local].items():
                used[tier][r] += need
        out[i] = best
    return out


def _order(pieces: list[Piece]) -> list[int]:
    return sorted(
        range(len(pieces)), key=lambda i: (-pieces[i].cost, -sum(pieces[i].memory.values()), pieces[i].name)
    )


def _greedy(pieces, loads, used, capacity) -> list[int]:
    ranks = [-1] * len(pieces)
    taken: dict[str, set[int]] = {}
    for i in _order(pieces):
        p = pieces[i]
        ok = _fits(p.memory, used, capacity)
        if p.group is not None:
            for r in taken.get(p.group, ()):
                ok[r] = False
        if not ok.any():
            if _fits(p.memory, used, capacity).any():
                raise PlacementError(
                    f"{p.name} fits on no rank: the ranks with room already hold a piece of the same table",
                    p.table,
                )
            raise _shortfall(p.name, p.memory, used, capacity, table=p.table)
        candidates = np.nonzero(ok)[0]
        r = int(candidates[np.argmin(loads[candidates])])  # first of the least loaded: lowest rank
        _put(p, r, loads, used)
        ranks[i] = r
        if p.group is not None:
            taken.setdefault(p.group, set()).add(r)
    return ranks


def _put(p: Piece, r: int, loads, used, sign: int = 1) -> None:
    loads[r] += sign * p.cost
    for tier, need in p.memory.items():
        used[tier][r] += sign * need


def _can_take(p: Piece, r: int, used, capacity, skip: Piece | None = None) -> bool:
    for tier, need in p.memory.items():
        freed = skip.memory.get(tier, 0.0) if skip is not None else 0.0
        if used[tier][r] - freed + need > capacity[tier][r] * (1 + 1e-12):
            return False
    return True


SWAP_CANDIDATES = 8  # least loaded ranks tried as swap partners


def _improve(pieces, ranks, loads, used, capacity, deadline: float) -> None:
    """Moves and swaps off the most loaded rank while they strictly lower it (see module doc)."""
    by_rank: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        by_rank.setdefault(r, []).append(i)
    groups: dict[str, dict[int, int]] = {}  # group -> rank -> count
    for i, r in enumerate(ranks):
        g = pieces[i].group
        if g is not None:
            groups.setdefault(g, {}).setdefault(r, 0)
            groups[g][r] += 1

    def group_ok(p: Piece, r: int, leaving: Piece | None = None) -> bool:
        if p.group is None:
            return True
        here = groups.get(p.group, {}).get(r, 0)
        if leaving is not None and leaving.group == p.group:
            here -= 1
        return here == 0

    def relocate(i: int, src: int, dst: int) -> None:
        p = pieces[i]
        _put(p, src, loads, used, -1)
        _put(p, dst, loads, used)
        by_rank[src].remove(i)
        by_rank.setdefault(dst, []).append(i)
        ranks[i] = dst
        if p.group is not None:
            groups[p.group][src] -= 1
            groups[p.group][dst] = groups[p.group].get(dst, 0) + 1

    while time.perf_counter() < deadline:
        src = int(np.argmax(loads))
        top = loads[src]
        best = None  # (new max of the two ranks, piece, dst, swap piece or None)
        order = [int(r) for r in np.argsort(loads, kind="stable") if r != src]
        partners = order[:SWAP_CANDIDATES]
        for i in sorted(by_rank.get(src, []), key=lambda i: -pieces[i].cost):
            p = pieces[i]
            if p.cost <= 0:
                continue
            for dst in order:  # a move: the least loaded rank that can take it
                if loads[dst] + p.cost >= top - 1e-15:
                    break
                if group_ok(p, dst) and _can_take(p, dst, used, capacity):
                    score = max(top - p.cost, loads[dst] + p.cost)
                    if best is None or score < best[0] - 1e-15:
                        best = (score, i, dst, None)
                    break
            for dst in partners:  # a swap for a cheaper piece
                if loads[dst] >= top:
                    break
                for j in by_rank.get(dst, []):
                    q = pieces[j]
                    if q.cost >= p.cost:
                        continue
                    score = max(top - p.cost + q.cost, loads[dst] - q.cost + p.cost)
                    if score >= top - 1e-15 or (best is not None and score >= best[0] - 1e-15):
                        continue
                    if not (group_ok(p, dst, q) and group_ok(q, src, p)):
                        continue
                    if _can_take(p, dst, used, capacity, q) and _can_take(q, src, used, capacity, p):
                        best = (score, i, dst, j)
        if best is None:
            return
        _, i, dst, j = best
        relocate(i, src, dst)
        if j is not None:
            relocate(j, dst, src)


def _exact(pieces, loads, used, capacity) -> list[int]:
    """Branch and bound over all placements; optimal maximum load (ties: the first found)."""
    W = len(loads)
    order = _order(pieces)
    best = {"max": np.inf, "ranks": None}
    assign = [-1] * len(pieces)
    taken: dict[str, set[int]] = {}
    mean = (float(loads.sum()) + sum(p.cost for p in pieces)) / W  # no placement beats the mean

    def search(k: int, current_max: float) -> None:
        if max(current_max, mean) >= best["max"] - 1e-15:
            return
        if k == len(order):
            best["max"], best["ranks"] = current_max, list(assign)
            return
        i = order[k]
        p = pieces[i]
        seen = set()
        for r in sorted(range(W), key=lambda r: loads[r]):
            if p.group is not None and r in taken.get(p.group, ()):
                continue
            if not _can_take(p, r, used, capacity):
                continue
            signature = (
                loads[r],
                tuple(float(used[t][r]) for t in used),
                tuple(float(capacity[t][r]) for t in capacity),
                tuple(sorted(g for g, rs in taken.items() if r in rs)),
            )
            if signature in seen:  # an identical rank was tried already
                continue
            seen.add(signature)
            _put(p, r, loads, used)
            assign[i] = r
            if p.group is not None:
                taken.setdefault(p.group, set()).add(r)
            search(k + 1, max(current_max, loads[r]))
            if p.group is not None:
                taken[p.group].discard(r)
            _put(p, r, loads, used, -1)
            assign[i] = -1

    search(0, float(loads.max()))
    if best["ranks"] is None:  # nothing fits: let the greedy pass say which piece and by how much
        return _greedy(pieces, loads, used, capacity)
    for i, r in enumerate(best["ranks"]):
        _put(pieces[i], r, loads, used)
    return best["ranks"]
