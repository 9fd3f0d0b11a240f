"""The two-tower model of two_tower.py with its tables sharded over processes (run under torchrun).

    torchrun --standalone --nproc-per-node 2 examples/two_tower_sharded.py
    torchrun --standalone --nproc-per-node 2 examples/two_tower_sharded.py --steps 50 --out /tmp/two_tower_sharded

Model parallel embeddings, data parallel towers: every process holds its shards of the tables
(the plan below) and a full copy of the towers, and trains on its slice of each global batch. The
sharded collection moves ids to the shards' owners and pooled vectors back; DenseGradSync averages
the towers' gradients. With the same global batches this trains the model that two_tower.py trains
in one process (losses equal up to float rounding). At the end every process writes its shards of
a checkpoint; a fresh model under another plan loads it, and so does one process without any plan.
The processes run on CPU over gloo. Walkthrough: docs/library.md.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from two_tower import OPTIMIZER, TABLES, TwoTower, build, make_batch  # the model and data, next to this file

from neorec.checkpoint import load_checkpoint, save_checkpoint
from neorec.distributed import (
    Comms,
    DenseGradSync,
    ShardedEmbeddingCollection,
    ShardingPlan,
    init_distributed,
)
from neorec.embedding import FusedEmbeddingCollection
from neorec.sparse import SparseBatch

# which process holds which rows (neorec.planner can write this too: `neorec plan`)
PLAN = ShardingPlan.from_dict({"tables": {
    "user": {"kind": "rw", "ranks": [0, 1]},  # rows split in two contiguous ranges
    "item": {"kind": "tw", "ranks": [1]},  # the whole table on rank 1
    "category": {"kind": "dp"},  # small and hot: a replica on every rank
}})  # fmt: skip
# the checkpoint is loaded back under this one: every table split by rows
OTHER_PLAN = ShardingPlan.from_dict({"tables": {t: {"kind": "rw", "ranks": [1, 0]} for t in PLAN.tables}})


def scores(model: TwoTower, sparse: SparseBatch, rank: int, world: int) -> torch.Tensor:
    """Logits of the global batch `sparse`: each rank scores its slice, then all are gathered."""
    b = sparse.batch_size // world
    with torch.no_grad():
        mine = model(sparse.slice_samples(rank * b, (rank + 1) * b))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch, split over the processes")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="runs/two_tower_sharded", help="checkpoint folder")
    args = parser.parse_args()

    topo = init_distributed(torch.device("cpu"))  # joins torchrun's process group (gloo on CPU)
    rank, world = topo.rank, topo.world_size
    if args.batch_size % world:
        parser.error(f"--batch-size {args.batch_size} must divide over {world} processes")
    comms = Comms(topo)  # every exchange of the sharded collection goes through here
    # checks the plan against the tables and the processes, then builds this rank's shards
    embeddings = ShardedEmbeddingCollection(TABLES, OPTIMIZER, PLAN, comms, seed=0)
    model, optimizers = build(embeddings)  # the same towers, and their optimizer, on every rank
    dense_opt, emb_opt = optimizers["dense"], optimizers["embedding"]
    sync = DenseGradSync(list(model.parameters()), comms)
    sync.broadcast_parameters()  # every rank starts from rank 0's towers

    b = args.batch_size // world
    for step in range(args.steps):
        sparse, labels = make_batch(step, args.batch_size)
        sparse, labels = sparse.slice_samples(rank * b, (rank + 1) * b), labels[rank * b : (rank + 1) * b]
        loss = F.binary_cross_entropy_with_logits(model(sparse), labels)
        dense_opt.zero_grad()
        loss.backward()  # exchanges gradients with the shards' owners, which update their rows
        sync.start().wait()  # the towers' gradients, averaged over ranks
        dense_opt.step()
        emb_opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the loss of the global batch: the mean of the ranks' losses
            if rank == 0:
                print(f"step {step:5d}  loss {mean.item() / world:.6f}", flush=True)

    # collective: each rank writes its shards, rank 0 the towers, the optimizers and the manifest
    path = save_checkpoint(args.out, args.steps, embeddings, model, optimizers)
    held_out, _ = make_batch(10**6, args.batch_size)  # a batch that no step trained on
    trained = scores(model, held_out, rank, world)

    fresh, _ = build(ShardedEmbeddingCollection(TABLES, OPTIMIZER, OTHER_PLAN, comms, seed=1))
    load_checkpoint(path, fresh.embeddings, fresh)  # each rank reads the rows it holds under OTHER_PLAN
    assert torch.allclose(scores(fresh, held_out, rank, world), trained, atol=1e-5)
    if rank == 0:  # and one process, with no plan at all, reads the whole tables
        single, _ = build(FusedEmbeddingCollection(TABLES, OPTIMIZER, seed=1))
        load_checkpoint(path, single.embeddings, single)
        with torch.no_grad():
            assert torch.allclose(single(held_out), trained, atol=1e-5)
        print(f"saved {path}; loaded under another plan and into one process: same scores")
    dist.barrier()  # rank 1 waits for rank 0's check: no rank tears its connections down early
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
