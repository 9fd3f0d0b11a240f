"""Held-out figures of the model architectures on MovieLens latest-small (per-user time split).

    python benchmarks/models.py                        # every model, seeds 0 1 2
    python benchmarks/models.py --models deepfm two_tower --seeds 0

Ranking models (one budget: the shipped `movielens` config's data, embeddings, MLP sizes, optimizers
and 2 epochs): DCNv2 (`movielens`), DLRM (the same config with model.arch=dlrm), DeepFM
(`movielens_deepfm`) and the multi-task heads (`movielens_multitask`: like, love, ok), each trained
once per seed; held-out AUC (per task for the multi-task model). Retrieval: `movielens_two_tower`,
recall@10 and recall@100 of the held-out liked ratings among all movies (each user's training movies
left out of its ranking; `two_tower_all`: every movie ranked), next to ranking every movie by its
count of training ratings (popularity, no training).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import append_results, markdown_table  # noqa: E402

from neorec.config.load import load_config  # noqa: E402
from neorec.data.movielens import MovieLensSource  # noqa: E402
from neorec.model.two_tower import RECALL_AT, SeenItems, recall_at  # noqa: E402
from neorec.train.trainer import Trainer  # noqa: E402

# name -> (shipped config, extra overrides, metrics reported)
MODELS = {
    "dcnv2": ("movielens", [], ["auc"]),
    "dlrm": ("movielens", ["model.arch=dlrm"], ["auc"]),
    "deepfm": ("movielens_deepfm", [], ["auc"]),
    "multitask": ("movielens_multitask", [], ["like/auc", "love/auc", "ok/auc"]),
    "two_tower": ("movielens_two_tower", [], [f"recall@{k}" for k in RECALL_AT]),
    "two_tower_all": ("movielens_two_tower", ["model.two_tower.exclude_seen=false"], [f"recall@{k}" for k in RECALL_AT]),
}


def popularity_recall(src: MovieLensSource, exclude_seen: bool) -> dict[str, float]:
    """recall@K of ranking every movie by its number of training ratings, for the held-out liked rows
    (with exclude_seen, each user's training movies left out of its ranking, as for the model)."""
    counts = torch.bincount(src.movie[src.train_index], minlength=len(src.movie_ids)).float()
    liked = src.val_index[src.labels[src.val_index] > 0.5]
    seen = SeenItems(src, "user", "movie", len(src.user_ids)) if exclude_seen else None
    hits = dict.fromkeys(RECALL_AT, 0)
    for rows in liked.split(1024):
        scores, targets = counts.expand(len(rows), -1), src.movie[rows]
        if seen is not None:
            scores = seen.mask(scores, src.user[rows], targets)
        for k, n in recall_at(scores, targets, RECALL_AT).items():
            hits[k] += n
    return {f"recall@{k}": hits[k] / len(liked) for k in RECALL_AT}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=str(Path(__file__).parents[2] / "shared" / "data" / "ml-latest-small"))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", default="runs/bench-models")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()

    rows = []
    for name in args.models:
        config, extra, metrics = MODELS[name]
        values: dict[str, list[float]] = {m: [] for m in metrics}
        seconds = []
        for seed in args.seeds:
            sets = [f"data.movielens.root={args.root}", f"seed={seed}", "train.progress=false",
                    "logging.plot=false", "logging.tensorboard=false", *extra]  # fmt: skip
            result = Trainer(load_config(config, sets), Path(args.out) / f"{name}-{seed}").fit()
            seconds.append(result.train_seconds)
            for m in metrics:
                values[m].append(result.eval[m])
            print(f"{name} seed {seed}: " + ", ".join(f"{m} {values[m][-1]:.4f}" for m in metrics), flush=True)
        for m in metrics:
            seeds = " / ".join(f"{v:.4f}" for v in values[m])
            rows.append([name, f"`{config}`" + (f" {' '.join(extra)}" if extra else ""), m,
                         f"{sum(values[m]) / len(values[m]):.4f}", seeds, f"{sum(seconds) / len(seconds):.0f}"])  # fmt: skip
        if name.startswith("two_tower"):
            src = MovieLensSource(args.root, split="user_time", val_fraction=0.2)
            exclude = name == "two_tower"
            for m, v in popularity_recall(src, exclude).items():
                rows.append([f"popularity (no training){'' if exclude else ', all items'}", "-", m, f"{v:.4f}", "-", "-"])
    table = markdown_table(["model", "config", "held-out metric", "mean", "per seed", "train s"], rows)
    print(table)
    if not args.no_append:
        notes = ("MovieLens latest-small, per-user time split (each user's last 20% of ratings held out). "
                 "AUC: label rating >= 4 (like), love: >= 4.5, ok: >= 3. recall@K: share of held-out ratings "
                 ">= 4 whose movie is among the user's K best-scored of all movies, the movies the user rated "
                 "in training left out of its ranking (all items: every movie ranked). Ranking rows share one budget (2 epochs, batch 256, dim 32, bottom MLP [32, 32], "
                 "top MLP [64, 32]); two-tower: batch 1024, 2 epochs. Train seconds on a shared machine.")  # fmt: skip
        append_results("MovieLens latest-small: DLRM, DCNv2, DeepFM, multi-task heads, two-tower", table, notes)


if __name__ == "__main__":
    main()
