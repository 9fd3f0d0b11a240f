"""Held-out AUC on MovieLens latest-small: the shipped configs against simple baselines, per split.

    python benchmarks/movielens.py                         # user_time split, seeds 0 1 2, every model
    python benchmarks/movielens.py --splits user_time random --seeds 0 --models movielens

Baselines need no training: a rating is scored by its user's smoothed rate of ratings >= 4 in the
training set, its movie's, or both combined (the sum of the two log-odds over the global rate's:
naive Bayes with two features). Smoothing: (positives + s * p) / (count + s), p the global rate.
The models, each trained once per seed on the same split with the same batch size and epochs (the
sequential config takes them from `movielens`, its base; the random split is drawn by the seed, so
there each seed has a split of its own, and its baselines are scored on it):
- `movielens`: the shipped DCNv2 config (neorec/configs/movielens.yaml);
- `movielens_seq`: the shipped DIN config (neorec/configs/movielens_seq.yaml), target attention over
  each rating's history of the user's earlier ratings (all of them, held-out ones included);
- `movielens_seq_train_histories`: the same with `data.movielens.history_from=train`, histories
  made of training ratings only, so a held-out rating's history stops at the split.
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
from neorec.metrics.auc import auc  # noqa: E402
from neorec.train.trainer import Trainer  # noqa: E402


def smoothed_rate(ids: torch.Tensor, labels: torch.Tensor, n: int, prior: float, strength: float) -> torch.Tensor:
    pos = torch.zeros(n, dtype=torch.float64).index_add_(0, ids, labels.double())
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, ids, torch.ones_like(labels, dtype=torch.float64))
    return (pos + strength * prior) / (count + strength)


def baselines(src: MovieLensSource, strength: float) -> dict[str, float]:
    tr, va = src.train_index, src.val_index
    y = src.labels
    prior = float(y[tr].mean())
    users = smoothed_rate(src.user[tr], y[tr], int(src.user.max()) + 1, prior, strength)[src.user[va]]
    movies = smoothed_rate(src.movie[tr], y[tr], len(src.movie_ids), prior, strength)[src.movie[va]]

    def logit(p):
        return torch.log(p) - torch.log1p(-p)

    both = logit(users) + logit(movies) - logit(torch.tensor(prior, dtype=torch.float64))
    return {name: auc(score.float(), y[va]) for name, score in
            (("per-user rate", users), ("per-movie rate", movies), ("per-user + per-movie", both))}  # fmt: skip


MODELS = {  # name -> (shipped config, --set overrides, table label)
    "movielens": ("movielens", [], "shipped `movielens` config (DCNv2)"),
    "movielens_seq": ("movielens_seq", [], "shipped `movielens_seq` config (DIN)"),
    "movielens_seq_train_histories": (
        "movielens_seq", ["data.movielens.history_from=train"], "`movielens_seq`, histories from training ratings only"
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=str(Path(__file__).parents[2] / "shared" / "data" / "ml-latest-small"))
    p.add_argument("--splits", nargs="+", default=["user_time"], choices=["user_time", "global_time", "random"])
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--strength", type=float, default=10.0, help="smoothing: pseudo-ratings at the global rate")
    p.add_argument("--out", default="runs/bench-movielens")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()

    rows = []
    for split in args.splits:
        # the random split is drawn by the run's seed: each seed's baselines on its own split
        split_seeds = args.seeds if split == "random" else [0]
        scores = [baselines(MovieLensSource(args.root, seed=s, val_fraction=args.val_fraction, split=split),
                            args.strength) for s in split_seeds]  # fmt: skip
        for name in scores[0]:
            values = [b[name] for b in scores]
            per_seed = " / ".join(f"{v:.4f}" for v in values) if len(values) > 1 else "-"
            shown = f"{min(values):.4f} - {max(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"
            rows.append([split, name, shown, per_seed])
        for model in args.models:
            config, extra, label = MODELS[model]
            aucs = []
            for seed in args.seeds:
                sets = [f"data.movielens.root={args.root}", f"data.movielens.split={split}",
                        f"data.movielens.val_fraction={args.val_fraction}", f"seed={seed}", "train.progress=false",
                        "logging.plot=false", "logging.tensorboard=false", *extra]  # fmt: skip
                result = Trainer(load_config(config, sets), Path(args.out) / f"{model}-{split}-{seed}").fit()
                aucs.append(result.eval["auc"])
                print(f"{model} {split} seed {seed}: AUC {aucs[-1]:.4f}", flush=True)
            seeds = " / ".join(f"{a:.4f}" for a in aucs)
            rows.append([split, label, f"{min(aucs):.4f} - {max(aucs):.4f}", seeds])
    table = markdown_table(["split", "model", "held-out AUC", "per seed"], rows)
    print(table)
    if not args.no_append:
        notes = (f"{args.val_fraction:.0%} held out; label = rating >= 4; baselines smoothed with "
                 f"{args.strength:g} pseudo-ratings at the global rate. Every model: batch size 256, 2 epochs "
                 "(the `movielens` config's). The machine is shared with other jobs: AUCs do not depend "
                 "on it, times would.")  # fmt: skip
        append_results("MovieLens latest-small: held-out AUC by split", table, notes)


if __name__ == "__main__":
    main()
