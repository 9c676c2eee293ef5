"""The back half of the parser: decoded units in, typed items out.

``CollectiveAssembler`` places sends (state machine, or the gloo placer), merges them
(concatenator) and groups the gradient all-reduces into iterations. An iteration is handed on only
when every one of its buckets is finished; it is complete only when every element of every bucket
is covered with agreeing copies, and an incomplete iteration never carries a gradient (``buckets``
is empty). ``JobStream`` runs it over a send stream (``streams.SendStream``) and yields, in order:
each finished ``CollectiveResult``, ``InitialWeights`` once (when DDP's start-up broadcast is
whole), each complete ``ReducedBucket`` as soon as it is final, and each ``ReducedIteration``.
Its ``report()`` is what callers may read of its state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.layout import RingSpec
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.concat import CollectiveResult, Concatenator
from mirrorckpt.parser.iteration import InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.parser.nccl import ConnKey, NcclSend
from mirrorckpt.parser.statemachine import RingStateMachine
from mirrorckpt.parser.streams import StreamStats, WireIdle

Item = CollectiveResult | InitialWeights | ReducedBucket | ReducedIteration


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
    connections: dict[ConnKey, int] = field(default_factory=dict)
    ring: RingSpec | None = None
    ranks: dict[bytes, int] = field(default_factory=dict)
    unfit: set[ConnKey] = field(default_factory=set)

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


class CollectiveAssembler:
    """``placer`` maps a wire unit to a ``Placement`` (default: the NCCL ring state machine; the
    gloo decoder brings its own), so every transport shares the concatenator and what follows."""

    def __init__(self, model: JobModel, ranks: dict[bytes, int], channels: dict[ConnKey, int] | None = None,
                 collective_window: int | None = None, placer=None, nstreams: int = 0, p2p_fill: bool = False):
        from mirrorckpt.parser.infer import ChannelResolver

        self.model = model
        # Ring connections are mapped to channels as they show up (see ChannelResolver).
        self.resolver = ChannelResolver(model, ranks, channels) if placer is None else None
        self.sm = placer if placer is not None else RingStateMachine(model, ranks, self.resolver.mapped)
        w = collective_window if collective_window is not None else default_collective_window(model)
        self.concat = Concatenator(model, w, p2p_fill=p2p_fill)  # see Concatenator: off unless declared
        self.concat.expected = set(range(nstreams))  # silent ones hold collectives back (0: none known)
        self.iterations = IterationAssembler(model)
        self.startup: dict[str, CollectiveResult] = {}  # start-up collectives by label
        self.weights_given = False

    def streams_ended(self, ended: set[int]) -> None:
        """Mirror streams with nothing more to come: collectives no longer wait for them."""
        self.concat.ended = set(ended)

    def add(self, sends: list[NcclSend]) -> tuple[list[CollectiveResult], list]:
        res = self.resolver
        mapped = res.mapped if res is not None else {}
        for s in sends:
            # a connection already mapped to its channel goes straight to placement (the resolver
            # would hand it on as it is)
            if res is not None and isinstance(s, NcclSend) and s.connection not in mapped and \
                    res.is_ring(s.connection):
                for r in res.offer(s):
                    self._place(r)
                if res.holding((s.stream, s.connection)):
                    self.concat.hold_from(s.stream)
            else:
                self._place(s)
        if self.concat.holding:
            due = self.concat.hold(res.holding_streams())
            if due:
                for r in res.flush(due):
                    self._place(r)
                self.concat.hold(res.holding_streams())
        return self._route(self.concat.poll())

    def _place(self, s) -> None:
        p = self.sm.place(s)
        if p is not None:
            self.concat.add(p)
        elif isinstance(s, NcclSend) and s.connection not in self.sm.channels and \
                (self.resolver is None or s.connection not in self.resolver.unplaced):
            # a ring link that fit no channel is not point-to-point traffic: its sends, of unknown
            # step, must never fill a hole by their size
            self.concat.add_p2p(s)

    def settle(self) -> tuple[list[CollectiveResult], list]:
        """Hands on what is already complete when the wire goes quiet (see Concatenator.settle)."""
        return self._route(self.concat.settle())

    def flush(self) -> tuple[list[CollectiveResult], list]:
        if self.resolver is not None:
            for r in self.resolver.flush():
                self._place(r)
        done, its = self._route(self.concat.poll(final=True))
        return done, its + self.iterations.flush()

    def _route(self, done: list[CollectiveResult]) -> tuple[list[CollectiveResult], list]:
        its = []
        for r in done:
            if r.spec.iteration is not None and r.spec.label == "grad":
                its += self.iterations.add(r)
            else:
                self.startup[r.spec.label] = r
        return done, its

    def initial_weights(self) -> InitialWeights | None:
        """DDP's broadcast of the initial parameters, once every group of it is whole (given once)."""
        if self.weights_given or self.model.layout is None:
            return None
        groups = [r for k, r in sorted(self.startup.items()) if k.startswith("init_params:")]
        if not groups or not all(g.complete for g in groups):
            return None
        self.weights_given = True
        return InitialWeights(self.model.layout, np.concatenate([g.values() for g in groups]))

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
        return Counter(self.sm.counts), list(self.sm.mismatches)


class JobStream:
    """A send stream to typed items (see the module doc), with the job model from the
    configuration or, when there is none, inferred from the first ``infer_after`` sends (then
    replayed)."""

    def __init__(self, streams, model: JobModel | None = None, ranks: dict[bytes, int] | None = None,
                 channels: dict[ConnKey, int] | None = None, dtype: str | None = None,
                 nccl_version: str | None = None, infer_after: int = 20000, collective_window: int | None = None,
                 p2p_fill: bool = False):
        self.streams = streams
        self.p2p_fill = p2p_fill
        self.model, self.ranks, self.channels = model, ranks, channels
        self.dtype, self.nccl_version = dtype, nccl_version
        self.infer_after = infer_after
        self.collective_window = collective_window
        self.notes: list[str] = []
        self.assembler: CollectiveAssembler | None = None

    def _setup(self, sends: list[NcclSend]) -> None:
        from mirrorckpt.parser import infer

        if self.model is None:
            got = infer.infer(sends, self.streams.decoders, self.dtype, self.nccl_version)
            self.model, self.ranks, self.channels = got.model, got.ranks, got.channels
            self.notes += got.notes
        self.assembler = CollectiveAssembler(self.model, self.ranks, self.channels, self.collective_window,
                                             nstreams=self.streams.nstreams, p2p_fill=self.p2p_fill)

    def __iter__(self) -> Iterator[Item]:
        pending: list[NcclSend] = []
        if self.model is not None:  # configured: connections are mapped as they appear
            self._setup([])
        for sends in self.streams:
            if isinstance(sends, WireIdle):
                if self.assembler is not None:
                    self.assembler.streams_ended(self.streams.ended)
                    yield from self.assembler.items(self.assembler.settle())
                continue
            if self.assembler is None:
                pending += sends
                if len(pending) < self.infer_after:
                    continue
                self._setup(pending)
                sends, pending = pending, []
            self.assembler.streams_ended(self.streams.ended)
            yield from self.assembler.items(self.assembler.add(sends))
        if self.assembler is None:
            if not pending:
                return
            self._setup(pending)
            yield from self.assembler.items(self.assembler.add(pending))
        self.assembler.streams_ended(self.streams.ended)
        yield from self.assembler.items(self.assembler.flush())
        self.notes += self.assembler.resolver.notes if self.assembler.resolver else []

    def report(self) -> JobReport:
        placement, mismatches = self.assembler.report() if self.assembler is not None else (Counter(), [])
        rep = JobReport(list(self.notes), placement, mismatches, list(self.streams.stats),
                        ring=self.model.ring if self.model is not None else None, ranks=dict(self.ranks or {}))
        counters = getattr(self.streams, "counters", None)
        if counters is not None:
            rep.roce_packets = sum(counters.by_opcode().values())
            rep.other_frames = {k: n for k, n in sorted(counters.classes.items()) if n and not k.startswith("roce:")}
        for d in self.streams.decoders:
            for conn, qps in getattr(d, "qps_by_connection", dict)().items():
                rep.connections[conn] = max(qps, rep.connections.get(conn, 0))
        resolver = self.assembler.resolver if self.assembler is not None else None
        rep.unfit = set(resolver.unplaced) if resolver is not None else set()
        return rep
