"""neorec against TorchRec, end to end: the same DLRM shapes trained on the same pre-built batches.

    python benchmarks/vs_torchrec.py --preset kaggle_sgd
    python benchmarks/vs_torchrec.py --preset mlperf_multihot --repeats 3 --steps 100
    python benchmarks/vs_torchrec.py --preset kaggle_rowwise_adagrad --torchrec-python /path/to/venv/bin/python
    python benchmarks/vs_torchrec.py --preset kaggle_sgd --compile    # neorec eager and with train.compile
    python benchmarks/vs_torchrec.py --preset kaggle_sgd --bf16       # also neorec with bf16 dense math

TorchRec's side is its DLRM over a FusedEmbeddingBagCollection (FBGEMM's CPU table-batched kernels,
the optimizer fused into backward); neorec's side is its DLRM over the fused embedding engine. The
batches are drawn once by neorec's synthetic generator and saved, and every run (a fresh process,
`--threads` intra-op threads) reads the same file. Both sides start from the same weights, bit for
bit: neorec's DLRM for the preset (seed 0) is built once, written under TorchRec DLRM keys by
neorec.interop.torchrec.torchrec_state (tables, both MLPs, the top MLP's input columns in TorchRec's
interaction order) to `<preset>-init.pt` next to the batches, and every run loads that file before
its first step (neorec through load_torchrec_state, TorchRec through its own load_state_dict), so
that the AUCs of the two sides can be compared. A run reports its loss on the first batch, before
any step; every run of a kind (full or dense-only) must start from the first run's loss up to 1e-5
relative, or the comparison stops. Runs are interleaved (neorec, TorchRec, neorec, ...) so that the
machine's drift hits both sides alike; each run reports samples/s over its timed steps (after
`--warmup`), its peak RSS (without the load of the initial weights, whose mapped pages are counted
only while they are read), the held-out AUC after training, and the seconds the load took. Each side
is also run dense-only: the same MLPs and interaction, from the same initial dense weights, with the
pooled embeddings replaced by a fixed tensor, so that what the embedding part and everything around
it cost shows as the difference. With --compile
neorec also runs with its dense stages compiled (train.compile, neorec/model/compile.py); the
compilation happens in the untimed warm-up steps. With --bf16 neorec also runs with its MLPs and
interaction under bf16 autocast (model.precision: bf16; fp32 weights, fp32 embeddings and last
layer), which CPUs with AVX512-BF16 or AMX run several times faster; its losses differ from fp32
by bf16 rounding, so its initial loss is checked against the other bf16 runs only.

TorchRec may live in a virtual environment of its own (torch 2.13 + fbgemm-gpu-cpu 1.8.0 + torchrec
1.8.0 installed with --no-deps, then tensordict, torchmetrics==1.0.3, tqdm, pyre-extensions; or
scripts/install-test-deps.sh): give its python with --torchrec-python. Appends to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

PRESETS = {
    # Criteo Kaggle cardinalities capped at 1M rows, one-hot, dim 64, SGD everywhere
    "kaggle_sgd": dict(rows="criteo_kaggle", max_rows=1_000_000, multi_hot=False, dim=64, bottom=[512, 256, 64],
                       top=[512, 256], emb_opt="sgd", emb_lr=0.05, dense_opt="sgd", dense_lr=0.05),
    "kaggle_rowwise_adagrad": dict(rows="criteo_kaggle", max_rows=1_000_000, multi_hot=False, dim=64,
                                   bottom=[512, 256, 64], top=[512, 256], emb_opt="rowwise_adagrad", emb_lr=0.05,
                                   dense_opt="sgd", dense_lr=0.05),
    # MLPerf Criteo 1TB cardinalities capped at 500k rows, the DCNv2 reference's fixed bag sizes (214 ids
    # a sample), dim 128, dot interaction, row-wise AdaGrad on the rows, AdaGrad on the MLPs
    "mlperf_multihot": dict(rows="mlperf", max_rows=500_000, multi_hot=True, dim=128, bottom=[512, 256, 128],
                            top=[1024, 1024, 512, 256], emb_opt="rowwise_adagrad", emb_lr=0.001,
                            dense_opt="adagrad", dense_lr=0.001),
}  # fmt: skip
SIDES = ("neorec", "torchrec")
VARIANTS = ("", "compiled", "bf16")  # of neorec: eager fp32, train.compile, model.precision bf16


# ---- the shared batches --------------------------------------------------------------------------
def make_batches(preset: dict, batch_size: int, steps: int, eval_batches: int, seed: int, path: Path) -> None:
    from neorec.data.synthetic import (
        CRITEO_KAGGLE_ROWS,
        MLPERF_MULTI_HOT,
        MLPERF_ROWS,
        SyntheticSource,
        SyntheticSpec,
    )

    rows = CRITEO_KAGGLE_ROWS if preset["rows"] == "criteo_kaggle" else MLPERF_ROWS
    spec = SyntheticSpec(
        rows=[min(r, preset["max_rows"]) for r in rows], num_dense=13,
        bag_sizes=list(MLPERF_MULTI_HOT) if preset["multi_hot"] else None,
        train_samples=batch_size * steps, eval_samples=batch_size * eval_batches, seed=seed,
    )  # fmt: skip
    source = SyntheticSource(spec, cache=False)

    def plain(batches):
        out = []
        for b in batches:
            s = b.sparse
            out.append({"dense": b.dense, "labels": b.labels, "values": s.values, "lengths": s.lengths})
        return out

    torch.save({"rows": spec.rows, "keys": source.keys, "train": plain(source.train_batches(batch_size)),
                "eval": plain(source.eval_batches(batch_size))}, path)  # fmt: skip


# ---- one run, in a process of its own ---------------------------------------------------------------
def neorec_model(preset: dict, rows: list[int], keys: list[str], dense_only: bool, variant: str = ""):
    from torch import nn

    from neorec.embedding import EmbeddingOptimizerConfig, FusedEmbeddingCollection, TableConfig
    from neorec.model.dlrm import DLRM

    tables = [TableConfig(name=k, rows=r, dim=preset["dim"], features=[k]) for k, r in zip(keys, rows, strict=True)]
    emb = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name=preset["emb_opt"], lr=preset["emb_lr"]), seed=0)
    if dense_only:
        names, dims, width = emb.feature_names, emb.feature_dims, emb.output_dim

        class FixedPooled(nn.Module):
            """The dense-only stand-in: fixed pooled vectors after the bottom MLP's output."""

            feature_names, feature_dims, sequence_names = names, dims, []

            def pooled_after(self, prefix, sparse):
                return torch.cat([prefix, torch.full((prefix.shape[0], width), 0.01)], dim=1)

            def start_pooled(self, sparse):
                return lambda prefix: self.pooled_after(prefix, sparse)

        emb = FixedPooled()
    torch.manual_seed(0)
    model = DLRM(13, emb, preset["bottom"], preset["top"], precision="bf16" if variant == "bf16" else "fp32")
    if variant == "compiled":
        from neorec.model.compile import apply_compile

        apply_compile(model, torch.device("cpu"))
    emb_opt = emb.build_optimizer() if not dense_only else None
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]

    def step(batch):
        from neorec.data.batch import Batch
        from neorec.sparse import SparseBatch

        b = Batch(batch["dense"], SparseBatch(keys, batch["values"], batch["lengths"]), batch["labels"])
        return model(b), b.labels

    return model, dense, emb_opt, step


def torchrec_model(preset: dict, rows: list[int], keys: list[str], dense_only: bool, variant: str = ""):
    from torch import nn
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    opt = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowWiseAdagrad}[preset["emb_opt"]]
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=preset["dim"], num_embeddings=r, feature_names=[k])
              for k, r in zip(keys, rows, strict=True)]  # fmt: skip
    ebc = FusedEmbeddingBagCollection(tables, optimizer_type=opt, optimizer_kwargs={"lr": preset["emb_lr"]},
                                      device=torch.device("cpu"))  # fmt: skip
    torch.manual_seed(0)
    model = DLRM(ebc, 13, preset["bottom"], preset["top"] + [1])
    if dense_only:

        class FixedPooled(nn.Module):
            def forward(self, kjt):
                return torch.full((kjt.stride(), len(keys), preset["dim"]), 0.01)

        model.sparse_arch = FixedPooled()
    dense = [p for n, p in model.named_parameters() if "sparse_arch" not in n]

    def step(batch):
        kjt = KeyedJaggedTensor(keys=keys, values=batch["values"], lengths=batch["lengths"].to(torch.int64))
        return model(batch["dense"], kjt).squeeze(1), batch["labels"]

    return model, dense, None, step


# ---- the shared initial weights ----------------------------------------------------------------------
def make_init(preset: dict, rows: list[int], keys: list[str], path: Path) -> float:
    """neorec's DLRM for the preset (seed 0), saved once under TorchRec DLRM keys for both sides;
    returns the seconds the save took."""
    from neorec.interop.torchrec import torchrec_state

    model = neorec_model(preset, rows, keys, dense_only=False)[0]
    state = torchrec_state(model)
    del model
    t0 = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - t0


def load_init(model, side: str, dense_only: bool, path: Path, keys: list[str]) -> tuple[float, float]:
    """Loads the shared initial weights into a worker's model; returns the seconds it took and the peak
    RSS before it. The file is memory-mapped and its pages count as resident while they are read, so
    the high-water mark is reset after the load (Linux) and the load left out of the run's peak."""
    from common import peak_rss_mib

    from neorec.interop.torchrec import DLRM_TABLES, EBC_KEY, load_torchrec_dense, load_torchrec_state

    peak = peak_rss_mib()
    t0 = time.perf_counter()
    state = torch.load(path, weights_only=True, mmap=True)
    if side == "neorec":
        # the TorchRec model's feature order: one table per feature, in `keys` order (torchrec_model)
        (load_torchrec_dense if dense_only else load_torchrec_state)(model, state, feature_names=keys)
    else:
        # TorchRec's tables are named t_<feature> (see torchrec_model), neorec's <feature>
        tables = DLRM_TABLES + EBC_KEY
        state = {(tables + "t_" + k[len(tables):] if k.startswith(tables) else k): v for k, v in state.items()}
        if dense_only:
            state = {k: v for k, v in state.items() if not k.startswith(tables)}
        model.load_state_dict(state, strict=True)  # FusedEmbeddingBagCollection copies into its own storage
    seconds = time.perf_counter() - t0
    del state
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return seconds, peak


def run_worker(args: argparse.Namespace) -> dict:
    from common import peak_rss_mib

    from neorec.metrics.auc import auc

    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    data = torch.load(args.data, weights_only=True)
    build = neorec_model if args.side == "neorec" else torchrec_model
    model, dense, emb_opt, step = build(preset, data["rows"], data["keys"], args.dense_only, args.variant)
    load_s, peak_before_load = load_init(model, args.side, args.dense_only, Path(args.init), data["keys"])
    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[preset["dense_opt"]]
    dense_opt = opt_cls(dense, lr=preset["dense_lr"])
    times = []
    for i, batch in enumerate(data["train"]):
        t0 = time.perf_counter()
        logits, labels = step(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # both sides update the embedding rows here
        dense_opt.step()
        if emb_opt is not None:
            emb_opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if i == 0:
            initial_loss = loss.detach()
    with torch.no_grad():
        scores, labels = zip(*(step(b) for b in data["eval"]), strict=True)
    batch_size = len(data["train"][0]["labels"])
    return {
        "samples_per_s": batch_size * len(times) / sum(times),
        "ms_per_step": 1000 * statistics.median(times),
        "peak_rss_mib": max(peak_before_load, peak_rss_mib()),
        "auc": float(auc(torch.sigmoid(torch.cat(scores)), torch.cat(labels))),
        "initial_loss": float(initial_loss),
        "load_s": round(load_s, 2),
    }


# ---- the comparison ------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="kaggle_sgd")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=100, help="training steps a run (all timed but --warmup)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torchrec-python", default=sys.executable, help="python of TorchRec's environment")
    p.add_argument("--no-dense-only", action="store_true", help="skip the dense-only runs")
    p.add_argument("--compile", action="store_true", help="also run neorec with its dense stages compiled")
    p.add_argument("--bf16", action="store_true", help="also run neorec with bf16 dense math (model.precision)")
    p.add_argument("--dir", default="runs/vs_torchrec", help="where the shared batches are written")
    p.add_argument("--no-append", action="store_true")
    # worker mode
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--dense-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        print(json.dumps(run_worker(args)))
        return

    preset = PRESETS[args.preset]
    path = Path(args.dir) / f"{args.preset}-b{args.batch_size}-s{args.steps}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_batches(preset, args.batch_size, args.steps, args.eval_batches, 0, path)
    init = Path(args.dir) / f"{args.preset}-init.pt"
    if not init.is_file():
        data = torch.load(path, weights_only=True)
        t0 = time.perf_counter()
        save_s = make_init(preset, data["rows"], data["keys"], init)
        del data
        print(f"initial weights built and saved to {init} in {time.perf_counter() - t0:.1f} s "
              f"(the save {save_s:.1f} s)", flush=True)  # fmt: skip
    initial_loss: dict[tuple[bool, bool], float] = {}  # (dense_only, bf16) -> the first such run's first loss
    extra = [("neorec", v) for v, on in (("compiled", args.compile), ("bf16", args.bf16)) if on]
    sides = [(side, "") for side in SIDES] + extra  # (side, variant)
    kinds = [(s, False, c) for s, c in sides] + ([] if args.no_dense_only else [(s, True, c) for s, c in sides])
    runs: dict[tuple[str, bool, str], list[dict]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds:
            side, dense_only, variant = kind
            python = args.torchrec_python if side == "torchrec" else sys.executable
            cmd = [python, __file__, "--side", side, "--preset", args.preset, "--data", str(path),
                   "--init", str(init), "--threads", str(args.threads), "--warmup", str(args.warmup)]  # fmt: skip
            cmd += (["--dense-only"] if dense_only else []) + (["--variant", variant] if variant else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{side} run failed:\n{out.stderr[-3000:]}")
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1} {label(kind)}: {runs[kind][-1]}", flush=True)
            check_initial_loss(initial_loss, kind, runs[kind][-1]["initial_loss"])
    print(report(args, runs))


def check_initial_loss(seen: dict[tuple[bool, bool], float], kind: tuple[str, bool, str], loss: float) -> None:
    """Every run of a kind (full or dense-only; fp32 or bf16 dense math) starts from the same weights,
    so its loss on the first batch, before any step, must agree with the first run's up to float
    rounding."""
    reference = seen.setdefault((kind[1], kind[2] == "bf16"), loss)
    if abs(loss - reference) > 1e-5 * abs(reference):
        raise SystemExit(
            f"{label(kind)} starts from a loss of {loss!r} on the first batch, the first "
            f"{'dense-only ' if kind[1] else ''}run from {reference!r}: the two sides do not start from the "
            f"same weights (relative difference {abs(loss - reference) / abs(reference):.2e} > 1e-5), "
            f"so their AUCs cannot be compared"
        )


def label(kind: tuple[str, bool, str]) -> str:
    side, dense_only, variant = kind
    return side + (f" {variant}" if variant else "") + (" dense-only" if dense_only else "")


def report(args: argparse.Namespace, runs: dict) -> str:
    from common import append_results, markdown_table

    def med(key, rs):
        return statistics.median(x[key] for x in rs)

    rows = []
    base = med("samples_per_s", runs[("torchrec", False, "")])
    for (side, dense_only, variant), rs in runs.items():
        sps = [x["samples_per_s"] for x in rs]
        rows.append([
            label((side, dense_only, variant)), round(med("samples_per_s", rs)),
            f"{min(sps):,.0f} - {max(sps):,.0f}", f"{med('samples_per_s', rs) / base:.2f}x",
            round(med("ms_per_step", rs), 1), round(med("peak_rss_mib", rs)),
            "-" if dense_only else f"{med('auc', rs):.4f}",
        ])  # fmt: skip
    header = ["side", "samples/s (median)", "range", "vs TorchRec", "ms/step (median)", "peak RSS MiB", "AUC"]
    table = markdown_table(header, rows)
    if not args.no_append:
        notes = (f"Preset {args.preset}: {PRESETS[args.preset]}; batch {args.batch_size}, {args.steps} steps "
                 f"({args.warmup} untimed), {args.repeats} interleaved runs per side, {args.threads} threads.")  # fmt: skip
        append_results(f"neorec vs TorchRec end to end: {args.preset}", table, notes)
    return table


if __name__ == "__main__":
    main()
