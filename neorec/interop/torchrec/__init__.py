"""TorchRec interop: batches, lookups, table configs and weights in both directions.

TorchRec is an optional dependency; it is imported when a function here first needs it. What maps
(docs/torchrec.md walks through it):

- batches.py: `KeyedJaggedTensor` <-> `SparseBatch` (the same feature-major layout, tensors shared;
  int32 ids and lengths widened to int64; a KJT's weights kept or dropped as the TorchRec module
  that reads it, weighted or not, uses them), and an `EmbeddingCollection`'s lookup (`JaggedTensor`
  per feature) <-> `JaggedRows` (what a neorec collection returns for its `pooling: none` tables).
- configs.py: `EmbeddingBagConfig` <-> a pooled `TableConfig` (sum/mean), `EmbeddingConfig` <-> a
  `TableConfig` with pooling none.
- weights.py: the state_dict of an `EmbeddingBagCollection` (`embedding_bags.<table>.weight`), of an
  `EmbeddingCollection` (`embeddings.<table>.weight`), or of `torchrec.models.dlrm.DLRM`, with any
  outer prefix (`model.` of DLRMTrain, `module.`) <-> a neorec collection (fused, reference or
  sharded) or DLRM. A DistributedModelParallel state_dict loads once its sharded tables are
  gathered into full tensors (`gather_torchrec_state`).
- dcp.py (with dcp_io.py): TorchRec's checkpoints, torch.distributed.checkpoint folders of a
  DistributedModelParallel (tables in any sharding, fused optimizer state, DLRM layers) <-> a neorec
  model, each process reading or writing only the table parts it holds.
- dlrm.py: DLRM's MLPs, with the top MLP's input columns permuted between the two orders of the
  interaction's dot products and of the features (TorchRec's taken from its tables' order, or given
  as `feature_names`).
"""

from neorec.interop.torchrec.batches import (
    jagged_from_rows,
    jagged_from_sequences,
    kjt_from_sparse,
    rows_from_jagged,
    sequences_from_jagged,
    sparse_from_kjt,
)
from neorec.interop.torchrec.common import TorchRecInteropError
from neorec.interop.torchrec.configs import configs_from_tables, tables_from_configs
from neorec.interop.torchrec.dcp import DcpReport, load_dcp, save_dcp
from neorec.interop.torchrec.dlrm import BOTTOM, DLRM_TABLES, LAST, TOP, load_torchrec_dense
from neorec.interop.torchrec.weights import (
    EBC_KEY,
    EC_KEY,
    gather_torchrec_state,
    load_torchrec_state,
    torchrec_state,
)

__all__ = [
    "BOTTOM",
    "DLRM_TABLES",
    "DcpReport",
    "EBC_KEY",
    "EC_KEY",
    "LAST",
    "TOP",
    "TorchRecInteropError",
    "configs_from_tables",
    "gather_torchrec_state",
    "jagged_from_rows",
    "jagged_from_sequences",
    "kjt_from_sparse",
    "load_dcp",
    "load_torchrec_dense",
    "load_torchrec_state",
    "rows_from_jagged",
    "save_dcp",
    "sequences_from_jagged",
    "sparse_from_kjt",
    "tables_from_configs",
    "torchrec_state",
]
