"""Tables and dense weights as a safetensors file, readable by any tool without neorec.

The format (https://huggingface.co/docs/safetensors):

    bytes 0..7   header length N (uint64 little-endian)
    N bytes      UTF-8 JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
                 "__metadata__": {str: str}}, padded with spaces to a multiple of 8 bytes
    data         every tensor's raw little-endian bytes, one after the other, no gaps

It is simple enough to write here, so neorec needs no extra package for it. The metadata holds
`crc32/<tensor name>` (decimal crc32 of the tensor's bytes) for every tensor, which `read_safetensors`
checks, and whatever the caller adds (the export's quantization and table layout).
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path
from typing import BinaryIO

import torch

from neorec.serving.file_format import ExportError
from neorec.utils.files import write_atomic

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}
_TORCH = {v: k for k, v in DTYPES.items()}
CRC_PREFIX = "crc32/"


def _raw(t: torch.Tensor) -> torch.Tensor:
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:  # the format is little-endian everywhere
        raw = raw.view(-1, t.element_size()).flip(1).reshape(-1)
    return raw


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write `tensors` with `metadata` (plus a crc32 per tensor) atomically; returns the file's size."""
    path = Path(path)
    entries: dict[str, dict] = {}
    raws, offset, meta = [], 0, dict(metadata)
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ExportError(f"tensor {name!r}: dtype {t.dtype} has no safetensors type")
        raw = _raw(t)
        entries[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        meta[CRC_PREFIX + name] = str(zlib.crc32(raw.numpy()))
        offset += raw.numel()
        raws.append(raw)
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(text)) + text)
        for r in raws:
            f.write(memoryview(r.numpy()))

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, write, "weights file", "an earlier export of that name, if any, is intact")
    return path.stat().st_size


def read_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, every recorded crc32 checked."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ExportError(f"safetensors file {path} cannot be read: {e.strerror or e}") from None
    if len(data) < 8:
        raise ExportError(f"safetensors file {path} is truncated (it ends inside its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ExportError(f"safetensors file {path} is truncated (it ends inside its header)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"safetensors file {path}: the header is not valid JSON ({e})") from None
    meta = header.pop("__metadata__", {}) or {}
    body = torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8) if len(data) > 8 + n else None
    tensors = {}
    for name, e in header.items():
        try:
            begin, end = e["data_offsets"]
            dtype = _TORCH[e["dtype"]]
            raw = body[begin:end] if body is not None else torch.empty(0, dtype=torch.uint8)
            if end > (body.numel() if body is not None else 0) or raw.numel() != end - begin:
                raise ExportError(
                    f"safetensors file {path}: tensor {name!r} lies past the end: the file is truncated"
                )
            if CRC_PREFIX + name in meta and zlib.crc32(raw.numpy()) != int(meta[CRC_PREFIX + name]):
                raise ExportError(
                    f"safetensors file {path}: checksum mismatch in tensor {name!r}: the file is corrupted"
                )
            if sys.byteorder != "little" and dtype.itemsize > 1:
                raw = raw.view(-1, dtype.itemsize).flip(1).reshape(-1)
            tensors[name] = raw.clone().view(dtype).view(e["shape"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ExportError(f"safetensors file {path}: tensor {name!r} is malformed ({err})") from None
    return tensors, meta
