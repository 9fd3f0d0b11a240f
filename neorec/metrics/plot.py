"""Training and validation curves of a run as one PNG (curves.png), from its metrics.jsonl records.

Panels: log loss (training: the mean over each log interval; validation) and validation AUC, over the
run's steps, with epoch boundaries marked. A panel whose metric has no finite value (an AUC on one-class data)
is left out, and a run with too few points for a curve says so in the picture.
"""

from __future__ import annotations

import math
from pathlib import Path

from neorec.utils.files import write_atomic


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


def plot_curves(records: list[dict], out_path: Path, title: str = "") -> Path:
    """Write curves.png of a run's metrics records; title: the run's name (its folder's)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = curves_figure(records, title)
    write_atomic(out_path, lambda f: fig.savefig(f, format="png", dpi=100), "training curves")
    plt.close(fig)
    return out_path


def curves_figure(records: list[dict], title: str = ""):
    """The matplotlib figure of plot_curves."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    loss = _points(train, "loss")
    val_loss = _points(evals, "log_loss")
    val_auc = _points(evals, "auc")
    ceiling = next((v for v in _points(evals, "teacher_auc")[1]), None)
    last_step = max((int(r["step"]) for r in records), default=0)

    panels = []
    if loss[0] or val_loss[0]:
        panels.append("loss")
    if val_auc[0]:
        panels.append("auc")
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4), squeeze=False)
    axes = list(axes[0])
    for name, ax in zip(panels, axes, strict=False):
        if name == "loss":
            if loss[0]:
                style = ".-" if len(loss[0]) < 20 else "-"
                ax.plot(*loss, style, label="train loss (mean over each log interval)")
            if val_loss[0]:
                ax.plot(*val_loss, "o-", label="validation log loss")
            ax.set_ylabel("log loss")
        else:
            ax.plot(*val_auc, "o-", color="C2", label="validation AUC")
            if ceiling is not None:
                ax.axhline(ceiling, color="grey", linestyle="--", label=f"teacher ceiling {ceiling:.4f}")
            ax.set_ylabel("AUC")
    for ax in axes:
        right = max(last_step, 1)
        ax.set_xlim(-0.02 * right, 1.02 * right)  # the run's steps, from its start
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ends = epoch_ends(records)
    for ax in axes[: len(panels)]:
        for i, step in enumerate(ends):
            ax.axvline(step, color="black", linestyle=":", linewidth=1, label="epoch boundary" if i == 0 else None)
        ax.legend(fontsize=8)
    note = _too_short(len(loss[0]), max(len(val_loss[0]), len(val_auc[0])))
    if not panels:
        note = "no finite training loss or validation metric was logged"
    fig.suptitle(title)
    if note:  # under the title, clear of the points
        fig.text(0.5, 0.87, note, ha="center", va="top", fontsize=10, color="darkred",
                 bbox={"facecolor": "lightyellow", "edgecolor": "grey"})  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.82) if note else None)
    return fig


def _too_short(train_points: int, eval_points: int) -> str | None:
    """The note for a run with no curve to draw: fewer than two points of either kind."""
    if train_points >= 2 or eval_points >= 2:
        return None
    return (
        f"Run too short for a curve: {train_points} training point(s), {eval_points} evaluation(s). "
        "Train longer, or lower train.log_every / train.eval_every."
    )
