"""Placing pieces on ranks so that a training step waits as little as possible, within memory.

A step has phases that end in an exchange every rank waits for (cost.PHASES), so it lasts the sum
over phases of the slowest rank in each: the "step cost" this module minimises. Pieces have a cost
per phase (seconds per step, additive) and memory per tier; every rank has a capacity per tier and a
base load per phase (what it pays whatever the placement). With one phase the step cost is the most
loaded rank's load. Node pieces (twrw, twcw) take one rank of every local index of one node. Pieces
of one row- or column-split table must land on different ranks (`group`).

Balancing totals is not enough: a rank heavy in lookups and one heavy in updates can have equal
totals and still make every step wait for the first in one phase and the second in the next.

0. Pinned pieces (a table's ranks or node constraint: constraints.py) go where they are pinned,
   first, and never move; everything below balances the other pieces around them.
1. Greedy, longest processing time first: node pieces, then rank pieces, most expensive first, each
   onto the rank (node) where it fits and adds the least to the step cost; ties go to the least
   loaded rank, which with one phase is LPT (within 4/3 of optimal without memory limits).
2. Improvement: moves and swaps of the pieces of the ranks that are slowest in some phase, best
   first, while they lower the step cost, or keep it and lower the sum of squared loads. Each move
   lowers that pair, so this ends.
3. Small instances (few pieces and ranks, no node pieces) are solved exactly by branch and bound,
   which is what the brute-force tests check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    cost: float  # seconds per step on its rank, all phases
    memory: dict[str, float]
    group: str | None = None  # pieces of one group go to different ranks
    table: str | None = None
    pinned: int | None = None  # the rank it must go to (None: the partitioner chooses)
    phases: tuple[float, ...] = ()  # `cost` per phase (empty: one phase)


@dataclass
class NodePiece:
    name: str
    costs: list[float]  # per local rank of the node
    memory: list[dict[str, float]]
    table: str | None = None
    pinned: int | None = None  # the node it must go to (None: the partitioner chooses)
    phases: list[tuple[float, ...]] = field(default_factory=list)  # `costs` per phase (empty: one phase)


@dataclass
class Assignment:
    ranks: list[int]  # rank of each piece
    nodes: list[int]  # node of each node piece
    loads: np.ndarray  # [rank, phase] seconds, base load included
    used: dict[str, np.ndarray]  # bytes per tier per rank

    @property
    def step_cost(self) -> float:
        """Sum over phases of the slowest rank in each (one phase: the most loaded rank)."""
        return step_cost(self.loads)

    @property
    def rank_loads(self) -> np.ndarray:
        return self.loads.sum(axis=1)


def step_cost(loads: np.ndarray) -> float:
    return float(loads.max(axis=0).sum())


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
    """Place every piece (and node piece); raises PlacementError when one fits nowhere. `base_load`:
    per rank, or per rank and phase."""
    node_pieces = node_pieces or []
    P = _num_phases(pieces, node_pieces, base_load)
    loads = np.zeros((num_ranks, P))
    if base_load is not None:
        loads += np.asarray(base_load, dtype=float).reshape(num_ranks, -1)
    used = {t: np.zeros(num_ranks) for t in capacity}
    for t, m in (base_memory or {}).items():
        used[t] = used[t] + m
    L = ranks_per_node
    nodes = [-1] * len(node_pieces)
    ranks = [-1] * len(pieces)
    for i, p in enumerate(node_pieces):  # pinned pieces first, where they are pinned
        if p.pinned is not None:
            for local, r in enumerate(range(p.pinned * L, (p.pinned + 1) * L)):
                part = Piece(f"{p.name} local rank {local}", p.costs[local], p.memory[local], table=p.table,
                             phases=p.phases[local] if p.phases else ())  # fmt: skip
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
    # exact for few placements (one rank has one placement of any number of pieces: the search, one
    # level per piece, is kept to a depth that Python's recursion allows)
    if not node_pieces and rest and len(rest) <= 64 and num_ranks ** len(rest) <= exact_limit:
        placed = _exact(rest, loads, used, capacity)
    else:
        placed = _greedy(rest, loads, used, capacity)
        _improve(rest, placed, loads, used, capacity, time.perf_counter() + improve_seconds)
    for i, r in zip(free, placed, strict=True):
        ranks[i] = r
    return Assignment(ranks, nodes, loads, used)


def _num_phases(pieces: list[Piece], node_pieces: list[NodePiece], base_load) -> int:
    """The phases the costs are given in: every piece's, node piece's and the base load's alike."""
    found = {len(p.phases) or 1 for p in pieces}
    found |= {len(p.phases[0]) if p.phases else 1 for p in node_pieces}
    if base_load is not None:
        base = np.asarray(base_load)
        found.add(base.shape[1] if base.ndim == 2 else 1)
    if len(found) > 1:
        raise ValueError(f"pieces and base load given in different numbers of phases: {sorted(found)}")
    return found.pop() if found else 1


def _vector(p: Piece) -> np.ndarray:
    return np.asarray(p.phases if p.phases else (p.cost,), dtype=float)


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
    """Each node piece, most expensive first, onto the node where it adds the least to the step cost
    (ties: where its most loaded rank ends lightest)."""
    num_nodes = len(loads) // L
    out = [0] * len(node_pieces)
    order = sorted(range(len(node_pieces)), key=lambda i: -max(node_pieces[i].costs))
    for i in order:
        p = node_pieces[i]
        costs = np.asarray(p.phases if p.phases else [[c] for c in p.costs], dtype=float)  # [local, phase]
        best, best_score = None, None
        fits = [_fits(p.memory[i], used, capacity) for i in range(L)]  # local index l -> ranks
        for n in range(num_nodes):
            ranks = range(n * L, (n + 1) * L)
            if not all(fits[local][r] for local, r in enumerate(ranks)):
                continue
            trial = loads.copy()
            trial[n * L : (n + 1) * L] += costs
            score = (step_cost(trial), float(trial[n * L : (n + 1) * L].sum(axis=1).max()))
            if best_score is None or _lower(score, best_score):
                best, best_score = n, score
        if best is None:
            worst = max(range(L), key=lambda i: sum(p.memory[i].values()))
            raise _shortfall(
                p.name, p.memory[worst], used, capacity, "no node has room on all its ranks", p.table
            )
        loads[best * L : (best + 1) * L] += costs
        for local, r in enumerate(range(best * L, (best + 1) * L)):
            for tier, need in p.memory[local].items():
                used[tier][r] += need
        out[i] = best
    return out


def _lower(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a < b lexicographically, ignoring differences below 1e-15 s."""
    if a[0] < b[0] - 1e-15:
        return True
    return a[0] <= b[0] + 1e-15 and a[1] < b[1] - 1e-15


def _order(pieces: list[Piece]) -> list[int]:
    return sorted(
        range(len(pieces)), key=lambda i: (-pieces[i].cost, -sum(pieces[i].memory.values()), pieces[i].name)
    )


def _greedy(pieces, loads, used, capacity) -> list[int]:
    ranks = [-1] * len(pieces)
    taken: dict[str, set[int]] = {}
    top = loads.max(axis=0)
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
        after = loads + _vector(p)
        added = np.where(ok, np.maximum(after, top).sum(axis=1), np.inf)  # the step cost with it there
        ties = added == added.min()
        r = int(np.argmin(np.where(ties, after.sum(axis=1), np.inf)))  # the least loaded, then the lowest
        _put(p, r, loads, used)
        top = np.maximum(top, loads[r])
        ranks[i] = r
        if p.group is not None:
            taken.setdefault(p.group, set()).add(r)
    return ranks


def _put(p: Piece, r: int, loads, used, sign: int = 1) -> None:
    loads[r] += sign * _vector(p)
    for tier, need in p.memory.items():
        used[tier][r] += sign * need


def _can_take(p: Piece, r: int, used, capacity, skip: Piece | None = None) -> bool:
    for tier, need in p.memory.items():
        freed = skip.memory.get(tier, 0.0) if skip is not None else 0.0
        if used[tier][r] - freed + need > capacity[tier][r] * (1 + 1e-12):
            return False
    return True


SWAP_CANDIDATES = 8  # per phase, the least loaded ranks in it tried as swap partners
TIED_SOURCES = 4  # per phase, ranks tied for its slowest whose pieces are tried


def _improve(pieces, ranks, loads, used, capacity, deadline: float) -> None:
    """Moves and swaps off the slowest ranks while they lower the step cost (see module doc)."""
    vectors = [_vector(p) for p in pieces]
    tiers = list(capacity)
    need = np.array([[p.memory.get(t, 0.0) for t in tiers] for p in pieces]).reshape(len(pieces), len(tiers))
    room = _by_tier(capacity, tiers, len(loads)) * (1 + 1e-12)
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

    def room_for(mine: list[int], src: int, dst: int | None = None, theirs: list[int] | None = None):
        """Moves of `mine` to every rank [piece, rank], or swaps with `theirs` on `dst` [mine, theirs]:
        whether memory allows them."""
        in_use = _by_tier(used, tiers, len(loads))
        if theirs is None:
            return (in_use[None] + need[mine][:, None] <= room[None]).all(axis=2)
        swapped = need[theirs][None] - need[mine][:, None]  # [mine, theirs, tier]: what dst gives up
        to_dst = (in_use[dst] - swapped <= room[dst]).all(axis=2)
        return to_dst & (in_use[src] + swapped <= room[src]).all(axis=2)

    def groups_allow(i: int, src: int, dst: int, j: int | None) -> bool:
        if j is None:
            return group_ok(pieces[i], dst)
        return group_ok(pieces[i], dst, pieces[j]) and group_ok(pieces[j], src, pieces[i])

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
        found = _best_move(vectors, by_rank, loads, room_for, groups_allow)
        if found is None:
            return
        i, src, dst, j = found
        relocate(i, src, dst)
        if j is not None:
            relocate(j, dst, src)


def _by_tier(per_tier: dict[str, np.ndarray], tiers: list[str], num_ranks: int) -> np.ndarray:
    """[rank, tier] of per-tier arrays over ranks."""
    out = np.zeros((num_ranks, len(tiers)))
    for k, t in enumerate(tiers):
        out[:, k] = per_tier[t]
    return out


def _best_move(vectors, by_rank, loads, room_for, groups_allow) -> tuple[int, int, int, int | None] | None:
    """The best move (piece i from src to dst) or swap (and piece j from dst to src) of a piece of a
    rank that is the slowest in some phase: the lowest step cost after it, then the lowest sum of
    squared loads; only one that lowers the step cost, or keeps it and lowers that sum, that memory
    allows (`room_for`) and that keeps a table's pieces apart (`groups_allow(i, src, dst, j)`).
    None when there is none."""
    W, P = loads.shape
    top = loads.max(axis=0)
    step = float(top.sum())
    squares = (loads**2).sum(axis=1)
    slowest = np.argsort(-loads, axis=0, kind="stable")[: min(3, W)]  # [k-th slowest, phase] -> rank
    tol, tol_sq = 1e-12 * step, 1e-12 * float(squares.sum())
    best: list = [(np.inf, np.inf), None]

    def consider(after: np.ndarray, change: np.ndarray, allowed: np.ndarray, what) -> None:
        """`after`, `change`: the step cost and change of the sum of squares of each candidate
        (same shape), `allowed`: where memory allows it; `what(index)` -> (i, src, dst, j)."""
        ok = allowed & ((after < step - tol) | ((after <= step) & (change < -tol_sq)))
        picks = np.flatnonzero(ok)
        if not len(picks):
            return
        a, c = after.ravel()[picks], change.ravel()[picks]
        for k in np.lexsort((c, a)):
            score = (float(a[k]), float(c[k]))
            if score >= best[0]:
                return
            move = what(int(picks[k]))
            if groups_allow(*move):
                best[:] = [score, move]
                return

    # the slowest rank of each phase, and up to TIED_SOURCES more that tie with it (one of them may
    # have the move that the first lacks)
    tied = [np.flatnonzero(loads[:, p] >= top[p] - tol)[:TIED_SOURCES] for p in range(P) if top[p] > 0]
    lightest = np.argsort(loads, axis=0, kind="stable")[:SWAP_CANDIDATES]  # [k-th lightest, phase]
    partners = {int(r) for r in lightest.ravel()}  # swap partners, whichever rank gives
    for src in sorted({int(r) for r in slowest[0]} | {int(r) for t in tied for r in t}):
        mine = by_rank.get(src, [])
        if not mine:
            continue
        C = np.stack([vectors[i] for i in mine])  # [piece, phase]
        rest = _others(loads, slowest, src)  # [dst, phase]: the slowest of the ranks but src and dst
        leaving = loads[src] - C
        arriving = loads[None, :, :] + C[:, None, :]  # [piece, dst, phase]
        after = np.maximum(np.maximum(rest[None], leaving[:, None, :]), arriving).sum(axis=2)
        change = (leaving**2).sum(axis=1)[:, None] - squares[src] + (arriving**2).sum(axis=2) - squares[None]
        after[:, src] = np.inf
        moves = room_for(mine, src)
        consider(after, change, moves, lambda k, mine=mine, src=src: (mine[k // W], src, k % W, None))
        for dst in sorted(partners - {src}):
            theirs = by_rank.get(dst, [])
            if not theirs:
                continue
            D = np.stack([vectors[j] for j in theirs])
            to_src = loads[src] - C[:, None, :] + D[None]  # [mine, theirs, phase]
            to_dst = loads[dst] + C[:, None, :] - D[None]
            after = np.maximum(np.maximum(rest[dst], to_src), to_dst).sum(axis=2)
            change = (to_src**2).sum(axis=2) + (to_dst**2).sum(axis=2) - squares[src] - squares[dst]
            n = len(theirs)
            consider(after, change, room_for(mine, src, dst, theirs), lambda k, mine=mine, theirs=theirs,
                     src=src, dst=dst, n=n: (mine[k // n], src, dst, theirs[k % n]))  # fmt: skip
    return best[1]


def _others(loads: np.ndarray, slowest: np.ndarray, src: int) -> np.ndarray:
    """[dst, phase]: the load of the slowest rank other than `src` and `dst` in each phase (-inf when
    there is none); `slowest`: [k-th slowest, phase] -> rank, for k < 3."""
    W, P = loads.shape
    out = np.full((W, P), -np.inf)
    filled = np.zeros((W, P), dtype=bool)
    dsts = np.arange(W)[:, None]
    for k in range(len(slowest)):
        rank = slowest[k][None, :]
        take = (rank != src) & (rank != dsts) & ~filled
        out = np.where(take, loads[slowest[k], np.arange(P)][None, :], out)
        filled |= take
    return out


def _exact(pieces, loads, used, capacity) -> list[int]:
    """Branch and bound over all placements; optimal step cost (ties: the first found)."""
    W, P = loads.shape
    order = _order(pieces)
    vectors = [_vector(p).tolist() for p in pieces]
    rows = loads.tolist()  # [rank][phase], plain floats: this loop runs up to ~10^5 times
    best = {"cost": np.inf, "ranks": None}
    assign = [-1] * len(pieces)
    taken: dict[str, set[int]] = {}
    # no placement beats the mean of a phase
    mean = [(sum(r[k] for r in rows) + sum(v[k] for v in vectors)) / W for k in range(P)]

    def search(k: int, top: list[float]) -> None:
        if sum(map(max, top, mean)) >= best["cost"] - 1e-15:
            return
        if k == len(order):
            best["cost"], best["ranks"] = sum(top), list(assign)
            return
        i = order[k]
        p, v = pieces[i], vectors[i]
        seen = set()
        for r in sorted(range(W), key=lambda r: sum(rows[r])):
            if p.group is not None and r in taken.get(p.group, ()):
                continue
            if not _can_take(p, r, used, capacity):
                continue
            signature = (
                tuple(rows[r]),
                tuple(float(used[t][r]) for t in used),
                tuple(float(capacity[t][r]) for t in capacity),
                tuple(sorted(g for g, rs in taken.items() if r in rs)),
            )
            if signature in seen:  # an identical rank was tried already
                continue
            seen.add(signature)
            before = rows[r]
            rows[r] = [a + b for a, b in zip(before, v, strict=True)]
            for tier, need in p.memory.items():
                used[tier][r] += need
            assign[i] = r
            if p.group is not None:
                taken.setdefault(p.group, set()).add(r)
            search(k + 1, list(map(max, top, rows[r])))
            if p.group is not None:
                taken[p.group].discard(r)
            for tier, need in p.memory.items():
                used[tier][r] -= need
            rows[r] = before
            assign[i] = -1

    search(0, [max(r[k] for r in rows) for k in range(P)])
    if best["ranks"] is None:  # nothing fits: let the greedy pass say which piece and by how much
        return _greedy(pieces, loads, used, capacity)
    for i, r in enumerate(best["ranks"]):
        _put(pieces[i], r, loads, used)
    return best["ranks"]
