"""The CPU sort of the fused backward (lookup.sort_by_row).

sort_by_row must order ids exactly as a stable sort by row does.
"""

from __future__ import annotations

import pytest
import torch

from neorec.embedding.fused.lookup import GroupBatch, sort_by_row


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("top", [50, 2**40, 2**60])
def test_sort_by_row_is_a_stable_sort_by_row(weighted: bool, top: int) -> None:
    """Rows up to 2^60 (keys of row and bag no longer fit in 63 bits: torch's stable sort instead),
    many duplicates within and across bags, empty bags."""
    gen = torch.Generator().manual_seed(top % 1000 + weighted)
    lengths = torch.randint(0, 6, (3000,), generator=gen)
    n = int(lengths.sum())
    rows = torch.randint(0, 50, (n,), generator=gen) * (top // 50)
    bags = torch.arange(3000).repeat_interleave(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    scales = torch.rand(n, generator=gen) if weighted else None
    unique_rows, row_offsets, sorted_bags, sorted_scales = sort_by_row(
        GroupBatch(rows, bags, offsets, scales, batch_size=1000, num_features=3)
    )
    expected_rows, order = torch.sort(rows, stable=True)
    assert torch.equal(unique_rows, torch.unique(rows))
    assert torch.equal(unique_rows.repeat_interleave(torch.diff(row_offsets)), expected_rows)
    assert torch.equal(sorted_bags, bags[order])
    if weighted:
        assert torch.equal(sorted_scales, scales[order])
    else:
        assert sorted_scales is None
