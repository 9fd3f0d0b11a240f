"""What the id check (embedding.bounds_check, neorec/sparse/bounds.py) costs a training step.

    python benchmarks/bounds_check.py                              # criteo_kaggle and mlperf_dcnv2, CPU
    python benchmarks/bounds_check.py --configs criteo_kaggle --rounds 9 --no-record
    python benchmarks/bounds_check.py --device cuda                # on a GPU (data in GPU memory)

One process trains one model of each config (the fused engine, the config's optimizers) on batches
drawn before timing, in interleaved rounds: each round trains `--steps` steps with the check on
(error, each batch's ids scanned: its limits are not known ahead, as for a reader that does not
count them), `--steps` with the check on where the batch's limits are known (the synthetic
generator's, or a GPU feed's, counted on the host: the check reads nothing), and `--steps` with the
check off, in an order that rotates from round to round, so the machine's drift hits every variant
alike. The table gives each variant's median over rounds of its mean step time, its ratio to off,
and the scan alone (the check of one batch, timed apart). Appends to RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import append_results, markdown_table  # noqa: E402

VARIANTS = ("off", "error, ids scanned", "error, limits known")


def without_limits(batch):
    """The batch with its id limits forgotten, as a reader that does not count them makes it."""
    from neorec.data.batch import Batch
    from neorec.sparse import SparseBatch

    s = batch.sparse
    sparse = SparseBatch(s.keys, s.values, s.lengths, s.weights, s.length_per_key())
    return Batch(batch.dense, sparse, batch.labels)


def build(config: str, batch_size: int, steps: int, device: str, sets: list[str]):
    from neorec.config.load import load_config
    from neorec.train.build import (
        build_dense_optimizer,
        build_model,
        build_source,
        build_tables,
        dense_parameters,
    )
    from neorec.train.embeddings import build_embeddings

    overrides = [f"data.batch_size={batch_size}", "train.progress=false", f"train.device={device}"]
    if load_config(config, [*overrides, *sets]).data.source == "synthetic":  # samples for every step
        overrides.append(f"data.synthetic.train_samples={batch_size * steps}")
    cfg = load_config(config, [*overrides, *sets])
    source = build_source(cfg, device_of_rank=torch.device(device))
    tables = build_tables(cfg, source.info)
    emb = build_embeddings(cfg, tables, device=device)
    model = build_model(cfg, source.info, emb, source).to(device)
    dense_opt = build_dense_optimizer(cfg.train.dense_optimizer, dense_parameters(model))
    emb_opt = emb.build_optimizer()
    batches = []
    for b in source.train_batches(batch_size, 0):
        batches.append(b.to(device))
        if len(batches) == steps:
            break
    return model, emb, dense_opt, emb_opt, batches


def run(model, dense_opt, emb_opt, batches, device: str) -> float:
    """Mean ms per training step over `batches`."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        emb_opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / len(batches)


def scan_us(emb, batches, repeats: int = 20) -> float:
    """Microseconds to check one batch whose limits are not known (the scan and the comparison)."""
    times = []
    for _ in range(repeats):
        for b in batches:
            fresh = without_limits(b).sparse
            start = time.perf_counter()
            emb.bounds.check(fresh)
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(config: str, args) -> list[list[object]]:
    model, emb, dense_opt, emb_opt, batches = build(
        config, args.batch_size, args.steps, args.device, args.set or []
    )
    scanned = [without_limits(b) for b in batches]  # made fresh per round: the limits are cached on a batch
    run(model, dense_opt, emb_opt, batches[: min(5, len(batches))], args.device)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for variant in order:
            emb.bounds.mode = "off" if variant == "off" else "error"
            data = [without_limits(b) for b in scanned] if variant == "error, ids scanned" else batches
            times[variant].append(run(model, dense_opt, emb_opt, data, args.device))
    emb.bounds.mode = "error"
    off = statistics.median(times["off"])
    rows = []
    for v in VARIANTS:
        ms = statistics.median(times[v])
        rows.append([config, v, f"{ms:.2f}", f"{ms / off:.3f}", f"{min(times[v]):.2f}-{max(times[v]):.2f}"])
    rows.append(
        [config, "the check alone (one batch, scanned)", f"{scan_us(emb, batches[:10]) / 1000:.3f}", "", ""]
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="criteo_kaggle,mlperf_dcnv2", help="comma-separated shipped configs")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--set", action="append", help="config override for every config (key=value)")
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args()
    rows = []
    for config in args.configs.split(","):
        rows += measure(config, args)
        print(markdown_table(["config", "variant", "ms per step (median)", "x off", "range over rounds"], rows[-4:]),
              flush=True)  # fmt: skip
    table = markdown_table(["config", "variant", "ms per step (median)", "x off", "range over rounds"], rows)
    print(table)
    if not args.no_record:
        notes = (f"Batch {args.batch_size}, {args.steps} steps per variant per round, {args.rounds} rounds, "
                 f"{args.device}. 'ids scanned': each batch's smallest and largest id per feature computed "
                 "and compared with its table; 'limits known': given by the generator, compared on the host.")  # fmt: skip
        append_results("The id check's cost per training step", table, notes)


if __name__ == "__main__":
    main()
