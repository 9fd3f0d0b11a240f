"""Compile neorec's Triton kernels for an H100 (sm_90) with Triton's own compiler and ptxas; no GPU needed.

Triton's interpreter (which runs the kernels on CPU in tests/test_triton_kernels.py and test_triton_engine.py) runs them as
NumPy code and never generates GPU code, so it cannot catch what only code generation checks: types
of constexpr branches, bitcasts, int64/uint32 mixes. This compiles every kernel, each update rule
with the options that change its code, and prints one line per variant. It must run where
TRITON_INTERPRET is unset (tests/test_triton_engine.py starts it in a process of its own):

    python tests/compile_kernels.py
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from neorec.embedding.fused import triton_fused_update, triton_pool

H100 = GPUTarget("cuda", 90, 32)
INTS = {"dim", "num_groups", "p_stride"}  # the integer (non-pointer) arguments of the kernels
# Pointer element types by argument name: `weight` (any group's buffer) and the rounded output take
# the variant's dtype; every other pointer is to int64 (ids, offsets, or a launch's tables of the
# groups' pointers, strides and sizes).
POINTERS = {"partial": "fp32", "x": "fp32"}


def compile_kernel(kernel, dtype: str, constexprs: dict[str, object]) -> None:
    """Compile `kernel` (a triton.jit function) with its table in `dtype` and the given constexprs.
    Every argument is marked 16-divisible, as Triton specialises aligned tensors and sizes."""
    names = kernel.arg_names
    signature, values = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
        elif name in INTS:
            signature[name] = "i32"
        elif name in ("weight", "out"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = f"*{POINTERS.get(name, 'i64')}"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name not in constexprs}
    triton.compile(ASTSource(kernel, signature, values, attrs), target=H100)


def variants() -> list[tuple[str, object, str, dict[str, object]]]:
    update = {"HAS_SCALES": True, "MULTI_TABLE": False, "STOCHASTIC": False, "NUM_HPARAMS": 7,
              "BLOCK_N": 16, "BLOCK_D": 128}  # fmt: skip
    return [
        ("pool fp32, weighted", triton_pool._pool_kernel, "fp32", {"HAS_SCALES": True, "BLOCK_N": 16, "BLOCK_D": 128}),
        ("pool bf16, one id per bag", triton_pool._pool_kernel, "bf16", {"HAS_SCALES": False, "BLOCK_N": 1, "BLOCK_D": 64}),
        ("partial sums of a hot row", triton_fused_update._partial_kernel, "fp32", {"HAS_SCALES": True, "CHUNK": 1024, "BLOCK_N": 16, "BLOCK_D": 128}),
        ("update sgd fp32", triton_fused_update._update_kernel, "fp32", {**update, "RULE": 0}),
        ("update row-wise adagrad fp16, stochastic", triton_fused_update._update_kernel, "fp16", {**update, "RULE": 1, "STOCHASTIC": True}),
        ("update adagrad bf16, per-table", triton_fused_update._update_kernel, "bf16", {**update, "RULE": 2, "MULTI_TABLE": True}),
        ("update adam bf16, stochastic, per-table", triton_fused_update._update_kernel, "bf16", {**update, "RULE": 3, "STOCHASTIC": True, "MULTI_TABLE": True}),
        ("stochastic rounding to fp16", triton_fused_update._round_kernel, "fp16", {"BLOCK_D": 64}),
    ]  # fmt: skip


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_kernels.py: unset TRITON_INTERPRET (the interpreter generates no GPU code)")
    for label, kernel, dtype, constexprs in variants():
        compile_kernel(kernel, dtype, constexprs)
        print(f"compiled for sm_90: {label}", flush=True)


if __name__ == "__main__":
    main()
