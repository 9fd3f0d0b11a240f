"""neorec/utils/index_ops.py against the torch operations it stands for."""

import torch

from neorec.utils import index_ops


def test_index_ops_match_torch() -> None:
    """index_ops (numpy on CPU) gives what torch.unique / nonzero / sort (stable too) give, for empty, tiny, odd
    and large sizes, duplicates, and views that are not contiguous."""
    gen = torch.Generator().manual_seed(7)
    for n in (0, 1, 2, 7, 1000, 40_001):
        for high in (1, 3, 500, 2**40):
            rows = torch.randint(0, high, (n,), generator=gen)
            assert torch.equal(index_ops.sorted_unique(rows), torch.unique(rows)), (n, high)
            mask = rows % 2 == 0
            hit, miss = index_ops.split(mask)
            assert torch.equal(hit, mask.nonzero().flatten()) and torch.equal(
                miss, (~mask).nonzero().flatten()
            )
            assert torch.equal(index_ops.where(mask), mask.nonzero().flatten())
            distinct = torch.randperm(n, generator=gen) * 3
            values, order = index_ops.sort(distinct)
            expected = torch.sort(distinct)
            assert torch.equal(values, expected.values) and torch.equal(order, expected.indices)
    strided = torch.randint(0, 50, (300,), generator=gen)[::7]  # not contiguous
    assert torch.equal(index_ops.sorted_unique(strided), torch.unique(strided))
    assert torch.equal(index_ops.where(strided > 20), (strided > 20).nonzero().flatten())
    # repeats; one, two and three 16-bit digits; 0 and 2^16 at a digit's edge; beyond the radix sort's 48 bits
    for n, high in ((0, 5), (1, 5), (9, 3), (81_920, 100_000), (30_000, 2**16 + 1), (20_000, 2**40), (5000, 2**62)):
        values = torch.randint(0, high, (n,), generator=gen)
        got, expected = index_ops.stable_sort(values), torch.sort(values, stable=True)
        assert torch.equal(got[0], expected.values) and torch.equal(got[1], expected.indices), (n, high)
    # stable by itself, on both sides of TORCH_RADIX_MIN: equal values keep their positions ascending
    for n in (index_ops.TORCH_RADIX_MIN - 1, 3 * index_ops.TORCH_RADIX_MIN):
        values = torch.randint(0, 2**25, (n,), generator=gen) // 512
        ordered, order = index_ops.stable_sort(values)
        assert torch.equal(ordered, values[order]) and torch.equal(order.sort().values, torch.arange(n))
        key = ordered * n + order  # strictly ascending exactly when sorted by value, ties by position
        assert bool((key[1:] > key[:-1]).all()), n
    negative = torch.tensor([-3, 5, -3, 2, 5])
    assert torch.equal(index_ops.stable_sort(negative)[1], torch.sort(negative, stable=True).indices)


def test_padded_runs_are_unique_consecutive_without_a_read():
    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 7, 300):
        ordered = torch.sort(torch.randint(0, max(n // 3, 1), (n,), generator=g)).values
        values, starts, count = index_ops.padded_runs(ordered)
        unique, per_run = torch.unique_consecutive(ordered, return_counts=True)
        u = unique.numel()
        assert values.shape == (n,) and starts.shape == (n + 1,)
        assert count.tolist() == ([u] if n else [])
        assert torch.equal(values[:u], unique) and not values[u:].any()
        assert torch.equal(starts[: u + 1], torch.cat([torch.zeros(1, dtype=torch.int64), per_run.cumsum(0)]))
        assert (starts[u:] == n).all()
