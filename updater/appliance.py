"""The appliance: the parser's items applied to the CPU replica, which the persister commits in
the background (``updater.drive`` is the one loop that hands them over: ``replay``, ``serve``, the
control plane's mirror path and the gloo transport all use it).

The replica starts from the initial weights DDP broadcast at start-up (an ``InitialWeights`` item
of the job stream), from a committed checkpoint, or from a state handed in (the trainer's
registration). An incomplete iteration is never applied: the replica goes stale, ``on_stale`` is
told once per stale episode (the control plane turns it into a fallback request), and later
iterations are counted as skipped until ``resync`` brings a consistent state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import PersistSpec, TrainingSpec
from mirrorckpt.parser.iteration import InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.updater import optim
from mirrorckpt.updater.persist import Persister
from mirrorckpt.updater.replica import Replica, ReplicaStale

log = logging.getLogger("mirrorckpt.appliance")


@dataclass
class Summary:
    iterations_applied: int = 0
    iterations_incomplete: int = 0  # seen on the wire but not reassembled whole
    iterations_skipped: int = 0  # complete, but the replica was stale (waiting for a resync)
    stale_events: int = 0
    replica_step: int = 0
    checkpoints: list[str] = field(default_factory=list)
    no_initial_state: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Appliance:
    """``training`` may be a function of the layout (a replay that learns the gradient dtype from
    the wire). ``pipelined``: step each bucket's parameters as soon as the bucket is final (where
    the step is separable; otherwise its gradients wait in the replica's buffers), so the
    iteration's step ends soon after its last packet. Off by default: a bucket stepped ahead must
    be undoable, and copying its parameters and state for that cost the replica about 45 % of its
    step rate (BENCHMARKS.md, "pipelined" row); whole-iteration steps copy nothing. ``impl``: the replica's optimizer
    implementation (updater.numeric)."""

    def __init__(self, layout: JobLayout | None, training: TrainingSpec | Callable[[JobLayout], TrainingSpec],
                 persist: PersistSpec | None = None, replica: Replica | None = None, on_stale=None,
                 on_iteration=None, pipelined: bool = False, impl: str = "mirror"):
        self.layout = layout
        self.impl = impl
        self.pipelined = pipelined
        self._by_buckets: int | None = None  # the last iteration stepped bucket by bucket
        self.training = training
        self.replica = replica
        self.on_stale = on_stale
        self.on_iteration = on_iteration  # progress callback (iteration index, replica)
        self.on_commit = None  # called with each committed checkpoint's path (the persister's thread)
        self.summary = Summary()
        self.persister = Persister(persist, on_commit=self._committed) if persist is not None else None
        self._closed = False
        if isinstance(training, TrainingSpec):  # the imports before the first iteration, not during it
            optim.warm_up(training.optimizer)
        self._t0 = time.perf_counter()

    def _committed(self, path) -> None:
        self.summary.checkpoints.append(str(path))
        if self.on_commit is not None:
            self.on_commit(path)

    def initial_weights(self, w: InitialWeights) -> None:
        """Creates the replica from DDP's initial-weight broadcast (ignored once there is one)."""
        if self.replica is not None:
            return
        if callable(self.training):
            self.training = self.training(w.layout)
        self.layout = w.layout
        self.replica = Replica.from_initial_weights(w.layout, self.training, w.values, self.impl)
        log.info("replica started from the initial weights on the wire (%d parameters)", w.layout.total_numel)

    def bucket(self, b: ReducedBucket) -> None:
        r = self.replica
        if not self.pipelined or r is None or r.stale is not None:
            return  # its iteration decides
        try:
            if r.apply_bucket(b.iteration, b.bucket, b.values):
                self._by_buckets = b.iteration  # its last bucket finished the step
        except ReplicaStale as e:  # an iteration before it was missed
            self._stale(e)

    def _stale(self, e: ReplicaStale) -> None:
        self.summary.stale_events += 1
        log.warning("%s", e)
        if self.on_stale is not None:
            self.on_stale(e)

    def apply(self, it: ReducedIteration) -> None:
        s = self.summary
        if not it.complete:
            s.iterations_incomplete += 1
        if self.replica is None:
            s.no_initial_state = True
            s.iterations_skipped += 1
            return
        if self.replica.stale is not None:  # waiting for a resync: told once, at the first
            s.iterations_skipped += it.complete
            return
        try:
            if not (it.complete and self._by_buckets == it.index):
                self.replica.apply(it)
        except ReplicaStale as e:
            self._stale(e)
            return
        s.iterations_applied += 1
        s.replica_step = self.replica.step
        if self.on_iteration is not None:
            self.on_iteration(it.index, self.replica)
        if self.persister is not None:
            self.persister.submit(self.replica)

    def close(self) -> Summary:
        """Commits the last good state if it is newer than the last commit (a replica stale for
        missing data still holds a state the trainer had; one that drifted does not), then stops.
        A second call (the daemon, then the control plane that owns it) returns the same summary."""
        if self._closed:
            return self.summary
        self._closed = True
        if self.persister is not None:
            r = self.replica
            if r is not None and r.committable and self.summary.iterations_applied:
                self.persister.submit(r, force=True)
            self.persister.close()
        self.summary.seconds = time.perf_counter() - self._t0
        return self.summary
