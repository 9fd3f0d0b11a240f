"""What `neorec plan` prints and draws: a table per rank, plans side by side, a PNG chart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from neorec.planner.cost import STAGES
from neorec.planner.hardware import Cluster
from neorec.planner.planner import PlanResult
from neorec.utils.files import write_atomic

STAGE_LABELS = {"input_dist": "ids", "lookup": "lookup", "output_dist": "out fwd", "output_dist_bwd": "out bwd",
                "update": "update"}  # fmt: skip


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def rank_table(result: PlanResult, cluster: Cluster, tables) -> str:
    """One line per rank: shards held, seconds per stage, memory per tier against capacity."""
    topo = cluster.topology()
    by_name = {t.name: t for t in tables}
    counts = [Counter() for _ in range(cluster.world_size)]
    for name, p in result.plan.tables.items():
        if p.kind == "dp":
            for c in counts:
                c["dp"] += 1
            continue
        for s in result.plan.shards(by_name[name], topo):
            counts[s.rank][p.kind] += 1
    tiers = [t.name for t in cluster.tiers]
    header = ["rank", "node", "shards", *(f"{STAGE_LABELS[s]} ms" for s in STAGES), "total ms"]
    header += [f"{t} GB (of {cluster.tier(t).capacity / 1e9:.1f})" for t in tiers]
    cached = any(r.tier_bytes for r in result.estimate.ranks)
    if cached:
        header.append("cache MB/step")
    rows = []
    for r in result.estimate.ranks:
        held = " ".join(f"{k}:{n}" for k, n in sorted(counts[r.rank].items())) or "-"
        rows.append(
            [str(r.rank), str(topo.node_of(r.rank)), held]
            + [f"{r.stages[s] * 1e3:.2f}" for s in STAGES]
            + [f"{r.total * 1e3:.2f}"]
            + [_gb(r.memory.get(t, 0)) for t in tiers]
            + ([f"{sum(r.tier_bytes.values()) / 1e6:.2f}"] if cached else [])
        )
    return _table(header, rows)


def summary(result: PlanResult, cluster: Cluster) -> str:
    e = result.estimate
    lines = [
        f"plan: {result.name}, {cluster.name}, {cluster.world_size} ranks ({cluster.num_nodes} node(s) x "
        f"{cluster.ranks_per_node}), planned in {result.seconds:.1f} s",
        f"slowest rank {e.max_cost * 1e3:.3f} ms/step, mean {e.mean_cost * 1e3:.3f} ms, imbalance (max/mean) "
        f"{e.imbalance:.4f}; step estimate (slowest rank per phase) {e.step_time * 1e3:.3f} ms",
    ]
    if result.bound is not None:
        above = e.step_time / result.bound.value - 1
        above = 0.0 if abs(above) < 1e-9 else above  # at the bound: no "-0.00%" from rounding
        lines.append(
            f"lower bound on the step: {result.bound.describe()}; this plan's step is {above:+.2%} above it"
        )
    kinds = Counter(
        p.kind + ("" if (p.tier or "device") == "device" else f"@{p.tier}")
        for p in result.plan.tables.values()
    )
    lines.append(
        "tables per sharding kind (@tier when not device): "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    )
    if e.hit_rates:
        rates = sorted(e.hit_rates.values())
        moved = max(sum(r.tier_bytes.values()) for r in e.ranks)
        lines.append(
            f"tables behind a row cache: {len(rates)}, estimated hit rate "
            f"{rates[0]:.2f}..{rates[-1]:.2f}; at most {moved / 1e6:.2f} MB per step from/to the backing tier on a rank"
        )
    for tier in cluster.tiers:
        used = [r.memory.get(tier.name, 0) for r in e.ranks]
        lines.append(
            f"{tier.name} memory per rank: max {_gb(max(used))} GB, min {_gb(min(used))} GB of {_gb(tier.capacity)} GB"
            f" ({'within capacity' if max(used) <= tier.capacity else 'OVER CAPACITY'})"
        )
    return "\n".join(lines)


def comparison(results: list[PlanResult], cluster: Cluster) -> str:
    """Plans side by side (the planner's first): slowest rank, imbalance, memory, capacity."""
    header = ["plan", "slowest rank ms", "mean ms", "max/mean", "step vs lower bound", "step ms",
              "max device GB", "fits in memory", "planning s"]  # fmt: skip
    bound = next((r.bound for r in results if r.bound is not None), None)
    rows = []
    for r in results:
        e = r.estimate
        over = [
            (x.rank, t.name) for x in e.ranks for t in cluster.tiers if x.memory.get(t.name, 0) > t.capacity
        ]
        rows.append([
            r.name, f"{e.max_cost * 1e3:.2f}", f"{e.mean_cost * 1e3:.2f}", f"{e.imbalance:.3f}",
            f"{e.step_time / bound.value:.3f}x" if bound else "-", f"{e.step_time * 1e3:.2f}",
            _gb(max(x.memory.get("device", 0) for x in e.ranks)),
            "yes" if not over else f"no ({len(over)} rank-tiers over)", f"{r.seconds:.2f}",
        ])  # fmt: skip
    return _table(header, rows)


def plot(results: list[PlanResult], cluster: Cluster, path: str | Path) -> Path:
    """plan.png: see plan_figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plan_figure(results, cluster)
    out = Path(path)
    # the legends right of the bars included; atomic, as every file neorec writes
    write_atomic(out, lambda f: fig.savefig(f, format="png", dpi=90, bbox_inches="tight"), "plan chart")
    plt.close(fig)
    return out


def plan_figure(results: list[PlanResult], cluster: Cluster):
    """Stacked seconds per stage and memory per tier, per rank, one column per plan (one scale for all
    plans, but for a plan whose cost would fill less than a quarter of it: that one gets its own, said in
    its title). Legends sit right of the bars and give each stage's largest value, so that a stage too
    small to see in the bars is still read; a capacity far above every bar is named, not drawn."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = len(results)
    all_ranks = [r for res in results for r in res.estimate.ranks]
    per_plan = min(14.0, 5 + 0.05 * cluster.world_size)  # inches: many ranks get room
    fig, axes = plt.subplots(2, n, figsize=(per_plan * n + 1.5, 7), squeeze=False)
    top_ms = max((r.total for r in all_ranks), default=0.0) * 1e3
    steps_ms = [max(r.estimate.step_time, r.bound.value if r.bound else 0.0) * 1e3 for r in results]
    common_ms = max([top_ms, 1e-9, *steps_ms])  # one scale for the plans
    stage_max = {s: max((r.stages[s] for r in all_ranks), default=0.0) * 1e3 for s in STAGES}
    used_gb = max((r.memory.get(t.name, 0) for r in all_ranks for t in cluster.tiers), default=0) / 1e9
    on_scale = [t for t in cluster.tiers if t.capacity / 1e9 <= 4 * max(used_gb, 1e-9)]  # else named only
    top_gb = max([used_gb] + [t.capacity / 1e9 for t in on_scale]) or 1.0
    label_bars = all(len(res.estimate.ranks) <= 16 for res in results)  # values on the bars while they fit
    for col, res in enumerate(results):
        ranks = [r.rank for r in res.estimate.ranks]
        ax = axes[0][col]
        bottom = [0.0] * len(ranks)
        for s in STAGES:
            values = [r.stages[s] * 1e3 for r in res.estimate.ranks]
            label = f"{STAGE_LABELS[s]} (up to {stage_max[s]:.2f} ms)"
            edge = {"edgecolor": "white", "linewidth": 0.3} if label_bars else {}  # stages apart, while bars are wide
            bars = ax.bar(ranks, values, bottom=bottom, label=label, width=0.85, **edge)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        if label_bars:
            ax.bar_label(bars, labels=[f"{b:.2f}" for b in bottom], fontsize=7, padding=2)
        if res.bound is not None:
            ax.axhline(res.bound.value * 1e3, color="black", linestyle="--", linewidth=1, label="lower bound")
        step_ms = res.estimate.step_time * 1e3  # ranks wait for each other at every exchange
        ax.axhline(step_ms, color="darkred", linestyle="-.", linewidth=1,
                   label=f"step estimate {step_ms:.2f} ms (slowest rank in each phase)")  # fmt: skip
        bound_ms = res.bound.value * 1e3 if res.bound is not None else 0.0
        own_ms = max(max(r.total for r in res.estimate.ranks) * 1e3, step_ms, bound_ms, 1e-9)
        own = common_ms > 4 * own_ms  # on the common scale its bars would hardly show
        ax.set_ylim(0, 1.15 * (own_ms if own else common_ms))
        scale = ", own scale" if own else ""
        ax.set_title(f"{res.name}: cost per rank (max/mean {res.estimate.imbalance:.3f}{scale})")
        ax.set_ylabel("estimated ms per step")
        ax = axes[1][col]
        width = 0.85 / len(cluster.tiers)
        for i, tier in enumerate(cluster.tiers):
            values = [r.memory.get(tier.name, 0) / 1e9 for r in res.estimate.ranks]
            x = [rank + (i - (len(cluster.tiers) - 1) / 2) * width for rank in ranks]
            name = tier.name if tier in on_scale else f"{tier.name} (capacity {tier.capacity / 1e9:.1f} GB, off the scale)"
            bars = ax.bar(x, values, width=width, color=f"C{i}", label=name)
            if label_bars:
                ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7, padding=2)
            if tier in on_scale:
                ax.axhline(tier.capacity / 1e9, color=f"C{i}", linestyle=":", linewidth=1.2,
                           label=f"{tier.name} capacity {tier.capacity / 1e9:.1f} GB")  # fmt: skip
        ax.set_ylim(0, 1.15 * top_gb)
        ax.set_ylabel("GB per rank")
        ax.set_title("memory per rank and tier")
        for a in (axes[0][col], ax):  # ranks are whole numbers
            a.set_xlabel("rank")
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
    for row in axes:  # one legend per row (every plan's entries), right of the last plan's bars
        entries: dict[str, object] = {}
        for a in row:
            for handle, label in zip(*a.get_legend_handles_labels(), strict=True):
                entries.setdefault(label, handle)
        row[-1].legend(entries.values(), entries.keys(), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                       borderaxespad=0)  # fmt: skip
    fig.tight_layout()
    return fig
