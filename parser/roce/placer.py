"""The NCCL ring's placer (``parser.pipeline.Placer``): ring connections are mapped to channels as
they show up (``channels.ChannelResolver``), and each send is placed by the ring state machine. A
send of a connection that is no ring link is point-to-point traffic: a candidate for the
concatenator's ``p2p_fill``, never placed by its size otherwise."""

from __future__ import annotations

from mirrorckpt.parser.concat import Concatenator
from mirrorckpt.parser.roce import _placerun
from mirrorckpt.parser.roce.channels import ChannelResolver
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.sends import flat
from mirrorckpt.parser.roce.statemachine import RingStateMachine


class RingPlacer:
    # Batches placed in one compiled pass (``_placerun``), the per-send path only for sends out of
    # the common case; off: every send the per-send way (tests hold the two equal).
    compiled = True

    def __init__(self, model: NcclJobModel, ranks: dict[bytes, int], channels: dict[ConnKey, int] | None = None):
        self.resolver = ChannelResolver(model, ranks, channels)
        self.sm = RingStateMachine(model, ranks, self.resolver.mapped)
        self.windows: dict = {}  # (channel, position) -> _placerun.Window: its last send's collective

    @property
    def counts(self):
        return self.sm.counts

    @property
    def mismatches(self) -> list[str]:
        return self.sm.mismatches

    def add(self, sends: list[NcclSend], concat: Concatenator) -> None:
        if self.compiled:
            _placerun.place_batch(self, sends, concat, lambda s: self._one(s, concat))
        else:
            for s in flat(sends):
                self._one(s, concat)
        res = self.resolver
        if concat.holding:
            due = concat.hold(res.holding_streams())
            if due:
                for r in res.flush(due):
                    self._place(r, concat)
                concat.hold(res.holding_streams())

    def _one(self, s: NcclSend, concat: Concatenator) -> None:
        """One send the per-send way."""
        res = self.resolver
        # a connection already mapped to its channel goes straight to placement (the resolver
        # would hand it on as it is)
        if isinstance(s, NcclSend) and s.connection not in res.mapped and res.is_ring(s.connection):
            for r in res.offer(s):
                self._place(r, concat)
            if res.holding((s.stream, s.connection)):
                concat.hold_from(s.stream)
        else:
            self._place(s, concat)

    def flush(self, concat: Concatenator) -> None:
        for r in self.resolver.flush():
            self._place(r, concat)

    def _place(self, s: NcclSend, concat: Concatenator) -> None:
        p = self.sm.place(s)
        if p is not None:
            concat.add(p)
        elif s.connection not in self.sm.channels and s.connection not in self.resolver.unplaced:
            # a ring link that fit no channel is not point-to-point traffic: its sends, of unknown
            # step, must never fill a hole by their size
            concat.add_p2p(s)

    def ring_connections(self) -> dict:
        """The ring connections mapped to channels so far (live)."""
        return self.resolver.mapped

    @property
    def notes(self) -> list[str]:
        """The channel decisions so far, and the connections left unplaced."""
        return self.resolver.notes
