"""The send-stream contract: what a transport's job stream reads.

A send stream (``SendStream``) yields lists of decoded units (NCCL sends; gloo ops for the gloo
transport) in roughly wire order, and ``WIRE_IDLE`` when a live stream went quiet, so that what is
already complete is handed on. ``parser.roce.streams.MirrorStreams`` (capture files), the gloo
``GlooStreams`` and the daemon's ``QueueStreams`` implement it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from mirrorckpt.parser import encap


@dataclass
class StreamStats:
    """One capture source's counts, the same for every transport."""

    source: str
    frames: int = 0
    bytes: int = 0
    damage: str | None = None  # why the source ended early (None: a clean end)
    mirror: encap.MirrorHealth | None = None  # what its mirror encapsulation showed (RoCE sources)
    mirror: encap.MirrorHealth | None = None  # what its mirror encapsulation showed (RoCE sources)


class WireIdle:
    """Marker in a send stream: no source delivered anything for a while (end of job, pause)."""

    def __repr__(self) -> str:
        return "WIRE_IDLE"


WIRE_IDLE = WireIdle()


class SendStream(Protocol):
    """What ``pipeline.JobStream`` reads."""

    nstreams: int  # mirror streams (a collective is final once every stream moved past it)
    stats: list[StreamStats]

    @property
    def ended(self) -> set[int]:
        """Streams with nothing more to come (finished, failed or silent)."""

    @property
    def decoders(self) -> list:
        """Per-stream decoders whose state inference reads (CTS tags); may be empty."""

    def __iter__(self) -> Iterator[list | WireIdle]: ...
