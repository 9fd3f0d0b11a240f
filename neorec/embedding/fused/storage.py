"""Where the rows of a group of tables live: the only way the fused engine reads or writes them.

The engine asks a storage object for rows by global row index (`read`) and hands back updated rows
(`write`). Today that is one in-memory tensor (`TensorStorage`); a cache over DRAM/SSD will implement
the same two methods (plus `prefetch`) so that the engine does not change. The engine takes a fast
path (one `embedding_bag` straight over `.tensor`, slices for checkpoints) only when a storage is
the plain kind.

Optimizer state (adagrad sums, adam moments) is stored the same way, one storage per state tensor,
so that a cache can keep the state of hot rows next to their weights. A `GroupStorageFactory` builds
all storages of a group in one call (neorec/embedding/cache does, so that a row's weights and state
are cached and evicted together).

Optional methods the engine uses when a storage has them:
- `prefetch(rows, lookup=False, ahead=False)`: bring rows into a cache before a step reads them
  (`lookup=True` counts them as looked up, for the hit rate; `ahead=True`: they belong to a coming
  batch, so a cache may only start reading them and bring them in when that batch is looked up);
- `read_range(start, end)` / `write_range(start, end, values)`: checkpoints, without going through a
  cache; read_range returns a copy, so callers read large tables in windows (`read_storage` and
  `write_storage` take a range of rows of any storage, with these methods where it has them);
- `view_range(start, end)`: rows [start, end) without reading them where the storage can (a view of
  a file, for state_dict), else a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from neorec.embedding.init import CHUNK_ROWS as INIT_CHUNK_ROWS
from neorec.utils.host import advise_huge_pages, mapped_empty

# init(start, end) -> fp32 rows [end - start, width]: the initial values of global rows [start, end).
RowInit = Callable[[int, int], torch.Tensor]


class RowStorage(Protocol):
    """Rows of one [num_rows, width] tensor of some dtype, addressed by global row index."""

    num_rows: int
    width: int
    dtype: torch.dtype

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), width] (or [len(rows)] when width is 0) in the stored dtype; rows may repeat.

        Returns a new tensor: the update rules modify what they read in place."""
        ...

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite `rows` with `values`, already in the stored dtype. Rows are unique, except that
        plain tensors also take a row repeated with the same values (replicas.py's padding)."""
        ...


# factory(num_rows, width, dtype, device, init) -> storage; width 0 means one value per row.
StorageFactory = Callable[[int, int, torch.dtype, torch.device, RowInit], RowStorage]


@dataclass
class StorageSpec:
    """One tensor of a group to build: rows, width (0 = one value per row), dtype, initial values."""

    num_rows: int
    width: int
    dtype: torch.dtype
    init: RowInit


# group_factory(tables, specs, device) -> storages. tables: (name, first global row, rows) of each
# table of the group; specs and the result are keyed "weight", then the optimizer state names.
GroupStorageFactory = Callable[
    [list[tuple[str, int, int]], dict[str, StorageSpec], torch.device], dict[str, RowStorage]
]


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


class TensorStorage:
    """Rows in one dense tensor on one device (host memory or GPU memory)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.num_rows = tensor.shape[0]
        self.width = tensor.shape[1] if tensor.dim() == 2 else 0
        self.dtype = tensor.dtype

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(0, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        # rows are unique, or repeat with the same values: the copy order cannot change the result.
        if self.tensor.device.type == "cpu" and self.dtype in _NUMPY_DTYPES and torch.get_num_threads() == 1:
            # index_copy_ copies element by element; numpy's row assignment copies row by row: 35%
            # faster on one thread (8.6k random rows of 64 fp32 in a 283k-row table: 0.5 vs 0.77 ms).
            # With more threads index_copy_ runs in parallel and keeps up, so it stays there.
            self.tensor.numpy()[rows.numpy()] = values.detach().to(self.dtype).numpy()
        else:
            self.tensor.index_copy_(0, rows, values)


def read_storage(storage: RowStorage, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of any storage: a plain tensor's view, else a copy (read_range where the
    storage has it, which bypasses a cache)."""
    if isinstance(storage, TensorStorage):
        return storage.tensor[start:end]
    if hasattr(storage, "read_range"):  # a cached table: straight from its backing store
        return storage.read_range(start, end)
    return storage.read(torch.arange(start, end))


def write_storage(storage: RowStorage, start: int, end: int, values: torch.Tensor) -> None:
    """Overwrite rows [start, end) of any storage with `values` (converted to its dtype)."""
    values = values.to(storage.dtype)
    if isinstance(storage, TensorStorage):
        storage.tensor[start:end].copy_(values)
    elif hasattr(storage, "write_range"):
        storage.write_range(start, end, values)
    else:
        storage.write(torch.arange(start, end), values)


def build_tensor_storage(
    num_rows: int, width: int, dtype: torch.dtype, device: torch.device, init: RowInit
) -> TensorStorage:
    """Allocate and fill a plain tensor, converting from fp32 in windows so no fp32 copy is whole.
    A large host buffer asks for huge pages before it is filled (rows are touched at random)."""
    shape = (num_rows, width) if width else (num_rows,)
    if torch.device(device).type == "cpu":  # a large buffer gets a memory map of its own (utils/host.py)
        tensor = mapped_empty(shape, dtype)
    else:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    window = init_window_rows(width)
    for start in range(0, num_rows, window):
        end = min(start + window, num_rows)
        tensor[start:end].copy_(init(start, end).reshape(tensor[start:end].shape))
    return TensorStorage(tensor)


# A window's temporaries (the rows drawn per table, their concatenation, one chunk of init.py) come
# from the heap, which keeps its peak for the rest of the run when freed memory is kept for reuse
# (utils/host.py). Windows of a fixed 2^20 rows (256 MiB each at dim 64) left a heap of 1.2-1.4 GB
# after initialising a 5.6M-row table and its AdaGrad state, a different size in each run with how
# the windows' holes were reused; windows of 32 MiB leave 0.37 GB (benchmarks/init_memory.py).
INIT_WINDOW_BYTES = 32 << 20


def init_window_rows(width: int) -> int:
    """Rows per initialisation window of a storage `width` fp32 values wide (0: one value per row):
    about INIT_WINDOW_BYTES, and at least one chunk of init.py, which draws whole chunks."""
    return max(INIT_CHUNK_ROWS, INIT_WINDOW_BYTES // (4 * max(width, 1)))
