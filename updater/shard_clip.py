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

Two implementations of one interface (``coefficient``, ``ended``, ``stop``, ``rings``,
``norm_type``): ``NormExchange`` for rings of one process, ``StoreNormExchange`` for rings of
several appliance processes, which meet in their process group's store (``updater.joint.join_group``):
each ring posts its float32 norm of an iteration there, every process reads every ring's and sums
them in the same shard order, so each computes the same coefficient.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

log = logging.getLogger("mirrorckpt.shards")


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


def _coefficient(norms: list, norm_type: float, max_norm: float) -> torch.Tensor | None:
    """The coefficient from every ring's local norm in shard order; None when one has none."""
    if any(n is None for n in norms):
        return None
    return clip_coefficient(global_norm(norms, norm_type), max_norm)


class NormExchange:
    """The rings of one process meet here once per iteration (each from its own updater thread)."""

    def __init__(self, rings: list[str], max_norm: float, norm_type: float):
        self.rings = list(rings)  # shard (ring position) order
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self._cond = threading.Condition()
        self._norms: dict[int, dict[str, torch.Tensor | None]] = {}
        self._ended: set[str] = set()
        self._latest: dict[str, int] = {}  # each ring's newest iteration given
        self._stopped = False

    def coefficient(self, ring: str, iteration: int, norm: torch.Tensor | None,
                    timeout: float | None = None) -> torch.Tensor | None:
        """Give ``ring``'s local norm of ``iteration`` (None: it has none) and wait for the others';
        the clipping coefficient, or None when a ring gave none, skipped the iteration (gave a later
        one), ended, or the exchange stopped."""
        with self._cond:
            self._norms.setdefault(iteration, {})[ring] = norm
            self._latest[ring] = iteration
            self._cond.notify_all()

            def settled(r: str) -> bool:
                return r in self._norms[iteration] or r in self._ended or self._latest.get(r, -1) > iteration

            ok = self._cond.wait_for(lambda: self._stopped or all(settled(r) for r in self.rings), timeout)
            got = self._norms[iteration]
            for old in [i for i in self._norms if i < iteration - 2]:
                del self._norms[old]
            if not ok or self._stopped:
                return None
        return _coefficient([got.get(r) for r in self.rings], self.norm_type, self.max_norm)

    def ended(self, ring: str) -> None:
        """``ring`` will give no more norms: whoever waits for it gets no coefficient."""
        with self._cond:
            self._ended.add(ring)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


ENDED = 1 << 62  # a ring's "posted up to" counter once it gives no more norms
KEEP = 1024  # iterations a ring's posted norms stay in the store for slower readers
POLL_S = 0.002


class StoreNormExchange:
    """The rings of several appliance processes meet in a store (a c10d Store: the appliances'
    TCPStore). ``rings``: every ring of the job in shard order; ``local``: this process's.

    Ring g posts ``<it>/g`` (its float32 norm as text, "none" without one), then raises its
    counter ``at/g`` to it + 1 (``ENDED`` once it ended). A reader of iteration it reads the
    counter first, then the norm: a counter past ``it`` with no norm posted means the ring skipped
    that iteration, and no coefficient. A store that fails (a peer gone) or ``timeout`` gives none."""

    def __init__(self, rings: list[str], local: list[str], max_norm: float, norm_type: float, store=None,
                 timeout: float | None = None):
        self.rings, self.local = list(rings), list(local)
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.store = None
        if store is not None:
            self.connect(store)
        self.timeout = timeout
        self._lock = threading.Lock()  # one store client, several ring threads
        self._at = {r: 0 for r in self.local}
        self._stopped = False
        self.error: str | None = None

    def connect(self, store) -> None:
        """The store to meet in (before the first ``coefficient``)."""
        import torch.distributed as dist

        self.store = dist.PrefixStore("mirrorckpt-norms/", store)

    def _op(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _post(self, ring: str, iteration: int, text: str | None) -> None:
        if text is not None:
            self._op(self.store.set, f"{iteration}/{ring}", text)
        target = ENDED if text is None else iteration + 1
        self._op(self.store.add, f"at/{ring}", target - self._at[ring])
        self._at[ring] = target
        old = iteration - KEEP
        if text is not None and old >= 0:
            self._op(self.store.delete_key, f"{old}/{ring}")

    def _read(self, ring: str, iteration: int, deadline: float | None):
        """``ring``'s norm of ``iteration`` (a tensor), or None when it has none."""
        key = f"{iteration}/{ring}"
        while not self._stopped:
            at = self._op(self.store.add, f"at/{ring}", 0)
            if self._op(self.store.check, [key]):
                text = self._op(self.store.get, key).decode()
                return None if text == "none" else torch.tensor(float(text), dtype=torch.float32)
            if at > iteration:
                return None
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)
        return None

    def coefficient(self, ring: str, iteration: int, norm: torch.Tensor | None,
                    timeout: float | None = None) -> torch.Tensor | None:
        """As ``NormExchange.coefficient``, across processes."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._post(ring, iteration, "none" if norm is None else repr(float(norm)))
            norms = [norm if r == ring else self._read(r, iteration, deadline) for r in self.rings]
        except (RuntimeError, OSError) as e:  # the store's host is gone: no iteration can be agreed on
            if self.error is None:
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.error("the appliances' gradient norm exchange failed: %s; no shard can be clipped exactly",
                          self.error)
            return None
        return _coefficient(norms, self.norm_type, self.max_norm)

    def ended(self, ring: str) -> None:
        try:
            self._post(ring, 0, None)
        except (RuntimeError, OSError):
            pass  # the store is gone: nobody waits for this ring there

    def stop(self) -> None:
        self._stopped = True
