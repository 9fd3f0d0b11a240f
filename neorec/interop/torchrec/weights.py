"""Weights: TorchRec state_dicts <-> neorec models and embedding collections.

TorchRec keys of a table: `<prefix>embedding_bags.<table>.weight` in an EmbeddingBagCollection (a
pooled table), `<prefix>embeddings.<table>.weight` in an EmbeddingCollection (one row per id, a
neorec table with pooling none). A neorec collection holds both kinds, so its state under TorchRec
keys is an EmbeddingBagCollection's and an EmbeddingCollection's state_dicts side by side, both with
an empty prefix. The DLRM's dense layers map as dlrm.py says.

Every engine reads and writes whole tables: the fused engine and the sharded collection through the
table parts each process holds (neorec/checkpoint/pieces.py: a shard's rows and columns, written
from the full tensor; gathered with `gather_tables`, a collective), the reference engine through its
own state_dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.tables import TableConfig
from neorec.interop.torchrec.common import TorchRecInteropError, expect, sharded_kind
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

EBC_KEY = "embedding_bags."
EC_KEY = "embeddings."
# what each kind of TorchRec table collection is called, and what its tables are in neorec
_KINDS = {
    EBC_KEY: ("EmbeddingBagCollection", "pooled (sum or mean)"),
    EC_KEY: ("EmbeddingCollection", "unpooled (pooling none)"),
}


# ---- TorchRec -> neorec ---------------------------------------------------------------------------
def load_torchrec_state(
    model: nn.Module, state_dict: Mapping[str, Any], feature_names: Sequence[str] | None = None
) -> list[str]:
    """Copy TorchRec weights into a neorec model in place; returns the TorchRec keys it used.

    `model` is a neorec DLRM (tables and MLPs load from a TorchRec DLRM state_dict; tables alone
    from an EmbeddingBagCollection one) or an embedding collection, which takes its tables from any
    state_dict that holds them (an EmbeddingBagCollection's, an EmbeddingCollection's, both side by
    side, or a whole TorchRec model's, whose other entries it leaves). Every table of the model must
    be in the state_dict and the reverse; any shape or structure that differs raises
    TorchRecInteropError naming the key, before anything is written. A sharded collection is loaded
    by every rank with the same state_dict (not a collective): each writes the parts it holds.

    For a DLRM, the TorchRec interaction's feature order is the state_dict's order of the tables (as
    the TorchRec DLRM's own `state_dict()` lists them) when every table has one feature; otherwise,
    and for a DistributedModelParallel's state_dict (its keys sorted), `feature_names` gives it
    (TorchRec's `dlrm.sparse_arch.sparse_feature_names`; dlrm.py)."""
    from neorec.model.dlrm import DLRM

    emb = _collection(model)
    prefixes = _table_prefixes(state_dict)
    weights: dict[str, torch.Tensor] = {}
    used = []
    for kind in _KINDS:
        ours = [t for t in emb.tables if (t.pooling == "none") == (kind == EC_KEY)]
        prefix = prefixes.get(kind)
        if prefix is None and not ours:
            continue
        _check_table_names(ours, state_dict, prefix, kind, prefixes)
        for t in ours:
            key = f"{prefix}{t.name}.weight"
            weights[t.name] = expect(state_dict, key, (t.rows, t.dim))
            used.append(key)

    dense: dict[str, torch.Tensor] = {}
    tables_prefix = prefixes.get(EBC_KEY, "")
    if tables_prefix.endswith(DLRM_TABLES + EBC_KEY) and not isinstance(model, EmbeddingCollection):
        if not isinstance(model, DLRM):
            raise TorchRecInteropError(
                f"the state_dict is a TorchRec DLRM ({tables_prefix}...) but the model is a "
                f"{type(model).__name__}, which has no TorchRec counterpart: load the tables alone with "
                "load_torchrec_state(model.embeddings, state_dict)"
            )
        outer = tables_prefix[: -len(DLRM_TABLES + EBC_KEY)]
        check_plain_dlrm(state_dict, outer)
        table_order, why = recorded_table_order(state_dict, outer, "the state_dict")
        order = torchrec_feature_order(model, table_order, feature_names, why)
        dense = dlrm_dense_from_torchrec(model, state_dict, outer, order)
        used += [outer + k for k in dlrm_dense_keys(model)]
    elif isinstance(model, DLRM) and any(BOTTOM in k for k in state_dict):
        raise TorchRecInteropError(
            f"the state_dict has DLRM layers but its tables are under {tables_prefix!r}"
        )

    write_tables(emb, weights)
    if dense:
        model.load_state_dict(dense, strict=False)
    return used


def gather_torchrec_state(state_dict: Mapping[str, Any], dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective, called by every rank: a DistributedModelParallel state_dict with each sharded
    table (ShardedTensor or DTensor) assembled into one full host tensor on rank `dst`, which
    `load_torchrec_state` then reads. Returns None on the other ranks. Plain tensors pass through."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    gathered: dict[str, torch.Tensor] = {}
    for key in sorted(state_dict):  # the same order on every rank: each gather is a collective
        value = state_dict[key]
        kind = sharded_kind(value)
        if kind == "ShardedTensor":
            full = torch.empty(tuple(value.size()), dtype=value.dtype) if rank == dst else None
            value.gather(dst=dst, out=full)
            if full is not None:
                gathered[key] = full
        elif kind == "DTensor":
            gathered[key] = value.full_tensor().cpu()
        else:
            gathered[key] = value
    # in the state_dict's own order
    return {key: gathered[key] for key in state_dict} if rank == dst else None


def _table_prefixes(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """{EBC_KEY or EC_KEY: the one prefix (ending in it) under which the state_dict holds such tables}.
    A table key ends in `embedding_bags.<table>.weight` or `embeddings.<table>.weight`: module
    names hold no dots, so the table is the last name but one."""
    found: dict[str, set[str]] = {EBC_KEY: set(), EC_KEY: set()}
    for k in state_dict:
        parts = k.split(".")
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] + "." in found:
            found[parts[-3] + "."].add(".".join(parts[:-2]) + ".")
    if not any(found.values()):
        raise TorchRecInteropError(
            f"no TorchRec embedding tables in the state_dict (no '...{EBC_KEY}<table>.weight' or "
            f"'...{EC_KEY}<table>.weight' key among {sorted(state_dict)[:8]}{' ...' if len(state_dict) > 8 else ''})"
        )
    out = {}
    for kind, prefixes in found.items():
        if len(prefixes) > 1:
            first = sorted(prefixes)[0]
            raise TorchRecInteropError(
                f"the state_dict holds several {_KINDS[kind][0]}s: {sorted(prefixes)}; pass the entries of "
                f"the one that fits the model, e.g. {{k: v for k, v in state_dict.items() if k.startswith({first!r})}}"
            )
        if prefixes:
            out[kind] = prefixes.pop()
    return out


def _collection(model: nn.Module) -> EmbeddingCollection:
    if isinstance(model, EmbeddingCollection):
        return model
    emb = getattr(model, "embeddings", None)
    if not isinstance(emb, EmbeddingCollection):
        raise TorchRecInteropError(
            f"{type(model).__name__} has no neorec embedding collection (model.embeddings)"
        )
    return emb


def _names_under(state_dict: Mapping[str, Any], prefix: str | None) -> list[str]:
    if prefix is None:
        return []
    return [
        k[len(prefix) : -len(".weight")] for k in state_dict if k.startswith(prefix) and k.endswith(".weight")
    ]


def _check_table_names(
    ours: list[TableConfig],
    state_dict: Mapping[str, Any],
    prefix: str | None,
    kind: str,
    prefixes: dict[str, str],
) -> None:
    """The model's tables of one kind (pooled or not) are exactly the state_dict's of that kind."""
    what, pooling = _KINDS[kind]
    theirs = _names_under(state_dict, prefix)
    names = [t.name for t in ours]
    if set(theirs) == set(names):
        return
    missing, extra = sorted(set(names) - set(theirs)), sorted(set(theirs) - set(names))
    other = next(k for k in _KINDS if k != kind)
    elsewhere = sorted(set(missing) & set(_names_under(state_dict, prefixes.get(other))))
    hint = ""
    if elsewhere:
        hint = (
            f"; {elsewhere} are {_KINDS[other][0]} tables in the state_dict ({_KINDS[other][1]}) but "
            f"{pooling} in the model: tables_from_configs makes a pooled table of an EmbeddingBagConfig and "
            "one with pooling none of an EmbeddingConfig"
        )
    where = f"under {prefix!r}" if prefix is not None else f"(no '...{kind}<table>.weight' key)"
    raise TorchRecInteropError(
        f"{what} tables differ: the state_dict has {sorted(theirs)} {where}, the model's {pooling} tables are "
        f"{sorted(names)} (missing in the state_dict: {missing}, not in the model: {extra}){hint}"
    )


def write_tables(emb: EmbeddingCollection, weights: Mapping[str, torch.Tensor]) -> None:
    """Overwrite the tables' rows with full [rows, dim] tensors; optimizer state is left as it is."""
    from neorec.distributed.sharded import ShardedEmbeddingCollection
    from neorec.embedding.fused import FusedEmbeddingCollection

    if isinstance(emb, FusedEmbeddingCollection | ShardedEmbeddingCollection):
        from neorec.checkpoint.pieces import slots, storages
        from neorec.embedding.fused.storage import write_storage

        with torch.no_grad():
            for slot in slots(emb):  # the table parts this process holds, in global rows and columns
                (r0, r1), (c0, c1) = slot.rows, slot.cols
                storage, start = storages(slot)["weight"]
                part = weights[slot.table].detach()[r0:r1, c0:c1].contiguous()
                write_storage(storage, start, start + r1 - r0, part)
        return
    # other engines (the reference one) through their own state_dict
    state = emb.state_dict()
    index = {t.name: i for i, t in enumerate(emb.tables)}
    for name, value in weights.items():
        for key in (f"tables.{name}.weight", f"bags.{index[name]}.weight"):
            if key in state:
                state[key] = value.detach().to(state[key].dtype)
                break
        else:
            raise TorchRecInteropError(
                f"{type(emb).__name__} does not expose table {name!r} in its state_dict"
            )
    emb.load_state_dict(state)


# ---- neorec -> TorchRec ---------------------------------------------------------------------------
def torchrec_state(model: nn.Module, feature_names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A neorec DLRM's (or embedding collection's) weights under TorchRec's keys: the state_dict of
    torchrec.models.dlrm.DLRM over the same tables, or, for a collection, of an unsharded
    EmbeddingBagCollection (its pooled tables, `embedding_bags.<table>.weight`) and of an
    EmbeddingCollection (its tables with pooling none, `embeddings.<table>.weight`).

    A DLRM's top MLP takes its input columns in the order of the TorchRec DLRM's interaction: the
    neorec collection's feature order (a TorchRec DLRM over `configs_from_tables(tables)` has it),
    or `feature_names` (TorchRec's `dlrm.sparse_arch.sparse_feature_names`) for another; the tables
    are listed in that order.

    Tensors are copies, in each table's storage dtype. For a sharded collection (or a model over
    one) it is a collective: every rank calls it, and every rank gets the whole tables in host memory."""
    from neorec.model.dlrm import DLRM

    if isinstance(model, EmbeddingCollection):
        kinds = {t.name: EC_KEY if t.pooling == "none" else EBC_KEY for t in model.tables}
        return {f"{kinds[n]}{n}.weight": w for n, w in read_tables(model).items()}
    if not isinstance(model, DLRM):
        raise TorchRecInteropError(
            f"TorchRec has no model laid out like neorec's {type(model).__name__}: "
            f"use torchrec_state(model.embeddings) for its tables"
        )
    features, tables = export_feature_order(model, feature_names)
    weights = read_tables(model.embeddings)
    out = {f"{DLRM_TABLES}{EBC_KEY}{n}.weight": weights[n] for n in tables}
    out.update(dlrm_dense_to_torchrec(model, features))
    return out


def read_tables(emb: EmbeddingCollection) -> dict[str, torch.Tensor]:
    """Every table's weight [rows, dim] (copies, storage dtype); collective for a sharded collection."""
    if hasattr(emb, "gather_tables"):  # the sharded collection: shards assembled on every rank
        replicated = {t.name for t in emb.layout.dp_tables}
        gathered = emb.gather_tables()
        # gathered shards are new host tensors; a replicated table's may be the engine's own buffer
        return {
            name: entry["weight"].to("cpu", copy=True) if name in replicated else entry["weight"]
            for name, entry in gathered.items()
        }
    if not hasattr(emb, "table_weights"):
        raise TorchRecInteropError(f"{type(emb).__name__} does not hold whole tables in this process")
    return {name: w.detach().clone() for name, w in emb.table_weights().items()}
