"""Set-up shared by every test.

Without a CUDA device, Triton's kernels are built for its interpreter, which runs them on CPU tensors
(tests/test_triton_kernels.py checks the kernels that way). Triton decides this when a kernel is
decorated and when triton.language itself is imported, so TRITON_INTERPRET must be set before any
test module imports neorec's kernels. It changes nothing else: the engine picks the Triton kernels on
its own only on CUDA devices (kernels="auto"), so on CPU they run only where a test asks for them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
