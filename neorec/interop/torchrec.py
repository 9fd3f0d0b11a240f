"""TorchRec interop: batches, table configs and weights in both directions.

TorchRec is an optional dependency; it is imported when a function here first needs it. What maps:

- `KeyedJaggedTensor` <-> `SparseBatch`: both are feature-major keyed jagged layouts (all ids of
  feature 0 for samples 0..B-1, then feature 1, ...), so the id and weight tensors are shared, not
  copied. Only lengths are widened to int64 when TorchRec holds them as int32 (one entry per bag).
- `EmbeddingBagConfig` <-> `TableConfig`: name, num_embeddings -> rows, embedding_dim -> dim,
  feature_names -> features, pooling SUM/MEAN -> sum/mean, data_type FP32/FP16/BF16 -> dtype.
- weights: the state_dict of an unsharded `EmbeddingBagCollection` (`embedding_bags.<table>.weight`)
  or of `torchrec.models.dlrm.DLRM` (tables under `sparse_arch.embedding_bag_collection.`, the bottom
  MLP `dense_arch.model._mlp.<i>._linear`, the top MLP `over_arch.model.0._mlp.<i>._linear` and
  `over_arch.model.1`), with any outer prefix (`model.` of DLRMTrain, `module.`). A
  DistributedModelParallel state_dict loads once its sharded tables are gathered into full tensors.

DLRM's dense layers carry over one to one: both put ReLU after every bottom layer and every top layer
but the last, and both feed the top MLP [bottom output, pairwise dots of (bottom output, pooled
features...)]. Only the order of the dots differs: TorchRec lists pairs (i < j) row by row of the
upper triangle, neorec (i > j) row by row of the lower one, so the top MLP's first layer has its
input columns permuted on the way in and out. Features must come in the same order on both sides,
which `tables_from_configs` keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from neorec.embedding.collection import EmbeddingCollection
from neorec.embedding.tables import TableConfig
from neorec.errors import NeorecError
from neorec.sparse import SparseBatch

if TYPE_CHECKING:  # pragma: no cover
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

EBC_KEY = "embedding_bags."
DLRM_TABLES = "sparse_arch.embedding_bag_collection."
BOTTOM = "dense_arch.model._mlp."
TOP = "over_arch.model.0._mlp."
LAST = "over_arch.model.1."

_DTYPES = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}
_POOLING = {"SUM": "sum", "MEAN": "mean"}


class TorchRecInteropError(NeorecError):
    """A TorchRec object or state_dict that has no neorec counterpart, or does not fit the model."""


def _torchrec() -> Any:
    try:
        import torchrec
    except ImportError as e:
        raise TorchRecInteropError(
            "neorec.interop.torchrec needs TorchRec: pip install fbgemm-gpu-cpu (or fbgemm-gpu) and then "
            f"pip install --no-deps torchrec; see docs/torchrec.md ({e})"
        ) from None
    return torchrec


# ---- batches ------------------------------------------------------------------------------------
def sparse_from_kjt(kjt: KeyedJaggedTensor) -> SparseBatch:
    """A SparseBatch over the KJT's own id and weight tensors (no copy of the ids).

    Ids must be int64 (neorec's id type); int32 lengths are widened. A KJT whose features have
    different batch sizes (variable stride per key) has no SparseBatch form."""
    if kjt.variable_stride_per_key():
        raise TorchRecInteropError(
            f"KeyedJaggedTensor with a different batch size per feature ({kjt.stride_per_key()}) "
            f"has no SparseBatch form: every feature needs one length per sample"
        )
    values = kjt.values()
    if values.dtype != torch.int64:
        raise TorchRecInteropError(
            f"KeyedJaggedTensor ids are {values.dtype}; neorec reads int64 ids (kjt.values().long() copies them)"
        )
    lengths = kjt.lengths()
    return SparseBatch(kjt.keys(), values, lengths.to(torch.int64), kjt.weights_or_none())


def kjt_from_sparse(sparse: SparseBatch) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor over the SparseBatch's own id, length and weight tensors (no copy)."""
    kjt_type = _torchrec().KeyedJaggedTensor
    return kjt_type(
        keys=list(sparse.keys),
        values=sparse.values,
        lengths=sparse.lengths,
        weights=sparse.weights,
        stride=sparse.batch_size,
    )


# ---- table configs ------------------------------------------------------------------------------
def tables_from_configs(configs: Sequence[EmbeddingBagConfig]) -> list[TableConfig]:
    """neorec tables for TorchRec EmbeddingBagConfigs, in the same order (so features keep theirs)."""
    out = []
    for c in configs:
        pooling = _POOLING.get(c.pooling.name)
        dtype = _DTYPES.get(c.data_type.name)
        if pooling is None:
            raise TorchRecInteropError(
                f"EmbeddingBagConfig {c.name!r}: pooling {c.pooling.name} has no neorec counterpart (SUM or MEAN)"
            )
        if dtype is None:
            raise TorchRecInteropError(
                f"EmbeddingBagConfig {c.name!r}: data_type {c.data_type.name} has no neorec counterpart "
                f"(FP32, FP16 or BF16)"
            )
        if not c.feature_names:
            raise TorchRecInteropError(f"EmbeddingBagConfig {c.name!r} has no feature_names")
        out.append(
            TableConfig(
                name=c.name,
                rows=c.num_embeddings,
                dim=c.embedding_dim,
                features=list(c.feature_names),
                pooling=pooling,
                dtype=dtype,
            )
        )
    return out


def configs_from_tables(tables: Sequence[TableConfig]) -> list[EmbeddingBagConfig]:
    """TorchRec EmbeddingBagConfigs for neorec tables, in the same order."""
    configs = _torchrec().modules.embedding_configs
    dtypes = {v: k for k, v in _DTYPES.items()}
    return [
        configs.EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            feature_names=list(t.features),
            pooling=configs.PoolingType[t.pooling.upper()],
            data_type=configs.DataType[dtypes[t.dtype]],
        )
        for t in tables
    ]


# ---- weights: TorchRec -> neorec ----------------------------------------------------------------
def load_torchrec_state(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Copy TorchRec weights into a neorec model in place; returns the TorchRec keys it used.

    `model` is a neorec DLRM (tables and MLPs load from a TorchRec DLRM state_dict; tables alone
    from an EmbeddingBagCollection one) or an EmbeddingCollection (tables only). Every table of the
    model must be in the state_dict and the reverse; any shape or structure that differs raises
    TorchRecInteropError naming the key."""
    from neorec.model.dlrm import DLRM

    tables_prefix = _tables_prefix(state_dict)
    emb = _collection(model)
    _check_table_names(emb, state_dict, tables_prefix)
    weights = {}
    for t in emb.tables:
        key = f"{tables_prefix}{t.name}.weight"
        weights[t.name] = _expect(state_dict, key, (t.rows, t.dim))
    used = [f"{tables_prefix}{t.name}.weight" for t in emb.tables]

    dense: dict[str, torch.Tensor] = {}
    if tables_prefix.endswith(DLRM_TABLES + EBC_KEY):
        if not isinstance(model, DLRM):
            raise TorchRecInteropError(
                f"the state_dict is a TorchRec DLRM ({tables_prefix}...) but the model is a "
                f"{type(model).__name__}: load its tables into model.embeddings instead"
            )
        outer = tables_prefix[: -len(DLRM_TABLES + EBC_KEY)]
        dense = _dlrm_dense_from_torchrec(model, state_dict, outer)
        used += [outer + k for k in _dlrm_dense_keys(model)]
    elif isinstance(model, DLRM) and any(BOTTOM in k for k in state_dict):
        raise TorchRecInteropError(
            f"the state_dict has DLRM layers but its tables are under {tables_prefix!r}"
        )

    _write_tables(emb, weights)
    if dense:
        model.load_state_dict(dense, strict=False)
    return used


def load_torchrec_dense(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Copy only the MLP layers of a TorchRec DLRM state_dict into a neorec DLRM in place; returns the
    TorchRec keys it used. The model's embeddings are left alone, so it may pool them any way (a
    dense-only stand-in, tables loaded elsewhere); the state_dict's tables, if any, are not read."""
    from neorec.model.dlrm import DLRM

    if not isinstance(model, DLRM):
        raise TorchRecInteropError(f"load_torchrec_dense needs a neorec DLRM, not a {type(model).__name__}")
    outers = {k[: k.index(BOTTOM)] for k in state_dict if BOTTOM in k}
    if len(outers) != 1:
        raise TorchRecInteropError(
            f"expected the layers of one TorchRec DLRM ('...{BOTTOM}<i>._linear.weight'), found "
            f"{len(outers)} ({sorted(outers)})"
        )
    outer = outers.pop()
    model.load_state_dict(_dlrm_dense_from_torchrec(model, state_dict, outer), strict=False)
    return [outer + k for k in _dlrm_dense_keys(model)]


def gather_torchrec_state(state_dict: Mapping[str, Any], dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective, called by every rank: a DistributedModelParallel state_dict with each sharded
    table (ShardedTensor or DTensor) assembled into one full host tensor on rank `dst`, which
    `load_torchrec_state` then reads. Returns None on the other ranks. Plain tensors pass through."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}
    for key in sorted(state_dict):  # the same order on every rank: each gather is a collective
        value = state_dict[key]
        kind = _sharded(value)
        if kind == "ShardedTensor":
            full = torch.empty(tuple(value.size()), dtype=value.dtype) if rank == dst else None
            value.gather(dst=dst, out=full)
            if full is not None:
                out[key] = full
        elif kind == "DTensor":
            out[key] = value.full_tensor().cpu()
        else:
            out[key] = value
    return out if rank == dst else None


def _sharded(value: Any) -> str | None:
    """ "ShardedTensor" or "DTensor" for a tensor that holds only this process's shards, else None."""
    names = {c.__name__ for c in type(value).__mro__}
    return next((n for n in ("ShardedTensor", "DTensor") if n in names), None)


def _tables_prefix(state_dict: Mapping[str, Any]) -> str:
    prefixes = {
        k[: k.index(EBC_KEY) + len(EBC_KEY)] for k in state_dict if EBC_KEY in k and k.endswith(".weight")
    }
    if not prefixes:
        raise TorchRecInteropError(
            f"no TorchRec embedding tables in the state_dict (no '...{EBC_KEY}<table>.weight' key among "
            f"{sorted(state_dict)[:8]}{' ...' if len(state_dict) > 8 else ''})"
        )
    if len(prefixes) > 1:
        raise TorchRecInteropError(
            f"the state_dict holds several EmbeddingBagCollections: {sorted(prefixes)}"
        )
    return prefixes.pop()


def _collection(model: nn.Module) -> EmbeddingCollection:
    if isinstance(model, EmbeddingCollection):
        return model
    emb = getattr(model, "embeddings", None)
    if not isinstance(emb, EmbeddingCollection):
        raise TorchRecInteropError(
            f"{type(model).__name__} has no neorec embedding collection (model.embeddings)"
        )
    return emb


def _check_table_names(emb: EmbeddingCollection, state_dict: Mapping[str, Any], prefix: str) -> None:
    theirs = [
        k[len(prefix) : -len(".weight")] for k in state_dict if k.startswith(prefix) and k.endswith(".weight")
    ]
    ours = [t.name for t in emb.tables]
    if set(theirs) != set(ours):
        raise TorchRecInteropError(
            f"tables differ: the state_dict has {sorted(theirs)} under {prefix!r}, the model {sorted(ours)}"
            f" (missing in the state_dict: {sorted(set(ours) - set(theirs))}, "
            f"not in the model: {sorted(set(theirs) - set(ours))})"
        )


def _expect(state_dict: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in state_dict:
        raise TorchRecInteropError(
            f"the state_dict has no {key!r}; the neorec model needs one of shape {shape}"
        )
    value = state_dict[key]
    if not isinstance(value, torch.Tensor) or _sharded(value):
        raise TorchRecInteropError(
            f"{key!r} is a {type(value).__name__}, not a full tensor: gather a sharded (DistributedModelParallel) "
            f"state_dict into full tensors on one process first (gather_torchrec_state)"
        )
    if tuple(value.shape) != shape:
        raise TorchRecInteropError(f"{key!r} has shape {tuple(value.shape)}; the neorec model needs {shape}")
    return value


def _write_tables(emb: EmbeddingCollection, weights: Mapping[str, torch.Tensor]) -> None:
    """Through the collection's own state_dict, so every engine stores rows its own way."""
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


def _linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


def _dlrm_dense_keys(model: nn.Module) -> list[str]:
    """TorchRec keys of a neorec DLRM's MLP layers, in the order _dlrm_pairs lists them."""
    return [tr + p for _, tr in _dlrm_pairs(model) for p in ("weight", "bias")]


def _dlrm_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(neorec key prefix, TorchRec key prefix) of every linear layer of a neorec DLRM."""
    pairs = []
    for i, _ in enumerate(_linears(model.bottom)):
        pairs.append((f"bottom.{2 * i}.", f"{BOTTOM}{i}._linear."))
    top = _linears(model.top)
    for i in range(len(top) - 1):
        pairs.append((f"top.{2 * i}.", f"{TOP}{i}._linear."))
    pairs.append((f"top.{2 * (len(top) - 1)}.", LAST))
    return pairs


def _interaction_order(model: nn.Module) -> torch.Tensor:
    """For each of neorec's dot columns, the column of the same pair in TorchRec's InteractionArch."""
    n = model.interaction.num_vectors
    rows, cols = torch.triu_indices(n, n, offset=1)  # TorchRec's pairs, i < j
    position = {(int(i), int(j)): k for k, (i, j) in enumerate(zip(rows, cols, strict=True))}
    flat = model.interaction.flat.cpu()
    out = []
    for p in flat.tolist():
        i, j = divmod(p, n)  # neorec's pair, i > j
        if (j, i) not in position:
            raise TorchRecInteropError(
                "the neorec DLRM has model.self_interaction: true; TorchRec's DLRM has no self-interaction terms"
            )
        out.append(position[(j, i)])
    return torch.tensor(out, dtype=torch.int64)


def _dlrm_dense_from_torchrec(
    model: nn.Module, state_dict: Mapping[str, Any], outer: str
) -> dict[str, torch.Tensor]:
    order = _interaction_order(model)
    ours = model.state_dict()
    expected = {outer + k for k in _dlrm_dense_keys(model)}
    extra = sorted(
        k
        for k in state_dict
        if k.startswith(outer) and (BOTTOM in k or "over_arch." in k) and k not in expected
    )
    if extra:
        raise TorchRecInteropError(
            f"the TorchRec DLRM has layers the neorec DLRM lacks: {extra} (compare model.bottom_mlp / "
            f"model.top_mlp with dense_arch_layer_sizes / over_arch_layer_sizes)"
        )
    out = {}
    for ne, tr in _dlrm_pairs(model):
        for p in ("weight", "bias"):
            out[ne + p] = _expect(state_dict, outer + tr + p, tuple(ours[ne + p].shape)).detach().clone()
    d = _linears(model.bottom)[-1].out_features
    first = out["top.0.weight"]
    out["top.0.weight"] = torch.cat([first[:, :d], first[:, d:][:, order]], dim=1)
    return out


# ---- weights: neorec -> TorchRec ----------------------------------------------------------------
def torchrec_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A neorec DLRM's (or EmbeddingCollection's) weights under TorchRec's keys: the state_dict of
    torchrec.models.dlrm.DLRM (or of an unsharded EmbeddingBagCollection) over the same tables.

    Tensors are copies, in each table's storage dtype."""
    from neorec.model.dlrm import DLRM

    if isinstance(model, EmbeddingCollection):
        return {f"{EBC_KEY}{n}.weight": w for n, w in _table_weights(model).items()}
    if not isinstance(model, DLRM):
        raise TorchRecInteropError(
            f"TorchRec has no model laid out like neorec's {type(model).__name__}: "
            f"use torchrec_state(model.embeddings) for its tables"
        )
    out = {f"{DLRM_TABLES}{EBC_KEY}{n}.weight": w for n, w in _table_weights(model.embeddings).items()}
    ours = model.state_dict()
    for ne, tr in _dlrm_pairs(model):
        for p in ("weight", "bias"):
            out[tr + p] = ours[ne + p].detach().clone()
    d = _linears(model.bottom)[-1].out_features
    order = _interaction_order(model)
    first = out[f"{TOP}0._linear.weight"] if len(_linears(model.top)) > 1 else out[LAST + "weight"]
    back = torch.empty_like(first)
    back[:, :d] = first[:, :d]
    back[:, d + order] = first[:, d:]
    if len(_linears(model.top)) > 1:
        out[f"{TOP}0._linear.weight"] = back
    else:
        out[LAST + "weight"] = back
    return out


def _table_weights(emb: EmbeddingCollection) -> dict[str, torch.Tensor]:
    if not hasattr(emb, "table_weights"):
        raise TorchRecInteropError(f"{type(emb).__name__} does not hold whole tables in this process")
    return {name: w.detach().clone() for name, w in emb.table_weights().items()}
