"""DLRM's dense layers: a TorchRec `torchrec.models.dlrm.DLRM` <-> a neorec `neorec.model.dlrm.DLRM`.

TorchRec keys: the bottom MLP `dense_arch.model._mlp.<i>._linear`, the top MLP
`over_arch.model.0._mlp.<i>._linear` and `over_arch.model.1` (its last layer, the logit). They carry
over one to one: both put ReLU after every bottom layer and every top layer but the last, and both
feed the top MLP [bottom output, pairwise dots of (bottom output, pooled features...)]. Only the
order of the dots differs: TorchRec lists pairs (i < j) row by row of the upper triangle, neorec
(i > j) row by row of the lower one, so the top MLP's first layer has its input columns permuted on
the way in and out. Features must come in the same order on both sides, which `tables_from_configs`
keeps.

TorchRec's DLRM_DCN and DLRM_Projection put weights in the interaction (`inter_arch.`), which
neorec's DLRM has none of: only their tables carry over.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    model.load_state_dict(dlrm_dense_from_torchrec(model, state_dict, outer), strict=False)
    return [outer + k for k in dlrm_dense_keys(model)]


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
    model: nn.Module, state_dict: Mapping[str, Any], outer: str
) -> dict[str, torch.Tensor]:
    """A neorec DLRM's MLP entries (its own keys) from a TorchRec DLRM's under prefix `outer`."""
    order = _interaction_order(model)
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


def dlrm_dense_to_torchrec(model: nn.Module) -> dict[str, torch.Tensor]:
    """A neorec DLRM's MLP layers under TorchRec DLRM keys (copies)."""
    out = {}
    ours = model.state_dict()
    for ne, tr in _dlrm_pairs(model):
        for p in ("weight", "bias"):
            out[tr + p] = ours[ne + p].detach().clone()
    d = _linears(model.bottom)[-1].out_features
    order = _interaction_order(model)
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
