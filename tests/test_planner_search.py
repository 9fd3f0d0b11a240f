"""The sharding planner's search: the partitioner against brute force and its 4/3 bound, the lower
bound, memory limits and the errors that name a shortfall, plan.json, a dry run near the bound, the
train default and the CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.distributed.topology import Topology
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.planner import build_workload, estimate_plan, plan_sharding, this_machine
from neorec.planner.bounds import lower_bound, lower_hull
from neorec.planner.hardware import CALIBRATED_CPU, Cluster, MemoryTier, paper_cluster, preset
from neorec.planner.options import table_options
from neorec.planner.partition import Piece, PlacementError, partition
from neorec.planner.planner import capacity_error, place, rank_capacity


def brute_force(pieces: list[Piece], W: int, capacity: dict[str, np.ndarray]) -> float | None:
    """The least step cost (each phase's most loaded rank, summed) of any placement within memory."""
    best = None
    phases = len(pieces[0].phases) or 1
    for assign in itertools.product(range(W), repeat=len(pieces)):
        loads, used = np.zeros((W, phases)), {t: np.zeros(W) for t in capacity}
        seen = set()
        ok = True
        for p, r in zip(pieces, assign, strict=True):
            if p.group is not None:
                if (p.group, r) in seen:
                    ok = False
                    break
                seen.add((p.group, r))
            loads[r] += p.phases or p.cost
            for t, m in p.memory.items():
                used[t][r] += m
        if ok and all((used[t] <= capacity[t]).all() for t in capacity):
            step = loads.max(axis=0).sum()
            best = step if best is None else min(best, step)
    return best


def random_instance(seed: int, n: int = 7, W: int = 3):
    rng = np.random.default_rng(seed)
    pieces = []
    for i in range(n):
        group = "g" if i < 2 else ("h" if i < 4 and seed % 2 else None)
        pieces.append(
            Piece(f"p{i}", float(rng.integers(1, 20)), {"device": float(rng.integers(1, 10))}, group)
        )
    capacity = {"device": np.array([float(rng.integers(12, 30)) for _ in range(W)])}
    return pieces, W, capacity


@pytest.mark.parametrize("seed", range(30))
def test_partition_is_optimal_on_small_instances_and_within_capacity(seed):
    pieces, W, capacity = random_instance(seed)
    best = brute_force(pieces, W, capacity)
    if best is None:
        with pytest.raises(PlacementError, match="fits on no rank"):
            partition(pieces, W, capacity)
        return
    result = partition(pieces, W, capacity)
    assert result.step_cost == pytest.approx(best)
    assert (result.used["device"] <= capacity["device"] + 1e-9).all()
    # the heuristic path (LPT + moves/swaps) is never over capacity either
    try:
        heuristic = partition(pieces, W, capacity, exact_limit=0)
    except PlacementError:
        return  # greedy can miss a tight packing that exists; it never returns an over-full plan
    assert (heuristic.used["device"] <= capacity["device"] + 1e-9).all()
    assert heuristic.step_cost >= best - 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_lpt_with_improvement_is_within_four_thirds_without_memory_limits(seed):
    rng = np.random.default_rng(100 + seed)
    pieces = [Piece(f"p{i}", float(rng.integers(1, 50)), {}) for i in range(9)]
    capacity = {"device": np.full(3, np.inf)}
    best = brute_force(pieces, 3, capacity)
    heuristic = partition(pieces, 3, capacity, exact_limit=0)
    assert heuristic.step_cost <= 4 / 3 * best + 1e-9


def phased(name: str, phases, memory: float = 0.0, group: str | None = None) -> Piece:
    return Piece(name, float(sum(phases)), {"device": memory}, group, phases=tuple(float(v) for v in phases))


def test_partition_balances_each_phase_not_only_each_rank():
    """Two lookup-heavy and two update-heavy pieces on two ranks: both ranks carry 20 whichever way
    they pair, but a step waits for the slowest rank of each phase, so only one lookup-heavy and one
    update-heavy piece per rank gives a step of 20 rather than 40."""
    pieces = [phased("lookup a", (0, 10, 1)), phased("lookup b", (0, 10, 1)),
              phased("update a", (1, 0, 9)), phased("update b", (1, 0, 9))]  # fmt: skip
    capacity = {"device": np.full(2, np.inf)}
    for limit in (200_000, 0):  # exact, then greedy with moves and swaps
        result = partition(pieces, 2, capacity, exact_limit=limit)
        assert result.step_cost == pytest.approx(21.0), limit
        assert result.ranks[0] != result.ranks[1] and result.ranks[2] != result.ranks[3]
    # with a base load per phase: rank 0 already busy with lookups takes the update-heavy pieces
    base = np.array([[0.0, 20.0, 0.0], [0.0, 0.0, 0.0]])
    for limit in (200_000, 0):
        result = partition(pieces, 2, capacity, base_load=base, exact_limit=limit)
        assert result.ranks[:2] == [1, 1], limit
        assert result.step_cost == pytest.approx(1 + 20 + 11)  # one update-heavy piece beside them


@pytest.mark.parametrize("seed", range(12))
def test_partition_by_phase_is_optimal_on_small_instances_and_close_without_it(seed):
    rng = np.random.default_rng(500 + seed)
    W = 3
    pieces = [
        phased(f"p{i}", rng.integers(0, 12, size=3), float(rng.integers(1, 10)), "g" if i < 2 else None)
        for i in range(7)
    ]
    capacity = {"device": np.array([float(rng.integers(14, 30)) for _ in range(W)])}
    best = brute_force(pieces, W, capacity)
    if best is None:
        return
    assert partition(pieces, W, capacity).step_cost == pytest.approx(best)
    try:
        heuristic = partition(pieces, W, capacity, exact_limit=0)
    except PlacementError:
        return
    assert (heuristic.used["device"] <= capacity["device"] + 1e-9).all()
    assert best - 1e-9 <= heuristic.step_cost <= 1.5 * best


def test_partition_names_the_piece_and_the_shortfall():
    pieces = [Piece("table 'big' shard 0", 1.0, {"device": 50.0}, table="big")]
    with pytest.raises(PlacementError, match=r"'big'.*shortfall 20 bytes") as e:
        partition(pieces, 2, {"device": np.array([30.0, 30.0])})
    assert e.value.table == "big"


def test_one_rank_places_a_thousand_pieces():
    """One rank has one placement of any number of pieces (1 ** n is under any search limit): each
    piece goes to rank 0, with no search one level deep per piece."""
    pieces = [Piece(f"t{i}", 1e-4, {"device": 1.0}, phases=(1e-4, 0.0, 0.0)) for i in range(1200)]
    a = partition(pieces, 1, {"device": np.array([1e9])}, improve_seconds=0.0)
    assert a.ranks == [0] * 1200 and a.loads[0] == pytest.approx([0.12, 0.0, 0.0])


# ---- the planner -----------------------------------------------------------------------------------------
def cpu(world: int = 2, memory: int = 2**33) -> Cluster:
    return this_machine(world, calibration=dict(CALIBRATED_CPU), memory=memory)


def test_lower_hull_keeps_the_convex_cheap_side():
    assert lower_hull([(1, 10), (2, 9), (3, 4), (4, 4), (5, 1), (2, 12)]) == [(1, 10), (3, 4), (5, 1)]


def test_bound_gives_device_memory_only_as_far_as_it_goes():
    from neorec.planner.options import Option

    def option(name: str, tier: str, cost: float, memory: dict) -> Option:
        return Option(name, "tw", 1, tier, [(cost, 0.0, 0.0)], [memory])

    both = [("device", 1.0), ("host", 3.0)]  # (tier, seconds) of 10 bytes in that tier
    options = {n: [option(n, tier, cost, {tier: 10.0}) for tier, cost in both] for n in "ab"}
    # room for half a table in device memory: (3 + 3 - 2 x 1/2) / 2 ranks
    assert lower_bound(options, 2, 5.0).mean_bound == pytest.approx(2.5)
    assert lower_bound(options, 2, 20.0).mean_bound == pytest.approx(1.0)


def test_bound_is_below_the_best_plan_found_by_exhaustive_search():
    tables = [
        TableConfig(name=f"t{i}", rows=r, dim=8, features=[f"f{i}"]) for i, r in enumerate([5000, 300, 80])
    ]
    wl = build_workload(tables, "rowwise_adagrad", 512, {"f0": 3.0, "f1": 1.0, "f2": 2.0})
    cluster = cpu(2)
    options = {t.name: table_options(t, wl, cluster, ("tw", "rw", "cw", "dp")) for t in wl.tables}
    capacity = rank_capacity(cluster)
    best = min(
        place(dict(zip(options, combo, strict=True)), cluster, capacity).step_cost
        for combo in itertools.product(*options.values())
    )
    bound = lower_bound(options, 2, float(capacity["device"].sum()))
    assert bound.value <= best + 1e-12
    result = plan_sharding(wl, cluster, ("tw", "rw", "cw", "dp"), time_budget=5)
    assert bound.value <= result.additive_step + 1e-12
    assert result.additive_step <= best * 1.10


def test_one_rank_pays_no_exchange_and_meets_the_bound():
    """One process exchanges nothing: its plan (every table whole on the one rank) is exactly at the
    lower bound, which counts no exchange either."""
    tables = [TableConfig(name=f"t{i}", rows=r, dim=16, features=[f"f{i}"]) for i, r in enumerate([4000, 900, 50])]
    wl = build_workload(tables, "rowwise_adagrad", 512, {"f0": 3.0, "f1": 1.0, "f2": 2.0})
    for cluster in (cpu(1), preset("h100-node", world_size=1, ranks_per_node=1)):
        result = plan_sharding(wl, cluster, ("tw", "rw", "cw"), time_budget=2)
        assert result.bound.value <= result.estimate.max_cost * (1 + 1e-9)
        assert result.estimate.max_cost <= result.bound.value * (1 + 1e-9)


def test_plan_respects_memory_and_moves_cold_tables_to_host():
    # 4 GPUs with 1 GB each and 10 GB host: the hot small tables belong in device memory
    device = MemoryTier("device", 10**9, 1e12, 5e11)
    host = MemoryTier("host", 10 * 10**9, 2e10, 1e10)
    cluster = Cluster("tiny", 4, 4, (device, host), 1e11, 1e10, 1e-5, 5e11, 1e-11, 1e-11, reserved=10**8)
    tables = [TableConfig(name=f"hot{i}", rows=100_000, dim=64, features=[f"h{i}"]) for i in range(4)]
    tables += [TableConfig(name=f"cold{i}", rows=8_000_000, dim=64, features=[f"c{i}"]) for i in range(3)]
    ids = {f"h{i}": 20.0 for i in range(4)} | {f"c{i}": 1.0 for i in range(3)}
    wl = build_workload(tables, "rowwise_adagrad", 4096, ids)
    result = plan_sharding(wl, cluster, time_budget=5)
    for r in result.estimate.ranks:
        assert r.memory["device"] <= device.capacity and r.memory.get("host", 0) <= host.capacity
    assert all((result.plan.tables[f"hot{i}"].tier or "device") == "device" for i in range(4))
    # the cold tables' rows go to host memory: read there over PCIe, or behind a cache in device memory
    assert any(result.plan.tables[f"cold{i}"].tier in ("host", "cached") for i in range(3))
    result.plan.validate(wl.table_configs, cluster.topology())


def test_table_that_fits_nowhere_is_named_with_its_shortfall():
    tables = [
        TableConfig(name="huge", rows=10**9, dim=64, features=["f"]),
        TableConfig(name="ok", rows=10, dim=64, features=["g"]),
    ]
    with pytest.raises(
        ConfigError, match=r"(?s)table 'huge'.*fits nowhere.*device: .* needs .* a rank has .*shortfall"
    ):
        plan_sharding(build_workload(tables, "adam", 64), cpu(2, memory=2**30))


def test_infeasible_total_memory_names_the_constraint():
    tables = [TableConfig(name=f"t{i}", rows=2_000_000, dim=64, features=[f"f{i}"]) for i in range(8)]
    with pytest.raises(ConfigError, match="constraint 'memory of all ranks together' broke"):
        plan_sharding(build_workload(tables, "sgd", 64), cpu(2, memory=3 * 2**30))


def test_capacity_error_names_any_rank_over_its_memory():
    tables = [TableConfig(name="big", rows=4_000_000, dim=64, features=["f"]),
              TableConfig(name="small", rows=10, dim=64, features=["g"])]  # fmt: skip
    wl, cluster = build_workload(tables, "sgd", 64), cpu(2, memory=2**30)
    for r in (0, 1):
        plan = ShardingPlan({"big": TablePlan("tw", [r]), "small": TablePlan("tw", [1 - r])})
        error = capacity_error(estimate_plan(plan, wl, cluster), cluster)
        assert error is not None and f"device memory of rank {r}' broke" in str(error)


def test_column_splits_go_down_to_slices_of_four_columns():
    from neorec.planner.options import split_counts

    wl = build_workload([TableConfig(name="a", rows=100, dim=16, features=["f"])], "sgd", 64)
    assert split_counts(wl.tables[0], cpu(8)) == {"rw": [2, 4, 8], "cw": [2, 4]}


def test_plan_json_keeps_tier_and_reads_old_files(tmp_path):
    plan = ShardingPlan({"a": TablePlan("rw", [0, 1], None, "host"), "b": TablePlan("tw", [1])})
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["tables"]["a"]["tier"] == "host" and "tier" not in data["tables"]["b"]
    assert ShardingPlan.load(tmp_path / "p.json").tables["a"].tier == "host"
    with pytest.raises(ConfigError, match="'tier' must be one of"):
        ShardingPlan.from_dict({"tables": {"a": {"kind": "tw", "ranks": [0], "tier": "tape"}}})


def test_dry_run_on_a_reduced_large_model_respects_capacity_near_the_bound():
    """A quarter of the 12T dry run (same proportions of weights to device and host memory). With
    fewer tables a whole table's tier is a coarser step than the bound's fractional one, so the
    margin here is wider than the full run's (RESULTS.md)."""
    from neorec.planner.large_model import twelve_trillion_tables

    tables, ids = twelve_trillion_tables(num_tables=250, total=3e12)
    wl = build_workload(tables, "rowwise_adagrad", 16384, ids)
    cluster = paper_cluster().with_ranks(32, 8)
    result = plan_sharding(wl, cluster, time_budget=8)
    for r in result.estimate.ranks:
        for tier in cluster.tiers:
            assert r.memory.get(tier.name, 0) <= tier.capacity
    # the step (each phase's slowest rank, summed) near the bound, which no rank's total is below
    # (1.07x with the whole budget on this VM; balancing each rank's total gave 1.87x)
    assert result.estimate.step_time <= 1.25 * result.bound.value


# ---- the default plan of neorec train, and neorec plan ---------------------------------------------------------
def small_config(extra: list[str] | None = None):
    from neorec.config.load import load_config

    sets = ["data.synthetic.max_rows=500", "data.synthetic.train_samples=4096", "data.batch_size=256"]
    return load_config("default", sets + (extra or []))


def test_train_default_plan_comes_from_the_planner_and_overrides_still_apply(tmp_path):
    from neorec.train.build import build_source, build_tables
    from neorec.train.run_plan import build_plan, workload_for_run

    cfg = small_config()
    tables = build_tables(cfg, build_source(cfg).info)
    topo = Topology(2, 0, 2)
    plan = build_plan(cfg, tables, topo)
    workload = workload_for_run(cfg, tables, one_machine=True)  # 2 ranks on one node: shared-memory codecs
    expected = plan_sharding(workload, this_machine(2, 2), time_budget=10).plan
    assert plan.to_dict() == expected.to_dict()
    over = build_plan(small_config(["distributed.sharding={C1: {kind: rw, ranks: [1, 0]}}"]), tables, topo)
    assert over.tables["C1"].kind == "rw" and over.tables["C1"].ranks == [1, 0]
    path = tmp_path / "plan.json"
    ShardingPlan({t.name: TablePlan("tw", [1]) for t in tables}).save(path)
    from_file = build_plan(small_config([f"distributed.plan={path}"]), tables, topo)
    assert all(p.kind == "tw" and p.ranks == [1] for p in from_file.tables.values())


def test_cli_plan_writes_plan_report_and_chart(tmp_path, capsys):
    from neorec.cli import main

    out = tmp_path / "plan"
    code = main(["plan", "--set", "data.synthetic.max_rows=500", "--set", "data.batch_size=256", "--nproc", "2",
                 "--baselines", "--output-dir", str(out), "--time-budget", "2"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "imbalance" in text and "round-robin" in text and "size-greedy" in text
    for name in ("plan.json", "report.txt", "summary.json", "plan.png"):
        assert (out / name).is_file()
    ShardingPlan.load(out / "plan.json")
