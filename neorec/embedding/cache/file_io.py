"""The SSD tier's files: whole positioned reads and writes of a tensor's bytes, and disk blocks
given to a file up front."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from neorec.errors import MachineError, naming


def transfer(fd: int, data: torch.Tensor | memoryview, offset: int, write: bool, name: str | Path) -> None:
    """Write all of `data` at byte `offset` of the file, or read that many bytes into it, going on
    after short transfers; a read that reaches the end of the file, or a failing one, is an error
    naming the file."""
    view = data if isinstance(data, memoryview) else memoryview(data.numpy()).cast("B")
    done = 0
    while done < len(view):
        try:
            n = (
                os.pwrite(fd, view[done:], offset + done)
                if write
                else os.preadv(fd, [view[done:]], offset + done)
            )
        except OSError as e:  # a failing disk: name the file
            raise naming(e, name) from e
        if n == 0:
            raise OSError(f"{name}: ended at byte {offset + done}; the file was truncated")
        done += n


def allocate(fd: int, size: int, path: str | Path, what: str) -> None:
    """Give the file open as `fd` its `size` bytes of disk blocks up front (posix_fallocate), so that
    a full disk shows now, naming the file and `what` it holds, and not in the middle of training.
    Where the filesystem cannot allocate ahead, the file is only given its length (sparse)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise MachineError(
                f"{path}: no room on the disk for {what} ({size / 2**20:,.0f} MiB); free some space "
                "there, or set embedding.cache.directory to a folder on a larger disk",
            ) from e
        if e.errno == errno.EFBIG:  # a file-size limit (ulimit -f) or the filesystem's largest file
            raise naming(e, path) from e
        os.ftruncate(fd, size)
