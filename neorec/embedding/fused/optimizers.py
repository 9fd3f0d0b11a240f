"""Embedding update rules as small pure functions, shared by the CPU torch path and any GPU kernel.

Each rule is written as a change to the weights, `delta(grads, state, step, hp) -> (delta, state)`:
- `grads` [U, D] fp32: the summed gradients of the U unique rows touched by the batch (with
  weight decay already added, see below);
- `state` {name: [U, D] or [U]} fp32: optimizer state of those rows (see `RuleSpec.state`);
- `step`: the engine's update count, starting at 1 (used by adam's bias correction);
- `hp`: hyper-parameters, each a float or a [U, 1] tensor when tables of one group differ;
- `delta` [U, D]: what the step adds to the rows' weights.
`with_weights(delta)` is the rule on weights, `(rows, grads, state, step, hp) -> (rows, state)`:
g += wd * w, then w += delta. The split lets a plain fp32 table take the step in one pass over the
touched rows (index_add_ of the deltas, FusedEmbeddingCollection.apply_update) instead of a gather,
an add and a scatter, with bitwise the same result: both compute w + delta.

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


def _sqrt(x: Scalar) -> Scalar:
    return math.sqrt(x) if isinstance(x, float) else x.sqrt()


def sgd_delta(grads: torch.Tensor, state: State, step: int, hp: Hparams) -> tuple[torch.Tensor, State]:
    """-lr * g."""
    return grads.mul_(-hp.lr), state


def folded_sgd_delta(grads: torch.Tensor, state: State, step: int, hp: Hparams) -> tuple[torch.Tensor, State]:
    """g itself: it already carries -lr (summed with -lr as each id's weight; see
    FusedEmbeddingCollection.folded_lr), the SGD step of groups without weight decay on CPU."""
    return grads, state


def adagrad_delta(grads: torch.Tensor, state: State, step: int, hp: Hparams) -> tuple[torch.Tensor, State]:
    """G += g^2 per element; -lr * g / (sqrt(G) + eps)  (torch.optim.Adagrad without lr decay)."""
    acc = state["momentum1"]
    acc.addcmul_(grads, grads)
    return grads.div_(acc.sqrt().add_(hp.eps)).mul_(-hp.lr), state


def rowwise_adagrad_delta(
    grads: torch.Tensor, state: State, step: int, hp: Hparams
) -> tuple[torch.Tensor, State]:
    """One accumulator per row: G += mean(g^2 over the row); -lr * g / (sqrt(G) + eps).

    D times less state than adagrad, which is why large tables use it (as FBGEMM does). The row's
    factor -lr / (sqrt(G) + eps) is formed once per row, so g is scaled in one pass.
    """
    acc = state["momentum1"]
    acc.add_(torch.linalg.vecdot(grads, grads).div_(grads.shape[1]))
    denom = acc.sqrt().unsqueeze(1).add_(hp.eps)  # [U, 1]
    neg_lr = torch.full_like(denom, -hp.lr) if isinstance(hp.lr, float) else hp.lr.neg()
    return grads.mul_(neg_lr.div_(denom)), state


def adam_delta(grads: torch.Tensor, state: State, step: int, hp: Hparams) -> tuple[torch.Tensor, State]:
    """Lazy adam: m, v of touched rows only; bias correction with the global step."""
    m, v = state["momentum1"], state["momentum2"]
    m.lerp_(grads, 1.0 - hp.beta1)  # m = beta1 * m + (1 - beta1) * g
    v.lerp_(grads.square(), 1.0 - hp.beta2)
    bias1, bias2 = 1.0 - hp.beta1**step, 1.0 - hp.beta2**step
    denom = v.sqrt().div_(_sqrt(bias2)).add_(hp.eps)
    return torch.div(m, denom, out=grads).mul_(-hp.lr / bias1), state


Delta = Callable[[torch.Tensor, State, int, Hparams], tuple[torch.Tensor, State]]


def with_weights(delta: Delta) -> Rule:
    """The rule on weights: g += wd * w, then w += delta(g)."""

    def rule(rows: torch.Tensor, grads: torch.Tensor, state: State, step: int, hp: Hparams):
        change, state = delta(_add_weight_decay(rows, grads, hp.weight_decay), state, step, hp)
        return rows.add_(change), state

    rule.__doc__ = delta.__doc__
    return rule


sgd, folded_sgd = with_weights(sgd_delta), with_weights(folded_sgd_delta)
adagrad, rowwise_adagrad, adam = with_weights(adagrad_delta), with_weights(rowwise_adagrad_delta), with_weights(adam_delta)


@dataclass(frozen=True)
class RuleSpec:
    """An update rule and its state: name -> True if one value per element, False if one per row."""

    update: Rule
    delta: Delta
    state: dict[str, bool]


RULES: dict[str, RuleSpec] = {
    "sgd": RuleSpec(sgd, sgd_delta, {}),
    "adagrad": RuleSpec(adagrad, adagrad_delta, {"momentum1": True}),
    "rowwise_adagrad": RuleSpec(rowwise_adagrad, rowwise_adagrad_delta, {"momentum1": False}),
    "adam": RuleSpec(adam, adam_delta, {"momentum1": True, "momentum2": True}),
}


def initial_state_value(name: str, initial_accumulator: float) -> float:
    """Adagrad sums start at `initial_accumulator`; adam moments at zero."""
    return initial_accumulator if name in ("adagrad", "rowwise_adagrad") else 0.0
