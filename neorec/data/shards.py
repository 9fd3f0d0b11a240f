"""Generated data on disk: one .npz file per block of samples, plus meta.json describing the features.

`neorec data generate` writes them (from the synthetic generator); `data.source: shards` trains on them.
Each file holds `dense` [n, d] float32, `labels` [n] float32, and per feature `values_<name>`,
`lengths_<name>` (and `weights_<name>` when weighted). A file's values are checked when it is read,
before any of its samples are handed out (neorec/data/checks.py): labels 0 or 1, dense values finite,
ids within their features' `num_ids` as `bounds_check` says.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.blocks import Block, rebatch
from neorec.data.checks import check_dense, check_ids, check_labels, checked_mode
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.data.synthetic import SyntheticSource
from neorec.errors import DataError


def write_shards(source: SyntheticSource, out: Path) -> list[Path]:
    """Write every train and eval block of `source`; files are written under a temporary name, then renamed."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
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
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **arrays)
            tmp.replace(path)
            paths.append(path)
    meta = {
        "num_dense": source.info.num_dense,
        "features": [vars(f) for f in source.info.features],
        "num_train_samples": source.spec.train_samples,
        "teacher_auc": source.teacher_auc(),
        "train_files": source.num_blocks("train"),
        "eval_files": source.num_blocks("eval"),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
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
            self.meta = json.loads(meta_path.read_text())
            self.features = [FeatureSpec(**f) for f in self.meta["features"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path}: not a valid shard description ({e})") from None
        self.keys = [f.name for f in self.features]
        self._checked: set[Path] = set()  # files already checked (not rescanned nor warned about each epoch)
        self.info = SourceInfo(
            self.meta["num_dense"], self.features, num_train_samples=self.meta.get("num_train_samples"),
            notes={"teacher_auc": self.meta.get("teacher_auc")},
        )  # fmt: skip

    def _read(self, path: Path) -> Block:
        try:
            with np.load(path) as z:
                t = {k: torch.from_numpy(z[k]) for k in z.files}
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read shard ({e})") from None
        names = ["dense", "labels"] + [f"{a}_{n}" for n in self.keys for a in ("values", "lengths")]
        missing = [k for k in names if k not in t]
        if missing:
            raise DataError(f"{path}: shard lacks arrays {missing}")
        if path not in self._checked:
            self._check(path, t)
            self._checked.add(path)
        weights = [t[f"weights_{n}"] for n in self.keys] if f"weights_{self.keys[0]}" in t else None
        return Block(
            t["dense"], t["labels"], torch.zeros_like(t["labels"]),
            [t[f"values_{n}"] for n in self.keys], [t[f"lengths_{n}"] for n in self.keys], weights,
        )  # fmt: skip

    def _check(self, path: Path, t: dict[str, torch.Tensor]) -> None:
        """The file's labels, dense values and ids (see the module docstring); rows are sample indices in
        the file."""
        check_labels(t["labels"].numpy(), str(path))
        check_dense(t["dense"].numpy(), str(path))
        for f in self.features:
            check_ids(t[f"values_{f.name}"].numpy(), str(path), f.name, f.num_ids,
                      lengths=t[f"lengths_{f.name}"].numpy(), mode=self.bounds_check)  # fmt: skip

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
