"""torch.save of a model state whose tables are larger than memory (the trainer's model.pt).

A cached table's state_dict entries are views of its file (neorec/embedding/cache); torch.save would
read them through the map, and every page read stays resident until the save ends, so memory would
grow by the table. Here those entries are replaced by placeholders (allocated, never touched) and
the file torch.save writes gets each placeholder's bytes from its storage instead, read in windows
of rows (`WINDOW_BYTES`): memory holds one window, never the table. The result is an ordinary
torch.save file (torch.load, weights_only, mmap all work). Its records carry no CRC32, as with
torch's own `compute_crc32 = False` setting: torch.load does not need them, and computing them
would mean reading every placeholder.

How the bytes are swapped: torch.save writes each tensor's storage with one call of the file
object's write(), handing it the storage's memory; a placeholder's memory is recognised by its
address and size. A torch that wrote storages differently would leave a placeholder unseen: that
raises instead of writing a wrong file.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from torch import nn

from neorec.embedding.fused.storage import RowStorage

WINDOW_BYTES = 64 << 20
_STREAM_MIN_BYTES = 1 << 20  # smaller entries are copied as they are


def save_model_state(state: dict, path: str | Path, model: nn.Module) -> None:
    """torch.save(state, path), streaming the entries of `model`'s cached tables from their storage."""
    sources: dict[str, tuple[RowStorage, int, int]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "range_sources"):
            sources.update(module.range_sources(f"{name}." if name else ""))
    sources = {k: v for k, v in sources.items() if k in state}
    if not sources:
        torch.save(state, path)
        return
    # small entries are simply read (a copy of exactly the table's rows); large ones are streamed
    small = {k for k in sources if state[k].numel() * state[k].element_size() < _STREAM_MIN_BYTES}
    copies = {k: sources[k][0].read_range(sources[k][1], sources[k][2]) for k in small}
    placeholders = {k: torch.empty(state[k].shape, dtype=state[k].dtype) for k in sources if k not in small}
    by_address = {(p.data_ptr(), p.nbytes): k for k, p in placeholders.items()}
    from torch.utils.serialization import config

    compute_crc32 = config.save.compute_crc32
    config.save.compute_crc32 = False  # a CRC would read the placeholders (see the module doc)
    try:
        with open(path, "wb") as f:
            writer = _SwappingWriter(f, by_address, {k: sources[k] for k in by_address.values()})
            torch.save({k: placeholders.get(k, copies.get(k, v)) for k, v in state.items()}, writer)
    finally:
        config.save.compute_crc32 = compute_crc32
    unseen = sorted(set(by_address.values()) - writer.streamed)
    if unseen:
        Path(path).unlink(missing_ok=True)
        raise RuntimeError(
            f"saving {path}: torch.save did not write {unseen} as one piece, so their rows could not be "
            f"streamed (torch {torch.__version__}); save the sharded checkpoint instead (neorec/checkpoint)"
        )


class _SwappingWriter(io.RawIOBase):
    """A file for torch.save that writes a placeholder's rows from its storage, window by window."""

    def __init__(self, f, by_address: dict[tuple[int, int], str], sources: dict) -> None:
        super().__init__()
        self.f, self.by_address, self.sources = f, by_address, sources
        self.streamed: set[str] = set()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        key = None
        if view.nbytes >= _STREAM_MIN_BYTES:
            key = self.by_address.get((np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes))
        if key is None:
            return self.f.write(view)
        storage, start, end = self.sources[key]
        row_bytes = view.nbytes // max(end - start, 1)
        step = max(1, WINDOW_BYTES // max(row_bytes, 1))
        for a in range(start, end, step):
            rows = storage.read_range(a, min(a + step, end)).contiguous()
            self.f.write(memoryview(rows.reshape(-1).view(torch.uint8).numpy()))
            del rows  # before the next window is read: one window in memory, not two
        self.streamed.add(key)
        return view.nbytes

    def flush(self) -> None:
        self.f.flush()
