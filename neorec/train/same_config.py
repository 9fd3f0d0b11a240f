"""Every process of a run trains one config. Each is started with its own command line (torchrun
runs it once per process, a cluster once per node), so a config file that differs between nodes, or
a `--set` given to one rank alone, would train ranks on other data, seeds or learning rates without a
word: the processes compare their resolved configs when they start, before any data is read."""

from __future__ import annotations

import json

import torch

from neorec.config.data_keys import is_reader_speed
from neorec.config.load import tree_changes
from neorec.config.schema import RunConfig
from neorec.distributed.comms import Comms
from neorec.errors import ConfigError

# settings of the machine a process runs on (its folders, threads, memory use, console), which may
# differ between nodes and change no result; and the data readers' speed (is_reader_speed)
NODE_LOCAL = ("embedding.cache.directory", "embedding.cache.release_mib", "embedding.cache.io_thread",
              "train.kernel_cache", "train.threads", "train.progress", "train.keep_freed_memory")  # fmt: skip


def check_same_config(cfg: RunConfig, comms: Comms) -> None:
    """ConfigError on every process, naming ranks and settings, unless all processes have `cfg`'s
    settings (the node-local folders aside). Collective: every process calls it at its start."""
    mine = json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    with comms.stats.set_aside():  # no training step's bytes
        every = comms.all_gather_bytes(torch.frombuffer(bytearray(mine), dtype=torch.uint8), "config").wait()
    configs = [json.loads(bytes(t.cpu().tolist())) for t in every]
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
