"""TorchRec's checkpoints: torch.distributed.checkpoint (DCP) folders <-> neorec models.

A TorchRec DistributedModelParallel (DMP) is saved with `dcp.save({"model": dmp.state_dict(), "optim":
dmp.fused_optimizer.state_dict()}, checkpoint_id=...)` or the like. Its entries, flattened with dots:

- a table: `<prefix>embedding_bags.<table>.weight` (an EmbeddingBagCollection's; an
  EmbeddingCollection's under `embeddings.`), [rows, dim], in the chunks its sharding cut it into;
- a table's fused optimizer state: `<...>.<table key>.<table>.momentum1` (row-wise Adagrad: one value
  per row; Adagrad: [rows, dim]; Adam: its first moment, with the second in `...<table>.exp_avg_sq`);
- a TorchRec DLRM's MLP layers (dlrm.py), plain tensors.

A row-wise state of a table that TorchRec splits by columns is one block of [rows] per column shard,
the blocks in column order ([rows * shards]); otherwise it is [rows] (table-wise, row-wise). The
state means what neorec's does: FBGEMM's row-wise Adagrad adds mean(g^2) over the row's (shard's)
columns, and TorchRec's table gradients, like neorec's, are those of the mean loss over the global
batch.

`load_dcp` reads such a folder into a neorec model: every process reads only the table parts it
holds (DCP reshards: any TorchRec sharding in, any neorec plan and world size out), in windows of
rows. `save_dcp` writes a neorec model as such a folder, each process its own shards, for
`dcp.load(dmp.state_dict())` on the TorchRec side. What is not carried is reported, not guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.fused.optimizers import RULES
from neorec.embedding.tables import TableConfig
from neorec.interop.torchrec.common import TorchRecInteropError
from neorec.interop.torchrec.dcp_io import (
    CheckedReader,
    Part,
    load_parts,
    read_metadata,
    save_parts,
    tensor_entry,
)
from neorec.interop.torchrec.dlrm import (
    BOTTOM,
    DLRM_TABLES,
    check_plain_dlrm,
    dlrm_dense_from_torchrec,
    dlrm_dense_keys,
    dlrm_dense_to_torchrec,
    export_feature_order,
    recorded_table_order,
    torchrec_feature_order,
)
from neorec.interop.torchrec.weights import EBC_KEY, EC_KEY, _check_table_names, _collection, _table_prefixes

# neorec's state of each embedding optimizer -> the name of the same state in TorchRec's fused optimizer
TORCHREC_STATE = {
    "sgd": {},
    "rowwise_adagrad": {"momentum1": "momentum1"},
    "adagrad": {"momentum1": "momentum1"},
    "adam": {"momentum1": "momentum1", "momentum2": "exp_avg_sq"},
}


@dataclass
class DcpReport:
    """What a load or save carried: table weights, optimizer state per table, dense keys, and why a
    table's optimizer state was left out."""

    tables: list[str] = field(default_factory=list)
    optimizer_state: dict[str, list[str]] = field(default_factory=dict)  # table -> DCP keys
    dense: list[str] = field(default_factory=list)  # DCP keys of dense layers
    not_carried: dict[str, str] = field(default_factory=dict)  # table -> why its state stayed


# ---- TorchRec -> neorec ---------------------------------------------------------------------------
def load_dcp(
    model: nn.Module,
    folder: str | Path,
    optimizer_state: bool = True,
    feature_names: Sequence[str] | None = None,
) -> DcpReport:
    """Read a DCP checkpoint of a TorchRec model into a neorec DLRM or embedding collection in place.

    Every table of the model must be in the checkpoint and the reverse (names, shapes and kind:
    pooled tables from an EmbeddingBagCollection, pooling none from an EmbeddingCollection); a neorec
    DLRM also takes a TorchRec DLRM's MLP layers. With `optimizer_state`, a table's embedding
    optimizer state is read where TorchRec's has the same meaning (TORCHREC_STATE); a table whose
    checkpoint holds another optimizer's state is refused, naming it. Everything is checked before
    any table is written. Not a collective: every process of a sharded collection calls it and reads
    the parts it holds, so it reads any TorchRec sharding under any neorec plan and world size.

    A TorchRec DLRM's feature order (which its top MLP's columns follow) is the order of its tables
    in the saved dict, which DCP's metadata records as `planner_data` (dcp.save's default planner and
    `save_dcp` write it), when every table has one feature and the dict is the DLRM's own state_dict;
    otherwise, and for a DistributedModelParallel's (its keys sorted), `feature_names` gives it
    (TorchRec's `dlrm.sparse_arch.sparse_feature_names`; dlrm.py)."""
    metadata = read_metadata(folder)
    keys = metadata.state_dict_metadata
    emb = _collection(model)
    _refuse_id_maps(emb)
    table_keys = _table_keys(emb, keys)
    report = DcpReport(tables=[t.name for t in emb.tables])
    states: dict[str, dict[str, str]] = {}  # table -> {neorec state: DCP key}
    for t in emb.tables:
        entry = tensor_entry(metadata, table_keys[t.name])
        if tuple(entry.size) != (t.rows, t.dim):
            raise TorchRecInteropError(
                f"{table_keys[t.name]!r} is {list(entry.size)} in the DCP checkpoint; the neorec table {t.name!r} is "
                f"[{t.rows}, {t.dim}]"
            )
        found = _state_keys(keys, table_keys[t.name], t.name)
        if optimizer_state:
            states[t.name] = _carried_state(
                t, _optimizer_name(emb, t), found, metadata, table_keys[t.name], report
            )
    dense = _read_dlrm_dense(model, metadata, folder, table_keys, feature_names)
    reader = CheckedReader(folder, metadata)
    _read_tables(emb, reader, metadata, table_keys, states)
    if dense:
        model.load_state_dict(dense[0], strict=False)
        report.dense = dense[1]
    for name, by_state in states.items():
        if by_state:
            report.optimizer_state[name] = sorted(by_state.values())
    return report


def _refuse_id_maps(emb: EmbeddingCollection) -> None:
    mapped = [t.name for t in emb.tables if t.managed_collision is not None]
    if mapped:
        raise TorchRecInteropError(
            f"tables {mapped} have managed collision: their id maps have no counterpart in a TorchRec DCP "
            "checkpoint of an EmbeddingBagCollection or EmbeddingCollection"
        )


def _table_keys(emb: EmbeddingCollection, keys: Mapping[str, object]) -> dict[str, str]:
    """{table: its weight's DCP key}, after checking that the model's tables are exactly the
    checkpoint's, kind by kind (the error names the missing and extra tables)."""
    prefixes = _table_prefixes(keys)
    out = {}
    for kind in (EBC_KEY, EC_KEY):
        ours = [t for t in emb.tables if (t.pooling == "none") == (kind == EC_KEY)]
        prefix = prefixes.get(kind)
        if prefix is None and not ours:
            continue
        _check_table_names(ours, keys, prefix, kind, prefixes)
        out.update({t.name: f"{prefix}{t.name}.weight" for t in ours})
    return out


def _state_keys(keys: Iterable[str], table_key: str, table: str) -> dict[str, str]:
    """{TorchRec state name: DCP key} of a table's fused optimizer state: keys that end in
    `<table key without its outer prefix>.<table>.<state>`, e.g. `optim.state.<module key>.t.momentum1`."""
    parts = table_key.split(".")
    tail = ".".join(parts[-3:]) + f".{table}."  # embedding_bags.<table>.weight.<table>.
    out: dict[str, str] = {}
    for k in keys:
        at = k.rfind(tail)
        if at < 0 or (at > 0 and k[at - 1] != ".") or k == table_key:
            continue
        state = k[at + len(tail) :]
        if "." in state:
            continue
        if state in out:
            raise TorchRecInteropError(
                f"the DCP checkpoint holds state {state!r} of table {table!r} twice: {out[state]!r} and {k!r}"
            )
        out[state] = k
    return out


def _optimizer_name(emb: EmbeddingCollection, t: TableConfig) -> str:
    return (t.optimizer or emb.optimizer_config).name


def _torchrec_kind(found: Mapping[str, str], metadata) -> str:
    """Which TorchRec (FBGEMM) optimizer a table's state comes from, by its names and shapes."""
    names = set(found)
    if names == {"momentum1", "exp_avg_sq"}:
        return "adam"
    if names == {"momentum1"}:
        return "rowwise_adagrad" if len(tensor_entry(metadata, found["momentum1"]).size) == 1 else "adagrad"
    return f"an optimizer with state {sorted(names)}"


def _carried_state(
    t: TableConfig, ours: str, found: dict[str, str], metadata, table_key: str, report: DcpReport
) -> dict[str, str]:
    """{neorec state: DCP key} to read for table `t`, whose neorec optimizer is `ours`; refuses state
    of another optimizer, notes in the report why a table's state is not read."""
    wanted = TORCHREC_STATE[ours]
    if not found:
        if wanted:
            report.not_carried[t.name] = "the checkpoint holds no optimizer state for it"
        return {}
    theirs = _torchrec_kind(found, metadata)
    if not wanted:
        report.not_carried[t.name] = f"neorec's {ours} keeps no state (the checkpoint's is {theirs}'s)"
        return {}
    if theirs != ours:
        raise TorchRecInteropError(
            f"table {t.name!r}: the DCP checkpoint holds the state of {theirs} ({sorted(found.values())}), the neorec "
            f"table's optimizer is {ours}: give the table the optimizer it was trained with, or read its weights "
            "alone (optimizer_state=False, neorec checkpoint import-dcp --no-optimizer-state)"
        )
    out = {state: found[name] for state, name in wanted.items()}
    for key in out.values():
        entry = tensor_entry(metadata, key)
        if len(entry.size) == 2 and tuple(entry.size) != (t.rows, t.dim):
            raise TorchRecInteropError(
                f"{key!r} is {list(entry.size)}; table {t.name!r} is [{t.rows}, {t.dim}]"
            )
        if len(entry.size) == 1:
            blocks = row_blocks(metadata, table_key)
            if entry.size[0] != sum(r1 - r0 for (r0, r1), _, _ in blocks):
                raise TorchRecInteropError(
                    f"{key!r} holds {entry.size[0]} values, which is not one per row of each of the {len(blocks)} "
                    f"chunks of {table_key!r} (table {t.name!r}, {t.rows} rows): a layout neorec does not read"
                )
    return out


def row_blocks(metadata, table_key: str) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """(rows, cols, first value) of each chunk of a table in its row-wise optimizer state: one
    block of values per chunk, chunks in column order (then row order), as TorchRec lays it out."""
    chunks = sorted(
        tensor_entry(metadata, table_key).chunks, key=lambda c: (int(c.offsets[1]), int(c.offsets[0]))
    )
    out, start = [], 0
    for c in chunks:
        (r0, c0), (nr, nc) = (int(x) for x in c.offsets), (int(x) for x in c.sizes)
        out.append(((r0, r0 + nr), (c0, c0 + nc), start))
        start += nr
    return out


def _read_dlrm_dense(model: nn.Module, metadata, folder, table_keys: dict[str, str], feature_names):
    """(neorec entries, DCP keys) of a TorchRec DLRM's MLP layers for a neorec DLRM, else None."""
    from neorec.model.dlrm import DLRM

    keys = metadata.state_dict_metadata
    tables_prefix = next(iter(table_keys.values()), "").rsplit(".", 2)[0] + "."
    is_dlrm = tables_prefix.endswith(DLRM_TABLES + EBC_KEY)
    if not isinstance(model, DLRM):
        if is_dlrm and not isinstance(model, EmbeddingCollection):
            raise TorchRecInteropError(
                f"the DCP checkpoint is a TorchRec DLRM's ({tables_prefix}...) but the model is a "
                f"{type(model).__name__}, which has no TorchRec counterpart: load its tables alone with "
                "load_dcp(model.embeddings, folder)"
            )
        return None
    if not is_dlrm:
        if any(BOTTOM in k for k in keys):
            raise TorchRecInteropError(
                f"the DCP checkpoint has DLRM layers but its tables are under {tables_prefix!r}"
            )
        return None
    outer = tables_prefix[: -len(DLRM_TABLES + EBC_KEY)]
    check_plain_dlrm(keys, outer)
    # planner_data: DCP's record of the saved dict's entries in its order ({flattened key: path})
    saved = getattr(metadata, "planner_data", None)
    table_order, why = None, (
        f"{folder}: its .metadata does not record the order of the saved entries (no planner_data, which "
        "dcp.save writes when it flattens the saved dict, as by default), so the TorchRec DLRM's feature "
        "order is unknown"
    )
    if isinstance(saved, Mapping):
        table_order, why = recorded_table_order(saved, outer, f"{folder}: the saved dict")
    order = torchrec_feature_order(model, table_order, feature_names, why)
    layers = [k for k in keys if k.startswith(outer) and (BOTTOM in k or "over_arch." in k)]
    parts = {k: [((0,) * len(tensor_entry(metadata, k).size), torch.empty(tuple(tensor_entry(metadata, k).size)))] for k in layers}  # fmt: skip
    load_parts(CheckedReader(folder, metadata), parts)
    values = {k: p[0][1] for k, p in parts.items()}
    return dlrm_dense_from_torchrec(model, values, outer, order), [outer + k for k in dlrm_dense_keys(model)]


def _read_tables(emb: EmbeddingCollection, reader: CheckedReader, metadata, table_keys, states) -> None:
    """Every table part this process holds, window by window: weights, then the chosen states."""
    from neorec.checkpoint.pieces import slots, storages, windows
    from neorec.embedding.fused.storage import write_storage

    for slot in slots(emb):
        (r0, _), (c0, c1) = slot.rows, slot.cols
        held = storages(slot)
        weight_storage, start = held["weight"]
        by_state = {"weight": table_keys[slot.table], **states.get(slot.table, {})}
        for a, b in windows(slot.rows[1] - r0, weight_storage):
            rows = (r0 + a, r0 + b)
            parts: dict[str, list[Part]] = {}
            combine = []  # per-row state: (state, [(part index, weight, rows in the window)])
            for state, key in by_state.items():
                storage = held[state][0]
                if len(tensor_entry(metadata, key).size) == 2:
                    parts.setdefault(key, []).append(
                        ((rows[0], c0), torch.empty(b - a, c1 - c0, dtype=storage.dtype))
                    )
                    combine.append((state, key, None))
                else:
                    combine.append((state, key, _row_state_parts(metadata, table_keys[slot.table], key, rows, (c0, c1), parts)))  # fmt: skip
            load_parts(reader, parts)
            for state, key, pieces in combine:
                storage, first = held[state]
                if pieces is None:  # the region itself
                    values = parts[key][0][1]
                else:
                    values = torch.zeros(b - a)
                    for index, share, (lo, hi) in pieces:
                        values[lo - rows[0] : hi - rows[0]] += parts[key][index][1] * share
                write_storage(storage, first + a, first + b, values)


def _row_state_parts(metadata, table_key: str, key: str, rows, cols, parts: dict[str, list[Part]]):
    """Ask for the values of rows `rows` of a row-wise state, for a slot of columns `cols`: from
    every TorchRec chunk that overlaps it, the chunk's block, weighted by the columns shared (a
    slot over several column shards gets their overlap-weighted mean). Returns [(part index, weight,
    (first row, end row))]."""
    (a, b), (c0, c1) = rows, cols
    out = []
    for (r0, r1), (k0, k1), first in row_blocks(metadata, table_key):
        lo, hi, shared = max(a, r0), min(b, r1), min(c1, k1) - max(c0, k0)
        if lo >= hi or shared <= 0:
            continue
        parts.setdefault(key, []).append(((first + lo - r0,), torch.empty(hi - lo)))
        out.append((len(parts[key]) - 1, shared / (c1 - c0), (lo, hi)))
    return out


# ---- neorec -> TorchRec ---------------------------------------------------------------------------
def save_dcp(
    model: nn.Module,
    folder: str | Path,
    prefix: str = "model.",
    module_prefix: str = "",
    optimizer_prefix: str | None = "optim.",
    row_state_columns: Mapping[str, Sequence[int]] | None = None,
    feature_names: Sequence[str] | None = None,
) -> DcpReport:
    """Write a neorec DLRM or embedding collection as a DCP checkpoint that a TorchRec model loads
    with `dcp.load`. Collective for a sharded collection (every rank calls it; each writes the table
    parts it holds, as chunks of the whole tables); `folder` appears only once complete.

    Keys: `prefix` + `module_prefix` + what `torchrec_state` names the weights (a DLRM's tables and MLP
    layers under TorchRec DLRM's keys, a collection's under `embedding_bags.` / `embeddings.`).
    `prefix` is where the saved dict holds the model ("model." for `{"model": dmp.state_dict(), ...}`,
    "" for `dmp.state_dict()` itself); `module_prefix` is where the TorchRec model keeps the tables
    ("model." in DLRMTrain). With `optimizer_prefix`, each table's optimizer state goes to
    `<optimizer_prefix>state.<module_prefix + table key>.<table>.<state>`, the layout of
    `dmp.fused_optimizer.state_dict()`.

    Row-wise state (row-wise Adagrad's) is laid out as TorchRec lays out a table's: one block of
    [rows] per column shard. `row_state_columns` {table: the first column of each shard} says how
    the TorchRec model that will load it splits a table; by default a table is split as this model
    splits it ([0]: a whole table, [rows]). A block over other columns than neorec's shards gets their
    mean weighted by the columns shared (exact where the splits agree).

    A DLRM's top MLP takes its columns in the TorchRec DLRM's feature order: the collection's own
    (a TorchRec DLRM over `configs_from_tables(tables)`), or `feature_names` for another. The
    metadata's `planner_data` lists the tables in that order, which `load_dcp` reads back."""
    from neorec.checkpoint.pieces import slots, storages
    from neorec.embedding.fused.storage import read_storage
    from neorec.model.dlrm import DLRM

    emb = _collection(model)
    _refuse_id_maps(emb)
    if hasattr(emb, "sync_replica_state"):  # replicated tables' state, current on their owners only
        emb.sync_replica_state()
    dlrm = isinstance(model, DLRM)
    features, order = ([], [t.name for t in emb.tables])
    if dlrm:
        features, order = export_feature_order(model, feature_names)
    tables = {t.name: t for t in emb.tables}
    report = DcpReport(tables=list(tables))
    keys: dict[tuple[str, str], str] = {}  # (table, "weight" or a neorec state) -> DCP key
    for t in emb.tables:
        kind = EC_KEY if t.pooling == "none" and not dlrm else EBC_KEY
        module_key = f"{module_prefix}{DLRM_TABLES if dlrm else ''}{kind}{t.name}.weight"
        keys[(t.name, "weight")] = prefix + module_key
        names = TORCHREC_STATE[_optimizer_name(emb, t)] if optimizer_prefix is not None else {}
        for state, name in names.items():
            keys[(t.name, state)] = f"{optimizer_prefix}state.{module_key}.{t.name}.{name}"
        if names:
            report.optimizer_state[t.name] = sorted(keys[(t.name, s)] for s in names)
        elif optimizer_prefix is not None:
            report.not_carried[t.name] = f"neorec's {_optimizer_name(emb, t)} keeps no state"
    blocks = _row_state_blocks(emb, row_state_columns or {})
    # row-wise state: summed here into its blocks, [rows * blocks], unless a whole table is written whole
    row_sums = {
        key: torch.zeros(tables[table].rows * len(blocks[table]))
        for (table, state), key in keys.items()
        if state != "weight" and not RULES[_optimizer_name(emb, tables[table])].state[state]
        and (blocks[table] != [(0, tables[table].dim)] or table in _column_split(emb))
    }  # fmt: skip
    # the weight of a table whose row-wise state is in blocks comes in chunks of the blocks' columns,
    # as a TorchRec table split by columns has it: a reader finds each block's columns in the chunks
    in_blocks = {table for (table, _), key in keys.items() if key in row_sums}
    parts: dict[str, list[Part]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for slot in slots(emb):
        t = tables[slot.table]
        (r0, r1), (c0, c1) = slot.rows, slot.cols
        for state, (storage, first) in storages(slot).items():
            key = keys.get((t.name, state))
            if key is None or not slot.owner:
                continue
            values = read_storage(storage, first, first + r1 - r0).detach().to("cpu", copy=True)
            if storage.width:
                cuts = blocks[t.name] if state == "weight" and t.name in in_blocks else [(c0, c1)]
                for a, b in ((max(c0, k0), min(c1, k1)) for k0, k1 in cuts):
                    if b > a:
                        parts.setdefault(key, []).append(((r0, a), values[:, a - c0 : b - c0].contiguous()))
                sizes[key] = (t.rows, t.dim)
            elif key in row_sums:
                for i, (k0, k1) in enumerate(blocks[t.name]):
                    shared = min(c1, k1) - max(c0, k0)
                    if shared > 0:
                        row_sums[key][i * t.rows + r0 : i * t.rows + r1] += values.float() * (
                            shared / (k1 - k0)
                        )
            else:
                parts.setdefault(key, []).append(((r0,), values))
                sizes[key] = (t.rows,)
    for key, total in sorted(row_sums.items()):  # the same keys in the same order on every rank
        if _world(emb) > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        if _rank(emb) == 0:
            parts[key], sizes[key] = [((0,), total)], (total.numel(),)
    if dlrm:
        dense = {prefix + module_prefix + k: v for k, v in dlrm_dense_to_torchrec(model, features).items()}
        report.dense = list(dense)
        if _rank(emb) == 0:  # the same on every rank: written once
            for key, value in dense.items():
                parts[key], sizes[key] = [((0,) * value.dim(), value)], tuple(value.shape)
    # every key, the tables' weights first and in the TorchRec model's order (the same on every rank)
    entries = [keys[(name, "weight")] for name in order]
    entries += [k for (_, state), k in keys.items() if state != "weight"] + report.dense
    save_parts(folder, parts, sizes, entries)
    return report


def _column_split(emb: EmbeddingCollection) -> dict[str, list[int]]:
    """{table: the first column of each of its shards}, for the tables a sharded collection's plan
    splits by columns (on any rank)."""
    units = getattr(getattr(emb, "layout", None), "units", None)  # the sharded collection's, on all ranks
    starts: dict[str, set[int]] = {}
    for per_rank in units or []:
        for u in per_rank:
            starts.setdefault(u.table.name, set()).add(u.shard.cols[0])
    return {name: sorted(s) for name, s in starts.items() if len(s) > 1}


def _row_state_blocks(
    emb: EmbeddingCollection, given: Mapping[str, Sequence[int]]
) -> dict[str, list[tuple[int, int]]]:
    """{table: the column range of each block of its row-wise state}, from `given` first columns
    (checked: the error names the table), else the collection's own split."""
    tables = {t.name: t for t in emb.tables}
    unknown = sorted(set(given) - set(tables))
    if unknown:
        raise TorchRecInteropError(
            f"row_state_columns names tables {unknown} that the model does not have ({sorted(tables)})"
        )
    own = _column_split(emb)
    out = {}
    for name, t in tables.items():
        starts = [int(c) for c in given.get(name, own.get(name, [0]))]
        if (
            not starts
            or starts[0] != 0
            or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
            or starts[-1] >= t.dim
        ):
            raise TorchRecInteropError(
                f"row_state_columns[{name!r}] = {starts}: the first column of each column shard, rising from 0 and "
                f"below the table's dim {t.dim}"
            )
        out[name] = list(zip(starts, [*starts[1:], t.dim], strict=True))
    return out


def _rank(emb: EmbeddingCollection) -> int:
    topo = getattr(emb, "topo", None)
    return topo.rank if topo is not None else 0


def _world(emb: EmbeddingCollection) -> int:
    topo = getattr(emb, "topo", None)
    return topo.world_size if topo is not None else 1
