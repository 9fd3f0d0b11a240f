"""Where the public data sets are found on this machine, and what an error says when they are not.

MovieLens latest-small can be downloaded by neorec (`neorec data download movielens`,
neorec/data/download.py) into the user's data folder, `data_home()`:
`$NEOREC_DATA`, else `$XDG_CACHE_HOME/neorec/data`, else `~/.cache/neorec/data`. A config that leaves
`data.movielens.root` unset reads `../shared/data/ml-latest-small` where that folder exists (the copy
beside a checkout of this project), else `<data home>/ml-latest-small`.

Criteo's logs are behind a licence that must be accepted on Criteo's (or Kaggle's) site, so neorec
cannot fetch them: `criteo_hint` says where they are and which keys point neorec at them.
"""

from __future__ import annotations

import os
from pathlib import Path

MOVIELENS_NAME = "ml-latest-small"
SHARED_MOVIELENS = Path("../shared/data") / MOVIELENS_NAME  # relative to the working folder
DOWNLOAD_COMMAND = "neorec data download movielens"
CRITEO_SITE = "https://ailab.criteo.com/ressources/"


def data_home() -> Path:
    """The folder of downloaded data sets: $NEOREC_DATA, else $XDG_CACHE_HOME/neorec/data (when that
    is an absolute path, as the XDG spec asks), else ~/.cache/neorec/data."""
    if os.environ.get("NEOREC_DATA"):
        return Path(os.environ["NEOREC_DATA"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return cache / "neorec" / "data"


def downloaded_movielens() -> Path:
    """Where `neorec data download movielens` puts MovieLens latest-small by default."""
    return data_home() / MOVIELENS_NAME


def movielens_root(root: str | Path | None) -> Path:
    """The MovieLens folder to read: `root` when one is named (checked by the reader), else the first
    folder of ../shared/data/ml-latest-small and <data home>/ml-latest-small that exists (the latter
    when neither does, so that the reader's error names where the download goes)."""
    if root is not None:
        return Path(root)
    return SHARED_MOVIELENS if SHARED_MOVIELENS.is_dir() else downloaded_movielens()


def missing_movielens(root: Path, named: bool) -> str:
    """The error of a MovieLens folder that does not exist: what was expected and the command that
    gets it. `named`: the folder came from data.movielens.root (else it is the default location)."""
    what = f"{root}: no such directory; expected MovieLens latest-small (ratings.csv, movies.csv)"
    if not named:
        return f"{what}; get it with: {DOWNLOAD_COMMAND} (into {root})"
    if root.name == MOVIELENS_NAME:
        return f"{what}; get it with: {DOWNLOAD_COMMAND} --dest {root.parent}"
    return (
        f"{what}; get it with: {DOWNLOAD_COMMAND} (into {downloaded_movielens()}), then set "
        "data.movielens.root to that folder, or leave it unset to read it there"
    )


def criteo_hint(key: str | None) -> str:
    """What to do about a Criteo TSV file that does not exist: where Criteo's logs are, and how to point
    neorec at them. `key`: the config key that named the file (None: a file named on the command line)."""
    where = (
        f"Criteo's logs (the Kaggle Display Advertising Challenge set, or the 1TB Click Logs) are at {CRITEO_SITE}, "
        "behind a licence accepted there"
    )
    if key is None:
        return f"{where}; see docs/data.md, 'Getting the data'"
    return (
        f"{where}; set {key} to your copy (e.g. --set data.source=criteo_tsv --set '{key}=[day_0.gz]'); "
        "see docs/data.md, 'Getting the data'"
    )
