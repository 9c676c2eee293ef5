"""The back half of the parser, shared by every transport: decoded units in, typed items out.

``CollectiveAssembler`` has a transport's ``Placer`` place its units (the NCCL ring's,
``parser.roce.placer.RingPlacer``; gloo's, ``parser.gloo.placer.GlooPlacer``), merges them
(concatenator) and groups the gradient all-reduces into iterations. An iteration is handed on only
when every one of its buckets is finished; it is complete only when every element of every bucket
is covered with agreeing copies, and an incomplete iteration never carries a gradient (``buckets``
is empty). A transport's job stream (``parser.roce.jobstream.JobStream``,
``parser.gloo.job.GlooJobStream``) runs it over its units and yields, in order: each finished
``CollectiveResult``, ``InitialWeights`` once (when DDP's start-up broadcast is whole), each complete
``ReducedBucket`` as soon as it is final, each ``ReducedIteration``, and (a sharded optimizer's
ring) each per-iteration all-gather of parameters as ``GatheredWeights``; its ``report()``
(``JobReport``) is what callers may read of its state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from mirrorckpt.config.layout import RingSpec
from mirrorckpt.config.shard_steps import INIT_PARAMS, PARAMS
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.concat import CollectiveResult, Concatenator
from mirrorckpt.parser.iteration import GatheredWeights, InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.parser.streams import StreamStats

Item = CollectiveResult | InitialWeights | ReducedBucket | ReducedIteration | GatheredWeights


def default_collective_window(model: JobModel) -> int:
    """Collectives the traffic must move past one before it is final: two iterations' worth."""
    return max(8, 2 * (model.first_of_iteration(3) - model.first_of_iteration(2)) + 2)


@dataclass
class JobReport:
    """What a job stream tells its caller: notes on what was inferred, placement counts, state
    machine mismatches, and per capture source its counts."""

    notes: list[str] = field(default_factory=list)
    placement: Counter = field(default_factory=Counter)  # reason -> sends (0 for any other reason)
    mismatches: list[str] = field(default_factory=list)
    streams: list[StreamStats] = field(default_factory=list)
    # What the wire showed against what the job model names, to say why nothing was placed:
    # RoCEv2 packets and other frames by class (None: the send stream does not count them),
    # the data connections seen (with their QPs), the model's ring and its ranks by wire address,
    # and the ring links that fit no channel.
    roce_packets: int | None = None
    other_frames: dict[str, int] = field(default_factory=dict)
    connections: dict = field(default_factory=dict)
    ring: RingSpec | None = None
    ranks: dict[bytes, int] = field(default_factory=dict)
    unfit: set = field(default_factory=set)

    @property
    def damage(self) -> list[str]:
        return [s.damage for s in self.streams if s.damage]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.streams)

    @property
    def frames(self) -> int:
        return sum(s.frames for s in self.streams)


class IterationAssembler:
    """Gradient all-reduces to iterations: each complete bucket at once (``ReducedBucket``), the
    iteration (``ReducedIteration``) when its last bucket is final."""

    def __init__(self, model: JobModel):
        self.model = model
        self.current: dict[int, CollectiveResult] = {}
        self.values: dict[int, np.ndarray] = {}  # bucket -> its values, shared by both items
        self.iteration = 0

    def _buckets(self, i: int) -> int:
        return len(self.model.grads(i))

    def add(self, r: CollectiveResult) -> list[ReducedBucket | ReducedIteration]:
        i, b = r.spec.iteration, r.spec.bucket
        out = []
        while i > self.iteration:  # an iteration whose last buckets never showed up
            out.append(self._emit())
        self.current[b] = r
        if r.complete and i == self.iteration:
            # The result's own buffer, read-only: the concatenator never writes a finished result
            # again, and a copy here cost as much as placing the bucket.
            v = self.values[b] = r.values()
            v.flags.writeable = False
            out.append(ReducedBucket(i, b, v))
        if len(self.current) == self._buckets(i):
            out.append(self._emit())
        return out

    def _emit(self) -> ReducedIteration:
        i, n = self.iteration, self._buckets(self.iteration)
        holes, buckets = {}, []
        for b in range(n):
            r = self.current.get(b)
            if r is None:  # never seen at all
                holes[b] = [(0, self.model.grads(i)[b].count)]
            elif not r.complete:
                holes[b] = r.holes
            else:
                buckets.append(self.values[b])
        complete = not holes
        last_ts = max((r.last_ts for r in self.current.values()), default=0)
        self.current, self.values = {}, {}
        self.iteration += 1
        return ReducedIteration(i, buckets if complete else [], complete, holes, last_ts=last_ts)

    def flush(self) -> list[ReducedIteration]:
        return [self._emit()] if self.current else []


class Placer(Protocol):
    """A transport's placer: its decoded units to ``placement.Placement``s, handed to the
    concatenator. Call order: ``add`` for each batch of units as they come, ``flush`` once at the
    end; ``counts`` (units by outcome, "placed" or why not) and ``mismatches`` at any time."""

    counts: Counter
    mismatches: list[str]

    def add(self, units: list, concat: Concatenator) -> None: ...

    def flush(self, concat: Concatenator) -> None: ...


class CollectiveAssembler:
    """``placer`` places the units; every transport shares the concatenator and what follows."""

    def __init__(self, model: JobModel, placer: Placer, collective_window: int | None = None, nstreams: int = 0,
                 p2p_fill: bool = False):
        self.model = model
        self.placer = placer
        w = collective_window if collective_window is not None else default_collective_window(model)
        self.concat = Concatenator(model, w, p2p_fill=p2p_fill)  # see Concatenator: off unless declared
        self.concat.expected = set(range(nstreams))  # silent ones hold collectives back (0: none known)
        self.iterations = IterationAssembler(model)
        self.startup: dict[str, CollectiveResult] = {}  # start-up collectives by label
        self.weights_given = False

    def streams_ended(self, ended: set[int]) -> None:
        """Mirror streams with nothing more to come: collectives no longer wait for them."""
        self.concat.ended = set(ended)

    def add(self, units: list) -> tuple[list[CollectiveResult], list]:
        self.placer.add(units, self.concat)
        return self._route(self.concat.poll())

    def settle(self) -> tuple[list[CollectiveResult], list]:
        """Hands on what is already complete when the wire goes quiet (see Concatenator.settle)."""
        return self._route(self.concat.settle())

    def flush(self) -> tuple[list[CollectiveResult], list]:
        self.placer.flush(self.concat)
        done, its = self._route(self.concat.poll(final=True))
        return done, its + self.iterations.flush()

    def _route(self, done: list[CollectiveResult]) -> tuple[list[CollectiveResult], list]:
        its = []
        for r in done:
            if r.spec.iteration is not None and r.spec.label == "grad":
                its += self.iterations.add(r)
            elif r.spec.iteration is not None and r.spec.label == PARAMS:
                its.append(GatheredWeights(r.spec.iteration, r.spec.bucket, r.values() if r.complete else None,
                                           r.holes, r.last_ts))
            elif r.spec.iteration is None:
                self.startup[r.spec.label] = r
        return done, its

    def initial_weights(self) -> InitialWeights | None:
        """The start-up broadcasts of the initial parameters (DDP's groups, DeepSpeed's one per
        parameter), once every one of them is whole (given once)."""
        layout = self.model.weights_layout
        if self.weights_given or layout is None:
            return None
        groups = sorted((int(k[len(INIT_PARAMS):]), r) for k, r in self.startup.items() if k.startswith(INIT_PARAMS))
        if not groups or not all(r.complete for _, r in groups):
            return None
        self.weights_given = True
        return InitialWeights(layout, np.concatenate([r.values() for _, r in groups]))

    def items(self, out: tuple[list[CollectiveResult], list]) -> Iterator[Item]:
        """One ``add``/``settle``/``flush`` result as typed items, the initial weights before the
        first iteration that needs them."""
        done, its = out
        yield from done
        w = self.initial_weights()
        if w is not None:
            yield w
        yield from its

    def report(self) -> tuple[Counter, list[str]]:
        return Counter(self.placer.counts), list(self.placer.mismatches)
