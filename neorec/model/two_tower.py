"""Two-tower retrieval (`model.arch: two_tower`): a user tower and an item tower, scored by a dot product.

Each tower is an MLP over the pooled embeddings of its features (`model.two_tower.user_features`,
`item_features`); its output is L2-normalised, and a score is the cosine of the two divided by
`temperature`. Dense features are not used (they describe the rating event, not the user or item).

Loss: in-batch sampled softmax with logQ correction (Yi et al. 2019). For the B rows of a batch,
row i's user is scored against the items of all B rows; the positive is its own item, the other
rows' items are the negatives. Rows count in the loss by their label (the positives of a batch:
on MovieLens, ratings >= 4); every row's item is a candidate. Popular items turn up as in-batch
negatives more often than uniform sampling would draw them, so each candidate's score loses
log q_j, q_j the share of training rows holding item j, counted over the training data once when the
model is built: (count_j + 1) / (N + num_items), +1 so that unseen items stay finite. The counts are
a buffer of the model, saved with it. A candidate that is the same item as row i's positive (the item
twice in a batch) is masked out, so an item is never its own negative.

Over W processes (`comms`) the negatives are still the global batch's items: each rank runs both
towers on its local rows, then gathers every rank's item vectors, item ids and labels
(neorec/distributed/gather.py: the item vectors' gradient comes back summed over ranks), and scores
its users against the whole global batch. Its loss is its users' share of the global batch's loss,
times W: the dense gradients and the embedding rows' gradients are averaged over ranks
(distributed/dense.py, output_dist.py), so the sum of those shares is what trains, and W ranks train
the model one process trains on the same global batches. The ranks' losses average to the global
batch's loss.

Held-out evaluation (`evaluate_held_out`) scores every item once with the item tower (the source's
`item_catalog`), then, for every held-out row with label 1, ranks the whole item set by the user's
score: recall@K is the share of those rows whose item is in the top K. With `exclude_seen` (the
default), the items the user (the `user_id` feature) rated in training are left out of that user's
ranking, as a deployed retriever would filter them; the held-out item itself always stays in. Over W
processes each rank scores its share of the items (gathered, so every rank holds all item vectors)
and its rows of every held-out batch (neorec/data/ranks.py: eval_slices); the hits and queries are
summed over ranks, so every rank reports the figures of the whole set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neorec.data.batch import Batch
from neorec.data.ranks import RankData, padded_share, take_samples
from neorec.data.source import DataSource, SourceInfo
from neorec.distributed.comms import Comms
from neorec.distributed.gather import gather_rows
from neorec.embedding.collection import EmbeddingCollection
from neorec.errors import ConfigError
from neorec.model.dlrm import check_pooled_only
from neorec.model.mlp import build_mlp
from neorec.sparse import SparseBatch

RECALL_AT = (10, 100)


def logq_softmax_loss(
    user: torch.Tensor, item: torch.Tensor, item_ids: torch.Tensor, log_q: torch.Tensor, weights: torch.Tensor,
    temperature: float, first: int = 0, weight_total: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """In-batch softmax with logQ correction over a batch of B rows: user [b, k] (rows first..first+b of
    the batch: all of it by default), item [B, k], item_ids [B], log_q [B] (of each row's item),
    weights [b] (0 leaves a row out). Row first+i's positive is item first+i. Returns the weighted sum
    of the users' losses divided by `weight_total` (default: weights.sum(), the weighted mean)."""
    rows = torch.arange(first, first + len(user), device=user.device)
    logits = user @ item.T / temperature - log_q[None, :]
    same = item_ids[rows][:, None] == item_ids[None, :]
    same[torch.arange(len(rows), device=rows.device), rows] = False  # the same item in another row is no negative
    logits = logits.masked_fill(same, float("-inf"))
    per_row = F.cross_entropy(logits, rows, reduction="none")
    total = weights.sum() if weight_total is None else weight_total
    return (per_row * weights).sum() / total.clamp(min=1.0)


class SeenItems:
    """The items each user has in the training data, as CSR over user ids: one pass over the data."""

    def __init__(self, source: DataSource, user_id: str, item_id: str, num_users: int) -> None:
        users, items = [], []
        for batch in source.train_batches(65536, 0):
            users.append(batch.sparse.feature(user_id)[0].cpu())
            items.append(batch.sparse.feature(item_id)[0].cpu())
        user, item = torch.cat(users), torch.cat(items)
        order = torch.argsort(user, stable=True)
        self.items = item[order]
        self.counts = torch.bincount(user, minlength=num_users)
        self.starts = torch.cumsum(self.counts, 0) - self.counts

    def mask(self, scores: torch.Tensor, users: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """scores [Q, num_items] with each query user's seen items at -inf, its target kept."""
        users = users.cpu()
        lengths = self.counts[users]
        query = torch.repeat_interleave(torch.arange(len(users)), lengths)
        at = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[query] + self.starts[users][query]
        kept = scores.gather(1, targets[:, None])
        scores = scores.index_put((query.to(scores.device), self.items[at].to(scores.device)),
                                  torch.tensor(float("-inf"), device=scores.device))  # fmt: skip
        return scores.scatter(1, targets[:, None], kept)


def recall_at(scores: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...]) -> dict[int, int]:
    """Hits at each K: rows of scores [Q, num_items] whose target item is among the K highest."""
    top = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    found = top == targets[:, None]
    return {k: int(found[:, :k].any(dim=1).sum()) for k in ks}


class TwoTower(nn.Module):
    """User tower and item tower over pooled embeddings; forward gives (user, item) unit vectors [B, k]."""

    def __init__(
        self,
        embeddings: EmbeddingCollection,
        user_features: list[str],
        item_features: list[str],
        item_id: str,
        num_items: int,
        tower_mlp: list[int],
        temperature: float,
        exclude_seen: tuple[str, int] | None = None,
        comms: Comms | None = None,
    ) -> None:
        """exclude_seen: (the user id feature, its number of ids) to leave each user's training items
        out of its held-out ranking; None keeps every item. comms: the run's processes, whose global
        batch gives the in-batch negatives (None: one process)."""
        super().__init__()
        check_pooled_only(embeddings, "two_tower")
        width = dict(zip(embeddings.feature_names, embeddings.feature_dims, strict=True))
        self.embeddings = embeddings
        self.user_features, self.item_features, self.item_id = user_features, item_features, item_id
        self.temperature = temperature
        self.exclude_seen = exclude_seen
        self.comms = comms if comms is not None and comms.topo.world_size > 1 else None
        self._seen: SeenItems | None = None  # made at the first evaluation
        self.user_tower = build_mlp(sum(width[f] for f in user_features), tower_mlp, last_activation=False)
        self.item_tower = build_mlp(sum(width[f] for f in item_features), tower_mlp, last_activation=False)
        self.register_buffer("item_counts", torch.zeros(num_items, dtype=torch.float64))

    def towers(self, pooled: torch.Tensor, which: str) -> torch.Tensor:
        """One tower's unit vectors from pooled embeddings [B, sum dims] ('user' or 'item')."""
        by_feature = self.embeddings.split(pooled)
        names, tower = (self.user_features, self.user_tower) if which == "user" else (self.item_features, self.item_tower)
        return F.normalize(tower(torch.cat([by_feature[f] for f in names], dim=1)), dim=1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.embeddings(batch.sparse)
        return self.towers(pooled, "user"), self.towers(pooled, "item")

    def log_q(self, item_ids: torch.Tensor) -> torch.Tensor:
        """log of each item's estimated share of the training rows (see the module docstring)."""
        counts = self.item_counts + 1.0
        return (counts[item_ids] / counts.sum()).log().to(torch.float32)

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
        """This rank's loss on its local rows (see the module docstring for several processes)."""
        user, item = outputs
        ids = batch.sparse.feature(self.item_id)[0]
        if self.comms is None:
            return logq_softmax_loss(user, item, ids, self.log_q(ids), batch.labels, self.temperature)
        world, rank = self.comms.topo.world_size, self.comms.topo.rank
        items = gather_rows(item, self.comms, "in_batch")
        all_ids = self.comms.all_gather(ids, "in_batch")
        total = self.comms.all_gather(batch.labels, "in_batch").sum()  # the global batch's positives
        share = logq_softmax_loss(user, items, all_ids, self.log_q(all_ids), batch.labels, self.temperature,
                                  first=rank * len(user), weight_total=total)  # fmt: skip
        return share * world

    @torch.no_grad()
    def evaluate_held_out(self, source: DataSource, batch_size: int, max_batches: int | None = None) -> dict:
        """recall@10 and recall@100 over the whole item set (see the module docstring). Collective
        over several processes: every rank returns the same figures."""
        items = self.item_vectors(source.item_catalog(), batch_size)  # type: ignore[attr-defined]
        device = self.item_counts.device
        if self.exclude_seen is not None and self._seen is None:
            self._seen = SeenItems(source, self.exclude_seen[0], self.item_id, self.exclude_seen[1])
        rank, world = (self.comms.topo.rank, self.comms.topo.world_size) if self.comms is not None else (0, 1)
        counts = torch.zeros(len(RECALL_AT) + 1, dtype=torch.int64)  # hits at each K, then queries
        for i, (batch, n) in enumerate(RankData(source, batch_size, rank, world).eval_slices(batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = batch.to(device)
            real = rank * len(batch) + torch.arange(len(batch), device=device) < n  # not a padding copy
            liked = (batch.labels > 0.5) & real
            user = self.towers(self.embeddings(batch.sparse), "user")[liked]
            targets = batch.sparse.feature(self.item_id)[0][liked]
            scores = user @ items.T
            if self._seen is not None:
                scores = self._seen.mask(scores, batch.sparse.feature(self.exclude_seen[0])[0][liked], targets)
            counts[:-1] += torch.tensor(list(recall_at(scores, targets, RECALL_AT).values()))
            counts[-1] += len(targets)
        if self.comms is not None:
            counts = self.comms.all_gather(counts, "eval").view(world, -1).sum(dim=0)
        hits, queries = counts[:-1].tolist(), int(counts[-1])
        if not queries:
            return {}
        return {**{f"recall@{k}": h / queries for k, h in zip(RECALL_AT, hits, strict=True)},
                "num_queries": queries, "num_items": len(items)}  # fmt: skip

    def item_vectors(self, catalog: SparseBatch, batch_size: int) -> torch.Tensor:
        """The item tower's vector of every item of `catalog` (a SparseBatch, one sample per item), in
        its order. Over several processes each rank scores its share and the shares are gathered."""
        device = self.item_counts.device
        n = catalog.batch_size
        if self.comms is not None:  # every rank looks up as many rows, as the sharded embeddings need
            catalog = take_samples(catalog, padded_share(n, self.comms.topo.rank, self.comms.topo.world_size))
        items = []
        for start in range(0, catalog.batch_size, batch_size):
            part = catalog.slice_samples(start, min(start + batch_size, catalog.batch_size)).to(device)
            items.append(self.towers(self.embeddings(part), "item"))
        vectors = torch.cat(items)
        return self.comms.all_gather(vectors, "eval")[:n] if self.comms is not None else vectors


def build_two_tower(
    c, embeddings: EmbeddingCollection, info: SourceInfo, source: DataSource | None, comms: Comms | None = None
) -> TwoTower:
    """A TwoTower from `model.two_tower` (a TwoTowerConfig), its item counts taken from the training
    data of `source` (without a source they stay zero until a state dict loads them); `comms`: the
    run's processes (None: one)."""
    features = {f.name: f for f in info.features}
    unknown = [f for f in c.user_features + c.item_features if f not in features]
    if unknown:
        raise ConfigError(f"model.two_tower names features {unknown} that the data lacks; features: {list(features)}")
    item_id, user_id = c.item_id or c.item_features[0], c.user_id or c.user_features[0]
    for key, name in (("item_id", item_id), ("user_id", user_id))[: 2 if c.exclude_seen else 1]:
        if features[name].multi_hot:
            raise ConfigError(f"model.two_tower.{key} {name!r} must be a one-id feature (it names the {key[:4]})")
    if source is not None and not hasattr(source, "item_catalog"):
        raise ConfigError(
            "model.arch two_tower evaluates recall over the whole item set, which needs a source that lists its "
            "items (data.source: movielens)"
        )
    exclude = (user_id, features[user_id].num_ids) if c.exclude_seen else None
    model = TwoTower(
        embeddings, c.user_features, c.item_features, item_id, features[item_id].num_ids, c.tower_mlp, c.temperature,
        exclude, comms,
    )  # fmt: skip
    if source is not None:
        model.item_counts.copy_(item_counts(source, item_id, features[item_id].num_ids))
    return model


def item_counts(source: DataSource, item_id: str, num_items: int) -> torch.Tensor:
    """How many training rows hold each item (one pass over epoch 0 of the training data)."""
    counts = torch.zeros(num_items, dtype=torch.float64)
    for batch in source.train_batches(65536, 0):
        ids = batch.sparse.feature(item_id)[0].cpu()
        counts += torch.bincount(ids, minlength=num_items).to(torch.float64)
    return counts
