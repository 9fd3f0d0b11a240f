"""Initial table weights, identical for every engine so that engines can be compared row for row."""

from __future__ import annotations

import math
import zlib

import torch

from neorec.embedding.tables import TableConfig
from neorec.utils.hashing import mix64


def table_seed(table: TableConfig, seed: int) -> int:
    """A seed per table that does not depend on table order (stable across processes and runs)."""
    return (seed * 1_000_003 + zlib.crc32(table.name.encode())) % (2**63 - 1)


def init_rows(table: TableConfig, seed: int, row_start: int = 0, row_end: int | None = None) -> torch.Tensor:
    """fp32 weights of rows [row_start, row_end) of `table`: uniform(+-1/sqrt(rows)) as in facebookresearch/dlrm.

    Rows are drawn in fixed chunks so that any row range (a row-wise shard, a cache fill) gets exactly
    the values the whole table would have, without materialising the table. Managed-collision tables
    draw each value from a hash of (seed, row, column) instead (init_rows_at), so that the rows an
    eviction frees are re-initialised to exactly their starting values, one row at a time.
    """
    row_end = table.rows if row_end is None else row_end
    if table.managed_collision is not None:
        return init_rows_at(table, seed, torch.arange(row_start, row_end))
    bound = 1.0 / math.sqrt(table.rows)
    out = torch.empty(row_end - row_start, table.dim, dtype=torch.float32)
    base = table_seed(table, seed)
    chunk = CHUNK_ROWS
    first, last = row_start // chunk, (row_end - 1) // chunk if row_end > row_start else -1
    gen = torch.Generator()
    for c in range(first, last + 1):
        lo, hi = c * chunk, min((c + 1) * chunk, table.rows)
        gen.manual_seed(base + c)
        block = torch.empty(hi - lo, table.dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, row_start), min(hi, row_end)
        out[a - row_start : b - row_start] = block[a - lo : b - lo]
    return out


CHUNK_ROWS = 65536


def init_rows_at(table: TableConfig, seed: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 initial weights of any rows of a managed-collision table, [len(rows), dim]: uniform(+-1/sqrt(rows))
    from a counter-based hash of (table seed, row, column), on the device of `rows`."""

    bound = 1.0 / math.sqrt(table.rows)
    cells = rows.to(torch.int64).view(-1, 1) * table.dim + torch.arange(table.dim, device=rows.device)
    bits = mix64(mix64(cells) ^ table_seed(table, seed))
    unit = (bits >> 10).to(torch.float64) * (1.0 / (1 << 53))  # 53 random bits: uniform [0, 1)
    return ((unit * 2.0 - 1.0) * bound).to(torch.float32)
