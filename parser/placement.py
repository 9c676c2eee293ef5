"""What every transport's placer hands the concatenator: which collective, which of its ring
steps, and the unit of the wire that carries it.

A placer (the NCCL ring state machine, ``parser.roce.placer``; the gloo placer,
``parser.gloo.placer``) maps each decoded unit to a ``Placement``. The unit is whatever its wire
decodes to (an NCCL send, a gloo op); the concatenator reads it only through ``Unit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mirrorckpt.config.ddp import CollSpec

# The phase of the data a ring step carries: a rank's own contribution, a partial sum on its way
# round the ring, the fully reduced value (all-reduce), or a value forwarded unchanged (all-gather,
# broadcast). Only REDUCED and FORWARD values are final.
OWN, PARTIAL, REDUCED, FORWARD = "own", "partial", "reduced", "forward"


@dataclass(frozen=True)
class RingStep:
    """One network message of one ring position on one channel."""
    step: int  # ring step in the loop: all-reduce 0..2R-3, all-gather 0..R-2, broadcast 0
    loop: int
    chunk: int  # all-reduce: chunk index c; all-gather/broadcast: ring position the data comes from
    offset: int  # first element (all-gather: inside the origin's contribution)
    nelem: int
    phase: str  # own | partial | reduced (all-reduce); own | forward (all-gather, broadcast)
    slice: int  # slice of the chunk (Simple: 0 or 1; LL/LL128: 0)
    conn_step: int  # connection step of this message minus the collective's first step t0
    nbytes: int
    wire_bytes: int


class Unit(Protocol):
    """A decoded unit of the wire as the concatenator reads it."""

    nbytes: int  # payload bytes it carries
    ts_ns: int  # when its last byte was captured
    stream: int  # the mirror stream it came from
    holes: list  # byte ranges of its payload that did not arrive
    connection: object  # the link it travelled (named in conflict reports)
    complete: bool  # no byte missing

    @property
    def data(self):
        """Its payload (uint8)."""

    def place_agreeing(self, dst, covered, start: int, n: int, es: int) -> int | None:
        """Places its elements straight into ``dst`` (``parser._merge.place_agreeing``), or None when
        its ``data`` must be placed instead."""

    def keep(self) -> Unit:
        """Itself with a payload of its own (not a view of a buffer that is reused)."""


@dataclass(slots=True)  # one per placed unit
class Placement:
    coll: int  # collective index in the job model
    spec: CollSpec
    step: RingStep
    channel: int
    rank_pos: int
    send: Unit
    t: int  # absolute connection step
