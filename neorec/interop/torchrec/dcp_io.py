"""torch.distributed.checkpoint (DCP) folders: reading and writing parts of their tensors.

A DCP checkpoint is a folder: `.metadata` (every entry's global size and the chunks it was saved
in) and `__<rank>_<n>.distcp` data files. DCP reads by planning against the metadata: a process asks
for regions of a tensor in global coordinates and DCP reads them from whichever chunks hold them, so
any sharding in gives any sharding out. Here a region is a *part*: (global offsets, a tensor whose
shape is the region's). `load_parts` fills parts (one process, not a collective); `save_parts` writes
each process's parts as the chunks of the global tensors (a collective over the process group when
one is initialised).

`.metadata` is a pickle. `CheckedReader` unpickles only the classes DCP's own metadata is made of
(torch.distributed.checkpoint.metadata, torch.Size, dtypes, paths), so a file that names anything
else is refused, not run. DCP's data files carry no checksums; what is checked is that every part
asked for is covered by the checkpoint's chunks and that sizes agree with the metadata.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from neorec.interop.torchrec.common import TorchRecInteropError
from neorec.utils.files import foreign_files, fsync_dir

METADATA = ".metadata"
Part = tuple[Sequence[int], torch.Tensor]  # (global offsets, the region's tensor)

# what DCP's metadata pickle may name besides torch.distributed.checkpoint.metadata's classes
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(folder: str | Path) -> Metadata:
    """The checkpoint's metadata, unpickled through the allow-list above; TorchRecInteropError names
    the file when the folder is no DCP checkpoint or the file is damaged or foreign."""
    path = Path(folder) / METADATA
    if not Path(folder).is_dir():
        raise TorchRecInteropError(
            f"{folder}: no such folder (a torch.distributed.checkpoint folder was expected)"
        )
    if not path.is_file():
        raise TorchRecInteropError(
            f"{folder}: not a torch.distributed.checkpoint (DCP) folder: it has no {METADATA} file"
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
    ) as e:
        raise TorchRecInteropError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise TorchRecInteropError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class CheckedReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read once, through `read_metadata`."""

    def __init__(self, folder: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(folder))
        self._metadata = metadata if metadata is not None else read_metadata(folder)

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ARG002 - DCP's signature
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def tensor_entry(metadata: Metadata, key: str) -> TensorStorageMetadata:
    """The metadata of tensor `key`; TorchRecInteropError names the key when it is missing or no tensor."""
    entry = metadata.state_dict_metadata.get(key)
    if entry is None:
        raise TorchRecInteropError(f"the DCP checkpoint has no {key!r}")
    if not isinstance(entry, TensorStorageMetadata):
        raise TorchRecInteropError(f"{key!r} in the DCP checkpoint is not a tensor")
    return entry


class _PartsLoadPlanner(LoadPlanner):
    """Reads the regions `parts` names (global offsets) from the chunks that hold them."""

    def __init__(self, parts: Mapping[str, Sequence[Part]]) -> None:
        self.parts = {k: list(v) for k, v in parts.items()}

    def set_up_planner(
        self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        assert metadata is not None
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, parts in self.parts.items():
            entry = tensor_entry(self.metadata, key)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in parts]
            for offsets, t in parts:
                if len(offsets) != len(entry.size) or any(
                    o < 0 or o + n > s for o, n, s in zip(offsets, t.shape, entry.size, strict=True)
                ):
                    raise TorchRecInteropError(
                        f"{key!r} is {list(entry.size)} in the DCP checkpoint; the region at {list(offsets)} of "
                        f"shape {list(t.shape)} lies outside it"
                    )
            found = create_read_items_for_chunk_list(key, entry, chunks)
            covered = [0] * len(parts)
            for item in found:
                n = 1
                for length in item.lengths:
                    n *= int(length)
                covered[item.dest_index.index] += n
            for (offsets, t), done in zip(parts, covered, strict=True):
                if done != t.numel():
                    raise TorchRecInteropError(
                        f"{key!r}: the DCP checkpoint's chunks cover {done} of the {t.numel()} values at "
                        f"{list(offsets)} of shape {list(t.shape)}; the checkpoint is incomplete"
                    )
            items += found
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise TorchRecInteropError(f"{read_item.dest_index.fqn!r} is not a tensor in the DCP checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _, tensor = self.parts[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, int(start), int(length))
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the part: the values are in place


def load_parts(reader: CheckedReader, parts: Mapping[str, Sequence[Part]]) -> None:
    """Fill every part from the checkpoint, in this process alone (not a collective), and refuse a
    value that is NaN or infinite (TorchRecInteropError naming the folder, key, row and value): a
    checkpoint of a run that diverged would otherwise train to a NaN loss blamed on the learning rates."""
    if parts:
        with warnings.catch_warnings():  # DCP warns that one process loads alone, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load({}, storage_reader=reader, planner=_PartsLoadPlanner(parts), no_dist=True)
            except CheckpointException as e:  # a BaseException, wrapping what each rank raised
                cause = first_failure(e)
                if isinstance(cause, OSError) and cause.errno is not None:
                    raise cause from None  # a file that cannot be read, named by it
                what = " ".join(f"{type(cause).__name__}: {cause}".split()).removesuffix(":")[:300]
                raise TorchRecInteropError(
                    f"{reader.path}: its data files cannot be read ({what}); the checkpoint is damaged or "
                    "incomplete (DCP files carry no checksums): save it again"
                ) from None
    for key, held in parts.items():
        for offsets, t in held:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise TorchRecInteropError(
                    f"{reader.path}: {key!r} holds {_first_nonfinite(t, offsets)}: not a finite number; the "
                    "run that saved it diverged or the files are damaged, and a model cannot train from it"
                )


def first_failure(error: CheckpointException) -> BaseException:
    """The exception that the first failing rank of a DCP load or save raised (DCP wraps them)."""
    for exc, _trace in error.failures.values():
        return exc
    return error


def _first_nonfinite(t: torch.Tensor, offsets: Sequence[int]) -> str:
    """The first NaN or infinite value of part `t` (placed at `offsets` in its tensor) and where it is."""
    flat = int(torch.argmin(torch.isfinite(t).flatten().to(torch.uint8)))
    index = [
        int(o) + int(i)
        for o, i in zip(offsets, torch.unravel_index(torch.tensor(flat), t.shape), strict=True)
    ]
    where = f" at row {index[0]}" if index else ""
    if len(index) > 1:
        where += f", column {index[1]}"
    return f"{t.flatten()[flat].item()}{where}"


class _PartsSavePlanner(DefaultSavePlanner):
    """Writes this process's parts as chunks of tensors of the given global sizes; DCP's global
    plan checks that the chunks of all processes cover each tensor exactly once. The metadata's
    `planner_data` lists the entries in the order `entries` gives ({key: (key,)}, as DCP's own
    planner records a flat dict), the record of the saved dict's order that `load_dcp` reads."""

    def __init__(
        self, parts: Mapping[str, Sequence[Part]], sizes: Mapping[str, Sequence[int]], entries: Sequence[str]
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts, self.sizes, self.entries = parts, sizes, list(entries)
        self.by_index: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        saved, listed = metadata.state_dict_metadata, set(self.entries)
        order = [k for k in self.entries if k in saved] + [k for k in saved if k not in listed]
        self.metadata = dataclasses.replace(metadata, planner_data={k: (k,) for k in order})
        return plans, self.metadata

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, parts in self.parts.items():
            for offsets, t in parts:
                t = t.detach().contiguous()
                o = tuple(int(x) for x in offsets)
                self.by_index[(key, o)] = t
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, torch.Size(o)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()),
                            properties=TensorProperties.create_from_tensor(t),
                            size=torch.Size(self.sizes[key]),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return self.by_index[(index.fqn, tuple(index.offset))]


def check_replaceable(folder: str | Path) -> Path:
    """`folder`, once it is known to be absent, empty or an earlier DCP checkpoint (its `.metadata` and
    `.distcp` files alone), the only folder a checkpoint written there may replace: a run's folder or any
    other given by mistake would be removed with everything in it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise TorchRecInteropError(f"{folder}: is a file; a DCP checkpoint is a folder")
    if not folder.name or folder.resolve() == Path.cwd().resolve():
        raise TorchRecInteropError(
            f"{folder}: name a folder of its own for the DCP checkpoint, not the current one"
        )
    others = foreign_files(folder, lambda name: name == ".metadata" or Path(name).suffix == ".distcp")
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise TorchRecInteropError(
            f"{folder} holds other files ({shown}); a DCP checkpoint replaces only an earlier one (.metadata and "
            ".distcp files): give a new folder"
        )
    return folder


def save_parts(
    folder: str | Path,
    parts: Mapping[str, Sequence[Part]],
    sizes: Mapping[str, Sequence[int]],
    entries: Sequence[str] = (),
) -> Path:
    """Collective when torch.distributed is initialised (every rank calls it with its own parts):
    write a DCP checkpoint whose tensor `key` has global size `sizes[key]` and is made of the parts
    of all ranks, its metadata listing them in the order `entries` gives (others after). It is
    written into a hidden temporary folder that is renamed to `folder` once complete, so `folder`
    never holds a partial checkpoint; an existing `folder` is replaced."""
    folder = check_replaceable(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if distributed:
        dist.barrier()
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
    with warnings.catch_warnings():  # without a process group DCP warns that one process saves alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            planner = _PartsSavePlanner(parts, sizes, entries)
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=not distributed)
        except CheckpointException as e:  # a BaseException: what a rank raised (a full disk) is reported
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise first_failure(e) from None
    if distributed:
        dist.barrier()
    if rank == 0:
        fsync_dir(tmp)
        old = folder.with_name(f".{folder.name}.old")
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()
    return folder
