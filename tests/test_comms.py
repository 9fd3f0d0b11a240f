"""Codecs, byte counting and the all-to-all based collectives (reduce-scatter, all-reduce, two hops)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import spawn

from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms
from neorec.distributed.topology import Topology
from neorec.errors import ConfigError
from neorec.sparse import SparseBatch


@pytest.mark.parametrize("name,tol", [("fp32", 0.0), ("fp16", 2**-11), ("bf16", 2**-8)])
def test_codec_round_trip_relative_to_row_peak(name, tol):
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-7, 1e-3, 1.0, 3e4, 1e6, 0.0]).view(-1, 1)
    x = torch.randn(6, 33, generator=g) * scales
    y = Codec(name).decode(Codec(name).encode(x))
    peak = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() / peak).max() <= tol
    assert torch.equal(y[-1], torch.zeros(33))
    into = torch.full((8, 33), 5.0)  # decoded into a slice of a larger buffer: the same values
    Codec(name).decode(Codec(name).encode(x), into[1:7])
    assert torch.equal(into[1:7], y) and (into[0] == 5).all() and (into[7] == 5).all()


def test_fp16_codec_survives_values_beyond_fp16_range():
    x = torch.tensor([[7e4, -1e5, 3.0], [1e-9, 2e-9, -5e-9]])
    plain = x.to(torch.float16).float()
    assert not torch.isfinite(plain).all() or plain[1].abs().max() == 0  # a plain cast overflows/underflows
    y = Codec("fp16").decode(Codec("fp16").encode(x))
    torch.testing.assert_close(y, x, rtol=1e-3, atol=0)
    assert Codec("fp16").wire_width(33) == 34


def test_fp16_codec_keeps_any_finite_row_and_a_non_finite_value_to_itself():
    """Every finite fp32 row to fp16's 2^-11 of its peak (a clamped shift made rows past 8e34 infinite
    and flushed rows below 1e-38 to 0); a NaN or infinity stays where it is, and the row's other
    values stay what fp16 makes of them (scaled by 2^15 as a peak without exponent, every one past 2
    became infinite)."""
    codec = Codec("fp16")
    for row in ([1e35, -3e34, 1.0], [3e38, 1e37, -2e38], [1e-38, 5e-39, -2e-38], [2.0**-110, 2.0**-112, 0.0]):
        x = torch.tensor([row])
        y = codec.decode(codec.encode(x))
        assert ((y - x).abs() / x.abs().max()).max() <= 2**-11, (row, y)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 5], x[1, 9] = float("nan"), float("-inf")
    y = codec.decode(codec.encode(x))
    assert y[0, 5].isnan() and y[1, 9] == float("-inf") and torch.isfinite(y).sum() == 30
    finite = torch.isfinite(x)
    torch.testing.assert_close(y[finite], x.to(torch.float16).float()[finite], rtol=0, atol=0)


def test_an_exchange_with_an_empty_block_sends_nothing_of_it():
    comms = Comms(Topology(1, 0, 1))
    for name in ("fp16", "fp32"):
        out = comms.exchange([torch.ones(0, 4)], [(0, 4)], Codec(name), "fwd").wait()
        assert out[0].shape == (0, 4)


def test_auto_precisions_are_fp32_in_shared_memory_only():
    from neorec.distributed.codecs import wire_precisions
    from neorec.distributed.shm import available
    from neorec.train.build import run_wire_precisions

    assert wire_precisions("auto", "auto", True) == ("fp32", "fp32")
    assert wire_precisions("auto", "auto", False) == ("fp16", "bf16")
    assert wire_precisions("bf16", "fp16", True) == ("bf16", "fp16")  # set explicitly: kept
    cfg = load_config("default")
    assert run_wire_precisions(cfg, one_machine=False) == ("fp16", "bf16")
    assert run_wire_precisions(cfg, one_machine=True) == (("fp32", "fp32") if available() else ("fp16", "bf16"))
    backend = load_config("default", ["distributed.transport=backend"])
    assert run_wire_precisions(backend, one_machine=True) == ("fp16", "bf16")


def test_codec_rejects_unknown_name():
    with pytest.raises(ConfigError, match="fp8"):
        Codec("fp8")


def test_bytes_counted_exclude_the_local_block():
    comms = Comms(Topology(1, 0, 1))
    out = comms.exchange([torch.ones(5, 4)], [(5, 4)], Codec("bf16"), "fwd").wait()
    assert torch.equal(out[0], torch.ones(5, 4))
    assert comms.stats.take() == {"fwd": 0}


def _collectives(topo: Topology):
    comms = Comms(topo)
    r, w = topo.rank, topo.world_size
    # reduce-scatter: rank r contributes (r + 1) * (k + 1) to rank k's block
    blocks = torch.cat([torch.full((2, 3), float((r + 1) * (k + 1))) for k in range(w)])
    rs = comms.reduce_scatter_rows(blocks, Codec("fp32"), "test").wait()
    # all-reduce in every codec
    flat = torch.arange(1000, dtype=torch.float32) * (r + 1) / 7
    sums = {c: comms.all_reduce_sum(flat.clone(), Codec(c), "dense").wait() for c in ("fp32", "fp16", "bf16")}
    for c in ("fp32", "bf16"):  # a list is summed as its concatenation
        parts = [flat[:400].clone(), flat[400:].clone()]
        sums[c + " parts"] = comms.all_reduce_sum(parts, Codec(c), "dense").wait()
    # exchange of blocks of different widths: rank r sends [r + 1, k + 2] filled with 10 r + k to rank k
    blocks = [torch.full((r + 1, k + 2), float(10 * r + k)) for k in range(w)]
    got = comms.exchange(blocks, [(s + 1, r + 2) for s in range(w)], Codec("fp32"), "test").wait()
    sent = comms.stats.take()
    return rs, sums, got, sent


def test_collectives_on_four_gloo_processes(tmp_path):
    results = spawn(4, _collectives, tmp_path=tmp_path)
    w = 4
    expected_flat = torch.arange(1000, dtype=torch.float32) / 7 * sum(r + 1 for r in range(w))
    for k, (rs, sums, got, sent) in results.items():
        assert torch.equal(torch.as_tensor(rs), torch.full((2, 3), float(sum((r + 1) * (k + 1) for r in range(w)))))
        torch.testing.assert_close(torch.as_tensor(sums["fp32"]), expected_flat)
        torch.testing.assert_close(torch.as_tensor(sums["fp16"]), expected_flat, rtol=2e-3, atol=1e-3)
        torch.testing.assert_close(torch.as_tensor(sums["bf16"]), expected_flat, rtol=1e-2, atol=1e-2)
        for s, block in enumerate(got):
            assert torch.equal(torch.as_tensor(block), torch.full((s + 1, k + 2), float(10 * s + k)))
        # reduce-scatter sends 3 of its 4 [2, 3] fp32 blocks; the exchange sends rank k's [k+1, j+2] blocks
        assert sent["test"] == 3 * 2 * 3 * 4 + sum((k + 1) * (j + 2) * 4 for j in range(w) if j != k)
        for c in ("fp32", "bf16"):
            assert torch.equal(torch.as_tensor(sums[c + " parts"]), torch.as_tensor(sums[c]))
    # every rank ends with the same dense sums, whatever the codec
    for c in ("fp32", "fp16", "bf16"):
        first = torch.as_tensor(results[0][1][c])
        assert all(torch.equal(torch.as_tensor(results[r][1][c]), first) for r in range(w))


def _two_hop(topo: Topology):
    comms = Comms(topo)
    b, d, w = 2, 3, topo.world_size
    rows = torch.stack([torch.full((b, d), float(100 * topo.rank + k)) for k in range(w)]).view(w * b, d)
    summed = comms.two_hop(rows, b, "sum", [d] * topo.num_nodes, Codec("fp32"), "fwd")
    joined = comms.two_hop(rows, b, "cat", [d * topo.local_world_size] * topo.num_nodes, Codec("fp32"), "fwd")
    return summed, joined


def test_two_hop_sums_inside_the_node_then_crosses(tmp_path):
    results = spawn(4, _two_hop, local_world=2, tmp_path=tmp_path)
    for k, (summed, joined) in results.items():
        for node in (0, 1):
            peers = [2 * node, 2 * node + 1]
            assert torch.equal(torch.as_tensor(summed[node]), torch.full((2, 3), float(sum(100 * p + k for p in peers))))
            expected = torch.cat([torch.full((2, 3), float(100 * p + k)) for p in peers], dim=1)
            assert torch.equal(torch.as_tensor(joined[node]), expected)


def _shm_vs_backend(topo: Topology):
    from neorec.distributed.shm import ShmGroup

    r, w = topo.rank, topo.world_size
    g = torch.Generator().manual_seed(100 + r)
    # uneven splits, empty parts, rows of 3 fp16 values, with a 64-byte capacity: many rounds
    splits = [int(x) for x in torch.randint(0, 30, (w,), generator=g)]
    splits[(r + 1) % w] = 0
    send = torch.randn(sum(splits), 3, generator=g).to(torch.float16)
    recv_splits = torch.empty(w, dtype=torch.int64)
    dist.all_to_all_single(recv_splits, torch.tensor(splits))
    recv_splits = recv_splits.tolist()
    expected = send.new_empty((sum(recv_splits), 3))
    dist.all_to_all_single(expected, send, recv_splits, splits)
    # all-gather of byte strings of different sizes (rank 1's empty), through shm and the backend
    size = 0 if r == 1 else int(torch.randint(1, 300, (1,), generator=g))
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    everyone: list = [None] * w
    dist.all_gather_object(everyone, payload)
    over_backend = Comms(topo, transport="backend").all_gather_bytes(payload, "dp").wait()
    backend_ok = [torch.equal(a, b) for a, b in zip(over_backend, everyone, strict=True)]
    # all-to-all of byte parts whose sizes the receivers do not know: the parts of `send` as bytes
    send_bytes = send.view(-1).view(torch.uint8)
    sizes = [n * 6 for n in splits]
    parts = list(expected.view(-1).view(torch.uint8).split([n * 6 for n in recv_splits]))
    by_backend = Comms(topo, transport="backend").all_to_all_bytes(send_bytes, sizes, "dp").wait()
    backend_ok += [torch.equal(a, b) for a, b in zip(by_backend, parts, strict=True)]
    results = {}
    for capacity in (64, 1 << 20):
        group = ShmGroup(list(range(w)), r, None, capacity=capacity)
        got = send.new_empty((sum(recv_splits), 3))
        group.all_to_all(got, send, recv_splits, splits)
        flat = torch.randn(1001, generator=g)  # 4004 bytes: 63 rounds of 64
        summed = flat.clone()
        group.all_reduce(summed)
        from_parts = group.sum_parts([flat[:300], flat[300:]])  # concatenated into the buffer (or not: 64)
        reference = torch.empty(w, 1001)
        dist.all_gather(list(reference), flat)
        for _ in range(50):  # back-to-back exchanges: the double buffers must not be overwritten early
            group.all_to_all(got, send, recv_splits, splits)
        gathered = group.all_gather_bytes(payload)  # up to 300 bytes: 5 rounds of 64
        parts_got = group.all_to_all_bytes(send_bytes, sizes)
        group.close()
        gathered_ok = all(torch.equal(a, b) for a, b in zip(gathered, everyone, strict=True))
        gathered_ok &= all(torch.equal(a, b) for a, b in zip(parts_got, parts, strict=True))
        summed_ok = torch.equal(summed, reference.sum(0)) and torch.equal(from_parts, summed)
        results[capacity] = (torch.equal(got, expected), summed_ok, gathered_ok)
    results["backend"] = all(backend_ok) and len(backend_ok) == 2 * w
    return results


def test_shared_memory_collectives_equal_the_backend(tmp_path):
    for w in (2, 4):
        results = spawn(w, _shm_vs_backend, tmp_path=tmp_path / str(w))
        for rank, by_capacity in results.items():
            assert by_capacity == {64: (True, True, True), 1 << 20: (True, True, True), "backend": True}, (w, rank)


def test_topology_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    topo = Topology.from_env()
    assert (topo.num_nodes, topo.node, topo.local_rank, topo.node_ranks(1)) == (2, 1, 1, [4, 5, 6, 7])
    with pytest.raises(ConfigError, match="multiple"):
        Topology(6, 0, 4)


def test_distributed_config_is_validated():
    with pytest.raises(ConfigError, match="kind"):
        load_config("default", ["distributed.sharding={C1: {kind: diagonal}}"])
    with pytest.raises(ConfigError, match="forward_precision"):
        load_config("default", ["distributed.forward_precision=fp8"])


def test_slice_samples_matches_per_sample_construction():
    g = torch.Generator().manual_seed(3)
    feats = {}
    for k in ("a", "b", "c"):
        lengths = torch.randint(0, 4, (9,), generator=g)
        ids = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
        feats[k] = (ids, lengths, torch.rand(ids.numel(), generator=g))
    sparse = SparseBatch.from_features(feats)
    batch = Batch(torch.randn(9, 2, generator=g), sparse, torch.rand(9, generator=g))
    part = batch.slice(3, 7)
    for k in ("a", "b", "c"):
        ids, lengths, weights = feats[k]
        start = int(lengths[:3].sum())
        n = int(lengths[3:7].sum())
        got = part.sparse.feature(k)
        assert torch.equal(got[0], ids[start : start + n]) and torch.equal(got[1], lengths[3:7])
        assert torch.equal(got[2], weights[start : start + n])
    assert torch.equal(part.dense, batch.dense[3:7]) and len(part) == 4
    assert batch.slice(0, 0).sparse.values.numel() == 0


def test_publishing_to_a_peer_that_already_left_is_not_an_error():
    """A peer can see a round's sequence number by spinning, finish and close its wake-up pipe before
    the publisher writes the wake-up byte: that write gets EPIPE, which must not fail the exchange."""
    import os

    from neorec.distributed.shm import HEADER_SLOTS, ShmGroup

    group = ShmGroup.__new__(ShmGroup)  # just the publishing half: no process group needed
    read_end, write_end = os.pipe()
    os.close(read_end)  # the peer has gone
    group.index, group.seq = 0, 0
    group._headers = [[torch.zeros(HEADER_SLOTS, dtype=torch.int64) for _ in (0, 1)]]
    group._wake_write = [-1, write_end]
    try:
        group._publish(0, [0, 0])
    finally:
        os.close(write_end)
    assert int(group._headers[0][0][0]) == 1


def test_shared_memory_waits_spin_only_where_each_rank_has_its_cores(monkeypatch):
    """A waiting rank busy-waits (SPIN_SECONDS) only when the node's ranks x torch's threads fit
    on the cores; otherwise a spinning rank would hold the core its peer needs."""
    from neorec.distributed import shm

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert shm.spin_seconds(2) == shm.SPIN_SECONDS > 0  # 2 ranks x 1 thread on 2 cores
    assert shm.spin_seconds(4) == 0.0  # 4 ranks on 2 cores
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert shm.spin_seconds(2) == 0.0  # 2 ranks x 2 threads on 2 cores


def test_fp16_codec_scales_each_row_by_its_largest_magnitude():
    """A row whose peak is negative, or just below a power of two, stays finite and within 2^-11 of
    its peak (a shift one too large, or a peak of the positive values only, overflows fp16)."""
    codec = Codec("fp16")
    for row in ([1.0, -5.0, 0.5], [0.9999, 0.25, 0.0], [-1.9999, 1.0, 0.5], [60000.0, -65504.0, 1.0]):
        x = torch.tensor([row])
        y = codec.decode(codec.encode(x))
        assert torch.isfinite(y).all(), row
        assert (y - x).abs().max() <= x.abs().max() * 2**-11, row
