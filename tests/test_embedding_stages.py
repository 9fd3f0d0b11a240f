"""The engine's step stages as profiler ranges (neorec/utils/stages.py), and the breakdown that
benchmarks/embedding_stages.py makes of them: each stage's time and the bytes it must move.

The Triton path runs here on CPU tensors through Triton's interpreter (tests/conftest.py), on a GPU
on the GPU."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embedding_stages import batch_counts, measure, stage_bytes, stage_device_ms, stage_times  # noqa: E402
from neorec.embedding.fused import FusedEmbeddingCollection  # noqa: E402
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig  # noqa: E402
from neorec.sparse import SparseBatch  # noqa: E402
from neorec.utils.stages import NAMES, stage  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"tables": 3, "rows": 40, "dim": 8, "batch": 6, "bags": [1, 3, 2]}


def tiny_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of TINY's shape (table-major ids, offsets), ids drawn with repeats."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.tensor([k for k in TINY["bags"] for _ in range(TINY["batch"])])
        ids = torch.randint(0, 10, (int(lengths.sum()),), generator=g)  # few rows: many repeats
        out.append((ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])))
    return out


def test_a_stage_is_a_profiler_range_only_while_a_profiler_records():
    assert isinstance(stage("sort"), nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with stage("sort"):
            torch.ones(3).sum()
    assert [e.name for e in prof.events() if e.name.startswith("neorec.")] == ["neorec.sort"]


@pytest.mark.parametrize("impl", ["triton", "torch_ops"])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad"])
def test_every_stage_of_a_step_is_timed_and_counted(impl, opt):
    args = argparse.Namespace(warmup=1, batches=1, profiled=2)
    r = measure(impl, opt, TINY, tiny_batches(4), torch.device(DEVICE), args)
    expected = {"check_ids", "prepare_bags", "lookup", "sort", "update"}
    expected |= {"partial_sums", "update_setup"} if impl == "triton" else {"row_sums"}
    assert set(r["stages"]) == expected
    assert set(r["stages"]) <= set(NAMES)
    assert all(host > 0 for host, _ in r["stages"].values())
    if DEVICE == "cuda":  # the kernels of the lookup, the sort and the update run inside their stages
        assert all(r["stages"][name][1] > 0 for name in ("lookup", "sort", "update"))
    assert set(r["bytes"]) <= expected


def test_stage_times_leave_out_stages_nested_in_a_stage():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with stage("update"):
                with stage("sort"):
                    torch.ones(1000).cumsum(0)
    times = stage_times(prof, passes=2)
    events = {e.name: e for e in prof.events() if e.name.startswith("neorec.")}
    assert set(times) == {"update", "sort"}
    outer = sum(e.cpu_time_total for e in prof.events() if e.name == "neorec.update") / 1e3 / 2
    inner = sum(e.cpu_time_total for e in prof.events() if e.name == "neorec.sort") / 1e3 / 2
    assert events and times["sort"][0] == pytest.approx(inner)
    assert times["update"][0] == pytest.approx(outer - inner)


def _event(name, start, end, device="cuda", annotation=False):
    """A profiler event as stage_device_ms reads it (times in microseconds)."""
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)  # fmt: skip


def test_device_time_goes_to_the_innermost_stage_range_on_the_device():
    events = [
        _event("neorec.update", 0, 300, device="cpu", annotation=True),  # host side: no device time
        _event("neorec.update", 100, 900, annotation=True),  # the ranges' device-side copies
        _event("neorec.partial_sums", 100, 400, annotation=True),
        _event("neorec.update", 500, 900, annotation=True),  # nested in the outer update, same name
        _event("neorec.sort", 1000, 1200, annotation=True),
        _event("partial_sums_kernel", 100, 400),  # linked to no CPU range, as Triton's were on a GPU
        _event("_update_kernel", 500, 850),
        _event("Memset (Device)", 450, 470),  # between the nested ranges: the outer update's own
        _event("radix_sort", 1000, 1100),
        _event("radix_sort", 1150, 1200),
        _event("gemm", 1300, 1400),  # in no stage
        _event("ProfilerStep#1", 0, 2000, annotation=True),  # another range on the device: not work
    ]
    ms = stage_device_ms(events)
    assert ms == pytest.approx({"partial_sums": 0.3, "update": 0.35 + 0.02, "sort": 0.15})
    assert stage_device_ms([e for e in events if not e.name.startswith("neorec.")]) == {}


def test_the_byte_model_counts_a_gradient_row_per_id_and_each_unique_row_once():
    tables = [TableConfig(name=f"t{i}", rows=TINY["rows"], dim=TINY["dim"], features=[f"f{i}"]) for i in range(3)]
    emb = FusedEmbeddingCollection(tables, EmbeddingOptimizerConfig(name="adam", lr=0.01), device=DEVICE)
    # sample 0: t0 [1], t1 [2, 2, 5], t2 [2, 1]; sample 1: t0 [1], t1 [5, 5, 5], t2 [3, 3]
    ids = torch.tensor([1, 1, 2, 2, 5, 5, 5, 5, 2, 1, 3, 3])
    lengths = torch.tensor([1, 1, 3, 3, 2, 2])
    sparse = SparseBatch(["f0", "f1", "f2"], ids.to(DEVICE), lengths.to(DEVICE))
    c = batch_counts(emb, sparse, chunk=3)
    # unique rows: t0 {1}, t1 {2, 5}, t2 {1, 2, 3}; t1's row 5 has 4 ids, more than the chunk of 3: 2 chunks
    assert c == {"ids": 12, "bags": 6, "unique": 6, "chunked_ids": 4, "chunks": 2}
    d, s = TINY["dim"], 2 * TINY["dim"]
    triton = stage_bytes(c, d, s, "triton")
    assert triton["sort"] == 24 * 12 + 16 * 6
    assert triton["partial_sums"] == 4 * (4 * d + 8) + 2 * 4 * d
    assert triton["update"] == 8 * (4 * d + 8) + 2 * 4 * d + 6 * (8 * d + 8 * s)
    torch_ops = stage_bytes(c, d, s, "torch_ops")
    assert torch_ops["row_sums"] == 12 * (4 * d + 8) + 4 * d * 6
    assert torch_ops["update"] == 4 * d * 6 + 6 * (8 * d + 8 * s)
    assert "partial_sums" not in torch_ops and "row_sums" not in triton
