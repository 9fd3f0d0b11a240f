"""Model-parallel embeddings over torch.distributed: plan, comms, sharded collection, dense sync."""

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms, CommStats, Pending
from neorec.distributed.dense import DenseGradSync
from neorec.distributed.plan import ShardingPlan, TablePlan, default_plan
from neorec.distributed.sharded import ShardedEmbeddingCollection
from neorec.distributed.topology import Topology, init_distributed

__all__ = [
    "Codec",
    "CommStats",
    "Comms",
    "DenseGradSync",
    "Pending",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "TablePlan",
    "Topology",
    "default_plan",
    "init_distributed",
]
