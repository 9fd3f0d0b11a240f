"""Modulo hashing vs managed-collision tables of the same size on a stream whose vocabulary moves.

The stream is a run of "days". Each feature has a window of active ids per day; every day the window
moves on by `--shift` ids, so new ids arrive and old ones fade. Within a day ids follow a power law
over the window in a random order (popular ids are not the newest). A sample's click logit is the
sum of a fixed latent effect per (feature, id), hashed from the id, plus a small dense part: a model
does well only by memorising ids. Raw ids are 63-bit hashes.

Both models see the same samples in the same order and have tables of `--rows` rows per feature:
- modulo: id % rows (what the readers do without managed collision): distinct ids share rows;
- managed collision (lru, lfu): the id map gives every id its own row and evicts old ids.
Training covers every day; the last 20% of the last day is held out and scored (AUC). Reported:
held-out AUC, the teacher's AUC on the same samples (the ceiling), for modulo the share of the
last day's distinct ids that share a row with another id of that day, for managed collision the
map's inserts, evictions, ids left out of full buckets, and the held-out ids it does not hold.

    python benchmarks/managed_collision.py            # about a minute on one CPU thread
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import append_results, markdown_table  # noqa: E402
from neorec.data.batch import Batch  # noqa: E402
from neorec.data.synthetic import zipf_ranks  # noqa: E402
from neorec.embedding.fused import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, ManagedCollisionConfig, TableConfig  # noqa: E402
from neorec.metrics.auc import auc  # noqa: E402
from neorec.model.dlrm import DLRM  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402
from neorec.utils.hashing import splitmix64  # noqa: E402

NUM_DENSE, DIM = 4, 16
MASK63 = np.uint64((1 << 63) - 1)


def raw_id(feature: int, index: np.ndarray) -> np.ndarray:
    """The feature's index-th id as a raw 63-bit id."""
    with np.errstate(over="ignore"):
        return (splitmix64(index.astype(np.uint64) * np.uint64(64) + np.uint64(feature)) & MASK63).astype(np.int64)


def effect(feature: int, ids: np.ndarray) -> np.ndarray:
    """The latent effect of each id: uniform with mean 0 and variance 1, fixed per (feature, id)."""
    with np.errstate(over="ignore"):
        h = splitmix64(ids.astype(np.uint64) ^ np.uint64(0xA5A5A5A5 + feature))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (u * 2.0 - 1.0) * math.sqrt(3.0)


def make_day(day: int, args, rng: np.random.Generator):
    """(dense [n, d], raw ids [F, n], labels [n], true probabilities [n]) of one day."""
    n, window = args.samples_per_day, args.window
    ids = []
    for f in range(args.features):
        # popularity ranks -> places in the day's window, in a fixed random order per feature
        place = np.random.default_rng([f, 17]).permutation(window)
        ranks = zipf_ranks(rng, n, window, args.alpha)
        ids.append(raw_id(f, day * args.shift + place[ranks]))
    dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)
    logit = sum(effect(f, ids[f]) for f in range(args.features)) * args.scale / math.sqrt(args.features)
    logit = logit + dense[:, 0] * 0.3 - 1.0
    probs = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probs).astype(np.float32)
    return dense, np.stack(ids), labels, probs


def to_batch(dense, ids, labels, lo: int, hi: int, rows: int | None) -> Batch:
    part = ids[:, lo:hi]
    if rows is not None:
        part = part % rows
    values = torch.from_numpy(np.ascontiguousarray(part).reshape(-1))
    keys = [f"f{f}" for f in range(ids.shape[0])]
    sparse = SparseBatch(keys, values, torch.ones(values.numel(), dtype=torch.int64))
    return Batch(torch.from_numpy(dense[lo:hi]), sparse, torch.from_numpy(labels[lo:hi]))


def run(method: str, days: list, args) -> dict:
    mc = None if method == "modulo" else ManagedCollisionConfig(eviction=method.split()[-1], buckets=1)
    tables = [
        TableConfig(name=f"t{f}", rows=args.rows, dim=DIM, features=[f"f{f}"], managed_collision=mc)
        for f in range(args.features)
    ]
    emb = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1), seed=0)
    torch.manual_seed(0)
    model = DLRM(NUM_DENSE, emb, [16, DIM], [32], self_interaction=False)
    emb_opt = emb.build_optimizer()
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3)
    modulo = args.rows if mc is None else None
    start = time.perf_counter()
    samples = 0
    for d, (dense, ids, labels, _) in enumerate(days):
        end = len(labels) if d < len(days) - 1 else int(0.8 * len(labels))
        for lo in range(0, end, args.batch):
            batch = to_batch(dense, ids, labels, lo, min(lo + args.batch, end), modulo)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            emb_opt.step()
            samples += len(batch)
    seconds = time.perf_counter() - start
    dense, ids, labels, _ = days[-1]
    held = int(0.8 * len(labels))
    model.eval()
    before = {k: dict(v) for k, v in emb.id_map_stats().items()}
    with torch.no_grad():
        scores = torch.cat(
            [
                torch.sigmoid(model(to_batch(dense, ids, labels, lo, min(lo + 4096, len(labels)), modulo)))
                for lo in range(held, len(labels), 4096)
            ]
        )
    out = {"auc": auc(scores, torch.from_numpy(labels[held:])), "samples_per_s": samples / seconds}
    stats = emb.id_map_stats()
    if stats:
        out["inserts"] = sum(s["inserts"] for s in stats.values())
        out["evictions"] = sum(s["evictions"] for s in stats.values())
        out["dropped"] = sum(s["dropped"] for s in stats.values())
        out["eval_misses"] = sum(stats[t]["misses"] - before[t]["misses"] for t in stats) / ids[:, held:].size
    return out


def shared_row_share(ids: np.ndarray, rows: int) -> float:
    """Share of the distinct ids (per feature, one day) that share a row with another id under id % rows."""
    shared = total = 0
    for f in range(ids.shape[0]):
        distinct = np.unique(ids[f])
        _, counts = np.unique(distinct % rows, return_counts=True)
        shared += int(counts[counts > 1].sum())
        total += distinct.size
    return shared / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--days", type=int, default=6)
    p.add_argument("--samples-per-day", type=int, default=60_000)
    p.add_argument("--features", type=int, default=4)
    p.add_argument("--window", type=int, default=8192, help="active ids per feature and day")
    p.add_argument("--shift", type=int, default=4096, help="new ids per feature and day")
    p.add_argument("--rows", type=int, default=4096, help="rows per table (both methods)")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of id popularity within a day")
    p.add_argument("--scale", type=float, default=2.5, help="std of the id part of the logit")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: no spinning barriers on a shared machine)")
    p.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    days = [make_day(d, args, rng) for d in range(args.days)]
    dense, ids, labels, probs = days[-1]
    held = int(0.8 * len(labels))
    teacher = auc(torch.from_numpy(probs[held:]), torch.from_numpy(labels[held:]))
    distinct = np.mean([np.unique(ids[f]).size for f in range(args.features)])
    rows = []
    for method in ("modulo", "managed collision lru", "managed collision lfu"):
        r = run(method, days, args)
        if method == "modulo":
            extra = [f"{shared_row_share(ids, args.rows):.1%} of the day's ids share a row", "-", "-", "-", "-"]
        else:
            extra = ["0 (one row per id)", f"{r['inserts']:,}", f"{r['evictions']:,}", f"{r['dropped']:,}",
                     f"{r['eval_misses']:.1%}"]  # fmt: skip
        rows.append([method, f"{r['auc']:.4f}", *extra, f"{r['samples_per_s']:,.0f}"])
        print(rows[-1], flush=True)
    header = ["tables", "held-out AUC", "collisions (last day)", "inserts", "evictions", "ids left out",
              "held-out ids not in the map", "train samples/s"]  # fmt: skip
    table = markdown_table(header, rows)
    notes = (
        f"Stream: {args.days} days of {args.samples_per_day:,} samples, {args.features} one-hot features; each day "
        f"{args.window:,} active ids per feature, {args.shift:,} of them new (about {distinct:,.0f} distinct ids per "
        f"feature on the last day), Zipf({args.alpha}) popularity; labels from a fixed effect per id "
        f"(logit std {args.scale}). Tables: {args.rows:,} rows x {DIM} per feature for every method; DLRM, "
        f"rowwise adagrad 0.1 on the rows, adam 1e-3 on the MLPs, batch {args.batch}; trained on every day but the "
        f"last 20% of the last day, which is held out. Teacher AUC on the held-out samples: {teacher:.4f}. "
        "`ids left out`: new ids of a batch beyond its bucket's free and evictable rows (their bags skip them). "
        f"Throughput was measured on a machine shared with other jobs (load average {os.getloadavg()[0]:.1f} at "
        f"the end, {torch.get_num_threads()} torch thread(s)): compare it between rows of one run only."
    )
    print(table)
    print(notes)
    if not args.no_record:
        append_results("Managed-collision tables vs modulo hashing on a moving vocabulary", table, notes)


if __name__ == "__main__":
    main()
