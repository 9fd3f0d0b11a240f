"""Each data file has one role: a file listed twice among the training files would train each of its
samples twice an epoch, and a held-out file that is also a training file (a folder of training files
that holds it) would be scored on samples the model trained on, its AUC inflated without a word.

`FileRoles` collects the files a source reads, each with its role ("train" or "eval") and where it was
named (the config key or flag, and the path given there, a file or a folder that holds it), and refuses
the second listing of a file, naming both. A local file is known by its real path (symbolic links and
`..` resolved); a file off this machine by its URI.
"""

from __future__ import annotations

import os

from neorec.errors import ConfigError

ROLES = {"train": "a training file", "eval": "a held-out file"}


class FileRoles:
    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}  # file's identity -> (role, where it was named)

    def add(self, file: str, role: str, named: str) -> None:
        """`file` read as `role`; `named`: where, e.g. "data.parquet.paths: data/" (the key and the
        path given). ConfigError when the file was added before."""
        key = file if "://" in file else os.path.realpath(file)
        if key not in self._seen:
            self._seen[key] = (role, named)
            return
        first_role, first_named = self._seen[key]
        if first_role == role:
            where = first_named if first_named == named else f"{first_named}; {named}"
            raise ConfigError(
                f"{file}: is listed twice as {ROLES[role]} ({where}): each file is read once an epoch; "
                "name it once"
            )
        raise ConfigError(
            f"{file}: is both {ROLES[first_role]} ({first_named}) and {ROLES[role]} ({named}): held-out "
            "samples must not train; keep the held-out files out of the training files and folders"
        )
