"""The appliance's main loop, shared by `replay` and `serve`: reduced iterations from the parser
applied to the CPU replica, which the persister commits in the background.

The replica starts from the initial weights DDP broadcast at start-up (read off the wire), from
a committed checkpoint, or from a state handed in (the trainer's registration). An incomplete
iteration is never applied: the replica goes stale, ``on_stale`` is told once per stale episode
(the control plane turns it into a fallback request), and later iterations are counted as
skipped until ``resync`` brings a consistent state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import PersistSpec, TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.pipeline import Startup
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
    def __init__(self, layout: JobLayout | None, training: TrainingSpec, persist: PersistSpec | None = None,
                 replica: Replica | None = None, on_stale=None, on_iteration=None):
        self.layout = layout
        self.training = training
        self.replica = replica
        self.on_stale = on_stale
        self.on_iteration = on_iteration  # progress callback (iteration index, replica)
        self.summary = Summary()
        self.persister = Persister(persist, on_commit=self._committed) if persist is not None else None
        self._t0 = time.perf_counter()

    def _committed(self, path) -> None:
        self.summary.checkpoints.append(str(path))

    def start_from_wire(self, startup: Startup, layout: JobLayout) -> bool:
        """Creates the replica from DDP's initial-weight broadcast once it has been reassembled."""
        if self.replica is not None:
            return True
        groups = startup.initial_weights()
        if not groups or not all(g.complete for g in groups):
            return False
        flat = np.concatenate([g.values() for g in groups])
        self.layout = layout
        self.replica = Replica.from_initial_weights(layout, self.training, flat)
        log.info("replica started from the initial weights on the wire (%d parameters)", layout.total_numel)
        return True

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
            self.replica.apply(it)
        except ReplicaStale as e:
            s.stale_events += 1
            log.warning("%s", e)
            if self.on_stale is not None:
                self.on_stale(e)
            return
        s.iterations_applied += 1
        s.replica_step = self.replica.step
        if self.on_iteration is not None:
            self.on_iteration(it.index, self.replica)
        if self.persister is not None:
            self.persister.submit(self.replica)

    def close(self) -> Summary:
        if self.persister is not None:
            if self.replica is not None and self.replica.stale is None and self.summary.iterations_applied:
                self.persister.submit(self.replica, force=True)
            self.persister.close()
        self.summary.seconds = time.perf_counter() - self._t0
        return self.summary
