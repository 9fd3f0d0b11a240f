"""Wire formats for float exchanges: fp32, fp16 with a power-of-two scale per row, bf16.

fp16 has the precision but not the range of fp32: pooled embeddings can overflow 65504 and small
gradients underflow. Each row is therefore multiplied by 2^k so that its largest magnitude lands in
[2^14, 2^15) before the cast, and k travels with the row in one extra fp16 slot (as an exact small
integer). Powers of two scale exactly, so the only error is fp16's 11-bit rounding relative to the
row's largest value, for any finite fp32 row (rows of largest magnitude below 2^-111 keep fewer bits).
A NaN or infinity stays what it is, and a row holding one is sent unscaled. bf16 keeps fp32's range,
so it is a plain cast (8-bit mantissa).
"""

from __future__ import annotations

import torch

from neorec.errors import ConfigError

CODECS = ("fp32", "fp16", "bf16")


def wire_precisions(forward: str, backward: str, in_shared_memory: bool) -> tuple[str, str]:
    """The codecs of the pooled-embedding exchange and of its gradient, resolving "auto".

    auto: fp32 where every exchange goes through shared memory (one machine, CPU tensors), fp16
    forward and bf16 backward otherwise (gloo TCP between nodes, NCCL). A narrower wire saves
    bytes on a link, but in shared memory a byte costs one memcpy while the conversions cost more:
    on the Kaggle-like config, 2 processes x 1 thread trained at 55.5 against 59.4 ms a step with
    fp32 against fp16/bf16 (medians of 4 interleaved runs, benchmarks/history/design_choices.md)."""
    return (
        forward if forward != "auto" else ("fp32" if in_shared_memory else "fp16"),
        backward if backward != "auto" else ("fp32" if in_shared_memory else "bf16"),
    )


class Codec:
    def __init__(self, name: str) -> None:
        if name not in CODECS:
            raise ConfigError(f"communication precision {name!r}: expected one of {list(CODECS)}")
        self.name = name

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, D] fp32 -> [N, D'] wire tensor (D' = D + 1 for fp16), written into `out` if given
        (a view of a send buffer: no extra copy)."""
        if out is None:
            out = torch.empty(x.shape[0], self.wire_width(x.shape[1]), dtype=self.wire_dtype, device=x.device)
        if self.name != "fp16":
            out.copy_(x)
            return out
        if x.numel():  # max |x| per row; two reductions are several times faster than abs().amax()
            peak = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg())
        else:
            peak = x.new_zeros(x.shape[0], 1)
        _, exp = torch.frexp(peak)  # peak = m * 2^exp, m in [0.5, 1); zero rows get exp 0
        # any finite fp32 peak (< 2^128) lands in [2^14, 2^15) with a shift >= -113; 2^126 is the
        # largest shift whose 2^-shift stays a normal fp32 number when decoded (peaks below 2^-111 keep
        # fewer bits, as fp32 itself does below 2^-126). A row with a NaN or infinity is sent unscaled,
        # so that its finite values stay what fp16 makes of them (frexp gives such a peak exponent 0:
        # scaled by 2^15, every value past 2 would overflow)
        shift = torch.where(torch.isfinite(peak), (15 - exp).clamp_(-113, 126), 0).to(torch.float32)
        out[:, :-1] = x * torch.exp2(shift)  # a power of two: exact
        out[:, -1:] = shift
        return out

    def decode(self, wire: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of encode, back to fp32, written into `out` if given (e.g. a slice of a larger
        buffer: no concatenation afterwards)."""
        if self.name == "fp32":
            return wire if out is None else out.copy_(wire)
        if self.name == "bf16":
            return wire.to(torch.float32) if out is None else out.copy_(wire)
        scale = torch.exp2(-wire[:, -1:].to(torch.float32))
        # widen first, then scale in place: the same fp32 values as `wire[:, :-1] * scale`, whose
        # mixed-dtype broadcast over a strided fp16 view took 5x longer (2.6 vs 0.5 ms for 13k x 64)
        wide = wire[:, :-1].to(torch.float32) if out is None else out.copy_(wire[:, :-1])
        return wide.mul_(scale)

    def wire_width(self, dim: int) -> int:
        return dim + 1 if self.name == "fp16" else dim

    @property
    def wire_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.name]

    def __repr__(self) -> str:
        return f"Codec({self.name})"
