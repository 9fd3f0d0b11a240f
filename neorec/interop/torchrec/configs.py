"""Table descriptions: TorchRec's EmbeddingBagConfig and EmbeddingConfig <-> neorec's TableConfig.

name, num_embeddings -> rows, embedding_dim -> dim, feature_names -> features, data_type FP32/FP16/BF16
-> dtype. An EmbeddingBagConfig (a table of an EmbeddingBagCollection) pools SUM or MEAN -> sum or
mean; an EmbeddingConfig (a table of an EmbeddingCollection, one row per id) -> pooling none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from neorec.embedding.tables import TableConfig
from neorec.interop.torchrec.common import TorchRecInteropError, import_torchrec

if TYPE_CHECKING:  # pragma: no cover
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

_DTYPES = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}
_POOLING = {"SUM": "sum", "MEAN": "mean"}


def tables_from_configs(configs: Sequence[EmbeddingBagConfig | EmbeddingConfig]) -> list[TableConfig]:
    """neorec tables for TorchRec table configs, in the same order (so features keep theirs).

    EmbeddingBagConfigs and EmbeddingConfigs may be mixed: one neorec collection holds pooled and
    unpooled tables (an EmbeddingBagCollection's and an EmbeddingCollection's)."""
    kinds = import_torchrec().modules.embedding_configs
    out = []
    for c in configs:
        kind = type(c).__name__
        if isinstance(c, kinds.EmbeddingBagConfig):
            pooling = _POOLING.get(c.pooling.name)
            if pooling is None:
                raise TorchRecInteropError(
                    f"EmbeddingBagConfig {c.name!r}: pooling {c.pooling.name} has no neorec counterpart (SUM or "
                    "MEAN); a table looked up one row per id is an EmbeddingConfig, which becomes pooling none"
                )
        elif isinstance(c, kinds.EmbeddingConfig):
            pooling = "none"
        else:
            raise TorchRecInteropError(
                f"{kind} is not a TorchRec table config: tables_from_configs takes EmbeddingBagConfig and "
                "EmbeddingConfig (ebc.embedding_bag_configs(), ec.embedding_configs())"
            )
        dtype = _DTYPES.get(c.data_type.name)
        if dtype is None:
            raise TorchRecInteropError(
                f"{kind} {c.name!r}: data_type {c.data_type.name} has no neorec counterpart (FP32, FP16 or BF16)"
            )
        if not c.feature_names:
            raise TorchRecInteropError(f"{kind} {c.name!r} has no feature_names")
        out.append(
            TableConfig(
                name=c.name,
                rows=c.num_embeddings,
                dim=c.embedding_dim,
                features=list(c.feature_names),
                pooling=pooling,
                dtype=dtype,
            )
        )
    return out


def configs_from_tables(tables: Sequence[TableConfig]) -> list[Any]:
    """TorchRec configs for neorec tables, in the same order: an EmbeddingBagConfig for a pooled
    table, an EmbeddingConfig for one with pooling none (EmbeddingCollection's tables all need the
    same dim, TorchRec's rule)."""
    configs = import_torchrec().modules.embedding_configs
    dtypes = {v: k for k, v in _DTYPES.items()}
    out = []
    for t in tables:
        common = dict(
            name=t.name,
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            feature_names=list(t.features),
            data_type=configs.DataType[dtypes[t.dtype]],
        )
        if t.pooling == "none":
            out.append(configs.EmbeddingConfig(**common))
        else:
            out.append(configs.EmbeddingBagConfig(**common, pooling=configs.PoolingType[t.pooling.upper()]))
    return out
