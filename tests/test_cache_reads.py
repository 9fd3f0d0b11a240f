"""The row cache (neorec/embedding/cache): reads ahead (one host read per read-ahead on the device path, slots
filled only at their result), pinned rows, stats, eviction and the LRU/LFU policies."""

from __future__ import annotations

import pytest
import torch
from test_cache import assert_same_state, batch, cached_engine, tables

from neorec.embedding.cache import DramBacking, RowCache
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig

READS = [  # what reads a device tensor back to the host (numpy: index_ops' CPU path)
    (torch.Tensor, "cpu"), (torch.Tensor, "item"), (torch.Tensor, "numpy"), (torch.Tensor, "nonzero"),
    (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"), (torch, "unique"), (torch, "nonzero"),
]  # fmt: skip


def count_host_reads(monkeypatch, cache_cls) -> tuple[dict[str, int], list[str]]:
    """Host reads of tensors on the training thread, by phase: inside RowCache.prefetch(ahead=True)
    ('ahead'); else in the phase the caller pushes on the returned list: 'lookup' counts every read,
    'update' those inside the cache's methods (none pushed: not counted)."""
    import threading

    main, counts, phase, depth = threading.main_thread(), {"ahead": 0, "lookup": 0, "update": 0}, [], [0]

    def counted(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if phase and threading.current_thread() is main and (phase[-1] != "update" or depth[0]):
                counts[phase[-1]] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in READS:
        counted(owner, name)

    def inside(name):
        fn = getattr(cache_cls, name)

        def wrapper(self, *args, **kwargs):
            ahead = name == "prefetch" and kwargs.get("ahead", args[2] if len(args) > 2 else False)
            phase.append("ahead") if ahead else None
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                phase.pop() if ahead else None

        monkeypatch.setattr(cache_cls, name, wrapper)

    for name in ("prefetch", "read", "write"):
        inside(name)
    return counts, phase


def test_device_path_reads_one_count_per_read_ahead_and_nothing_else(tmp_path, staged_on_cpu, monkeypatch):
    """The device path of the cache in the steady state: a coming batch's read ahead reads one thing
    back to the host (its counts of unique, missing and pinned rows), its lookup and its update none
    (on a GPU each read is a sync, which stalls the step). Counted on the CPU stand-in: every tensor
    read the training thread makes in the cache's read ahead, in the forward, and in the cache during
    the update, with victims chosen by topk as on a GPU."""
    from neorec.embedding.cache import slots as slots_module

    monkeypatch.setattr(slots_module, "smallest", lambda key, k: torch.topk(key, k, largest=False).indices)
    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt)
    cached = cached_engine(ts, opt, tmp_path, tier="dram", fraction=0.5, io_thread=True)
    gen = torch.Generator().manual_seed(11)
    batches = [batch(gen, ts) for _ in range(16)]
    grads = [torch.randn(16, plain.output_dim, generator=gen) for _ in batches]
    for i in range(8):  # fills the caches: evictions from here on
        cached.prefetch(batches[i + 1])
        cached(batches[i]).backward(grads[i])
        plain(batches[i]).backward(grads[i])
    evictions = sum(s["evictions"] for s in cached.cache_stats().values())
    assert evictions > 0
    counts, phase = count_host_reads(monkeypatch, RowCache)
    for i in range(8, len(batches) - 1):
        cached.prefetch(batches[i + 1])  # as the pipeline does: before batch i runs
        phase.append("lookup")
        pooled = cached(batches[i])
        phase[-1] = "update"
        pooled.backward(grads[i])
        phase.pop()
        plain(batches[i]).backward(grads[i])
    assert counts == {"ahead": 7 * len(cached.weights), "lookup": 0, "update": 0}
    monkeypatch.undo()
    assert sum(s["evictions"] for s in cached.cache_stats().values()) > evictions
    assert_same_state(plain, cached)  # and the sums without a read of their count are exact


def on_gpu_with_limits(sparse):
    sparse.id_limits()  # kept by .to, as DeviceFeed keeps the limits a reader counted
    return sparse.to("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpu_cache_steps_sync_once_per_read_ahead(tmp_path, policy) -> None:
    """A GPU cache over host memory in the steady state, under torch.cuda.set_sync_debug_mode("warn"),
    counting the training thread's syncs: one per coming batch's read ahead (its counts), none in
    the lookup or the update; and still bitwise training the tables in GPU memory."""
    import threading
    import warnings

    ts = [  # one group: the engine's own prefetch reads no per-feature sizes
        TableConfig(name="users", rows=3000, dim=8, features=["user", "friend"]),
        TableConfig(name="items", rows=2000, dim=8, features=["item"], pooling="mean"),
    ]
    opt = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05, initial_accumulator=0.01)
    plain = FusedEmbeddingCollection(ts, opt, device="cuda")  # the Triton kernels, as the cached engine
    cached = cached_engine(
        ts, opt, tmp_path, policy, tier="dram", fraction=0.3, device="cuda", io_thread="auto"
    )
    assert len(cached.weights) == 1 and cached.weights[0].cache.io.background
    gen = torch.Generator().manual_seed(12)
    # 128 samples: two batches' rows fit in the cache beside each other, so every read ahead is complete.
    # Each batch's id limits are counted on the host before its copy, as the device feed does: the id
    # check of a GPU batch without them reads them back (one sync, not the cache's)
    batches = [on_gpu_with_limits(batch(gen, ts, batch_size=128)) for _ in range(20)]
    grads = [torch.randn(128, plain.output_dim, generator=gen).to("cuda") for _ in batches]
    syncs = {"ahead": 0, "lookup": 0, "update": 0}
    phase: list[str] = []
    main = threading.main_thread()

    def seen(*args, **kwargs) -> None:
        if phase and threading.current_thread() is main:
            syncs[phase[-1]] += 1

    for i in range(len(batches) - 1):
        counting = i >= 12  # the cache is full by then: evictions every step
        if counting:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            phase.append("ahead")
            cached.prefetch(batches[i + 1])
            phase[-1] = "lookup"
            pooled = cached(batches[i])
            phase[-1] = "update"
            pooled.backward(grads[i])
            phase.pop()
        torch.cuda.set_sync_debug_mode("default")
        reference = plain(batches[i])
        assert torch.equal(pooled, reference), f"step {i}"
        reference.backward(grads[i])
        if not counting:
            syncs = dict.fromkeys(syncs, 0)
    assert syncs == {"ahead": 7, "lookup": 0, "update": 0}, syncs
    assert_same_state(plain, cached)
    assert sum(s["evictions"] for s in cached.cache_stats().values()) > 0


def test_device_reads_ahead_land_in_their_slots_only_at_result() -> None:
    """DeviceIO's read ahead follows the writes submitted before it (one worker, in order), and the
    worker fills a host buffer only: the records reach their slots when result() is asked, on the
    caller's thread (on a GPU, in its stream's order)."""
    import threading

    from neorec.embedding.cache.background import BackgroundIO
    from neorec.embedding.cache.device_io import DeviceIO

    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    layout = backing.layout
    io_ = DeviceIO(BackgroundIO(backing, background=True), torch.device("cpu"))
    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([3]), layout.pack({"weight": torch.full((1, 4), -1.0)}))
    buffer = layout.pack({"weight": torch.zeros(3, 4)})
    ahead = io_.read_ahead(torch.tensor([2, 3]), buffer, torch.tensor([2, 0]))
    release.set()
    io_.drain()  # the worker's read is done...
    assert not ahead.done() and bool((layout.view(buffer, "weight") == 0).all())  # ...the slots untouched
    ahead.result()
    assert ahead.done()
    assert torch.equal(
        layout.view(buffer, "weight"), torch.tensor([[-1.0, -1, -1, -1], [0, 0, 0, 0], [8, 9, 10, 11]])
    )
    ahead.result()  # once only
    io_.close()

def test_rows_read_ahead_are_pinned_until_their_lookup() -> None:
    """A batch read ahead keeps its slots until it is looked up: a lookup in between that needs room
    evicts other rows (or reads past the cache), never those; the records arrive intact."""
    from neorec.embedding.cache.background import BackgroundIO

    weights = torch.arange(80, dtype=torch.float32).view(20, 4)
    backing = DramBacking.from_tensors({"weight": weights.clone()})
    cache = RowCache([("t", 0, 20)], backing, capacity=4, policy="lru")
    cache.io = BackgroundIO(backing, background=True)  # reads ahead on a worker thread
    a, b = torch.tensor([0, 1, 2]), torch.tensor([5, 6])
    cache.prefetch(a, lookup=True)
    cache.prefetch(b, lookup=True, ahead=True)
    resident = set(cache.row_of.tolist())
    assert {5, 6} <= resident and len(resident & {0, 1, 2}) == 2  # b has slots at once (one of a's out)
    c = torch.tensor([7, 8, 9])
    cache.prefetch(c, lookup=True)  # room for 2 beside b's pinned slots; 9 read past the cache
    assert {5, 6} <= set(cache.row_of.tolist())
    assert torch.equal(cache.read("weight", c), weights[c])
    cache.write("weight", c, torch.zeros(3, 4))
    cache.prefetch(b, lookup=True)  # its lookup: the records read ahead are placed
    assert torch.equal(cache.read("weight", b), weights[b])
    cache.flush()
    assert torch.equal(backing.field("weight")[c], torch.zeros(3, 4))
    cache.close()


def test_stats_on_a_hand_checked_sequence() -> None:
    """Capacity 2, rows of 4 fp32 weights (16 bytes). Lookups [0, 1], [1, 2], [0, 2], [2, 3]."""
    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    lru = RowCache([("t", 0, 10)], backing, capacity=2, policy="lru")
    for rows in ([0, 1], [1, 2], [0, 2], [2, 3]):
        lru.prefetch(torch.tensor(rows), lookup=True)
        lru.write("weight", torch.tensor(rows[:1]), torch.zeros(1, 4))  # update the first row
    # misses: 0, 1 | 2 (evicts 0, dirty) | 0 (evicts 1, dirty) | 3 (evicts 0, dirty; 2 was used later)
    s = lru.stats.by_table()["t"]
    assert (s["lookups"], s["misses"], s["evictions"], s["writebacks"]) == (8, 5, 3, 3)
    assert s["hit_rate"] == pytest.approx(1 - 5 / 8)
    # a record of 16 bytes of weights takes 64 (records are padded to multiples of 64 bytes)
    assert s["mib_from_dram"] == pytest.approx(5 * 64 / 2**20) and s["mib_to_dram"] == pytest.approx(
        3 * 64 / 2**20
    )
    assert sorted(lru.row_of.tolist()) == [2, 3]
    # LFU evicts the least used row: 0 (1 use) when 2 comes in, then 2 (1 use; 1 has 3) when 3 comes in
    lfu = RowCache([("t", 0, 10)], DramBacking.from_tensors({"weight": torch.zeros(10, 4)}), 2, "lfu")
    for rows in ([0, 1], [1], [1, 2], [3]):
        lfu.prefetch(torch.tensor(rows), lookup=True)
    assert sorted(lfu.row_of.tolist()) == [1, 3]
    lfu.flush()
    assert lfu.stats.by_table()["t"]["evictions"] == 2


def test_values_survive_eviction_and_flush() -> None:
    backing = DramBacking.from_tensors({"weight": torch.zeros(6, 2)})
    cache = RowCache([("t", 0, 6)], backing, capacity=2)
    cache.prefetch(torch.tensor([4, 5]))
    cache.write("weight", torch.tensor([4, 5]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert backing.field("weight")[4].sum() == 0  # written back only on eviction or flush
    assert torch.equal(
        cache.read("weight", torch.tensor([0, 5, 4])), torch.tensor([[0.0, 0], [3, 4], [1, 2]])
    )
    cache.flush()
    assert torch.equal(backing.field("weight")[4:], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_rows_written_in_any_order_land_in_their_own_places() -> None:
    """`write` takes unique rows in any order: cached ones into their slots, the others straight through."""
    backing = DramBacking.from_tensors({"weight": torch.zeros(6, 2)})
    cache = RowCache([("t", 0, 6)], backing, capacity=2)
    cache.prefetch(torch.tensor([3]))
    values = torch.tensor([[5.0, 5.5], [3.0, 3.5], [2.0, 2.5]])
    cache.write("weight", torch.tensor([5, 3, 2]), values)  # 3 cached, 5 and 2 not, unsorted
    assert torch.equal(cache.read("weight", torch.tensor([2, 3, 5])), values[[2, 1, 0]])
    assert torch.equal(backing.field("weight")[[5, 2]], values[[0, 2]])


def test_lfu_counts_decay() -> None:
    """Row 0 is looked up 8 times, then rows 1 and 2 take turns. Without decay row 0 keeps its count
    and its slot for ever; halving the counts every 4 looked-up rows lets it go (hand-checked: its
    count is 3 after its 8 lookups, 1 after the next halving, then it is the oldest of two 1s)."""
    sequence = [[0]] * 8 + [[1], [2], [1], [2], [1]]

    def resident_after(decay_rows: int) -> list[int]:
        backing = DramBacking.from_tensors({"weight": torch.zeros(10, 4)})
        cache = RowCache([("t", 0, 10)], backing, 2, "lfu", lfu_decay_rows=decay_rows)
        for rows in sequence:
            cache.prefetch(torch.tensor(rows), lookup=True)
        return sorted(cache.row_of.tolist())

    assert resident_after(10**9) == [0, 1]
    assert resident_after(4) == [1, 2]


def test_lfu_count_survives_eviction() -> None:
    """A cache of 2. Row 0 is looked up 6 times, pushed out by a batch of rows 1 and 2, and comes back
    with its count (7), pushing out one of them; row 1 is looked up twice (count 2 or 3), then row 3
    comes: the victim is the smaller count, row 1. Counting afresh, row 0 would have come back with
    1 and been the victim instead (hand-checked both ways)."""
    backing = DramBacking.from_tensors({"weight": torch.zeros(10, 4)})
    cache = RowCache([("t", 0, 10)], backing, 2, "lfu")
    for rows in [[0]] * 6 + [[1, 2], [0], [1], [1], [3]]:
        cache.prefetch(torch.tensor(rows), lookup=True)
    assert int(cache.history[0]) == 6 and sorted(cache.row_of.tolist()) == [0, 3]
    assert int(cache.uses[int(cache.slot_of[0])]) == 7


def test_reads_ahead_follow_earlier_writes_and_pending_writes_are_read() -> None:
    """The background jobs' rules (background.py), on a host-memory backing run on a worker thread."""
    import threading

    from neorec.embedding.cache.background import BackgroundIO

    backing = DramBacking.from_tensors({"weight": torch.arange(40, dtype=torch.float32).view(10, 4)})
    io_ = BackgroundIO(backing, background=True)
    layout = backing.layout
    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([3]), layout.pack({"weight": torch.full((1, 4), -1.0)}))
    buffer = layout.empty(3)
    ahead = io_.read_ahead(torch.tensor([2, 3]), buffer, torch.tensor([2, 0]))  # behind the write: sees it
    assert not ahead.done()
    release.set()
    ahead.result()
    assert torch.equal(
        layout.view(buffer, "weight")[[2, 0]], torch.tensor([[8.0, 9, 10, 11], [-1, -1, -1, -1]])
    )
    backing.write = write

    # a write-back still pending: reads take its records, not the backing store's
    import threading

    release, write = threading.Event(), backing.write
    backing.write = lambda rows, records: (release.wait(10), write(rows, records))
    io_.write(torch.tensor([5, 6]), layout.pack({"weight": torch.full((2, 4), 7.0)}))
    assert torch.equal(backing.field("weight")[5], torch.tensor([20.0, 21, 22, 23]))  # not yet written
    got = layout.view(io_.read(torch.tensor([4, 5, 6])), "weight")
    assert torch.equal(got, torch.tensor([[16.0, 17, 18, 19], [7, 7, 7, 7], [7, 7, 7, 7]]))
    release.set()
    io_.close()
    assert torch.equal(backing.field("weight")[5:7], torch.full((2, 4), 7.0))


def test_a_state_loaded_between_a_batch_s_read_ahead_and_its_lookup_is_what_it_reads(tmp_path) -> None:
    """A batch read ahead, then a checkpoint loaded (its rows leave the cache), then the batch looked
    up and trained: as an engine without a cache does, bitwise."""
    ts = tables()
    opt = EmbeddingOptimizerConfig(name="adagrad", lr=0.05)
    plain, cached = FusedEmbeddingCollection(ts, opt), cached_engine(ts, opt, tmp_path, fraction=0.2)
    gen = torch.Generator().manual_seed(0)
    batches = [batch(gen, ts) for _ in range(6)]
    saved = None
    for i, sparse in enumerate(batches):
        if i == 2:
            saved = {k: v.clone() for k, v in plain.state_dict().items()}
        if i + 1 < len(batches):
            cached.prefetch(batches[i + 1])
        if i == 4:  # back to the saved state, the coming batch read ahead already
            cached.load_state_dict(saved)
            plain.load_state_dict(saved)
        out, ref = cached(sparse), plain(sparse)
        assert torch.equal(out, ref), i
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        ref.backward(grad)
    assert_same_state(cached, plain)
