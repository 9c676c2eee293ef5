"""gloo's collective algorithms as send lists: which data ops a sender puts on one connection.

The wire never says where a payload belongs (unbound-buffer ops carry offset 0), but every pair
delivers the sends of one slot in issue order, so the k-th data op of a (sender -> receiver,
slot) direction is the k-th send of that list. Read in facebookincubator/gloo at
cc441984208d0b54b4fc614301f41e82e951e5cd; ProcessGroupGloo (torch 2.13) calls these with no
algorithm set and the default segment size:

* ``allreduce.cc`` ``ring`` (UNSPECIFIED maps to RING): rank r sends only to r-1. numSegments =
  roundUp(max(ceil(T / maxSegBytes), 2P), P), segmentBytes = roundUp(ceil(T / numSegments), e),
  maxSegBytes = e * max(1, maxSegmentSize / e) with maxSegmentSize 1 MiB (allreduce.h). Sends are
  issued for i in 0 .. numSegments - numSegments/P - 1, first reduce-scatter (segment
  (r+1)*nspr + i, partial sums), then allgather (segment r*nspr + i, final values); a segment
  past the end (length <= 0) is not sent.
* ``broadcast.cc``: a binomial tree over virtual ranks (rank - root) mod P; a sender sends the
  whole buffer to each child, one op per child.
* ``allgather.cc``: rank r sends only to r+1, for i in 0 .. 2(P-1)-1 the half (i & 1) of the
  contribution of rank (r - i/2) mod P; halves are inBytes/2 and the rest, and a zero-length
  half is still sent.
* ``barrier.cc``: zero-byte sends to r + 2^k; no data.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, BROADCAST
from mirrorckpt.parser.placement import FORWARD, OWN, PARTIAL, REDUCED

MAX_SEGMENT_BYTES = 1 << 20  # gloo/allreduce.h kMaxSegmentSize

# Slot prefixes (gloo/types.h) and the collective kinds the placer maps them to.
PREFIX_GATHER, PREFIX_ALLGATHER, PREFIX_REDUCE, PREFIX_ALLREDUCE = 1, 2, 3, 4
PREFIX_SCATTER, PREFIX_BROADCAST, PREFIX_BARRIER, PREFIX_ALLTOALL = 5, 6, 7, 8
KIND_OF_PREFIX = {PREFIX_ALLGATHER: ALLGATHER, PREFIX_ALLREDUCE: ALLREDUCE, PREFIX_BROADCAST: BROADCAST}
PREFIX_NAMES = {1: "gather", 2: "allgather", 3: "reduce", 4: "allreduce", 5: "scatter", 6: "broadcast",
                7: "barrier", 8: "alltoall"}


def slot_parts(slot: int) -> tuple[int, int, int]:
    """(prefix, tag, delta) of a slot: prefix << 56 | tag << 24 | delta (gloo/types.cc)."""
    return slot >> 56, (slot >> 24) & 0xFFFFFFFF, slot & 0xFF


def make_slot(prefix: int, tag: int, delta: int = 0) -> int:
    return (prefix << 56) | ((tag & 0xFFFFFFFF) << 24) | delta


@dataclass(frozen=True)
class Send:
    """One data op: ``length`` bytes of the result buffer starting at ``offset``.

    ``origin``: all-reduce, the segment's chunk owner; all-gather and broadcast, the rank whose
    data it is (the all-gather offset is inside that rank's contribution)."""

    offset: int
    length: int
    phase: str  # own | partial | reduced (all-reduce); own | forward (broadcast, all-gather)
    origin: int


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class RingGeometry:
    segments: int
    per_rank: int
    segment_bytes: int


def ring_geometry(nbytes: int, esize: int, nranks: int, max_segment: int = MAX_SEGMENT_BYTES) -> RingGeometry:
    max_seg = esize * max(1, max_segment // esize)
    nseg = _round_up(max(-(-nbytes // max_seg), 2 * nranks), nranks)
    return RingGeometry(nseg, nseg // nranks, _round_up(-(-nbytes // nseg), esize))


def allreduce_sends(nbytes: int, esize: int, nranks: int, rank: int,
                    max_segment: int = MAX_SEGMENT_BYTES) -> list[Send]:
    """Rank ``rank``'s data ops to rank - 1, in wire order (reduce-scatter, then all-gather)."""
    g = ring_geometry(nbytes, esize, nranks, max_segment)
    span = g.segments * g.segment_bytes
    out = []
    for first, phase in ((rank + 1, PARTIAL), (rank, REDUCED)):
        for i in range(g.segments - g.per_rank):
            seg = (first * g.per_rank + i) % g.segments
            off = (seg * g.segment_bytes) % span
            ln = min(g.segment_bytes, nbytes - off)
            if ln > 0:
                ph = OWN if phase == PARTIAL and i < g.per_rank else phase
                out.append(Send(off, ln, ph, seg // g.per_rank))
    return out


def broadcast_children(nranks: int, root: int, rank: int) -> list[int]:
    """Ranks ``rank`` sends the whole buffer to, in order (binomial tree over virtual ranks)."""
    vrank = (rank - root) % nranks
    dim = max(0, (nranks - 1).bit_length())  # log2ceil
    mask = (1 << dim) - 1
    out = []
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask:
            continue
        vpeer = vrank ^ (1 << i)
        if vpeer >= nranks:
            continue
        if not vrank & (1 << i):
            out.append((vpeer + root) % nranks)
    return out


def allgather_sends(in_bytes: int, nranks: int, rank: int) -> list[Send]:
    """Rank ``rank``'s data ops to rank + 1; offsets are inside the origin's contribution."""
    half = (in_bytes // 2, in_bytes - in_bytes // 2)
    out = []
    for i in range(2 * (nranks - 1)):
        origin = (rank - i // 2) % nranks
        h = i & 1
        out.append(Send(h * half[0], half[h], OWN if i < 2 else FORWARD, origin))
    return out


def sends(kind: str, nbytes: int, esize: int, nranks: int, sender: int, receiver: int, root: int = 0,
          max_segment: int = MAX_SEGMENT_BYTES) -> list[Send]:
    """The data ops of one collective on the sender -> receiver direction, in wire order
    (``nbytes``: all-reduce and broadcast buffer, all-gather per-rank contribution)."""
    if kind == ALLREDUCE:
        if receiver != (sender - 1) % nranks:
            return []
        return allreduce_sends(nbytes, esize, nranks, sender, max_segment)
    if kind == BROADCAST:
        if receiver not in broadcast_children(nranks, root, sender):
            return []
        return [Send(0, nbytes, OWN if sender == root else FORWARD, root)]
    if kind == ALLGATHER:
        if receiver != (sender + 1) % nranks:
            return []
        return allgather_sends(nbytes, nranks, sender)
    raise ValueError(f"no gloo schedule for {kind!r}")
