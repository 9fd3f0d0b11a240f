"""DeepFM (Guo et al. 2017): a factorization machine and a deep MLP over the same fields, logits summed.

Fields, all of the embedding dim d: the bottom MLP's output (the dense features become one more field,
as in DLRM) and the F pooled embeddings. One logit per sample:

    first order:   a linear layer over [raw dense features | pooled embeddings]
  + second order:  sum over field pairs i < j of <v_i, v_j>   (the FM term)
  + deep:          top MLP over [v_0 | v_1 | ... | v_F]

First-order terms are a linear layer over the pooled vectors rather than a 1-dim table per feature:
the run keeps the same tables as DLRM (the planner, sharding and checkpoints see nothing new), and for
a one-hot feature w_f . e_id is still a scalar per id, learnt through the id's embedding row.
The FM term is summed in fp32 outside any autocast (a difference of two large squares).
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.collection import EmbeddingCollection
from neorec.errors import ConfigError
from neorec.model.dlrm import check_pooled_only, dense_autocast, last_layer
from neorec.model.mlp import build_mlp


def fm_interaction(fields: torch.Tensor) -> torch.Tensor:
    """sum_{i<j} <fields[:, i], fields[:, j]> for fields [B, n, d] -> [B], in O(n d):
    half of |sum_i v_i|^2 - sum_i |v_i|^2 (Rendle 2010)."""
    total = fields.sum(dim=1)
    return 0.5 * (total.pow(2).sum(dim=1) - fields.pow(2).sum(dim=(1, 2)))


class DeepFM(nn.Module):
    """Bottom MLP -> fields [dense_out, pooled...] -> first order + FM + deep MLP -> logit."""

    def __init__(
        self,
        num_dense: int,
        embeddings: EmbeddingCollection,
        bottom_mlp: list[int],
        top_mlp: list[int],
        precision: str = "fp32",
    ) -> None:
        super().__init__()
        self.precision = precision
        check_pooled_only(embeddings, "deepfm")
        dims = set(embeddings.feature_dims)
        if len(dims) != 1 or bottom_mlp[-1] not in dims:
            raise ConfigError(
                f"model.arch=deepfm needs one embedding dim for all tables and model.bottom_mlp ending in it, "
                f"got dims {sorted(dims)} and bottom_mlp {bottom_mlp}"
            )
        self.embeddings = embeddings
        self.num_fields = 1 + len(embeddings.feature_names)
        self.bottom = build_mlp(num_dense, bottom_mlp)
        self.first_order = nn.Linear(num_dense + embeddings.output_dim, 1)
        self.top = build_mlp(self.num_fields * bottom_mlp[-1], top_mlp + [1], last_activation=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B]."""
        device = batch.dense.device
        with dense_autocast(device, self.precision):
            dense_out = self.bottom(batch.dense)
        vectors = self.embeddings.pooled_after(dense_out.float(), batch.sparse)  # [dense_out | pooled]
        b, d = vectors.shape[0], dense_out.shape[1]
        first = self.first_order(torch.cat([batch.dense, vectors[:, d:]], dim=1)).squeeze(1)
        fm = fm_interaction(vectors.view(b, self.num_fields, d))
        with dense_autocast(device, self.precision):
            hidden = self.top[:-1](vectors)
        return last_layer(self.top, hidden) + first + fm
