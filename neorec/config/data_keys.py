"""Which `data.*` settings each data source reads, and the refusal of one set for a source the run does
not use (`--set data.movielens.history=50` with data.source synthetic would change nothing).

What counts as set (the file given to `--config` and `--set`, not its bases, and not a record of a run:
a `data` section that lists every key, its sections in full, as a run's config.yaml and `neorec config
show` write it): neorec/config/unread_keys.py.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from neorec.config.data import DataConfig
from neorec.config.unread_keys import set_keys, written_keys

# the source that reads each key of `data` that belongs to one source; the other keys (batch sizes,
# data.follow) every source reads or checks itself
READ_BY = {
    "synthetic": "synthetic",
    "criteo": "criteo_tsv",
    "movielens": "movielens",
    "shards_dir": "shards",
    "preprocessed": "preprocessed",
    "parquet": "parquet",
}
_SECTIONS = ("synthetic", "criteo", "movielens", "preprocessed", "parquet")  # their keys count one by one


def is_reader_speed(key: str) -> bool:
    """Whether dotted key `key` sets how fast a data reader works (its threads, batches made ahead),
    which changes no sample."""
    return key.startswith("data.") and key.endswith((".threads", ".prefetch"))


def written_data_keys(raw: dict[str, Any]) -> list[str]:
    """The data keys a raw config mapping writes ("movielens.history", "source"); none for a record of
    a run."""
    return written_keys(raw.get("data"), DataConfig, _SECTIONS)


def unread_data_keys(d: DataConfig, written: list[str], reads: Collection[str] = ()) -> list[str]:
    """A problem line for each key of `written` that holds a value other than its default and that
    belongs to a source other than data.source (and than the sources in `reads`, which the command
    reads besides it), naming the source in use and the one that reads the key."""
    problems = []
    for key in set_keys(d, written):
        reader = READ_BY.get(key.split(".")[0])
        if reader is None or reader == d.source or reader in reads:
            continue
        problems.append(
            f"key 'data.{key}' is set, but data.source {d.source} does not use it (used by: data.source "
            f"{reader}); remove it"
        )
    return problems
