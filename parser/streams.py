"""Several mirror streams of one job, decoded side by side and merged in time order.

Each capture source keeps its own packet path (PSN spaces are per QP and a QP may appear in two
sources: both directions of a port, or one rank's egress that is the next rank's ingress); the
sends meet only in the concatenator, where duplicate copies must agree. Batches are taken from
the source whose next frame is oldest, so the concatenator sees the job in (roughly) wire order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.parser import roce
from mirrorckpt.parser.nccl import NcclSend
from mirrorckpt.parser.packet_path import PacketPath


@dataclass
class StreamStats:
    source: str
    frames: int = 0
    bytes: int = 0
    damage: str | None = None


class MirrorStreams:
    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], icrc: bool = True,
                 nccl_version: str = "2.18", protocol: str | None = None):
        self.paths = [PacketPath(icrc=icrc, nccl_version=nccl_version, protocol=protocol) for _ in sources]
        self.stats = [StreamStats(name) for name, _ in sources]
        self._iters = [iter(b) for _, b in sources]

    def __iter__(self) -> Iterator[list[NcclSend]]:
        heap = []
        for k, it in enumerate(self._iters):
            b = self._next(k, it)
            if b is not None:
                heapq.heappush(heap, (int(b.ts_ns[0]) if len(b) else 0, k, b))
        while heap:
            _, k, b = heapq.heappop(heap)
            st = self.stats[k]
            st.frames += len(b)
            st.bytes += b.nbytes
            _, sends = self.paths[k].feed(b)
            if sends:
                yield sends
            nb = self._next(k, self._iters[k])
            if nb is not None:
                heapq.heappush(heap, (int(nb.ts_ns[0]) if len(nb) else 0, k, nb))
        for p in self.paths:
            _, sends = p.flush()
            if sends:
                yield sends

    def _next(self, k: int, it) -> FrameBatch | None:
        try:
            return next(it)
        except StopIteration:
            return None
        except CaptureError as e:  # damaged part-way: keep what came before, say so
            self.stats[k].damage = str(e)
            return None

    @property
    def counters(self) -> roce.Counters:
        c = roce.Counters()
        for p in self.paths:
            c.add(p.counters)
        return c

    @property
    def decoders(self):
        return [p.nccl for p in self.paths]
