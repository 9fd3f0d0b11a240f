"""Row-wise quantization of embedding tables to 8, 4 or 2 bits, and the pooled lookup that reads them.

Every row keeps its own scale and bias (the idea of FBGEMM's "fused 8-bit / n-bit row-wise" tables).
With `bits` b and qmax = 2^b - 1:

    bias = min(row), scale = (max(row) - min(row)) / qmax, code = round((w - bias) / scale) in [0, qmax]
    w ~ scale * code + bias

so each element is off by at most scale / 2, i.e. 1 / (2 qmax) of its row's range whatever the row's
magnitude: 1/510 for int8, 1/30 for int4, 1/6 for int2. A row's minimum is code 0 and comes back as
the bias, exactly: so does a constant row (scale 0). With fp16 scale and bias, bias is min(row)
rounded down and scale (max(row) - bias) / qmax rounded up to fp16, so that [bias, bias + qmax * scale]
still covers the row and the scale / 2 bound holds for the stored scale; the minimum (and a constant
row) comes back exactly when it is an fp16 number. A row whose minimum lies beyond the fp16 range
(+-65504), or whose scale would, is refused.

Codes are packed k = 8 / b to a byte, low bits first, as FBGEMM packs them: element j of a row lies in
byte j // k, at bits (j % k) * b up to (j % k) * b + b - 1 (int4: element 2i in the low nibble of byte
i, 2i + 1 in the high one). A row is padded to whole bytes, the unused high bits of its last byte
zero, so a row of `dim` fp32 values (4 * dim bytes) becomes ceil(dim * b / 8) bytes of codes plus 8
(fp32 scale and bias) or 4 (fp16).

Lookups gather the codes of the ids, unpack and dequantize them and pool in fp32 (sum or mean,
optional per-id weights, empty bags give zeros), with the same per-id scaling as the fused training
engine, a block of ids at a time so the fp32 rows stay small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neorec.errors import NeorecError

SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
BITS = {"int8": 8, "int4": 4, "int2": 2}  # quantization -> bits per code
_CHUNK_ROWS = 1 << 16  # rows quantized per block, so temporaries stay small for huge tables
_CHUNK_IDS = 1 << 16  # ids dequantized per block in a lookup (whole bags)


def kind_of(bits: int) -> str:
    """The name an export's header gives a quantization: "int8_rowwise", "int4_rowwise", ..."""
    return f"int{bits}_rowwise"


def packed_width(dim: int, bits: int) -> int:
    """Bytes of codes per row: `dim` codes of `bits` bits, padded to a whole byte."""
    per_byte = 8 // bits
    return -(-dim // per_byte)


@dataclass
class QuantizedRows:
    """A row-wise quantized table: codes [rows, packed_width(dim, bits)] uint8 (bits 8: [rows, dim]),
    scale and bias [rows] (fp32 or fp16)."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    bits: int = 8
    dim: int = -1  # values per row; -1: the codes' width, which only 8-bit codes allow

    def __post_init__(self) -> None:
        if self.bits not in BITS.values():
            raise ValueError(f"bits must be one of {sorted(BITS.values())}, got {self.bits}")
        if self.codes.dim() != 2 or self.codes.dtype != torch.uint8:
            raise ValueError(
                f"codes must be uint8 [rows, bytes], got {self.codes.dtype} {list(self.codes.shape)}"
            )
        if self.dim < 0:
            if self.bits != 8:
                raise ValueError(f"{self.bits}-bit codes need the table's dim")
            self.dim = self.codes.shape[1]
        rows, width = self.codes.shape
        if width != packed_width(self.dim, self.bits):
            raise ValueError(
                f"{self.bits}-bit codes of dim {self.dim} take {packed_width(self.dim, self.bits)} bytes a row, "
                f"got {width}"
            )
        for name, t in (("scale", self.scale), ("bias", self.bias)):
            if t.dtype not in SCALE_DTYPES.values() or tuple(t.shape) != (rows,):
                raise ValueError(f"{name} must be fp32 or fp16 [{rows}], got {t.dtype} {list(t.shape)}")

    @property
    def num_rows(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.bias))


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [n, dim] uint8 (each < 2^bits) -> packed rows [n, packed_width(dim, bits)], low bits first."""
    if bits == 8:
        return q
    per_byte, dim = 8 // bits, q.shape[1]
    padded = F.pad(q, (0, packed_width(dim, bits) * per_byte - dim))  # zero codes past the row's end
    out = padded[:, 0::per_byte].clone()
    for i in range(1, per_byte):
        out |= padded[:, i::per_byte] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Packed rows [n, packed_width(dim, bits)] uint8 -> codes [n, dim] uint8 (plain tensor ops, which
    torch.export traces)."""
    if bits == 8:
        return packed
    per_byte, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=2).reshape(-1, packed.shape[1] * per_byte)[:, :dim]


def quantize_rows(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32, bits: int = 8
) -> QuantizedRows:
    """Quantize a [rows, dim] table (any float dtype) row by row to `bits`-bit codes; see the module
    docstring."""
    if weight.dim() != 2:
        raise ValueError(f"expected a [rows, dim] table, got shape {tuple(weight.shape)}")
    if scale_dtype not in SCALE_DTYPES.values():
        raise ValueError(f"scale_dtype must be float32 or float16, got {scale_dtype}")
    if bits not in BITS.values():
        raise ValueError(f"bits must be one of {sorted(BITS.values())}, got {bits}")
    rows, dim = weight.shape
    qmax = float((1 << bits) - 1)
    codes = torch.empty(rows, packed_width(dim, bits), dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, dtype=scale_dtype, device=weight.device)
    bias = torch.empty(rows, dtype=scale_dtype, device=weight.device)
    for a in range(0, rows, _CHUNK_ROWS):
        b = min(a + _CHUNK_ROWS, rows)
        w = weight[a:b].to(torch.float32)
        if not bool(torch.isfinite(w).all()):
            raise NeorecError(
                f"rows {a}..{b - 1} hold NaN or infinite values; such a table cannot be quantized"
            )
        lo, hi = w.amin(1), w.amax(1)
        if scale_dtype == torch.float32:
            s, z = (hi - lo) / qmax, lo
        else:
            z = _to_half(lo, down=True)
            s = _to_half((hi - z.to(torch.float32)) / qmax, down=False)
            _check_fits_fp16(lo, hi, s, a, qmax)
        s32, z32 = s.to(torch.float32), z.to(torch.float32)
        inv = torch.where(s32 > 0, 1.0 / s32.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
        q = ((w - z32.unsqueeze(1)) * inv.unsqueeze(1)).round_().clamp_(0, qmax)
        codes[a:b] = pack_codes(q.to(torch.uint8), bits)
        scale[a:b], bias[a:b] = s, z
    return QuantizedRows(codes, scale, bias, bits, dim)


def _check_fits_fp16(lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor, first: int, qmax: float) -> None:
    """NeorecError naming the first row (of rows first, first + 1, ...) whose fp16 bias or scale
    would fall outside the fp16 range: a min(row) beyond +-65504 (rounded down it would be -inf, or
    65504 far below the row, which the scale would then have to span), or a scale above 65504."""
    fp16_max = torch.finfo(torch.float16).max
    bad_bias, bad_scale = lo.abs() > fp16_max, ~torch.isfinite(s)
    if not bool((bad_bias | bad_scale).any()):
        return
    i = int((bad_bias | bad_scale).nonzero()[0])
    if bool(bad_bias[i]):
        why = f"its smallest value {float(lo[i]):.7g} is beyond the fp16 range (+-{fp16_max:g}) of its bias"
    else:
        span = float(hi[i]) - float(lo[i])
        why = f"its values span {span:.7g}, a scale of {span / qmax:.7g} beyond the fp16 range ({fp16_max:g})"
    raise NeorecError(f"row {first + i}: {why}; quantize with fp32 scale and bias (--scale-dtype fp32)")


def _to_half(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp32 -> fp16 rounded toward -inf (down) or +inf (up), so a bound stays a bound."""
    h = x.to(torch.float16)
    wrong = h.to(torch.float32) > x if down else h.to(torch.float32) < x
    if bool(wrong.any()):
        toward = torch.full_like(h, float("-inf") if down else float("inf"))
        h = torch.where(wrong, torch.nextafter(h, toward), h)
    return h


def dequantize_rows(table: QuantizedRows, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of `rows` (int64 indices; None = the whole table), [len(rows), dim]."""
    if rows is None:
        codes, scale, bias = table.codes, table.scale, table.bias
    else:
        codes, scale, bias = table.codes.index_select(0, rows), table.scale[rows], table.bias[rows]
    return dequantize(codes, scale, bias, table.bits, table.dim)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, dim: int
) -> torch.Tensor:
    """fp32 rows [n, dim] = scale * code + bias of n packed rows and their scales and biases [n]."""
    s = scale.to(torch.float32).unsqueeze(1)
    values = unpack_codes(codes, bits, dim).to(torch.float32)
    return torch.addcmul(bias.to(torch.float32).unsqueeze(1), values, s)


def bag_scales(lengths: torch.Tensor, weights: torch.Tensor | None, mode: str) -> torch.Tensor | None:
    """Per-id factor of a pooled lookup, as the fused engine computes it: the id's weight (if any)
    times 1 / bag length for mean pooling. None when every factor is 1 (plain sum)."""
    if mode not in ("sum", "mean"):
        raise ValueError(f"pooling mode must be 'sum' or 'mean', got {mode!r}")
    scales = weights.to(torch.float32) if weights is not None else None
    if mode == "mean":
        num_ids = int(lengths.sum())
        inv = (
            lengths.clamp(min=1)
            .to(torch.float32)
            .reciprocal()
            .repeat_interleave(lengths, output_size=num_ids)
        )
        scales = inv if scales is None else scales * inv
    return scales


def pooled_lookup(
    table: QuantizedRows,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    mode: str = "sum",
) -> torch.Tensor:
    """[num_bags, dim] fp32 pooled vectors of a quantized table.

    ids [n] int64 rows; offsets [num_bags + 1] where each bag starts in ids (the last entry is n);
    per_sample_weights [n] optional weight per id; mode "sum" or "mean" (of the weighted ids, divided
    by the bag's id count). Empty bags give zeros. Dequantization and accumulation are fp32.
    """
    num_bags, num_ids = offsets.numel() - 1, ids.numel()
    lengths = offsets[1:] - offsets[:-1]
    scales = bag_scales(lengths, per_sample_weights, mode)
    if num_ids == 0:
        return torch.zeros(num_bags, table.dim, device=ids.device)
    if scales is None and num_ids == num_bags and bool((lengths == 1).all()):  # one-hot: a gather
        return dequantize_rows(table, ids)
    if num_ids <= _CHUNK_IDS:
        bag_bounds = [0, num_bags]
    else:  # cut before the bag holding every _CHUNK_IDS-th id, so the fp32 rows stay small
        cuts = torch.searchsorted(offsets, torch.arange(_CHUNK_IDS, num_ids, _CHUNK_IDS), right=True) - 1
        bag_bounds = sorted({0, num_bags, *cuts.tolist()})
    id_bounds = offsets[bag_bounds].tolist()
    parts = []
    for k in range(len(bag_bounds) - 1):
        lo, hi = id_bounds[k], id_bounds[k + 1]
        rows = dequantize_rows(table, ids[lo:hi])
        parts.append(
            F.embedding_bag(
                torch.arange(hi - lo, device=ids.device),
                rows,
                offsets[bag_bounds[k] : bag_bounds[k + 1] + 1] - lo,
                mode="sum",
                per_sample_weights=scales[lo:hi] if scales is not None else None,
                include_last_offset=True,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
