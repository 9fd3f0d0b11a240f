"""Where a table's rows live, as the planner sees it: plan tiers over the cluster's memory tiers.

A plan tier (distributed/plan.py TIERS, what `neorec train` builds: plan.STORAGE_TIERS) keeps every
row of a table, with its optimizer state, in one memory tier of the cluster (hardware.py), either
read there directly or through a row cache in device memory (neorec/embedding/cache):

    plan tier   cache in    every row in     offered when the cluster has
    device      -           device           always
    host        -           host             a host tier (GPU clusters)
    cached      device      host             a host tier
    ssd         device      ssd              an ssd tier (this_machine with a folder for table files)

A cached shard of R rows with a cache of C = ceil(fraction x R) rows (Workload.cache_fraction;
embedding.cache.fraction in training; with embedding.cache.size_mib, the share of its rows that
cost.cache_mib_fractions gives it) keeps each row as one record of B bytes: its weights and
optimizer state side by side, each field 8-byte aligned, padded to 64 bytes (embedding/cache/
records.py), and takes, as cache.py allocates it:
    device:        C x (B + 26) + 4 R   the cached rows; per slot its row (8 bytes), dirty bit (1),
                                        loading bit (1), last use (8) and use count (8); per row its
                                        slot (4); on SSD, per row where its record is (4, write_log.py);
                                        under LFU, per row its use count kept across evictions (1)
    backing tier:  R x B (1 + L)        every row's weights and state (the file, on SSD), and on SSD
                                        the write log of L x R records (embedding.cache.ssd_log)
Per step, the distinct rows a batch looks up in the shard that are not resident are misses: each is
read from the backing tier and, as training updates every row it looks up, written back once it is
evicted (in steady state, as many rows leave as come in). A miss reads the row's bytes rounded up to
the tier's access size (on SSD a 4 KiB page: a table's rows and state sit in one file, so a row up
to a page is one page) and writes them back the same way, except on SSD with a write log: there the
record is appended, and folding the log back into the file reads and writes, sequentially, about
4 / L records of the file per record appended (a half of the log, L R / 2 records, folds the whole
file in). Hit rate: workload.TableLoad.hit_rate, from the id sample when
there is one, else C / R (ids uniform over the rows), and never more than C over the distinct rows of
one batch (a batch's rows that do not fit are read and written in the backing tier directly).
Bookkeeping per step: the per-id cost for each distinct row, and a pass over the slots' keys
(8 bytes each, at the stream bandwidth) to choose victims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neorec.planner.hardware import Cluster
from neorec.planner.workload import TableLoad

SLOT_BYTES = 26  # per cache slot: row (int64), dirty and loading (bool), last use and use count (int64)
ROW_MAP_BYTES = 4  # per row of the table: its slot (int32); on SSD with a write log, its place (int32)
LFU_ROW_BYTES = 1  # per row of the table under LFU: its use count while not resident (uint8)


@dataclass(frozen=True)
class Placement:
    cache_in: str | None  # memory tier of the row cache (None: rows are read where they live)
    rows_in: str  # memory tier that holds every row and its optimizer state


PLACEMENTS = {
    "device": Placement(None, "device"),
    "host": Placement(None, "host"),
    "cached": Placement("device", "host"),
    "ssd": Placement("device", "ssd"),
}


def placements(cluster: Cluster) -> tuple[str, ...]:
    """The plan tiers a cluster offers, fastest first."""
    names = {t.name for t in cluster.tiers}
    return tuple(p for p, where in PLACEMENTS.items() if where.rows_in in names)


def cache_rows(num_rows: int, fraction: float) -> int:
    """Rows a cache of `fraction` of a shard's rows holds (embedding/cache/build.py _capacity)."""
    return min(num_rows, max(1, math.ceil(fraction * num_rows)))


def memory(
    load: TableLoad,
    tier: str,
    num_rows: int,
    width: int,
    fraction: float,
    ssd_log: float = 1.0,
    policy: str = "lru",
) -> dict[str, int]:
    """Bytes per memory tier of a shard of `num_rows` rows of `width` columns (weights + state)."""
    where = PLACEMENTS[tier]
    if where.cache_in is None:
        return {where.rows_in: num_rows * load.row_bytes(width)}
    slots, record = cache_rows(num_rows, fraction), record_bytes(load, width)
    # the per-row maps have one entry more than rows: a sink that evictions of empty slots write to
    cache = slots * (record + SLOT_BYTES) + (num_rows + 1) * ROW_MAP_BYTES
    if policy == "lfu":
        cache += (num_rows + 1) * LFU_ROW_BYTES
    backing = num_rows * record
    if tier == "ssd" and ssd_log > 0:
        cache += num_rows * ROW_MAP_BYTES
        backing += 2 * log_half(num_rows, ssd_log) * record
    return {where.cache_in: cache, where.rows_in: backing}


def log_half(num_rows: int, ssd_log: float) -> int:
    """Records in one half of an ssd table's write log (embedding/cache/write_log.py)."""
    return max(1, min(int(ssd_log * num_rows) // 2, 2**30))


def record_bytes(load: TableLoad, width: int) -> int:
    """Bytes of one cached row of `width` columns: weights, then each optimizer state (fp32), every
    field starting at a multiple of 8 bytes, the record padded to a multiple of 64."""
    fields = [width * load.weight_bytes] + {
        "sgd": [], "adagrad": [4 * width], "rowwise_adagrad": [4], "adam": [4 * width, 4 * width]
    }[load.optimizer]  # fmt: skip
    offset = 0
    for nbytes in fields:
        offset = -(-(offset + nbytes) // 8) * 8
    return -(-max(offset, 1) // 64) * 64


def moved_bytes(row_bytes: int, access_bytes: int) -> int:
    """Bytes one row's transfer moves in a tier: its bytes, rounded up to the tier's access size."""
    return -(-row_bytes // access_bytes) * access_bytes if access_bytes else row_bytes


@dataclass
class CacheTraffic:
    """What a cached shard's cache costs per step."""

    hit_rate: float  # share of the batch's distinct rows found resident
    misses: float  # rows brought in (and, in steady state, written back) per step
    seconds: float  # transfers to and from the backing tier, and bookkeeping
    tier_bytes: float  # bytes moved from and to the backing tier


def cache_traffic(
    load: TableLoad,
    tier: str,
    rows: tuple[int, int],
    width: int,
    touched: float,
    fraction: float,
    cluster: Cluster,
    ssd_log: float = 1.0,
) -> CacheTraffic | None:
    """Per step, the cache of a shard (rows [lo, hi) x `width` columns) whose batch looks up `touched`
    distinct rows; None for a plan tier without a cache."""
    where = PLACEMENTS[tier]
    if where.cache_in is None:
        return None
    slow = cluster.tier(where.rows_in)
    slots = cache_rows(rows[1] - rows[0], fraction)
    hit = load.hit_rate(rows[0], rows[1], slots)
    if touched > 0:
        hit = min(hit, slots / touched)
    misses = touched * (1.0 - hit)
    record = record_bytes(load, width)
    read = moved_bytes(record, slow.access_bytes)
    written = read
    if tier == "ssd" and ssd_log > 0:  # appended, and folded in: the file read and written in windows
        written = record * (1 + 2 * (rows[1] - rows[0]) / log_half(rows[1] - rows[0], ssd_log))
    seconds = misses * read / slow.lookup_bandwidth + misses * written / slow.update_bandwidth
    seconds += touched * cluster.lookup_per_id + slots * 8 / cluster.stream_bandwidth
    return CacheTraffic(hit, misses, seconds, misses * (read + written))
