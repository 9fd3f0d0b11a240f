"""A two-tower click model on neorec's fused embeddings, trained by a plain PyTorch loop.

    python examples/two_tower.py                      # 300 steps, checkpoint in runs/two_tower
    python examples/two_tower.py --steps 50 --out /tmp/two_tower

A user tower and an item tower each turn pooled embeddings into a vector; their dot product is the
logit that the user clicks the item. The embeddings come from neorec's fused collection: one lookup
for all tables, and the embedding optimizer runs inside backward. The data is made up here: every
user has a favourite category and mostly clicks items of it. At the end the script saves a
checkpoint and loads it into a fresh model, which must then hold the same weights and state.
The multi-process version of this script is two_tower_sharded.py. Walkthrough: docs/library.md.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from neorec.checkpoint import load_checkpoint, save_checkpoint
from neorec.embedding import (
    EmbeddingCollection,
    EmbeddingOptimizerConfig,
    FusedEmbeddingCollection,
    TableConfig,
)
from neorec.sparse import SparseBatch

NUM_USERS, NUM_ITEMS, NUM_CATEGORIES = 2000, 1000, 8
TABLES = [
    TableConfig(name="user", rows=NUM_USERS, dim=16, features=["user_id"]),
    TableConfig(name="item", rows=NUM_ITEMS, dim=16, features=["item_id"]),
    # one table, two features: the item's category, and the bag of categories the user clicked before
    TableConfig(name="category", rows=NUM_CATEGORIES, dim=8, features=["item_category", "user_history"], pooling="mean"),
]  # fmt: skip
OPTIMIZER = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.2)


class TwoTower(nn.Module):
    """logit(user clicks item) = <user tower(user features), item tower(item features)>."""

    def __init__(self, embeddings: EmbeddingCollection, dim: int = 16) -> None:
        super().__init__()
        self.embeddings = embeddings
        # the width of each feature's pooled vector
        width = dict(zip(embeddings.feature_names, embeddings.feature_dims, strict=True))
        user_in, item_in = width["user_id"] + width["user_history"], width["item_id"] + width["item_category"]
        self.user_tower = nn.Sequential(nn.Linear(user_in, 32), nn.ReLU(), nn.Linear(32, dim))
        self.item_tower = nn.Sequential(nn.Linear(item_in, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, sparse: SparseBatch) -> torch.Tensor:
        f = self.embeddings.split(self.embeddings(sparse))  # {feature: pooled [B, dim]}
        user = self.user_tower(torch.cat([f["user_id"], f["user_history"]], dim=1))
        item = self.item_tower(torch.cat([f["item_id"], f["item_category"]], dim=1))
        return (user * item).sum(dim=1)


# the world the data comes from: each user's favourite category, each item's category
_world = torch.Generator().manual_seed(1234)
FAVOURITE = torch.randint(0, NUM_CATEGORIES, (NUM_USERS,), generator=_world)
CATEGORY = torch.randint(0, NUM_CATEGORIES, (NUM_ITEMS,), generator=_world)


def make_batch(step: int, batch_size: int) -> tuple[SparseBatch, torch.Tensor]:
    """Global batch number `step` (the same in every process): ids and click labels."""
    g = torch.Generator().manual_seed(step)
    users = torch.randint(0, NUM_USERS, (batch_size,), generator=g)
    items = torch.randint(0, NUM_ITEMS, (batch_size,), generator=g)
    history_lengths = torch.randint(0, 5, (batch_size,), generator=g)  # 0-4 past clicks; empty bags pool to 0
    owner = torch.repeat_interleave(history_lengths)  # the sample each past click belongs to
    noise = torch.randint(0, NUM_CATEGORIES, (owner.numel(),), generator=g)
    history = torch.where(torch.rand(owner.numel(), generator=g) < 0.7, FAVOURITE[users[owner]], noise)
    p_click = torch.where(CATEGORY[items] == FAVOURITE[users], 0.9, 0.05)
    labels = (torch.rand(batch_size, generator=g) < p_click).float()
    one = torch.ones(batch_size, dtype=torch.int64)  # one id per sample
    sparse = SparseBatch.from_features({
        "user_id": (users, one), "item_id": (items, one),
        "item_category": (CATEGORY[items], one), "user_history": (history, history_lengths),
    })  # fmt: skip
    return sparse, labels


def build(embeddings: EmbeddingCollection) -> tuple[TwoTower, dict[str, torch.optim.Optimizer]]:
    """The model around `embeddings` and its two optimizers."""
    torch.manual_seed(0)  # the towers start from the same weights in every process
    model = TwoTower(embeddings)
    dense_opt = torch.optim.Adam(model.parameters(), lr=0.01)  # the towers (the tables are no nn.Parameter)
    emb_opt = embeddings.build_optimizer()  # learning rate per table; the update itself runs in backward
    return model, {"dense": dense_opt, "embedding": emb_opt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="runs/two_tower", help="checkpoint folder")
    args = parser.parse_args()

    embeddings = FusedEmbeddingCollection(TABLES, OPTIMIZER, seed=0)
    model, optimizers = build(embeddings)
    dense_opt, emb_opt = optimizers["dense"], optimizers["embedding"]
    for step in range(args.steps):
        sparse, labels = make_batch(step, args.batch_size)
        loss = F.binary_cross_entropy_with_logits(model(sparse), labels)
        dense_opt.zero_grad()
        loss.backward()  # also applies rowwise adagrad to the embedding rows this batch looked up
        dense_opt.step()
        emb_opt.step()  # counts the step (an LR scheduler may drive its param_groups)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.6f}")

    # weights, optimizer state of every table and of the towers, in one folder per step
    path = save_checkpoint(args.out, args.steps, embeddings, model, optimizers)
    fresh, fresh_optimizers = build(FusedEmbeddingCollection(TABLES, OPTIMIZER, seed=1))  # other weights
    load_checkpoint(path, fresh.embeddings, fresh, fresh_optimizers)
    loaded = fresh.state_dict()
    for key, value in model.state_dict().items():  # embedding weights, their adagrad state, the towers
        assert torch.equal(loaded[key], value), key
    adam, fresh_adam = dense_opt.state_dict()["state"], fresh_optimizers["dense"].state_dict()["state"]
    assert all(torch.equal(adam[i][k], fresh_adam[i][k]) for i in adam for k in adam[i])
    print(f"saved {path} and loaded it into a fresh model: equal")


if __name__ == "__main__":
    main()
