"""Every process of a run trains one config. Each is started with its own command line (torchrun
runs it once per process, a cluster once per node), so a config file that differs between nodes, or
a `--set` given to one rank alone, would train ranks on other data, seeds or learning rates without a
word: the processes compare their resolved configs when they start, before any data is read.

They compare their run folders too: two runs started by hand on one MASTER_ADDR:MASTER_PORT would
otherwise meet and train as one, in one of the folders. A folder is the same when its resolved path
is, or when its lock file names the same first holder (neorec/train/run_lock.py: one shared folder
that the nodes of a run mount under different paths); the same path on every node is accepted as well
(node-local folders of one name)."""

from __future__ import annotations

import json
import logging

import torch

from neorec.config.data_keys import is_reader_speed
from neorec.config.load import tree_changes
from neorec.config.schema import RunConfig
from neorec.distributed.comms import Comms
from neorec.errors import ConfigError
from neorec.train.run_lock import run_identity

log = logging.getLogger("neorec")

# settings of the machine a process runs on (its folders, threads, memory use, console), which may
# differ between nodes and change no result; and the data readers' speed (is_reader_speed)
NODE_LOCAL = ("embedding.cache.directory", "embedding.cache.release_mib", "embedding.cache.io_thread",
              "train.kernel_cache", "train.threads", "train.progress", "train.keep_freed_memory")  # fmt: skip


def check_same_config(cfg: RunConfig, comms: Comms) -> None:
    """ConfigError on every process, naming ranks and settings, unless all processes have `cfg`'s
    settings (the node-local folders aside). Collective: every process calls it at its start."""
    mine = json.dumps({"config": cfg.model_dump(mode="json"), "run": run_identity()}, sort_keys=True).encode()
    with comms.stats.set_aside():  # no training step's bytes
        every = comms.all_gather_bytes(torch.frombuffer(bytearray(mine), dtype=torch.uint8), "config").wait()
    gathered = [json.loads(bytes(t.cpu().tolist())) for t in every]
    check_same_folder([g["run"] for g in gathered])
    configs = [g["config"] for g in gathered]
    differ = [(r, tree_changes(configs[0], c, _of_the_machine)) for r, c in enumerate(configs)]
    differ = [(r, changes) for r, changes in differ if changes]
    if differ:
        rank, changes = differ[0]
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        others = f" (ranks {', '.join(str(r) for r, _ in differ)} differ)" if len(differ) > 1 else ""
        raise ConfigError(
            f"the processes of this run were given different configs: rank {rank} has, against rank 0's, "
            f"{shown}{others}. Every process must get the same config (the same --config file and --set "
            "on every node)"
        )


def _of_the_machine(key: str) -> bool:
    return key in NODE_LOCAL or is_reader_speed(key)


def check_same_folder(runs: list) -> None:
    """ConfigError unless every rank's run (run_lock.run_identity: its folder's resolved path and the
    first holder of its lock) is rank 0's: the same path, or the same holder (one shared folder,
    mounted elsewhere on another node). A rank that holds no folder (a library call) is not compared;
    where a folder has no lock (a filesystem without flock) other paths are only warned about: one
    shared folder mounted under two paths cannot be told from two folders."""
    first = runs[0]
    apart = [r for r, run in enumerate(runs) if run and first and run[0] != first[0]]
    unknown = [r for r in apart if runs[r][1] is None or first[1] is None]
    if unknown:
        folders = ", ".join(f"rank {r} in {runs[r][0]}" for r in unknown)
        log.warning(
            "rank 0 trains in %s, %s: one folder mounted under other paths, or two runs (without a lock "
            "on this filesystem this cannot be told); every process of a run must get the same --output-dir",
            first[0], folders,
        )  # fmt: skip
    other = [r for r in apart if r not in unknown and runs[r][1] != first[1]]
    if other:
        folders = ", ".join(f"rank {r} in {runs[r][0]}" for r in other)
        raise ConfigError(
            f"the processes of this run train in different run folders: rank 0 in {first[0]}, {folders}: two "
            "runs that meet at one MASTER_ADDR:MASTER_PORT, or a rank given another --output-dir. Every "
            "process of a run must get the same --output-dir (one folder that all nodes share); give each "
            "run its own MASTER_PORT"
        )
