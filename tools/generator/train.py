"""The generator's trainer: a real data-parallel training job, R ranks simulated in one process.

Every collective goes through a ``Comm``. The packetiser implements it and emits the frames NCCL
would send; ``LocalComm`` computes the results only, for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch


class Comm(Protocol):
    """Collectives over R ranks, each rank's buffer a flat numpy array (config.layout.numpy_dtype:
    bfloat16 travels as its uint16 bits). ``what`` names the collective: "param_count", "shapes",
    "init_params:K", "rebuild_indices", "rebuild_sizes", "grad:iter=I:bucket=B" (0-based I, B)."""

    def all_gather(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]: ...

    def broadcast(self, data: np.ndarray, root: int, what: str) -> np.ndarray: ...

    def all_reduce(self, per_rank: list[np.ndarray], what: str) -> np.ndarray: ...


def _as_torch(a: np.ndarray) -> torch.Tensor:
    # uint16 on the wire is always bfloat16 (config.layout.numpy_dtype)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def sum_in_rank_order(per_rank: Sequence[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ..., each addition rounded to the element type (torch CPU arithmetic,
    as NCCL and gloo add two 16-bit floats). Equal to NCCL's ring result for 2 ranks."""
    acc = _as_torch(per_rank[0])
    for a in per_rank[1:]:
        acc = acc + _as_torch(a)
    return _as_numpy(acc)


class LocalComm:
    """Comm without a wire: results only. ``reduce_fn(per_rank) -> reduced`` decides the
    summation order (for R > 2 pass the NCCL ring order's reduction)."""

    def __init__(self, reduce_fn: Callable[[Sequence[np.ndarray]], np.ndarray] = sum_in_rank_order):
        self.reduce_fn = reduce_fn

    def all_gather(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]:
        return [np.array(a, copy=True) for a in per_rank]

    def broadcast(self, data: np.ndarray, root: int, what: str) -> np.ndarray:
        return np.array(data, copy=True)

    def all_reduce(self, per_rank: list[np.ndarray], what: str) -> np.ndarray:
        if len({(a.dtype, a.shape) for a in per_rank}) != 1:
            raise ValueError(f"{what}: ranks disagree on dtype or size")
        return np.asarray(self.reduce_fn(per_rank))
