"""Global-norm clipping of a sharded job whose shards one appliance process follows (one ring each).

The trainer (FSDP2: ``torch.nn.utils.clip_grad_norm_`` over DTensor gradients, which
``control.sharded.ShardLink.clip_grad_norm_`` also runs) computes each shard's local norm
(``local_norm``: the norm of the per-tensor norms, ``get_total_norm``'s ops), raises it to the
p-th power, all-reduces that over the shard group (DTensor's ``_NormPartial``: one float32
element, which NCCL's ring sums from ring position 1 on, position 0 last: ``ring_sum``), and takes
the p-th root; the coefficient is ``clip_coefficient``'s. A ``NormExchange`` lets every ring's
updater thread contribute its shard's local norm for an iteration and take the coefficient once
all have: the same float32 values in the same order, so the replicas clip bit-exactly as the
trainer did. A ring that cannot give its norm (an incomplete iteration, a ring that ended) gives
every ring no coefficient: none of them can step that iteration exactly.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


def local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """One shard's norm: the per-tensor norms stacked in parameter order, then their norm."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, float(norm_type))), float(norm_type))


def ring_sum(values: list[float]) -> np.float32:
    """A one-element float32 sum-all-reduce over ring positions 0..N-1 as NCCL's ring reduces it:
    the element sits in chunk 0, whose sum starts at position 1 and ends with position 0's term."""
    acc = np.float32(values[1 % len(values)])
    for k in list(range(2, len(values))) + ([0] if len(values) > 1 else []):
        acc = np.float32(acc + np.float32(values[k]))
    return acc


def global_norm(local: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The job's norm from every shard's local norm, in shard (ring position) order."""
    p = float(norm_type)
    powered = [float((n ** p).item()) for n in local]
    return torch.tensor(ring_sum(powered), dtype=torch.float32) ** (1.0 / p)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grads_with_norm_``'s coefficient: the ops it runs on the total norm."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


class NormExchange:
    """The rings of one process meet here once per iteration (each from its own updater thread)."""

    def __init__(self, rings: list[str], max_norm: float, norm_type: float):
        self.rings = list(rings)  # shard (ring position) order
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self._cond = threading.Condition()
        self._norms: dict[int, dict[str, torch.Tensor | None]] = {}
        self._ended: set[str] = set()
        self._stopped = False

    def coefficient(self, ring: str, iteration: int, norm: torch.Tensor | None,
                    timeout: float | None = None) -> torch.Tensor | None:
        """Give ``ring``'s local norm of ``iteration`` (None: it has none) and wait for the others';
        the clipping coefficient, or None when a ring gave none, ended, or the exchange stopped."""
        with self._cond:
            self._norms.setdefault(iteration, {})[ring] = norm
            self._cond.notify_all()
            ok = self._cond.wait_for(lambda: self._stopped or set(self._norms[iteration]) | self._ended >=
                                     set(self.rings), timeout)
            got = self._norms[iteration]
            for old in [i for i in self._norms if i < iteration - 2]:
                del self._norms[old]
            if not ok or self._stopped or any(got.get(r) is None for r in self.rings):
                return None
            total = global_norm([got[r] for r in self.rings], self.norm_type)
        return clip_coefficient(total, self.max_norm)

    def ended(self, ring: str) -> None:
        """``ring`` will give no more norms: whoever waits for it gets no coefficient."""
        with self._cond:
            self._ended.add(ring)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
