"""Training and validation curves of a run as one PNG."""

from __future__ import annotations

from pathlib import Path


def plot_curves(records: list[dict], out_path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (running)")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["log_loss"] for r in evals], "o-", label="validation log loss")
        ax_auc.plot([r["step"] for r in evals], [r["auc"] for r in evals], "o-", color="C2", label="validation AUC")
    ceiling = next((r.get("teacher_auc") for r in evals if r.get("teacher_auc")), None)
    if ceiling:
        ax_auc.axhline(ceiling, color="grey", linestyle="--", label=f"teacher ceiling {ceiling:.4f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("log loss")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
