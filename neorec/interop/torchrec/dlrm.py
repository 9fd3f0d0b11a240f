"""DLRM's dense layers: a TorchRec `torchrec.models.dlrm.DLRM` <-> a neorec `neorec.model.dlrm.DLRM`.

TorchRec keys: the bottom MLP `dense_arch.model._mlp.<i>._linear`, the top MLP
`over_arch.model.0._mlp.<i>._linear` and `over_arch.model.1` (its last layer, the logit). They carry
over one to one: both put ReLU after every bottom layer and every top layer but the last, and both
feed the top MLP [bottom output, pairwise dots of (bottom output, pooled features...)]. Only the
order of the dots differs: TorchRec lists pairs (i < j) row by row of the upper triangle, neorec
(i > j) row by row of the lower one, each over its own order of the features, so the top MLP's
first layer has its input columns permuted on the way in and out.

TorchRec's interaction takes the features in its EmbeddingBagCollection's order: table by table as
its configs come, each table's features as its config lists them. A DLRM's own state_dict lists its
modules in order (the tables, then the bottom MLP) and the tables in that order, and DCP's metadata
keeps the saved dict's order (`planner_data`); a DistributedModelParallel's state_dict sorts its
keys (the bottom MLP then comes first), which loses it. Nothing says the order of a table's
features. So `torchrec_feature_order` takes the tables' order from the TorchRec side where it is
recorded (`recorded_table_order`) and asks for `feature_names` (TorchRec's
`dlrm.sparse_arch.sparse_feature_names`) where it is not or a table has several features. The
neorec side's order is its collection's `feature_names`.

TorchRec's DLRM_DCN and DLRM_Projection put weights in the interaction (`inter_arch.`), which
neorec's DLRM has none of: only their tables carry over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from typing import Any

import torch
from torch import nn

from neorec.interop.torchrec.common import TorchRecInteropError, expect

DLRM_TABLES = "sparse_arch.embedding_bag_collection."
BOTTOM = "dense_arch.model._mlp."
TOP = "over_arch.model.0._mlp."
LAST = "over_arch.model.1."
INTERACTION = "inter_arch."
# TorchRec's DLRM variants by the weights of their interaction
_VARIANTS = {"crossnet.": "DLRM_DCN", "interaction_branch": "DLRM_Projection"}
_ASK = "pass feature_names=dlrm.sparse_arch.sparse_feature_names (the TorchRec DLRM's order)"


def load_torchrec_dense(
    model: nn.Module, state_dict: Mapping[str, Any], feature_names: Sequence[str] | None = None
) -> list[str]:
    """Copy only the MLP layers of a TorchRec DLRM state_dict into a neorec DLRM in place; returns the
    TorchRec keys it used. The model's embeddings are left alone, so it may pool them any way (a
    dense-only stand-in, tables loaded elsewhere); the state_dict's tables, if it holds the model's in
    their recorded order, give only the order of the features (torchrec_feature_order), else
    `feature_names` does."""
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
    saved, why = recorded_table_order(state_dict, outer, "the state_dict")
    ours = [t.name for t in getattr(model.embeddings, "tables", []) if t.pooling != "none"]
    if saved is not None and sorted(saved) != sorted(ours):
        why = (
            f"the state_dict holds tables {sorted(saved)}, not the model's {sorted(ours)}, so the TorchRec "
            "DLRM's feature order is unknown"
            if saved
            else f"the state_dict holds no tables ('{outer}{DLRM_TABLES}embedding_bags.<table>.weight'), so "
            "the TorchRec DLRM's feature order is unknown"
        )
        saved = None
    order = torchrec_feature_order(model, saved, feature_names, why)
    model.load_state_dict(dlrm_dense_from_torchrec(model, state_dict, outer, order), strict=False)
    return [outer + k for k in dlrm_dense_keys(model)]


def recorded_table_order(keys: Iterable[str], outer: str, where: str) -> tuple[list[str] | None, str]:
    """(the TorchRec DLRM's tables in its EmbeddingBagCollection's order, "") from the keys of its
    state_dict as they are listed (`where` names them), or (None, why not) when they were sorted:
    the DLRM lists its tables before its bottom MLP, a sorted dict (DistributedModelParallel's
    state_dict sorts its keys) the other way round, and its tables' order is then the names'."""
    prefix, suffix = f"{outer}{DLRM_TABLES}embedding_bags.", ".weight"
    names: list[str] = []
    sorted_keys = False  # a table after the bottom MLP
    bottom = False
    for k in keys:
        bottom = bottom or k.startswith(outer + BOTTOM)
        if k.startswith(prefix) and k.endswith(suffix):
            names.append(k[len(prefix) : -len(suffix)])
            sorted_keys = sorted_keys or bottom
    if sorted_keys:
        return None, (
            f"{where} lists the bottom MLP ('{outer}{BOTTOM}...') before the tables: its keys were "
            "sorted (DistributedModelParallel.state_dict sorts them), so the order of the TorchRec "
            "DLRM's tables is lost"
        )
    return names, ""


def torchrec_feature_order(
    model: nn.Module,
    table_order: Sequence[str] | None,
    feature_names: Sequence[str] | None,
    unknown: str,
) -> list[str]:
    """The pooled features of a neorec DLRM in the order of the TorchRec DLRM's interaction.

    `table_order`: the TorchRec EmbeddingBagCollection's tables as the TorchRec side lists them
    (None where it does not; `unknown` says why, for the error). `feature_names`, when given, is that
    order itself, checked against the model's features and tables and against `table_order`.
    Without it the order is known only when every table has one feature (a table's features are
    in no state_dict) and `table_order` is; otherwise TorchRecInteropError asks for it."""
    _refuse_self_interaction(model)
    ours = list(model.embeddings.feature_names)
    tables = getattr(model.embeddings, "tables", None)
    pooled = [t for t in tables if t.pooling != "none"] if tables is not None else None
    if feature_names is not None:
        return _checked_feature_names(list(feature_names), ours, pooled, table_order)
    if len(ours) <= 1:
        return ours
    if table_order is None or pooled is None:
        raise TorchRecInteropError(f"{unknown}: {_ASK}")
    by_name = {t.name: t for t in pooled}
    if sorted(table_order) != sorted(by_name):
        raise TorchRecInteropError(
            f"the TorchRec DLRM's tables are {list(table_order)}, the neorec DLRM's {sorted(by_name)}"
        )
    shared = [t for t in pooled if len(t.features) > 1]
    if shared:
        raise TorchRecInteropError(
            f"table {shared[0].name!r} has features {shared[0].features}: a TorchRec state_dict or DCP "
            "checkpoint gives the order of the tables but not of a table's features, which the DLRM's "
            f"interaction follows: {_ASK}"
        )
    return [f for name in table_order for f in by_name[name].features]


def export_feature_order(
    model: nn.Module, feature_names: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """(features, tables) in the order of the TorchRec DLRM that takes a neorec DLRM's weights:
    `feature_names` (checked) when given, else the neorec collection's own order, which a TorchRec
    DLRM over `configs_from_tables(model.embeddings.tables)` has."""
    features = (
        list(model.embeddings.feature_names)
        if feature_names is None
        else torchrec_feature_order(model, None, feature_names, "")
    )
    owner = {f: t.name for t in model.embeddings.tables for f in t.features}
    return features, [name for name, _ in groupby(owner[f] for f in features)]


def _checked_feature_names(
    given: list[str], ours: list[str], pooled: list | None, table_order: Sequence[str] | None
) -> list[str]:
    if len(set(given)) != len(given) or set(given) != set(ours):
        raise TorchRecInteropError(
            f"feature_names {given}: expected the neorec DLRM's pooled features {ours}, each once, in the "
            "TorchRec DLRM's order"
        )
    if pooled is None:
        return given
    owner = {f: t.name for t in pooled for f in t.features}
    groups = [name for name, _ in groupby(owner[f] for f in given)]
    split = next((name for name in groups if groups.count(name) > 1), None)
    if split is not None:
        raise TorchRecInteropError(
            f"feature_names {given} splits the features of table {split!r}: a TorchRec DLRM takes each "
            "table's features together, table by table"
        )
    if table_order is not None and groups != list(table_order):
        raise TorchRecInteropError(
            f"feature_names {given} puts the tables in the order {groups}, but the TorchRec side lists them "
            f"as {list(table_order)}"
        )
    return given


def check_plain_dlrm(state_dict: Mapping[str, Any], outer: str) -> None:
    """Raise when the TorchRec DLRM under `outer` has interaction weights (DLRM_DCN, DLRM_Projection):
    neorec's DLRM takes only their tables, through its embedding collection."""
    weighted = sorted(k for k in state_dict if k.startswith(outer + INTERACTION))
    if not weighted:
        return
    rest = weighted[0][len(outer + INTERACTION) :]
    name = next((v for k, v in _VARIANTS.items() if rest.startswith(k)), "DLRM variant")
    raise TorchRecInteropError(
        f"the state_dict is a TorchRec {name} (its interaction has weights: {weighted[0]!r} ...), and neorec's DLRM "
        f"has no counterpart of its dense layers: load its tables alone with "
        f"load_torchrec_state(model.embeddings, state_dict), which reads the tables and leaves the rest"
    )


def dlrm_dense_keys(model: nn.Module) -> list[str]:
    """TorchRec keys of a neorec DLRM's MLP layers, in the order _dlrm_pairs lists them."""
    return [tr + p for _, tr in _dlrm_pairs(model) for p in ("weight", "bias")]


def dlrm_dense_from_torchrec(
    model: nn.Module, state_dict: Mapping[str, Any], outer: str, features: Sequence[str]
) -> dict[str, torch.Tensor]:
    """A neorec DLRM's MLP entries (its own keys) from a TorchRec DLRM's under prefix `outer`, whose
    interaction takes the pooled features in the order `features` (torchrec_feature_order)."""
    order = _interaction_order(model, features)
    ours = model.state_dict()
    expected = {outer + k for k in dlrm_dense_keys(model)}
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
            out[ne + p] = expect(state_dict, outer + tr + p, tuple(ours[ne + p].shape)).detach().clone()
    d = _linears(model.bottom)[-1].out_features
    first = out["top.0.weight"]
    out["top.0.weight"] = torch.cat([first[:, :d], first[:, d:][:, order]], dim=1)
    return out


def dlrm_dense_to_torchrec(model: nn.Module, features: Sequence[str]) -> dict[str, torch.Tensor]:
    """A neorec DLRM's MLP layers under TorchRec DLRM keys (copies), for a TorchRec DLRM whose
    interaction takes the pooled features in the order `features`."""
    out = {}
    ours = model.state_dict()
    for ne, tr in _dlrm_pairs(model):
        for p in ("weight", "bias"):
            out[tr + p] = ours[ne + p].detach().clone()
    d = _linears(model.bottom)[-1].out_features
    order = _interaction_order(model, features)
    first_key = f"{TOP}0._linear.weight" if len(_linears(model.top)) > 1 else LAST + "weight"
    first = out[first_key]
    back = torch.empty_like(first)
    back[:, :d] = first[:, :d]
    back[:, d + order] = first[:, d:]
    out[first_key] = back
    return out


def _linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


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


def _interaction_order(model: nn.Module, features: Sequence[str]) -> torch.Tensor:
    """For each of neorec's dot columns, the column of the same pair in TorchRec's InteractionArch,
    whose vectors are [dense, `features` in this order] (neorec's: [dense, its feature_names])."""
    _refuse_self_interaction(model)
    n = model.interaction.num_vectors
    rows, cols = torch.triu_indices(n, n, offset=1)  # TorchRec's pairs, i < j
    position = {(int(i), int(j)): k for k, (i, j) in enumerate(zip(rows, cols, strict=True))}
    theirs = {f: k + 1 for k, f in enumerate(features)}
    vector = [0] + [theirs[f] for f in model.embeddings.feature_names]  # neorec's vector -> TorchRec's
    out = []
    for p in model.interaction.flat.cpu().tolist():
        i, j = divmod(p, n)  # neorec's pair, i > j
        out.append(position[tuple(sorted((vector[i], vector[j])))])
    return torch.tensor(out, dtype=torch.int64)


def _refuse_self_interaction(model: nn.Module) -> None:
    n = model.interaction.num_vectors
    if model.interaction.num_pairs != n * (n - 1) // 2:
        raise TorchRecInteropError(
            "the neorec DLRM has model.self_interaction: true; TorchRec's DLRM has no self-interaction terms"
        )
