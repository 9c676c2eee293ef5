"""The one interface every capture backend yields: a batch of frames as numpy arrays.

A batch never holds per-packet Python objects. ``data`` is a flat uint8 buffer (a view of a
memory-mapped file, of a TPACKET_V3 block, or of DPDK mbuf memory); frame ``i`` occupies
``data[offset[i] : offset[i] + caplen[i]]``. A frame whose ``caplen < wirelen`` was truncated by
the capture: it is counted and never decoded as whole.

The buffer behind ``data`` is only guaranteed to stay valid until the consumer asks for the next
batch (live rings hand their blocks back to the kernel); a stage that keeps bytes must copy them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Link types we know (pcap LINKTYPE_* values).
LINKTYPE_ETHERNET = 1


@dataclass
class FrameBatch:
    data: np.ndarray  # uint8, 1-D
    offset: np.ndarray  # int64: start of each frame in data
    caplen: np.ndarray  # int64: bytes captured
    wirelen: np.ndarray  # int64: bytes on the wire
    ts_ns: np.ndarray  # int64: timestamp, ns since the epoch
    iface: np.ndarray  # int32: interface index within the source (pcapng IDB, port)
    source: str = ""  # name of the capture source (file path, interface)
    first_index: int = 0  # index of this batch's first frame among all frames of the source
    linktypes: dict[int, int] = field(default_factory=dict)  # iface -> LINKTYPE_*

    def __len__(self) -> int:
        return int(self.offset.shape[0])

    @property
    def truncated(self) -> np.ndarray:
        """Boolean mask of frames the capture cut short."""
        return self.caplen < self.wirelen

    @property
    def nbytes(self) -> int:
        """Captured bytes in this batch."""
        return int(self.caplen.sum())

    def copy(self) -> FrameBatch:
        """A compact copy owning its bytes (for a batch that outlives its source's buffer)."""
        from mirrorckpt.capture._pack import copy_ranges

        n = len(self)
        offset = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(self.caplen[:-1], out=offset[1:])
        data = np.empty(int(self.caplen.sum()), np.uint8)
        copy_ranges(np.ascontiguousarray(self.data), np.ascontiguousarray(self.offset, np.int64), data,
                    offset, np.ascontiguousarray(self.caplen, np.int64))
        return FrameBatch(data, offset, self.caplen.copy(), self.wirelen.copy(), self.ts_ns.copy(),
                          self.iface.copy(), self.source, self.first_index, dict(self.linktypes))

    def select(self, rows, first_index: int | None = None) -> FrameBatch:
        """Frames ``rows`` (a slice or an index array) sharing this batch's buffer; ``first_index``
        when they are not numbered from this batch's first frame (a batch cut in two)."""
        return FrameBatch(self.data, self.offset[rows], self.caplen[rows], self.wirelen[rows], self.ts_ns[rows],
                          self.iface[rows], self.source, self.first_index if first_index is None else first_index,
                          self.linktypes)

    def split_at(self, cuts) -> list[FrameBatch]:
        """This batch cut before each frame index in ``cuts`` (increasing, inside it), sharing its buffer."""
        bounds = [0, *map(int, cuts), len(self)]
        return [self.select(slice(lo, hi), self.first_index + lo) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def pieces(self, max_bytes: int) -> list[FrameBatch]:
        """This batch's frames in order, cut into batches of at most ``max_bytes`` captured bytes each
        (one frame larger than that is a piece alone), sharing this batch's buffer."""
        ends = np.cumsum(self.caplen)
        cuts, lo = [], 0
        while lo < len(self):
            start = int(ends[lo - 1]) if lo else 0
            lo = max(lo + 1, int(np.searchsorted(ends, start + max_bytes, "right")))
            cuts.append(lo)
        return self.split_at(cuts[:-1]) if cuts else []

    def frame(self, i: int) -> bytes:
        """One frame's captured bytes (tooling and tests only: not for the data path)."""
        o = int(self.offset[i])
        return self.data[o : o + int(self.caplen[i])].tobytes()

    def ethernet_mask(self) -> np.ndarray:
        """Frames whose interface link type is Ethernet (unknown interfaces count as Ethernet)."""
        if not self.linktypes or all(v == LINKTYPE_ETHERNET for v in self.linktypes.values()):
            return np.ones(len(self), dtype=bool)
        eth = [k for k, v in self.linktypes.items() if v == LINKTYPE_ETHERNET]
        return np.isin(self.iface, np.asarray(eth, dtype=self.iface.dtype))

    @staticmethod
    def from_frames(frames: list[bytes], source: str = "", ts_ns: list[int] | None = None,
                    wirelen: list[int] | None = None) -> FrameBatch:
        """Builds a batch from a list of frames (generator, tests)."""
        lens = np.fromiter((len(f) for f in frames), dtype=np.int64, count=len(frames))
        offset = np.zeros(len(frames), dtype=np.int64)
        if len(frames) > 1:
            np.cumsum(lens[:-1], out=offset[1:])
        data = np.frombuffer(b"".join(frames), dtype=np.uint8) if frames else np.zeros(0, np.uint8)
        return FrameBatch(
            data=data,
            offset=offset,
            caplen=lens,
            wirelen=np.asarray(wirelen, dtype=np.int64) if wirelen is not None else lens.copy(),
            ts_ns=np.asarray(ts_ns, dtype=np.int64) if ts_ns is not None else np.zeros(len(frames), np.int64),
            iface=np.zeros(len(frames), dtype=np.int32),
            source=source,
        )


class CaptureError(Exception):
    """A capture source that cannot be read; the message names the source and the byte offset."""
