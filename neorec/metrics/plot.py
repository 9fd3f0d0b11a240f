"""Training and validation curves of a run as one PNG (curves.png), from its metrics.jsonl records.

Panels, over the run's steps:
- the loss: training (the mean over each log interval) and the held-out value of the same objective:
  log loss; for multi-task heads the weighted sum of the tasks' log losses (`weighted_log_loss`); a
  two-tower model's in-batch softmax has no held-out counterpart (its evaluation is recall@K);
- validation AUC (per task for multi-task heads, with the teacher's AUC as a ceiling on synthetic
  data), or recall@K for a two-tower model;
- multi-task heads: each task's validation log loss;
- a followed stream (`--follow`): the progressive metrics of each partition (AUC, log loss, NE and
  calibration, at the step it ended) and of the sliding window (AUC, log loss).
Epoch ends and partition ends are marked, and so is the step whose loss was not finite (a "diverged"
record). A panel whose values span more than 100x (an exploding loss) has a log scale. A metric that
was logged but never finite (an AUC on one-class data) is named in a note instead of drawn, and a run
with too few points for a curve says so in the picture.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from neorec.utils.files import write_atomic

LOG_SCALE_SPAN = 100.0  # a panel whose finite values span more than this factor gets a log y scale
NAMED_PARTITIONS = 12  # partition ends are named in the first panel up to this many partitions


@dataclass
class Line:
    """One curve of a panel: its legend label, (steps, values) and matplotlib format and keywords."""

    label: str
    steps: list[int]
    values: list[float]
    fmt: str = "o-"
    style: dict = field(default_factory=dict)


@dataclass
class Panel:
    ylabel: str
    lines: list[Line]
    ceiling: float | None = None  # the teacher's AUC, a dashed horizontal line
    ceiling_label: str = "teacher ceiling"
    reference: float | None = None  # a thin horizontal line (1: a calibrated model, NE of the base rate)


def _points(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records whose `key` is a finite number (metrics.jsonl writes NaN as null)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def epoch_ends(records: list[dict]) -> list[int]:
    """Steps at which an epoch other than the last ended (the trainer's "epoch_end" records)."""
    return sorted({int(r["step"]) for r in records if r.get("split") == "epoch_end"})


def model_kind(records: list[dict], arch: str | None = None) -> str:
    """What the run trains: "retrieval" (two-tower: softmax loss, recall@K), "multitask" (weighted
    per-task BCE) or "binary" (one BCE); from `arch` (model.arch) when given, else from the keys of
    the evaluation records."""
    if arch is not None:
        return {"two_tower": "retrieval", "multitask": "multitask"}.get(arch, "binary")
    keys = {k for r in records if r.get("split") == "eval" for k in r}
    if any(k.startswith("recall@") for k in keys) and "auc" not in keys:
        return "retrieval"
    return "multitask" if "weighted_log_loss" in keys else "binary"


def plot_curves(records: list[dict], out_path: Path, title: str = "", arch: str | None = None) -> Path:
    """Write curves.png of a run's metrics records; title: the run's name (its folder's); arch: the
    run's model.arch (names the loss before the first evaluation; else read from the records)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = curves_figure(records, title, arch)
    write_atomic(out_path, lambda f: fig.savefig(f, format="png", dpi=100), "training curves")
    plt.close(fig)
    return out_path


def _split(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("split") == name]


def build_panels(records: list[dict], arch: str | None = None) -> tuple[list[Panel], list[str]]:
    """The panels of a run's records, and the labels of the metrics logged but never finite."""
    train, evals = _split(records, "train"), _split(records, "eval")
    parts, window = _split(records, "partition"), _split(records, "progressive")
    kind = model_kind(records, arch)
    never_finite: list[str] = []

    def line(rows: list[dict], key: str, label: str, fmt: str = "o-", **style) -> Line | None:
        """The line of `key` in `rows`; None, and the label noted, when it has no finite value."""
        steps, values = _points(rows, key)
        if steps:  # a plain line shows its points while they are few
            return Line(label, steps, values, ".-" if fmt == "-" and len(steps) < 20 else fmt, style)
        if any(key in r for r in rows):
            never_finite.append(label)
        return None

    def panel(ylabel: str, *lines: Line | None, **kw) -> Panel | None:
        drawn = [x for x in lines if x is not None]
        return Panel(ylabel, drawn, **kw) if drawn else None

    loss_name = {"binary": "log loss", "multitask": "weighted log loss (sum over tasks)",
                 "retrieval": "in-batch softmax CE (logQ-corrected)"}[kind]  # fmt: skip
    panels = [panel(
        loss_name,
        line(train, "loss", "train loss (mean over each log interval)", "-", color="C0"),
        line(evals, "weighted_log_loss", "validation weighted log loss", color="C1") if kind == "multitask"
        else line(evals, "log_loss", "validation log loss", color="C1"),
        line(window, "log_loss", "progressive log loss (sliding window)", "-", color="C4", linewidth=1),
        line(parts, "log_loss", "progressive log loss per partition", "s-", color="C3"),
    )]  # fmt: skip
    ceiling = next(iter(_points(evals, "teacher_auc")[1]), None)
    if kind == "retrieval":
        ks = sorted({k for r in evals for k in r if k.startswith("recall@")}, key=lambda k: int(k[7:]))
        panels.append(panel("recall@K", *(line(evals, k, f"validation {k}") for k in ks)))
    elif kind == "multitask":
        tasks = [k[:-4] for k in dict.fromkeys(k for r in evals for k in r) if k.endswith("/auc")]
        first = tasks[0] if tasks else "click"  # the teacher's AUC: of the primary task, click
        panels.append(panel("AUC", *(line(evals, f"{t}/auc", f"validation AUC: {t}") for t in tasks),
                            ceiling=ceiling, ceiling_label=f"teacher ceiling of {first}"))  # fmt: skip
        panels.append(panel("log loss per task",
                            *(line(evals, f"{t}/log_loss", f"validation log loss: {t}") for t in tasks)))
    else:
        panels.append(panel(
            "AUC",
            line(evals, "auc", "validation AUC", color="C2"),
            line(window, "auc", "progressive AUC (sliding window)", "-", color="C4", linewidth=1),
            line(parts, "auc", "progressive AUC per partition", "s-", color="C3"),
            line(parts, "held_out_auc", "held-out batches' AUC per partition", "^-", color="C5"),
            ceiling=ceiling,
        ))  # fmt: skip
    if parts:
        panels.append(panel(
            "NE, calibration (progressive)",
            line(parts, "ne", "progressive NE per partition", "s-", color="C3"),
            line(parts, "calibration", "calibration per partition (predicted / observed)", "D-", color="C6"),
            reference=1.0,
        ))  # fmt: skip
    return [p for p in panels if p is not None], never_finite


def curves_figure(records: list[dict], title: str = "", arch: str | None = None):
    """The matplotlib figure of plot_curves."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels, never_finite = build_panels(records, arch)
    last_step = max((int(r["step"]) for r in records), default=0)
    width = 5.5 if len(panels) <= 2 else 5.0
    entries = max((len(p.lines) + (p.ceiling is not None) for p in panels), default=0) + _num_marks(records)
    height = 4 + 0.17 * entries  # the legends under the panels
    columns = max(len(panels), 1)
    fig, axes = plt.subplots(1, columns, figsize=(width * columns, height), squeeze=False)
    axes = list(axes[0])
    for panel, ax in zip(panels, axes, strict=False):
        for x in panel.lines:
            ax.plot(x.steps, x.values, x.fmt, label=x.label, **x.style)
        if panel.ceiling is not None:
            label = f"{panel.ceiling_label} {panel.ceiling:.4f}"
            ax.axhline(panel.ceiling, color="grey", linestyle="--", label=label)
        if panel.reference is not None:
            ax.axhline(panel.reference, color="grey", linewidth=0.8, alpha=0.6)
        ax.set_ylabel(panel.ylabel)
        values = [v for x in panel.lines for v in x.values]
        if min(values) > 0 and max(values) > LOG_SCALE_SPAN * min(values):
            ax.set_yscale("log")  # an exploding loss would flatten the rest of the curve
    for ax in axes:
        right = max(last_step, 1)
        ax.set_xlim(-0.02 * right, 1.02 * right)  # the run's steps, from its start
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _mark_steps(records, axes)
    lines = [x for p in panels for x in p.lines]
    train_points = next((len(x.steps) for x in lines if x.label.startswith("train")), 0)
    other_points = max((len(x.steps) for x in lines if not x.label.startswith("train")), default=0)
    diverged = _diverged_steps(records)
    notes = []
    if not panels:
        notes.append("no finite training loss or validation metric was logged")
    elif not diverged and (short := _too_short(train_points, other_points)):
        notes.append(short)
    if never_finite:
        hint = " (an AUC needs both classes in its data)" if any("AUC" in n for n in never_finite) else ""
        notes.append(f"Not drawn, never finite: {', '.join(never_finite)}{hint}")
    notes += [f"Training stopped: the loss was not finite at step {s}" for s in diverged]
    fig.suptitle(title)
    top = 1.0
    if notes:  # under the title, clear of the points; about 13 characters an inch at this size
        fig_w, fig_h = fig.get_size_inches()
        wrapped = [part for note in notes for part in textwrap.wrap(note, int(13 * fig_w) - 4)]
        fig.text(0.5, 1 - 0.45 / fig_h, "\n".join(wrapped), ha="center", va="top", fontsize=10,
                 color="darkred", bbox={"facecolor": "lightyellow", "edgecolor": "grey"})  # fmt: skip
        top = 1 - (0.6 + 0.19 * len(wrapped)) / fig_h
    fig.tight_layout(rect=(0, 0, 1, top) if notes else None)
    return fig


def _diverged_steps(records: list[dict]) -> list[int]:
    """Steps whose training loss was not finite (the trainer's "diverged" records)."""
    return sorted({int(r["step"]) for r in records if r.get("split") == "diverged"})


def _num_marks(records: list[dict]) -> int:
    """Legend entries of the step marks: epoch end, partition end, one per non-finite loss."""
    return sum(any(r.get("split") == k for r in records) for k in ("epoch_end", "partition")) + len(
        _diverged_steps(records)
    )


def _mark_steps(records: list[dict], axes: list) -> None:
    """Vertical lines at epoch ends, partition ends (named in the first panel when few) and steps
    whose loss was not finite; then each panel's legend."""
    from matplotlib.transforms import ScaledTranslation, blended_transform_factory

    parts = [(int(r["step"]), str(r.get("partition", ""))) for r in _split(records, "partition")]
    for ax in axes:
        for i, step in enumerate(epoch_ends(records)):
            label = "epoch boundary" if i == 0 else None
            ax.axvline(step, color="black", linestyle=":", linewidth=1, label=label)
        for i, (step, _) in enumerate(parts):
            ax.axvline(step, color="tab:purple", linestyle="-.", linewidth=0.8, alpha=0.7,
                       label="partition end" if i == 0 else None)  # fmt: skip
        for step in _diverged_steps(records):
            ax.axvline(step, color="red", linewidth=1.5, label=f"loss not finite at step {step}")
        if ax.get_legend_handles_labels()[1]:  # under the panel and its x label, clear of the curves
            below = ax.transAxes + ScaledTranslation(0, -0.45, ax.figure.dpi_scale_trans)
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below,
                      frameon=False)  # fmt: skip
    if axes and len(parts) <= NAMED_PARTITIONS:
        at_top = blended_transform_factory(axes[0].transData, axes[0].transAxes)
        for step, name in parts:
            axes[0].text(step, 0.98, name, transform=at_top, rotation=90, ha="right", va="top", fontsize=7,
                         color="tab:purple")  # fmt: skip


def _too_short(train_points: int, eval_points: int) -> str | None:
    """The note for a run with no curve to draw: fewer than two points of either kind."""
    if train_points >= 2 or eval_points >= 2:
        return None
    return (
        f"Run too short for a curve: {train_points} training point(s), {eval_points} evaluation(s). "
        "Train longer, or lower train.log_every / train.eval_every."
    )
