"""One record per row: a row's weights and its optimizer state side by side, in bytes.

A cached group of tables keeps each row as one fixed-size record (in the backing tier and in the
cache), so that bringing a row in or writing it back moves one contiguous run of bytes instead of
one piece per tensor. Fields follow each other in the order given ("weight" first, then the state
tensors); each starts at a multiple of 8 bytes, and the record is padded to a multiple of 64 bytes
(a cache line; records of a power-of-two size, e.g. 512 bytes for dim 64 with AdaGrad, never
straddle a 4 KiB page).

    dim 64, fp32 weights, adagrad:  | weight 256 B | momentum1 256 B |                    = 512 B
    dim 64, fp16 weights, adam:     | weight 128 B | momentum1 256 B | momentum2 256 B |  = 640 B
    dim 16, fp32, rowwise adagrad:  | weight 64 B | momentum1 4 B | pad 60 B |            = 128 B

A field of a block of records is a strided view (`views`): no copy, and torch ops read and write
it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FIELD_ALIGN = 8
_RECORD_ALIGN = 64


@dataclass(frozen=True)
class Field:
    """One tensor of a row: `width` values (0 = one value per row) of `dtype` at byte `offset`."""

    name: str
    width: int
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return max(self.width, 1) * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_rows: int) -> tuple[int, ...]:
        return (num_rows, self.width) if self.width else (num_rows,)


class RecordLayout:
    """Where each field sits in a record of `record_bytes` bytes."""

    def __init__(self, fields: list[tuple[str, int, torch.dtype]]) -> None:
        """fields: (name, width, dtype) in record order."""
        self.fields: dict[str, Field] = {}
        offset = 0
        for name, width, dtype in fields:
            field = Field(name, width, dtype, offset)
            self.fields[name] = field
            offset = _round_up(offset + field.nbytes, _FIELD_ALIGN)
        self.payload_bytes = sum(f.nbytes for f in self.fields.values())
        self.record_bytes = _round_up(max(offset, 1), _RECORD_ALIGN)

    def empty(self, num_rows: int, device: torch.device | str = "cpu", pin: bool = False) -> torch.Tensor:
        """Uninitialised records [num_rows, record_bytes] (uint8); pin: in pinned host memory."""
        return torch.empty((num_rows, self.record_bytes), dtype=torch.uint8, device=device, pin_memory=pin)

    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Field `name` of records [n, record_bytes]: [n, width] (or [n]) of its dtype, a view."""
        f = self.fields[name]
        part = records[:, f.offset : f.offset + f.nbytes]
        values = part.view(f.dtype)  # last dim contiguous, offsets multiples of the element size
        return values if f.width else values[:, 0]

    def views(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.view(records, name) for name in self.fields}

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Records [n, record_bytes] holding `values` (every field; padding is zero)."""
        n = next(iter(values.values())).shape[0]
        records = torch.zeros((n, self.record_bytes), dtype=torch.uint8)
        for name, field in self.fields.items():
            self.view(records, name).copy_(values[name].reshape(field.shape(n)))
        return records


def rows_in_mib(mib: float, share: float, record_bytes: int) -> int:
    """Records of `record_bytes` each that `share` of `mib` MiB holds: a cache's slots where a rank's
    cached tables share embedding.cache.size_mib in proportion to their rows (training and the
    planner's estimate size caches by this)."""
    return int(mib * 2**20 * share // record_bytes)


def as_words(records: torch.Tensor) -> torch.Tensor:
    """Records as int64 words: torch copies whole rows of those several times faster than bytes."""
    return records.view(torch.int64)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
