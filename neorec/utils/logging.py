"""Console messages of neorec: the library logs through Python's `logging` under the "neorec"
logger; `setup_logging` (called once by the CLI) decides who prints what.

In a run of several processes every rank would print the same lines, so rank 0 prints at INFO and
the other ranks only WARNING and above, each line prefixed with its rank (`[rank 1] neorec: ...`).
Lines go to stderr through tqdm, so that they do not break a progress bar that is being drawn.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "neorec"


class RankFormatter(logging.Formatter):
    """`neorec: message`, `neorec: warning: message`; with a rank, prefixed `[rank R] `."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] " if rank is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        text = f"{self.prefix}{ROOT}: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class TqdmHandler(logging.Handler):
    """Writes each line with tqdm.write, which clears and redraws any progress bar around it (a plain
    write while tqdm is not imported: no bar can be on the screen)."""

    def __init__(self, stream=None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = self.stream or sys.stderr
            tqdm_module = sys.modules.get("tqdm")
            if tqdm_module is None:
                stream.write(self.format(record) + "\n")
                stream.flush()
            else:
                tqdm_module.tqdm.write(self.format(record), file=stream)
        except Exception:  # noqa: BLE001 - logging must never stop a run
            self.handleError(record)


def process_rank() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) in a single process. A value that is not a
    number counts as unset here: the command that needs it refuses it in one line
    (neorec/distributed/topology.py), and the logger must be set up to say so."""
    return _number("RANK", 0), _number("WORLD_SIZE", 1)


def _number(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def setup_logging(rank: int | None = None, world_size: int | None = None, stream=None) -> logging.Logger:
    """Configure the "neorec" logger for this process (again, if called again): rank 0 at INFO, other
    ranks at WARNING; the rank prefix only when there are several processes. rank and world_size
    default to torchrun's environment."""
    env_rank, env_world = process_rank()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if isinstance(h, TqdmHandler)]:
        logger.removeHandler(h)
    handler = TqdmHandler(stream)
    handler.setFormatter(RankFormatter(rank if world_size > 1 else None))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False  # the application's root handlers would print every line twice
    return logger
