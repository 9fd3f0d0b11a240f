"""Embedding tables and the collections that look them up (the model's side of the table storage).

    from neorec.embedding import TableConfig, EmbeddingOptimizerConfig, FusedEmbeddingCollection

`TableConfig` and `EmbeddingOptimizerConfig` describe tables and their fused optimizer (tables.py);
`EmbeddingCollection` is the interface every engine implements (collection.py);
`FusedEmbeddingCollection` is the single-process engine (fused/). The multi-process one is
neorec.distributed.ShardedEmbeddingCollection. A walkthrough: docs/library.md.
"""

from typing import Any

from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig

__all__ = ["EmbeddingCollection", "EmbeddingOptimizerConfig", "FusedEmbeddingCollection", "TableConfig"]


def __getattr__(name: str) -> Any:
    # imported on first use: the config schema imports tables.py, and reading a config needs no torch
    if name == "EmbeddingCollection":
        from neorec.embedding.collection import EmbeddingCollection

        return EmbeddingCollection
    if name == "FusedEmbeddingCollection":
        from neorec.embedding.fused import FusedEmbeddingCollection

        return FusedEmbeddingCollection
    raise AttributeError(f"module 'neorec.embedding' has no attribute {name!r}")
