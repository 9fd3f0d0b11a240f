"""Generated data on disk: one .npz file per block of samples, plus meta.json describing the features.

`neorec data generate` writes them (from the synthetic generator); `data.source: shards` trains on them.
Each file holds `dense` [n, d] float32, `labels` [n] float32, and per feature `values_<name>`,
`lengths_<name>` (and `weights_<name>` when weighted). A file's values are checked when it is read,
before any of its samples are handed out (neorec/data/checks.py): labels 0 or 1, dense values finite,
ids within their features' `num_ids` as `bounds_check` says.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.blocks import Block, rebatch
from neorec.data.checks import check_dense, check_ids, check_labels, check_weights, checked_mode
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.data.synthetic import SyntheticSource
from neorec.errors import ConfigError, DataError
from neorec.utils.files import (
    check_json,
    check_recorded,
    foreign_files,
    size_and_crc32,
    write_atomic,
    write_json,
)

_AGAIN = "write the shards again (`neorec data generate`)"
_META_KEYS = ("num_dense", "features", "num_train_samples", "teacher_auc", "train_files", "eval_files", "files")


# what write_shards writes, and its temporaries
_OURS = re.compile(r"^((train|eval)-\d{5}\.npz|meta\.json)(\.tmp)?$")


def check_shards_folder(out: Path, flag: str = "--out") -> None:
    """The folder `write_shards` writes: new, empty or an earlier set of generated shards, which it
    replaces; a folder holding other files (a run's, a preprocessed data set's) is refused."""
    others = foreign_files(out, lambda name: _OURS.match(name) is not None)
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise ConfigError(
            f"{flag} {out}: holds files that `neorec data generate` does not write ({shown}); generated "
            "shards replace only earlier ones: give a new or empty folder"
        )


def write_shards(source: SyntheticSource, out: Path) -> list[Path]:
    """Write every train and eval block of `source`, then meta.json with each file's size and crc32;
    every file through write_atomic (temporary name, fsync, rename). `out` is new, empty or an earlier
    set (check_shards_folder), whose files beyond this set's are removed once meta.json is written."""
    check_shards_folder(out, "folder")
    out.mkdir(parents=True, exist_ok=True)
    paths, files = [], {}
    for split in ("train", "eval"):
        for i in range(source.num_blocks(split)):
            b = source.block(split, i)
            arrays = {"dense": b.dense.numpy(), "labels": b.labels.numpy()}
            for f, name in enumerate(source.keys):
                arrays[f"values_{name}"] = b.values[f].numpy()
                arrays[f"lengths_{name}"] = b.lengths[f].numpy()
                if b.weights is not None:
                    arrays[f"weights_{name}"] = b.weights[f].numpy()
            path = out / f"{split}-{i:05d}.npz"
            write_atomic(path, lambda f, a=arrays: np.savez(f, **a), "generated shard file")
            files[path.name] = size_and_crc32(path)
            paths.append(path)
    meta = {
        "num_dense": source.info.num_dense,
        "features": [vars(f) for f in source.info.features],
        "num_train_samples": source.spec.train_samples,
        "teacher_auc": source.teacher_auc(),
        "train_files": source.num_blocks("train"),
        "eval_files": source.num_blocks("eval"),
        "files": files,
    }
    write_json(out / "meta.json", meta, "generated shard file", indent=2)
    for stale in foreign_files(out, lambda name: name in files or name == "meta.json"):
        (out / stale).unlink(missing_ok=True)  # of an earlier, larger set: _OURS names alone are here
    return paths


class ShardSource:
    """A DataSource over a folder written by `write_shards` (read one file at a time)."""

    def __init__(self, root: str | Path, *, bounds_check: str = "error") -> None:
        """`bounds_check` (embedding.bounds_check): what ids outside their features' tables do when a file
        is read: "error" stops, "warn" logs them and passes them on, "off" reads no id."""
        self.root = Path(root)
        self.bounds_check = checked_mode(bounds_check)
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"{meta_path}: missing; is {self.root} a folder written by `neorec data generate`?")
        try:
            meta = json.loads(meta_path.read_bytes().decode("utf-8"))
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON, an integer of 5000 digits
            raise DataError(f"{meta_path}: not a valid shard description ({e})") from None
        if not isinstance(meta, dict):
            raise DataError(
                f"{meta_path}: not a valid shard description (a {type(meta).__name__}, expected a JSON object); "
                f"{_AGAIN}"
            )
        # its "crc32" key, which neorec writes (a description written by hand may go without)
        self.meta = check_json(meta, meta_path, "generated shard file", _AGAIN, DataError, keys=_META_KEYS)
        self.features = _check_meta(self.meta, meta_path)
        self.keys = [f.name for f in self.features]
        self._checked: set[Path] = set()  # files already checked (not rescanned nor warned about each epoch)
        self.info = SourceInfo(
            self.meta["num_dense"], self.features, num_train_samples=self.meta.get("num_train_samples"),
            notes={"teacher_auc": self.meta.get("teacher_auc")},
        )  # fmt: skip

    def _read(self, path: Path) -> Block:
        if path not in self._checked and isinstance(self.meta.get("files"), dict):  # its size and crc32
            recorded = self.meta["files"].get(path.name)
            if recorded is not None:
                check_recorded(path, recorded, self.root / "meta.json", _AGAIN, DataError)
        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:  # damaged
            raise DataError(f"{path}: cannot read shard ({e}); write the shards again (`neorec data generate`)") from None
        except AttributeError:  # np.load gave a single array (an .npy file), not an archive
            raise DataError(f"{path}: not a shard archive (.npz); write the shards again") from None
        names = ["dense", "labels"] + [f"{a}_{n}" for n in self.keys for a in ("values", "lengths")]
        missing = [k for k in names if k not in arrays]
        if missing:
            raise DataError(f"{path}: shard lacks arrays {missing}")
        _check_arrays(arrays, path, self.keys, self.meta["num_dense"])
        t = {k: torch.from_numpy(a) for k, a in arrays.items()}
        if path not in self._checked:
            self._check(path, t)
            self._checked.add(path)
        weights = [t[f"weights_{n}"] for n in self.keys] if f"weights_{self.keys[0]}" in t else None
        return Block(
            t["dense"], t["labels"], torch.zeros_like(t["labels"]),
            [t[f"values_{n}"] for n in self.keys], [t[f"lengths_{n}"] for n in self.keys], weights,
        )  # fmt: skip

    def _check(self, path: Path, t: dict[str, torch.Tensor]) -> None:
        """The file's labels, dense values, id weights and ids (see the module docstring); rows are
        sample indices in the file."""
        check_labels(t["labels"].numpy(), str(path))
        check_dense(t["dense"].numpy(), str(path))
        for f in self.features:
            lengths = t[f"lengths_{f.name}"].numpy()
            if f"weights_{f.name}" in t:
                check_weights(t[f"weights_{f.name}"].numpy(), str(path), f.name, lengths)
            check_ids(t[f"values_{f.name}"].numpy(), str(path), f.name, f.num_ids, lengths=lengths,
                      mode=self.bounds_check)  # fmt: skip

    def _batches(
        self, split: str, batch_size: int, epoch: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        files = [self.root / f"{split}-{i:05d}.npz" for i in range(self.meta[f"{split}_files"])]
        if epoch:  # a new file order per epoch
            order = torch.randperm(len(files), generator=torch.Generator().manual_seed(epoch))
            files = [files[i] for i in order.tolist()]
        return rebatch((self._read(p) for p in files), batch_size, self.keys, rank, world_size)

    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        return self._batches("train", batch_size, epoch)

    def train_slices(self, batch_size: int, epoch: int, rank: int, world_size: int) -> Iterator[Batch]:
        """Rank `rank`'s slice of every training batch (every rank still reads every file whole)."""
        return self._batches("train", batch_size, epoch, rank, world_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        return self._batches("eval", batch_size, 0)

    def teacher_auc(self) -> float | None:
        return self.meta.get("teacher_auc")


def _check_meta(meta: object, path: Path) -> list[FeatureSpec]:
    """The features of a parsed meta.json, after checking its structure and types (DataError naming
    the file and the key)."""

    def bad(what: str) -> DataError:
        return DataError(f"{path}: not a valid shard description ({what}); write the shards again")

    if not isinstance(meta, dict):
        raise bad(f"a {type(meta).__name__}, expected a JSON object")
    for key in ("num_dense", "train_files", "eval_files"):
        if not _whole(meta.get(key)) or meta[key] < 0:
            raise bad(f"{key!r} is {meta.get(key)!r}, expected a whole number >= 0")
    if meta.get("num_train_samples") is not None and not _whole(meta["num_train_samples"]):
        raise bad(f"'num_train_samples' is {meta['num_train_samples']!r}, expected a whole number")
    auc = meta.get("teacher_auc")
    if auc is not None and (not isinstance(auc, int | float) or isinstance(auc, bool) or not 0 <= auc <= 1):
        raise bad(f"'teacher_auc' is {auc!r}, expected a number in [0, 1]")
    features = meta.get("features")
    if not isinstance(features, list) or not features:
        raise bad("'features' is not a non-empty list")
    out = []
    for f in features:
        ok = isinstance(f, dict) and isinstance(f.get("name"), str) and _whole(f.get("num_ids")) and f["num_ids"] > 0
        flags = ok and set(f) <= {"name", "num_ids", "multi_hot", "weighted"}
        if not flags or not all(isinstance(f.get(k, False), bool) for k in ("multi_hot", "weighted")):
            raise bad(f"feature {str(f)[:80]}: expected {{name, num_ids > 0, multi_hot, weighted}}")
        out.append(FeatureSpec(**f))
    return out


def _check_arrays(arrays: dict[str, np.ndarray], path: Path, keys: list[str], num_dense: int) -> None:
    """Each array of a shard has the dimensions and kind of dtype it needs (ids and bag sizes integers,
    labels one number per sample, dense [n, num_dense] numbers)."""
    n = len(arrays["labels"]) if arrays["labels"].ndim else 0
    wanted = {"dense": (2, "biuf"), "labels": (1, "biuf")}
    for name in keys:
        wanted |= {f"values_{name}": (1, "iu"), f"lengths_{name}": (1, "iu"), f"weights_{name}": (1, "f")}
    for key, array in arrays.items():
        ndim, kinds = wanted.get(key, (array.ndim, array.dtype.kind))
        if array.ndim != ndim or array.dtype.kind not in kinds:
            what = {"iu": "integers", "f": "floats"}.get(kinds, "numbers")
            raise DataError(f"{path}: array {key!r} is {array.ndim}-D {array.dtype}, expected {ndim}-D {what}")
    if arrays["dense"].shape != (n, num_dense):
        raise DataError(f"{path}: dense is {arrays['dense'].shape}, expected ({n}, {num_dense})")
    for name in keys:
        lengths, values = arrays[f"lengths_{name}"], arrays[f"values_{name}"]
        if len(lengths) != n or (n and int(lengths.min()) < 0) or int(lengths.sum()) != len(values):
            raise DataError(f"{path}: lengths_{name} does not describe the {len(values)} ids of {n} samples")
        weights = arrays.get(f"weights_{name}")
        if weights is not None and len(weights) != len(values):
            raise DataError(f"{path}: weights_{name} has {len(weights)} entries for {len(values)} ids")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
