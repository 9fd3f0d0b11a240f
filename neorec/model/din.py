"""DIN: a target item's embedding attends over the user's history of items (Zhou et al., 2018).

One batch: the embedding collection returns the pooled features (user, movie, genres, ...) and the
sequence features (tables with `pooling: none`) in one lookup. The history's rows, plus the rows of
any side features aligned with it (e.g. whether each past item was liked), padded to `max_len`,
are the keys; the target feature's pooled vector is the query. An activation unit scores each key
from [query, key, query - key, query * key]; the scores, masked and softmax-normalised, weight the
keys into one "interest" vector. [bottom MLP(dense), pooled, interest] -> (a DCNv2 cross network
when `cross_layers` > 0) -> top MLP -> one logit.

`precision="bf16"` runs the MLPs and the attention under bf16 autocast, as DLRM and DCNv2 do; the
lookup and the last layer stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.collection import EmbeddingCollection
from neorec.errors import ConfigError, DataError
from neorec.model.dlrm import dense_autocast, last_layer
from neorec.model.interaction import CrossNetwork
from neorec.model.mlp import build_mlp


class TargetAttention(nn.Module):
    """DIN's activation unit: one weight per history position from [q, k, q - k, q * k], softmax over
    the positions a mask keeps. A sample with no history gets the zero vector."""

    def __init__(self, dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.score = build_mlp(4 * dim, hidden + [1], last_activation=False)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """query [B, D], keys [B, L, D], mask [B, L] (True: a real position) -> [B, D]."""
        # zero the padding first, so nothing stored there (even NaN) reaches the output or its gradient
        keep = mask.unsqueeze(-1)
        keys = torch.where(keep, keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
        q = query.unsqueeze(1).expand_as(keys)
        scores = self.score(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1).float()
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        # an all-padding row softmaxes to uniform weights over zero keys: the zero vector
        weights = torch.softmax(scores, dim=1).masked_fill(~mask, 0.0)
        return torch.bmm(weights.unsqueeze(1).to(keys.dtype), keys).squeeze(1)


class DIN(nn.Module):
    """[bottom MLP(dense), pooled embeddings, target attention over the history] -> top MLP -> logit."""

    def __init__(
        self,
        num_dense: int,
        embeddings: EmbeddingCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        target: str,
        history: str,
        history_side: list[str],
        max_len: int,
        attention_mlp: list[int],
        cross_layers: int = 0,
        precision: str = "fp32",
        low_rank: int | None = None,
    ) -> None:
        super().__init__()
        check_features(embeddings, target, history, history_side)
        self.precision = precision
        self.embeddings = embeddings
        self.history = history
        self.history_side = list(history_side)
        self.max_len = max_len
        pooled_dims = dict(zip(embeddings.feature_names, embeddings.feature_dims, strict=True))
        index = embeddings.feature_names.index(target)
        self.target_start = sum(embeddings.feature_dims[:index])
        self.dim = pooled_dims[target]
        self.bottom = build_mlp(num_dense, bottom_mlp)
        self.attention = TargetAttention(self.dim, attention_mlp)
        width = bottom_mlp[-1] + embeddings.output_dim + self.dim
        self.cross = CrossNetwork(width, cross_layers, low_rank) if cross_layers else nn.Identity()
        self.top = build_mlp(width, top_mlp + [1], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B]."""
        device = batch.dense.device
        pooled, sequences = self.embeddings.embed(batch.sparse)
        history = sequences[self.history]
        keys, mask = history.to_padded(self.max_len)
        for name in self.history_side:
            side = sequences[name]
            self._check_aligned(batch.sparse, name, side.lengths, history.lengths)
            keys = keys + side.to_padded(self.max_len)[0]
        query = pooled.narrow(1, self.target_start, self.dim)
        with dense_autocast(device, self.precision):
            interest = self.attention(query, keys, mask)
            dense_out = self.bottom(batch.dense)
            x0 = torch.cat([dense_out.float(), pooled, interest.float()], dim=1)
            hidden = self.top[:-1](self.cross(x0))
        return last_layer(self.top, hidden)


    def _check_aligned(self, sparse, side: str, side_lengths: torch.Tensor, lengths: torch.Tensor) -> None:
        """DataError unless side feature `side` has as many ids as the history in every sample: read
        on the host where the batch's lengths are known there (a batch fed to a GPU) and the id check
        drops no id (bounds_check warn would: then the looked-up lengths), else compared on the device
        (one host read)."""
        dropping = getattr(getattr(self.embeddings, "bounds", None), "mode", "error") == "warn"
        on_host = (None, None) if dropping else (sparse.host_lengths(side), sparse.host_lengths(self.history))
        if on_host[0] is not None and on_host[1] is not None:
            side_lengths, lengths = on_host
        if not torch.equal(side_lengths, lengths):
            raise DataError(_misaligned(side, side_lengths, self.history, lengths))


def _misaligned(side: str, side_lengths: torch.Tensor, history: str, lengths: torch.Tensor) -> str:
    """The error of a side feature whose ids do not pair with the history's one by one."""
    row = int((side_lengths != lengths).nonzero()[0, 0])
    return (
        f"model.din.history_side feature {side!r} has {int(side_lengths[row])} ids in sample {row} of the "
        f"batch, but history {history!r} has {int(lengths[row])}: a side feature needs one id per history id"
    )


def check_features(embeddings: EmbeddingCollection, target: str, history: str, history_side: list[str]) -> None:
    """The target is a pooled feature, the history and its side features are sequence features
    (pooling none), all of one dim; errors name the config key to change."""
    pooled = dict(zip(embeddings.feature_names, embeddings.feature_dims, strict=True))
    sequences = dict(zip(embeddings.sequence_names, embeddings.sequence_dims, strict=True))
    if target not in pooled:
        where = "has pooling none" if target in sequences else "is not a feature of this data"
        raise ConfigError(
            f"model.din.target {target!r} {where}; the query must be a pooled feature, one of {sorted(pooled)}"
        )
    for key, name in [("model.din.history", history)] + [("model.din.history_side", n) for n in history_side]:
        if name in sequences:
            if sequences[name] != pooled[target]:
                raise ConfigError(
                    f"{key} {name!r} has dim {sequences[name]} but the target {target!r} has dim {pooled[target]}; "
                    f"set embedding.tables.{name}.dim to {pooled[target]}"
                )
        elif name in pooled:
            raise ConfigError(
                f"{key} {name!r} is pooled; model.arch din reads it as a sequence: set "
                f"embedding.tables.{name}.pooling: none"
            )
        else:
            raise ConfigError(
                f"{key} {name!r} is not a feature of this data (features: {sorted(pooled) + sorted(sequences)}); "
                "for MovieLens set data.movielens.history to the number of past ratings"
            )
    unread = sorted(set(sequences) - {history, *history_side})
    if unread:
        raise ConfigError(
            f"tables {unread} have pooling none, but model.arch din reads only model.din.history and "
            "history_side as sequences, so they would be looked up for nothing: pool them (sum or mean) or "
            "add them to model.din.history_side"
        )
