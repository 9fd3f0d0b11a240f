"""The fused table-batched embedding engine: flat buffers, one lookup call, optimizer in backward."""

from neorec.embedding.fused.collection import FusedEmbeddingCollection
from neorec.embedding.fused.optimizers import RULES, Hparams
from neorec.embedding.fused.param_groups import FusedEmbeddingOptimizer
from neorec.embedding.fused.storage import RowStorage, StorageFactory, TensorStorage, build_tensor_storage

__all__ = [
    "RULES",
    "FusedEmbeddingCollection",
    "FusedEmbeddingOptimizer",
    "Hparams",
    "RowStorage",
    "StorageFactory",
    "TensorStorage",
    "build_tensor_storage",
]
