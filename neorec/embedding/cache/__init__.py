"""Tables larger than fast memory: a RAM row cache (weights and optimizer state) over DRAM or SSD."""

from neorec.embedding.cache.backing import DramBacking, SsdBacking, create_ssd_file
from neorec.embedding.cache.build import TIERS, CacheSettings, cached_storage_factory
from neorec.embedding.cache.cache import POLICIES, RowCache
from neorec.embedding.cache.cached_storage import CachedStorage
from neorec.embedding.cache.records import RecordLayout
from neorec.embedding.cache.stats import CacheStats, summarize

__all__ = [
    "POLICIES",
    "TIERS",
    "CacheSettings",
    "CacheStats",
    "CachedStorage",
    "DramBacking",
    "RecordLayout",
    "RowCache",
    "SsdBacking",
    "cached_storage_factory",
    "create_ssd_file",
    "summarize",
]
