"""The dense part is data-parallel: every dense gradient is averaged over ranks.

Gradients are averaged in buckets of about `bucket_mib` MiB, in the order backward produces them (the
top MLP's first): when the last gradient of a bucket is accumulated, its all-reduce starts (a hook on
each parameter), so the top MLP's gradients cross while the embedding backward and the bottom MLP's
backward still compute. `start()` after backward launches whatever did not start (parameters without
a gradient count as zeros) and `wait()` writes the averages back. With `bucket_mib=0`, or where the
sum cannot run in the background (shared-memory transport: the sum is a memcpy on this thread; fp16/
bf16 on the wire: a two-stage exchange), everything goes in one flat all-reduce after backward.
Every bucket goes through Comms, so the codec applies and the bytes are counted; the same optimizer
step on every rank then keeps the replicas identical. Embedding rows are not here: they are updated by
their owners inside backward.
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms, Pending


def make_buckets(params: list[nn.Parameter], bucket_mib: float) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` in reverse order (the order backward reaches them), each run
    closed once it holds at least `bucket_mib` MiB of fp32 gradients (0: one bucket of all)."""
    if bucket_mib <= 0:
        return [list(params)] if params else []
    limit = bucket_mib * 2**20 / 4
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += p.numel()
        if size >= limit:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


class DenseGradSync:
    def __init__(
        self, params: list[nn.Parameter], comms: Comms, precision: str = "fp32", bucket_mib: float = 0.0
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.comms, self.codec = comms, Codec(precision)
        overlap = (
            bucket_mib > 0 and comms.topo.world_size > 1 and precision == "fp32" and comms.world.shm is None
        )
        self.buckets = make_buckets(self.params, bucket_mib if overlap else 0.0)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._armed = False
        self._missing: list[int] = []
        self._started: list[Pending | None] = []
        if len(self.buckets) > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """Call before backward: this backward's gradients start their buckets' all-reduces."""
        self._armed = len(self.buckets) > 1
        self._missing = [len(b) for b in self.buckets]
        self._started = [None] * len(self.buckets)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        i = self._bucket_of[id(p)]
        self._missing[i] -= 1
        if self._missing[i] == 0:
            self._started[i] = self._launch(self.buckets[i])

    def _launch(self, bucket: list[nn.Parameter]) -> Pending:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        return self.comms.all_reduce_sum([g.reshape(-1) for g in grads], self.codec, "dense")

    def start(self) -> Pending:
        """After backward: start averaging every gradient not under way yet (None counts as zero);
        wait() writes the averages back."""
        world = self.comms.topo.world_size
        if world == 1 or not self.params:
            return Pending.ready(None)
        if not self._armed:  # backward ran without arm(): everything now
            self._started = [None] * len(self.buckets)
        self._armed = False
        started = [s if s is not None else self._launch(b) for s, b in zip(self._started, self.buckets, strict=True)]
        self._started = []

        def finish() -> None:
            for bucket, pending in zip(self.buckets, started, strict=True):
                total = pending.wait().mul_(1.0 / world)
                offset = 0
                for p in bucket:
                    n = p.numel()
                    p.grad = total[offset : offset + n].view_as(p)  # a view: `total` is this step's own buffer
                    offset += n

        return Pending([], finish)

    def broadcast_parameters(self) -> None:
        """Make every rank start from rank 0's dense weights."""
        for p in self.params:
            self.comms.broadcast(p.data, src=0)
