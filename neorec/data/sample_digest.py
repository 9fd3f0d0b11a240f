"""A digest of a set of samples that does not depend on their order, their batches or how processes
split them: each sample's labels, dense values, ids (with their feature, place in the bag and weight)
and bag lengths are hashed to one 64-bit number, and the numbers of all samples are added (wrapping).

A run records the digest of the held-out set its final evaluation scored (summary.json); `neorec eval`
scores the set its config names now, and a digest that differs says the data changed since the run
(files rewritten, a relative path read from another folder, a config.yaml edited by hand): the
metrics would not be the run's.
"""

from __future__ import annotations

import torch

from neorec.data.batch import Batch

# odd 64-bit constants (as signed int64) of a multiply-xorshift mix
_MUL = (-7046029254386353131, -4658895280553007687, 7640891576956012809, -2601472011815224147)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """int64 -> int64, every bit of the input spread over the output (products wrap)."""
    x = (x ^ (x >> 31)) * _MUL[0]
    x = (x ^ (x >> 29)) * _MUL[1]
    return x ^ (x >> 32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of `t`'s values as int64."""
    return t.float().contiguous().view(torch.int32).to(torch.int64)


def sample_hashes(batch: Batch) -> torch.Tensor:
    """[B] int64: one hash per sample of `batch`, on its device."""
    n = len(batch)
    device = batch.dense.device
    labels = batch.labels.reshape(n, -1)
    column = torch.arange(1, labels.shape[1] + 1, device=device) * _MUL[2]
    h = _mix(_bits(labels) + column).sum(1)
    column = torch.arange(1, batch.dense.shape[1] + 1, device=device) * _MUL[3]
    h = h + _mix(_bits(batch.dense.reshape(n, -1)) + column).sum(1)
    sparse = batch.sparse
    for f, key in enumerate(sparse.keys):
        ids, lengths, weights = sparse.feature(key)
        salt = ((f + 1) * _MUL[2] + 2**63) % 2**64 - 2**63  # as int64 arithmetic wraps
        h = h + _mix(lengths.to(torch.int64) * _MUL[1] + salt)  # an empty bag counts too
        if ids.numel() == 0:
            continue
        sample = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=ids.numel())
        starts = torch.cumsum(lengths, 0) - lengths
        place = torch.arange(ids.numel(), device=device) - starts[sample]
        one = _mix(ids.to(torch.int64) * _MUL[0] + place * _MUL[3] + salt)
        if weights is not None:
            one = _mix(one + _bits(weights))
        h = h.index_add(0, sample, one)
    return _mix(h)


class SampleDigest:
    """The running digest of the samples `add`ed (see the module doc)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.started = False  # set by who adds the samples (a model scoring its set itself adds none)

    def add(self, batch: Batch, count: int | None = None) -> None:
        """The first `count` samples of `batch` (all: None); the rest are padding."""
        hashes = sample_hashes(batch)
        part = hashes[:count].sum() if count is not None else hashes.sum()
        self.total = part if self.total is None else self.total + part

    def hex(self, comms=None) -> str | None:
        """The digest, as 16 hex digits (None: no samples were taken); over several processes (`comms`,
        collective) the sum of every process's samples."""
        if not self.started:
            return None
        total = self.total if self.total is not None else torch.zeros((), dtype=torch.int64)
        total = total.reshape(1).cpu()
        if comms is not None:
            total = comms.sum_over_ranks(total, "eval")
        return f"{int(total[0]) & (2**64 - 1):016x}"
