"""Embedding update rules as small pure functions, shared by the CPU torch path and any GPU kernel.

Every rule has the signature `(rows, grads, state, step, hp) -> (rows, state)`:
- `rows` [U, D] fp32: current weights of the U unique rows touched by the batch;
- `grads` [U, D] fp32: their gradient, duplicates already summed;
- `state` {name: [U, D] or [U]} fp32: optimizer state of those rows (see `STATE`);
- `step`: the engine's update count, starting at 1 (used by adam's bias correction);
- `hp`: hyper-parameters, each a float or a [U, 1] tensor when tables of one group differ.

The inputs are fresh gathers owned by the caller, so rules update them in place and return them:
at 26 x 8192 rows x 64 every extra temporary is another pass over ~50 MB. Rules never look outside
the rows they are given, which is what makes the updates lazy (untouched rows and their state do not
decay) and lets a cache hold only some rows.

Weight decay is L2 added to the gradient of touched rows (g += wd * w), before the rule.
Adam is "lazy adam": moments of a row are updated only when the row is touched, and bias correction
uses the engine's global step (like torch.optim.SparseAdam), not a per-row count, so no per-row step
state is stored. Its update is the textbook one, w -= lr * m_hat / (sqrt(v_hat) + eps), as in
torch.optim.Adam.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Scalar = float | torch.Tensor  # a float, or a [U, 1] tensor with one value per row


@dataclass(frozen=True)
class Hparams:
    """Hyper-parameters of one update, for all rows (float) or per row ([U, 1] tensor)."""

    lr: Scalar
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0
    beta1: Scalar = 0.9
    beta2: Scalar = 0.999


State = dict[str, torch.Tensor]
Rule = Callable[[torch.Tensor, torch.Tensor, State, int, Hparams], tuple[torch.Tensor, State]]


def _add_weight_decay(rows: torch.Tensor, grads: torch.Tensor, wd: Scalar) -> torch.Tensor:
    if isinstance(wd, float) and wd == 0.0:
        return grads
    return grads.add_(rows * wd)


def _descend(rows: torch.Tensor, lr: Scalar, num: torch.Tensor, denom: torch.Tensor | None = None) -> None:
    """rows -= lr * num / denom in place, leaving num and denom alone (adam's num is its state)."""
    if isinstance(lr, float):
        if denom is None:
            rows.add_(num, alpha=-lr)
        else:
            rows.addcdiv_(num, denom, value=-lr)
    elif denom is None:
        rows.sub_(num * lr)
    else:
        rows.sub_((num / denom).mul_(lr))


def _sqrt(x: Scalar) -> Scalar:
    return math.sqrt(x) if isinstance(x, float) else x.sqrt()


def sgd(
    rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """w -= lr * g."""
    grads = _add_weight_decay(rows, grads, hp.weight_decay)
    _descend(rows, hp.lr, grads)
    return rows, state


def folded_sgd(
    rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """w += g, where g already carries -lr (summed with -lr as each id's weight; see
    FusedEmbeddingCollection.folded_lr): the SGD step of groups without weight decay on CPU."""
    rows.add_(grads)
    return rows, state


def adagrad(
    rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """G += g^2 per element; w -= lr * g / (sqrt(G) + eps)  (torch.optim.Adagrad without lr decay)."""
    grads = _add_weight_decay(rows, grads, hp.weight_decay)
    acc = state["momentum1"]
    acc.addcmul_(grads, grads)
    _descend(rows, hp.lr, grads, acc.sqrt().add_(hp.eps))
    return rows, state


def rowwise_adagrad(
    rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """One accumulator per row: G += mean(g^2 over the row); w -= lr * g / (sqrt(G) + eps).

    D times less state than adagrad, which is why large tables use it (as FBGEMM does).
    """
    grads = _add_weight_decay(rows, grads, hp.weight_decay)
    acc = state["momentum1"]
    acc.add_(grads.square().mean(dim=1))
    _descend(rows, hp.lr, grads, acc.sqrt().unsqueeze(1).add_(hp.eps))
    return rows, state


def adam(
    rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """Lazy adam: m, v of touched rows only; bias correction with the global step."""
    grads = _add_weight_decay(rows, grads, hp.weight_decay)
    m, v = state["momentum1"], state["momentum2"]
    m.lerp_(grads, 1.0 - hp.beta1)  # m = beta1 * m + (1 - beta1) * g
    v.lerp_(grads.square(), 1.0 - hp.beta2)
    bias1, bias2 = 1.0 - hp.beta1**step, 1.0 - hp.beta2**step
    denom = v.sqrt().div_(_sqrt(bias2)).add_(hp.eps)
    _descend(rows, hp.lr / bias1, m, denom)
    return rows, state


@dataclass(frozen=True)
class RuleSpec:
    """An update rule and its state: name -> True if one value per element, False if one per row."""

    update: Rule
    state: dict[str, bool]


RULES: dict[str, RuleSpec] = {
    "sgd": RuleSpec(sgd, {}),
    "adagrad": RuleSpec(adagrad, {"momentum1": True}),
    "rowwise_adagrad": RuleSpec(rowwise_adagrad, {"momentum1": False}),
    "adam": RuleSpec(adam, {"momentum1": True, "momentum2": True}),
}


def initial_state_value(name: str, initial_accumulator: float) -> float:
    """Adagrad sums start at `initial_accumulator`; adam moments at zero."""
    return initial_accumulator if name in ("adagrad", "rowwise_adagrad") else 0.0
