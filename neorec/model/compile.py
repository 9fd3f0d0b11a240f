"""`train.compile`: the dense stages of a model compiled with torch.compile (inductor).

A model's dense math sits in two methods, `bottom_stage` (bottom MLP) and `top_stage` (interaction
or cross network, top MLP, last layer); the embedding lookup between them stays eager, so the fused
engine's backward (which updates rows in place) never enters a graph. Each stage is replaced on the
instance by a wrapper that runs the compiled function while training and the eager one otherwise:
evaluation (no gradients, another batch size) would cost compilations of its own for a pass that is
short next to training. Parameters and buffers are the model's own, so `state_dict` keys do not change
(no `_orig_mod.` prefixes) and checkpoints move freely between compiled and eager runs.

Each batch size gets kernels of its own (static shapes): the training batch, and the smaller last
batch of an epoch (or of a rank's share) once more, which is the same size every epoch, so a run
compiles each stage twice at most and never again after. Kernels compiled for a dynamic batch size
would spare that second compilation but run slower every step on the CPU (benchmarks/dense_step.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from neorec.errors import ConfigError, NeorecError

STAGES = ("bottom_stage", "top_stage")


class CompileError(NeorecError):
    """torch.compile failed on a dense stage (train.compile)."""


def check_compiler(device: torch.device) -> None:
    """Raise ConfigError, naming train.compile, where inductor cannot build kernels for `device`:
    on the CPU it compiles C++ with the system's compiler, on a GPU it needs triton."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "train.compile: true needs triton on a GPU (pip install triton); set train.compile: false"
            )
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:  # InvalidCxxCompiler, or the search itself failing
        raise ConfigError(
            "train.compile: true needs a C++ compiler for torch.compile's CPU kernels (g++ or clang++ on PATH, "
            f"or CXX); none was found ({type(e).__name__}); install one or set train.compile: false"
        ) from e


class CompiledStage:
    """A dense stage that runs compiled while the model trains and eagerly otherwise."""

    def __init__(
        self,
        model: nn.Module,
        name: str,
        eager: Callable[[torch.Tensor], torch.Tensor],
        dynamic: bool = False,
    ) -> None:
        self.model, self.name, self.eager = model, name, eager
        self.compiled = torch.compile(eager, dynamic=dynamic)
        self.compiled_once = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.model.training and torch.is_grad_enabled()):
            return self.eager(x)
        if self.compiled_once:
            return self.compiled(x)
        try:  # the first call compiles: its failures are the setting's, not the model's
            out = self.compiled(x)
        except Exception as e:
            raise CompileError(
                f"train.compile: torch.compile failed on the model's {self.name} ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); set train.compile: false"
            ) from e
        self.compiled_once = True
        return out


def apply_compile(model: nn.Module, device: torch.device, dynamic: bool = False) -> nn.Module:
    """Compile the dense stages of `model` (a DLRM or DCNv2) in place; returns the model. dynamic=True
    compiles the batch dimension as a symbol (one compilation for every batch size)."""
    check_compiler(device)
    for name in STAGES:
        eager = getattr(model, name, None)
        if eager is None:
            raise ConfigError(
                f"train.compile: true compiles the dense stages of DLRM and DCNv2 models (model.arch dlrm, "
                f"dcnv2, with one or several tasks); {type(model).__name__} has no {name}: set train.compile: false"
            )
        setattr(model, name, CompiledStage(model, name, eager, dynamic))
    return model
