"""`neorec data inspect`: what a config's data looks like (features, table sizes, id statistics)."""

from __future__ import annotations

import itertools

import torch

from neorec.config.load import load_config
from neorec.train.build import build_source

MIN_LOOKUPS_PER_TOP_ROW = 10  # sampled lookups per row of a table's top 1% for its share to mean skew


def inspect_source(config: str, overrides: list[str], num_batches: int = 4) -> str:
    cfg = load_config(config, overrides)
    source = build_source(cfg, wait=False)
    info = source.info
    batches = list(itertools.islice(source.train_batches(cfg.data.batch_size, 0), num_batches))
    lines = [f"source: {cfg.data.source}   dense features: {info.num_dense}   categorical features: {len(info.features)}"]
    if info.num_train_samples:
        lines.append(f"training samples per epoch: {info.num_train_samples:,}")
    if batches:
        labels = torch.cat([b.labels for b in batches])
        dense = torch.cat([b.dense for b in batches])
        if labels.dim() == 1:
            lines.append(f"sampled {len(labels):,} training samples: CTR {float(labels.mean()):.4f}")
        else:  # one column per task, in the order of model.tasks
            rates = " ".join(f"{t.name} {float(r):.4f}" for t, r in zip(cfg.model.tasks, labels.mean(0), strict=True))
            lines.append(f"sampled {len(labels):,} training samples: positive rate {rates}")
        lines.append("dense mean " + " ".join(f"{x:.2f}" for x in dense.mean(0).tolist()))
    w = max([10] + [len(f.name) for f in info.features])  # the feature column fits the longest name
    header = f"{'feature':<{w}} {'ids (rows)':>12} {'ids/sample':>10} {'distinct':>9} {'top1% share':>11}"
    lines += ["", header, "-" * len(header)]
    too_few = []
    for f in info.features:
        if batches:
            parts = [b.sparse.feature(f.name) for b in batches]
            values = torch.cat([p[0] for p in parts])
            per_sample = values.numel() / sum(p[1].numel() for p in parts)
            _, counts = torch.unique(values, return_counts=True)
            top = counts.sort(descending=True).values
            k = max(1, int(0.01 * f.num_ids))
            if values.numel() >= MIN_LOOKUPS_PER_TOP_ROW * k:
                share = f"{float(top[:k].sum()) / values.numel():>11.3f}"
            else:  # the sample's k most frequent ids would hold most of it whatever the skew
                share, _ = f"{'-':>11}", too_few.append(f.name)
            lines.append(f"{f.name:<{w}} {f.num_ids:>12,} {per_sample:>10.2f} {counts.numel():>9,} {share}")
        else:
            lines.append(f"{f.name:<{w}} {f.num_ids:>12,}")
    if too_few:
        lines.append(
            f"top1% share: the share of the sampled lookups on the table's most frequent 1% of rows; '-' for "
            f"{len(too_few)} table(s) with fewer than {MIN_LOOKUPS_PER_TOP_ROW} sampled lookups per such row "
            "(more with --batches)"
        )
    if hasattr(source, "teacher_auc"):
        auc = source.teacher_auc()
        if auc is not None:
            lines += ["", f"teacher AUC on the held-out set (the ceiling): {auc:.4f}"]
    lines += _skipped_lines(source)
    return "\n".join(lines)


def _skipped_lines(source) -> list[str]:
    """The malformed lines skipped, saying which: those of the whole data set when it was preprocessed
    (training and held-out lines, by reason), or those met in the lines of raw files read for the sample."""
    at_preprocessing = source.info.notes.get("skipped")
    if isinstance(at_preprocessing, dict):
        if not any(at_preprocessing.values()):
            return []
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(at_preprocessing.items()))
        return [f"malformed lines skipped when the data was preprocessed (every split): {reasons}"]
    skipped = getattr(source, "num_skipped", None)
    if not skipped:
        return []
    return [f"malformed lines skipped in the training lines read (not the whole data): {skipped:,}"]
