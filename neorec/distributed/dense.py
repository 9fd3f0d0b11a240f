"""The dense part is data-parallel: after backward, every dense gradient is averaged over ranks.

One flat buffer, one all-reduce per step (through Comms, so the codec applies and the bytes are
counted), then the same optimizer step on every rank keeps the replicas identical. Embedding rows
are not here: they are updated by their owners inside backward.
"""

from __future__ import annotations

import torch
from torch import nn

from neorec.distributed.codecs import Codec
from neorec.distributed.comms import Comms, Pending


class DenseGradSync:
    def __init__(self, params: list[nn.Parameter], comms: Comms, precision: str = "fp32") -> None:
        self.params = [p for p in params if p.requires_grad]
        self.comms, self.codec = comms, Codec(precision)

    def start(self) -> Pending:
        """Start averaging the gradients (None counts as zero); wait() writes them back."""
        world = self.comms.topo.world_size
        if world == 1 or not self.params:
            return Pending.ready(None)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        summed = self.comms.all_reduce_sum([g.reshape(-1) for g in grads], self.codec, "dense")

        def finish() -> None:
            total = summed.wait().mul_(1.0 / world)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = total[offset : offset + n].view_as(p)  # a view: `total` is this step's own buffer
                offset += n

        return Pending([summed], finish)

    def broadcast_parameters(self) -> None:
        """Make every rank start from rank 0's dense weights."""
        for p in self.params:
            self.comms.broadcast(p.data, src=0)
