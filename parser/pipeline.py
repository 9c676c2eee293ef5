"""The back half of the parser: NCCL sends in, finished collectives and iterations out.

``Reassembly`` places sends (state machine), merges them (concatenator) and groups the gradient
all-reduces into iterations. An iteration is handed on only when every one of its buckets is
finished; it is complete only when every element of every bucket is covered with agreeing
copies, and an incomplete iteration never carries a gradient (``buckets`` is empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.concat import CollectiveResult, Concatenator
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.nccl import ConnKey, NcclSend
from mirrorckpt.parser.statemachine import RingStateMachine


def default_window(model: JobModel) -> int:
    """Collectives the traffic must move past one before it is final: two iterations' worth."""
    return max(8, 2 * (model.first_of_iteration(3) - model.first_of_iteration(2)) + 2)


@dataclass
class Startup:
    """What the start-up collectives carried (DDP: parameter count, shapes, initial weights)."""

    results: dict[str, CollectiveResult] = field(default_factory=dict)  # label -> result

    def initial_weights(self) -> list[CollectiveResult] | None:
        groups = sorted((k, r) for k, r in self.results.items() if k.startswith("init_params:"))
        return [r for _, r in groups] or None


class IterationAssembler:
    def __init__(self, model: JobModel):
        self.model = model
        self.current: dict[int, CollectiveResult] = {}
        self.iteration = 0

    def _buckets(self, i: int) -> int:
        return len(self.model.grads(i))

    def add(self, r: CollectiveResult) -> list[ReducedIteration]:
        i = r.spec.iteration
        out = []
        while i > self.iteration:  # an iteration whose last buckets never showed up
            out.append(self._emit())
        self.current[r.spec.bucket] = r
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
                buckets.append(r.values().copy())
        complete = not holes
        self.current = {}
        self.iteration += 1
        return ReducedIteration(i, buckets if complete else [], complete, holes)

    def flush(self) -> list[ReducedIteration]:
        return [self._emit()] if self.current else []


class Reassembly:
    """``placer`` maps a wire unit to a ``Placement`` (default: the NCCL ring state machine; the
    gloo decoder brings its own), so every transport shares the concatenator and what follows."""

    def __init__(self, model: JobModel, ranks: dict[bytes, int], channels: dict[ConnKey, int] | None = None,
                 window: int | None = None, placer=None):
        from mirrorckpt.parser.infer import ChannelResolver

        self.model = model
        # Ring connections are mapped to channels as they show up (see ChannelResolver).
        self.resolver = ChannelResolver(model, ranks, channels) if placer is None else None
        self.sm = placer if placer is not None else RingStateMachine(model, ranks, self.resolver.mapped)
        self.concat = Concatenator(model, window if window is not None else default_window(model))
        self.iterations = IterationAssembler(model)
        self.startup = Startup()
        self.results: list[CollectiveResult] = []  # every finished collective (kept by the caller's choice)
        self.keep_results = True

    def add(self, sends: list[NcclSend]) -> tuple[list[CollectiveResult], list[ReducedIteration]]:
        for s in sends:
            if self.resolver is not None and isinstance(s, NcclSend) and self.resolver.is_ring(s.connection):
                for r in self.resolver.offer(s):
                    self._place(r)
            else:
                self._place(s)
        return self._route(self.concat.poll())

    def _place(self, s) -> None:
        p = self.sm.place(s)
        if p is not None:
            self.concat.add(p)
        elif isinstance(s, NcclSend) and s.connection not in self.sm.channels:
            self.concat.add_p2p(s)

    def settle(self) -> tuple[list[CollectiveResult], list[ReducedIteration]]:
        """Hands on what is already complete when the wire goes quiet (see Concatenator.settle)."""
        return self._route(self.concat.settle())

    def flush(self) -> tuple[list[CollectiveResult], list[ReducedIteration]]:
        if self.resolver is not None:
            for r in self.resolver.flush():
                self._place(r)
        done, its = self._route(self.concat.poll(final=True))
        return done, its + self.iterations.flush()

    def _route(self, done: list[CollectiveResult]) -> tuple[list[CollectiveResult], list[ReducedIteration]]:
        its = []
        for r in done:
            if self.keep_results:
                self.results.append(r)
            if r.spec.iteration is not None and r.spec.label == "grad":
                its += self.iterations.add(r)
            else:
                self.startup.results[r.spec.label] = r
        return done, its


class JobStream:
    """Mirror streams to collectives and iterations, with the job model from the configuration
    or, when there is none, inferred from the first ``infer_after`` sends (then replayed)."""

    def __init__(self, streams, model: JobModel | None = None, ranks: dict[bytes, int] | None = None,
                 channels: dict[ConnKey, int] | None = None, dtype: str | None = None,
                 nccl_version: str = "2.18", infer_after: int = 20000, window: int | None = None,
                 keep_results: bool = True):
        self.streams = streams
        self.model, self.ranks, self.channels = model, ranks, channels
        self.dtype, self.nccl_version = dtype, nccl_version
        self.infer_after = infer_after
        self.window = window
        self.keep_results = keep_results  # False for a daemon: finished collectives are not kept
        self.notes: list[str] = []
        self.reassembly: Reassembly | None = None

    def _setup(self, sends: list[NcclSend]) -> None:
        from mirrorckpt.parser import infer

        if self.model is None:
            got = infer.infer(sends, self.streams.decoders, self.dtype, self.nccl_version)
            self.model, self.ranks, self.channels = got.model, got.ranks, got.channels
            self.notes += got.notes
        self.reassembly = Reassembly(self.model, self.ranks, self.channels, self.window)
        self.reassembly.keep_results = self.keep_results
        self.reassembly.concat.expected = set(range(getattr(self.streams, "nstreams", 1)))

    def __iter__(self):
        pending: list[NcclSend] = []
        if self.model is not None:  # configured: connections are mapped as they appear
            self._setup([])
        for sends in self.streams:
            if self.reassembly is None:
                pending += sends
                if len(pending) < self.infer_after:
                    continue
                self._setup(pending)
                sends, pending = pending, []
            self.reassembly.concat.ended = set(getattr(self.streams, "ended", ()))
            yield self.reassembly.add(sends)
        if self.reassembly is None:
            if not pending:
                return
            self._setup(pending)
            yield self.reassembly.add(pending)
        yield self.reassembly.flush()
        self.notes += self.reassembly.resolver.notes if self.reassembly.resolver else []
