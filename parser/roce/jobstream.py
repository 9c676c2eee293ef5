"""NCCL's job stream: a send stream (``parser.streams.SendStream``) to the parser's typed items
(``parser.pipeline``), with the job model from the configuration or, when there is none, inferred
from the first ``infer_after`` sends (``parser.roce.infer``; then replayed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from mirrorckpt.parser.pipeline import CollectiveAssembler, Item, JobReport
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.placer import RingPlacer
from mirrorckpt.parser.roce.sends import flat
from mirrorckpt.parser.streams import WireIdle


class JobStream:
    """Its ``report()``, and the live view ``ring_connections``/``placement_counts``/
    ``channel_notes``, are what callers may read of its state."""

    def __init__(self, streams, model: NcclJobModel | None = None, ranks: dict[bytes, int] | None = None,
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
        self.placer: RingPlacer | None = None

    def _setup(self, sends: list[NcclSend]) -> None:
        from mirrorckpt.parser.roce import infer

        if self.model is None:
            got = infer.infer(sends, self.streams.decoders, self.dtype, self.nccl_version)
            self.model, self.ranks, self.channels = got.model, got.ranks, got.channels
            self.notes += got.notes
        self.placer = RingPlacer(self.model, self.ranks, self.channels)
        self.assembler = CollectiveAssembler(self.model, self.placer, self.collective_window,
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
                pending += flat(sends)
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
        self.notes += self.placer.notes

    def ring_connections(self):
        """The ring connections mapped to channels so far (live; empty before the set-up)."""
        return self.placer.ring_connections() if self.placer is not None else {}

    def placement_counts(self) -> dict | None:
        """Sends by placement outcome so far ("placed", or why not); None before the set-up."""
        return dict(self.placer.counts) if self.placer is not None else None

    def channel_notes(self) -> list[str]:
        """The channel decisions so far, and the connections left unplaced."""
        return list(self.placer.notes) if self.placer is not None else []

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
        rep.unfit = set(self.placer.resolver.unplaced) if self.placer is not None else set()
        return rep
