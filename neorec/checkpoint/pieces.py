"""What part of which table a process holds, and moving those rows between storage and checkpoints.

A *slot* is one table part this process owns: a whole table of a single-process fused engine, a
shard of the sharded collection (global rows and columns per the plan), or a replicated (dp)
table. A *piece* is what a checkpoint holds for one (table, state, rows, cols): weights, or one
optimizer state tensor ([rows, width], or [rows] for per-row state such as rowwise adagrad's).

Loading under another plan assembles each slot from the pieces that overlap it. Per-row state of
column-split tables is one value per row and column slice: a slot that covers other columns than
the piece gets the mean over the pieces it overlaps, weighted by the overlap width (a slot equal to
a piece gets that piece's values exactly; a whole table gets what gather_tables reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from neorec.checkpoint.files import DTYPES, CheckpointError, check_file, read_rows
from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.embedding.fused.storage import RowStorage

WINDOW_BYTES = 64 << 20  # rows are copied to and from storage in windows of about this size


@dataclass(frozen=True)
class Slot:
    table: str  # the (global) table name
    engine: FusedEmbeddingCollection  # the engine that stores it
    local_name: str  # its name in that engine (`<table>#<shard index>` for shards)
    rows: tuple[int, int]  # global [start, end)
    cols: tuple[int, int]
    owner: bool  # this process writes it in a save (a replicated table: rank 0 only)


def slots(embeddings: EmbeddingCollection) -> list[Slot]:
    """The table parts this process holds, in table order per engine."""
    from neorec.distributed.sharded import ShardedEmbeddingCollection

    if isinstance(embeddings, ShardedEmbeddingCollection):
        rank = embeddings.topo.rank
        out = [
            Slot(
                u.table.name, embeddings.local, f"{u.table.name}#{u.index}", u.shard.rows, u.shard.cols, True
            )
            for u in embeddings.layout.units[rank]
        ]
        out += [
            Slot(t.name, embeddings.replicated, t.name, (0, t.rows), (0, t.dim), rank == 0)
            for t in embeddings.layout.dp_tables
        ]
        return out
    if isinstance(embeddings, FusedEmbeddingCollection):
        return [Slot(t.name, embeddings, t.name, (0, t.rows), (0, t.dim), True) for t in embeddings.tables]
    raise CheckpointError(
        f"sharded checkpoints need the fused engine or the sharded collection, not {type(embeddings).__name__}; "
        "set embedding.engine: fused"
    )


def storages(slot: Slot) -> dict[str, tuple[RowStorage, int]]:
    """{"weight", an optimizer state name, or an id map's state name: (storage, first row of the
    slot in it)}. A managed-collision table's id map (mc_keys, ...) is per-row state of its rows."""
    gi, index = slot.engine.layout.table_slot[slot.local_name]
    start = slot.engine.layout.groups[gi].row_starts[index]
    out = {name: (s, start) for name, s in {"weight": slot.engine.weights[gi], **slot.engine.states[gi]}.items()}
    for m in slot.engine.mapped:
        if m.name == slot.local_name:
            out.update({name: (s, 0) for name, s in m.id_map.storages().items()})
    return out


def windows(num_rows: int, storage: RowStorage) -> list[tuple[int, int]]:
    size = max(storage.width, 1) * torch.empty(0, dtype=storage.dtype).element_size()
    step = max(1, WINDOW_BYTES // size)
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)] or [(0, 0)]


class PieceReader:
    """Reads any (table, state, rows, cols) from a checkpoint's pieces, opening only the files that
    hold it and reading only the rows it needs. Files are checked (size, crc32) when first opened."""

    def __init__(self, folder: Path, manifest: dict, verify: bool = True) -> None:
        self.folder, self.verify = folder, verify
        self.files = {f["name"]: f for f in manifest["files"]}
        self.by_key: dict[tuple[str, str], list[dict]] = {}
        for p in manifest["pieces"]:
            self.by_key.setdefault((p["table"], p["state"]), []).append(p)
        self._open: dict[str, BinaryIO] = {}

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, name: str) -> tuple[BinaryIO, Path]:
        path = self.folder / name
        if name not in self._open:
            entry = self.files.get(name)
            if entry is None:
                raise CheckpointError(
                    f"{self.folder}/manifest.json: a piece names file {name!r}, which it does not list"
                )
            check_file(path, entry["bytes"], entry["crc32"] if self.verify else None)
            self._open[name] = open(path, "rb")  # noqa: SIM115 - kept open until close()
        return self._open[name], path

    def read(
        self, table: str, state: str, rows: tuple[int, int], cols: tuple[int, int], per_row: bool
    ) -> torch.Tensor:
        """[rows, cols] of a table's weight or 2-d state, or [rows] of per-row state (see module doc)."""
        pieces = self.by_key.get((table, state))
        if not pieces:  # the manifest lists the table (load.check_tables): damaged, or another optimizer's state
            if state == "weight":
                raise CheckpointError(
                    f"checkpoint {self.folder}: its manifest.json lists table {table!r} but no piece of its weight: "
                    "the checkpoint is incomplete or damaged; use an earlier checkpoint"
                )
            raise CheckpointError(
                f"checkpoint {self.folder}: its manifest.json has no {state!r} piece for table {table!r}: it was "
                "trained with another embedding optimizer; continue with the one it was trained with (a "
                "table's optimizer section merges over embedding.optimizer: `neorec config show` gives "
                "each table's)"
            )
        (r0, r1), (c0, c1) = rows, cols
        out: torch.Tensor | None = None
        covered = 0
        for p in pieces:
            (pr0, pr1), (pc0, pc1) = p["rows"], p["cols"]
            a, b, ca, cb = max(r0, pr0), min(r1, pr1), max(c0, pc0), min(c1, pc1)
            if a >= b or ca >= cb:
                continue
            if (len(p["shape"]) == 1) != per_row:
                raise CheckpointError(
                    f"checkpoint {self.folder}: table {table!r} state {state!r} has shape {p['shape']} per piece, "
                    "which does not fit this optimizer; use the optimizer the checkpoint was trained with"
                )
            f, path = self._file(p["file"])
            part = read_rows(f, path, p["offset"], p["shape"], DTYPES[p["dtype"]], (a - pr0, b - pr0))
            exact = part.dtype == torch.int64  # an id map's state: values, not means
            if (a, b, pc0, pc1) == (r0, r1, c0, c1):  # the piece holds exactly what is asked: no copy
                return part.float() if per_row and not exact else part
            if out is None:
                shape = (r1 - r0,) if per_row else (r1 - r0, c1 - c0)
                out = torch.zeros(shape, dtype=torch.float32 if per_row and not exact else part.dtype)
            if exact:  # whole rows (a managed-collision table has no column split)
                out[a - r0 : b - r0] = part
                covered += (b - a) * (c1 - c0)
                continue
            if per_row:  # the overlap-width-weighted mean over column slices
                out[a - r0 : b - r0] += part.float() * ((cb - ca) / (c1 - c0))
            else:
                out[a - r0 : b - r0, ca - c0 : cb - c0] = part[:, ca - pc0 : cb - pc0]
            covered += (b - a) * (cb - ca)
        if covered != (r1 - r0) * (c1 - c0):
            raise CheckpointError(
                f"checkpoint {self.folder}: table {table!r} state {state!r}: the pieces its manifest.json lists cover "
                f"{covered} of the {(r1 - r0) * (c1 - c0)} cells of rows [{r0}, {r1}) columns [{c0}, {c1}); the "
                "checkpoint is incomplete; use an earlier checkpoint"
            )
        assert out is not None
        return out
