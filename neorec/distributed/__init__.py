"""Model-parallel embeddings over torch.distributed: plan, comms, sharded collection, dense sync.

The names below are imported when first used (PEP 562), so that `neorec.distributed.launch`, which a
command's error report reads, does not import torch: a user's mistake is told without that wait."""

from importlib import import_module

_MODULE_OF = {
    "Codec": "codecs",
    "CommStats": "comms",
    "Comms": "comms",
    "DenseGradSync": "dense",
    "Pending": "comms",
    "ShardedEmbeddingCollection": "sharded",
    "ShardingPlan": "plan",
    "TablePlan": "plan",
    "Topology": "topology",
    "default_plan": "plan",
    "init_distributed": "topology",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
