"""Checkpoints and reading of FusedEmbeddingCollection's tables.

`state_dict()` holds, per table, `tables.<name>.weight` (in the storage dtype, so a round trip is
exact), one fp32 tensor per state entry (`momentum1`: adagrad sum [rows, dim] / rowwise adagrad sum
[rows] / adam first moment; `momentum2`: adam second moment) and `tables.<name>.step` (updates
applied so far), and the maps of managed-collision tables. Keys do not depend on the layout, so a
checkpoint loads into another grouping, another engine or another sharding.

It is a base class of FusedEmbeddingCollection (collection.py) and works on the groups, storages
and settings that the collection's __init__ sets up.
"""

from __future__ import annotations

import torch

from neorec.embedding.fused.storage import RowStorage, TensorStorage


class CollectionCheckpoint:
    """The collection's state_dict, its loading, and reading tables' rows."""

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's rows in the storage dtype (views of the buffers when storage is plain)."""
        out = {}
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            out[t.name] = _read_range(self.weights[gi], start, end, copy=False)
        return out

    def range_sources(self, prefix: str = "") -> dict[str, tuple[RowStorage, int, int]]:
        """state_dict keys whose rows a storage reads in ranges rather than holding them (cached
        tables): key -> (storage, start, end). Writers of large states read these in windows
        (neorec/checkpoint/stream.py) instead of through the state_dict's views."""
        out: dict[str, tuple[RowStorage, int, int]] = {}
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            for name, s in [("weight", self.weights[gi]), *self.states[gi].items()]:
                if not isinstance(s, TensorStorage) and hasattr(s, "read_range"):
                    out[f"{prefix}tables.{t.name}.{name}"] = (s, start, end)
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            key = f"{prefix}tables.{t.name}."
            destination[key + "weight"] = _read_range(self.weights[gi], start, end, copy=True)
            for name, s in self.states[gi].items():
                destination[key + name] = _read_range(s, start, end, copy=True)
            destination[key + "step"] = torch.tensor(self.num_updates, dtype=torch.int64)
        for m in self.mapped:
            for name, storage in m.id_map.storages().items():
                destination[f"{prefix}tables.{m.name}.{name}"] = storage.tensor.clone()

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        expected: set[str] = set()
        steps = []
        for t in self.tables:
            gi, start, end = self._table_range(t.name)
            key = f"{prefix}tables.{t.name}."
            for name, storage in [("weight", self.weights[gi]), *self.states[gi].items()]:
                expected.add(key + name)
                if key + name not in state_dict:
                    missing_keys.append(key + name)
                    continue
                value = state_dict[key + name]
                shape = (end - start, storage.width) if storage.width else (end - start,)
                if tuple(value.shape) != shape:
                    error_msgs.append(
                        f"{key + name}: shape {tuple(value.shape)} in the checkpoint, table needs {shape}"
                    )
                    continue
                _write_range(storage, start, end, value)
            expected.add(key + "step")
            if key + "step" in state_dict:
                steps.append(int(state_dict[key + "step"]))
        for m in self.mapped:
            for name, storage in m.id_map.storages().items():
                key = f"{prefix}tables.{m.name}.{name}"
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                elif tuple(state_dict[key].shape) != tuple(storage.tensor.shape):
                    error_msgs.append(f"{key}: shape {tuple(state_dict[key].shape)}, the map needs {tuple(storage.tensor.shape)}")
                else:
                    storage.tensor.copy_(state_dict[key])
        if steps:
            self.num_updates = max(steps)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)


def _read_range(storage: RowStorage, start: int, end: int, copy: bool) -> torch.Tensor:
    """Rows [start, end); plain storage slices (a copy only when asked and the slice is partial:
    torch.save would otherwise write the whole buffer behind a view)."""
    if isinstance(storage, TensorStorage):
        rows = storage.tensor[start:end]
        return rows.clone() if copy and end - start != storage.num_rows else rows
    if hasattr(storage, "view_range"):  # a cached table: a view of its file where it has one
        return storage.view_range(start, end)
    if hasattr(storage, "read_range"):
        return storage.read_range(start, end)
    return storage.read(torch.arange(start, end))


def _write_range(storage: RowStorage, start: int, end: int, value: torch.Tensor) -> None:
    if isinstance(storage, TensorStorage):
        storage.tensor[start:end].copy_(value)
    elif hasattr(storage, "write_range"):
        storage.write_range(start, end, value.to(storage.dtype))
    else:
        storage.write(torch.arange(start, end), value.to(storage.dtype))
