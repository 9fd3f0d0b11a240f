"""Whole positioned reads and writes of a tensor's bytes in a file (the SSD tier's files)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def transfer(fd: int, data: torch.Tensor | memoryview, offset: int, write: bool, name: str | Path) -> None:
    """Write all of `data` at byte `offset` of the file, or read that many bytes into it, going on
    after short transfers; a read that reaches the end of the file is an error naming the file."""
    view = data if isinstance(data, memoryview) else memoryview(data.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = (
            os.pwrite(fd, view[done:], offset + done)
            if write
            else os.preadv(fd, [view[done:]], offset + done)
        )
        if n == 0:
            raise OSError(f"{name}: ended at byte {offset + done}; the file was truncated")
        done += n
