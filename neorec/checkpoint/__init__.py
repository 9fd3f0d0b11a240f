"""Sharded checkpoints: every rank writes its table shards, rank 0 the dense state and a manifest.

Save (collective) with `save_checkpoint`; load under any plan and world size with
`load_checkpoint` (each process reads only the rows and columns it holds); find the newest
complete one with `latest_checkpoint`; `describe` is what `neorec checkpoint inspect` prints.
See save.py for the folder layout and pieces.py for how table parts are cut and reassembled.
"""

from neorec.checkpoint.files import CheckpointError
from neorec.checkpoint.inspect import describe
from neorec.checkpoint.load import latest_checkpoint, load_checkpoint, read_manifest, resolve_checkpoint
from neorec.checkpoint.save import list_checkpoints, save_checkpoint

__all__ = [
    "CheckpointError",
    "describe",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
]
