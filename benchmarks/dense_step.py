"""The dense half of a DLRM step on the CPU: the dot interaction's forms, and eager against compiled.

    python benchmarks/dense_step.py --preset kaggle_sgd
    python benchmarks/dense_step.py --preset mlperf_multihot --repeats 7

Two tables. (1) The dot interaction alone, forward and backward, in three forms: autograd through
bmm(x, x^T), an index and a concat; the Gram product with a scatter-built backward (zero-filled
buffers, the pairs' gradient copied in, S = G + G^T, and the prefix gradient summed by autograd);
and neorec's DotInteractionFn (gather-built S, prefix gradient added in place). (2) One dense-only
training step (bottom MLP, interaction, top MLP, loss, backward, dense optimizer; the pooled
embeddings are a fixed tensor) of neorec's DLRM: eager with out-of-place and with in-place ReLUs
(neorec's MLPs), and with `train.compile` (torch.compile of the dense stages, neorec/model/compile.py),
the batch size static (neorec's setting) or dynamic.

Everything runs in this one process, in interleaved rounds (each variant once per round), so that
a shared machine's drift hits every variant alike; the table gives each variant's median over
rounds of its mean time per step, and its ratio to the first variant. Appends to RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from vs_torchrec import PRESETS  # noqa: E402

NUM_FEATURES = 26  # Criteo's categorical features, both presets


class ScatterBackwardDots(torch.autograd.Function):
    """The Gram product and gather of DotInteractionFn, with S built by scattering into zeros."""

    @staticmethod
    def forward(ctx, x, flat):  # type: ignore[override]
        ctx.save_for_backward(x, flat)
        b, f, _ = x.shape
        return torch.bmm(x, x.transpose(1, 2)).view(b, f * f).index_select(1, flat)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, flat = ctx.saved_tensors
        b, f, _ = x.shape
        sym = x.new_zeros(b, f * f).index_copy_(1, flat, grad.contiguous()).view(b, f, f)
        return torch.bmm(sym + sym.transpose(1, 2), x), None


def interaction_forms(f: int):
    from neorec.model.interaction import DotInteraction

    inter = DotInteraction(f)
    flat = inter.flat

    def autograd_form(v):
        b, d = v.shape[0], v.shape[1] // f
        x = v.view(b, f, d)
        return torch.cat([v[:, :d], torch.bmm(x, x.transpose(1, 2)).view(b, f * f)[:, flat]], dim=1)

    def scatter_form(v):
        b, d = v.shape[0], v.shape[1] // f
        return torch.cat([v[:, :d], ScatterBackwardDots.apply(v.view(b, f, d), flat)], dim=1)

    return {
        "autograd (bmm, index, cat)": autograd_form,
        "scatter backward": scatter_form,
        "DotInteractionFn": inter,
    }


def time_rounds(variants: dict, repeats: int, steps: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """Mean ms per call of each variant, one number per round, rounds interleaved."""
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = clock()
            for _ in range(steps):
                fn()
            out[name].append(1000 * (clock() - t0) / steps)
    return out


def interaction_table(preset: dict, batch: int, repeats: int, steps: int, clock) -> list[list[object]]:
    f, d = NUM_FEATURES + 1, preset["dim"]
    v0 = torch.randn(batch, f * d)
    forms = interaction_forms(f)
    grad = torch.randn(batch, d + f * (f - 1) // 2)
    want = None
    variants = {}
    for name, form in forms.items():

        def run(form=form):
            v = v0.detach().requires_grad_()
            out = form(v)
            out.backward(grad)
            return out, v.grad

        out, g = run()
        if want is None:
            want = (out, g)
        assert torch.allclose(out, want[0], atol=1e-4) and torch.allclose(g, want[1], atol=1e-3), name
        variants[name] = run
        run()  # warm
    times = time_rounds(variants, repeats, steps, clock)
    return summarize(times)


def dense_step_variants(preset: dict, batch: int, threads: int) -> dict:
    from neorec.model.compile import apply_compile

    out = {}
    for name in ("eager, ReLU out of place", "eager", "compiled", "compiled, dynamic batch size"):
        model = dense_only_dlrm(preset)
        if name == "eager, ReLU out of place":
            for relu in (m for m in model.modules() if isinstance(m, torch.nn.ReLU)):
                relu.inplace = False
        elif name != "eager":
            apply_compile(model, torch.device("cpu"), dynamic=name != "compiled")
        dense = [p for p in model.parameters() if p.requires_grad]
        opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[preset["dense_opt"]]
        opt = opt_cls(dense, lr=preset["dense_lr"])
        gen = torch.Generator().manual_seed(0)
        dense_in = torch.rand(batch, 13, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()

        def step(model=model, opt=opt, dense_in=dense_in, labels=labels):
            logits = model.top_stage(model.embeddings.pooled_after(model.bottom_stage(dense_in), None))
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        t0 = time.perf_counter()
        for _ in range(3):  # compiles on the first step
            step()
        print(f"{name}: first 3 steps {time.perf_counter() - t0:.1f} s", flush=True)
        out[name] = step
    return out


class FixedPooled(torch.nn.Module):
    """The dense-only stand-in for an embedding collection: fixed pooled vectors after the prefix."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.feature_names = [f"cat_{i}" for i in range(NUM_FEATURES)]
        self.feature_dims = [dim] * NUM_FEATURES
        self.sequence_names: list[str] = []
        self.width = dim * NUM_FEATURES

    def pooled_after(self, prefix: torch.Tensor, sparse) -> torch.Tensor:
        return torch.cat([prefix, torch.full((prefix.shape[0], self.width), 0.01)], dim=1)

    def start_pooled(self, sparse):
        return lambda prefix: self.pooled_after(prefix, sparse)


def dense_only_dlrm(preset: dict):
    from neorec.model.dlrm import DLRM

    torch.manual_seed(0)
    return DLRM(13, FixedPooled(preset["dim"]), preset["bottom"], preset["top"])


def summarize(times: dict[str, list[float]]) -> list[list[object]]:
    base = statistics.median(next(iter(times.values())))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append([name, round(med, 2), f"{min(ts):.2f} - {max(ts):.2f}", f"{base / med:.2f}x"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="kaggle_sgd")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=5, help="calls timed together in a round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-interaction", action="store_true", help="skip the interaction table")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the process's CPU time (all threads) instead of the wall clock: on a machine "
                   "shared with other work, time spent descheduled does not count (use with --threads 1, "
                   "where no thread waits for another)")  # fmt: skip
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    preset = PRESETS[args.preset]
    from common import append_results, markdown_table

    unit = "CPU ms" if args.cpu_time else "ms"
    header = ["variant", f"{unit} (median)", "range", "speed vs first"]
    tables = []
    if not args.no_interaction:
        rows = interaction_table(preset, args.batch_size, args.repeats, args.steps, clock)
        tables.append(("dot interaction forward + backward", markdown_table(header, rows)))
    variants = dense_step_variants(preset, args.batch_size, args.threads)
    rows = summarize(time_rounds(variants, args.repeats, args.steps, clock))
    tables.append(("dense-only training step", markdown_table(header, rows)))
    for title, table in tables:
        print(f"\n{title}\n{table}")
    if not args.no_append:
        notes = (f"Preset {args.preset} (dim {preset['dim']}, bottom {preset['bottom']}, top {preset['top']}, "
                 f"dense optimizer {preset['dense_opt']}); batch {args.batch_size}; {args.repeats} interleaved "
                 f"rounds of {args.steps} calls, {args.threads} threads, "
                 f"{'process CPU time' if args.cpu_time else 'wall clock'}.")  # fmt: skip
        text = "\n\n".join(f"**{title}**\n\n{table}" for title, table in tables)
        append_results(f"Dense half on the CPU: {args.preset}", text, notes)


if __name__ == "__main__":
    main()
