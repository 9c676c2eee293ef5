"""The concatenator: each collective's result buffer, assembled from every mirror stream.

Only messages that carry final values are used: the fully reduced all-gather phase of an
all-reduce, any message of a broadcast (the root's data), the pieces of an all-gather. A
reduce-scatter carries none (its owners add their own terms locally): its result holds nothing
and is complete as soon as the traffic is past it (its sends only keep the ring's steps). Every
element records whether it was covered; a second copy of an element (the same send mirrored at
two ports, or a reduced chunk forwarded along the ring) must carry the same bytes, otherwise the
element is marked conflicting and the collective can never be complete. A complete collective is
handed on once every running stream is ``settle_margin`` collectives past it; an incomplete one once the
traffic has moved ``collective_window`` collectives past it (or at the end), when late data can no
longer complete it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, REDUCESCATTER, CollSpec
from mirrorckpt.config.layout import dtype_size, numpy_dtype
from mirrorckpt.parser import _merge, memory
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.placement import REDUCED, Placement, Unit


def ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """Runs of True as [(start, length)]."""
    m = np.concatenate(([False], mask.astype(bool), [False]))
    edges = np.flatnonzero(m[1:] != m[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[0::2], edges[1::2])]


def uniform_flags(value: bool, n: int) -> np.ndarray:
    """``n`` flags all ``value``, read-only and without memory of their own."""
    return np.broadcast_to(np.bool_(value), (n,))


@dataclass
class CollectiveResult:
    index: int
    spec: CollSpec
    data: np.ndarray  # uint8, the result's bytes (all-gather: every rank's part, by rank); read where covered
    covered: np.ndarray  # bool per element
    conflict: np.ndarray  # bool per element: copies disagreed (a read-only all-False view until two do)
    pieces: int = 0
    filled_by_p2p: list[tuple[int, int]] = field(default_factory=list)  # element ranges
    # the fill is off, yet exactly one point-to-point send would have filled the one hole: said in
    # the report, so an operator whose workload sends such copies can declare it
    p2p_candidate: bool = False
    conflicts: list[str] = field(default_factory=list)
    last_ts: int = 0
    # Kept by Concatenator._put as it places, so that asking whether an open result is complete
    # (poll does for every batch of sends) costs no pass over its flags
    ncovered: int = 0
    nconflict: int = 0
    _sealed: bool | None = field(default=None, init=False, repr=False, compare=False)  # see seal()

    @property
    def count(self) -> int:
        return int(self.covered.size)

    def seal(self) -> None:
        """Handed on: nothing is placed into it any more, so its verdict is taken once, from the
        flags themselves (every reader of a finished result asks for it). A complete one gives its
        flags back (half as many bytes again as a float32 result's data, held for as long as the
        bucket is: by the iteration, the replica's step, the report's hash): they are all
        covered and none conflicting, which read-only views of one value say as well."""
        # Conflict flags are a read-only all-False view until copies disagree: no pass over those.
        self._sealed = bool(self.covered.all()) and not (self.conflict.flags.writeable and self.conflict.any())
        if self._sealed:
            n = self.count
            self.covered, self.conflict = uniform_flags(True, n), uniform_flags(False, n)

    @property
    def complete(self) -> bool:
        if self._sealed is not None:
            return self._sealed
        return self.ncovered == self.covered.size and self.nconflict == 0

    @property
    def coverage(self) -> float:
        if self.complete:  # one pass over the flags instead of three (the report asks for every result)
            return 1.0
        return float((self.covered & ~self.conflict).mean()) if self.covered.size else 1.0

    @property
    def holes(self) -> list[tuple[int, int]]:
        if self.complete:
            return []
        return ranges(~self.covered | self.conflict)

    def values(self) -> np.ndarray:
        return self.data.view(numpy_dtype(self.spec.dtype))

    def sha256(self) -> str | None:
        return hashlib.sha256(self.data).hexdigest() if self.complete else None  # the buffer itself: no copy


class Concatenator:
    """``p2p_fill``: the job declares that its workload sends, point to point, the final values of
    an all-reduce its mirrors lack, after that all-reduce and before the next collective (as the
    iter_40000_p2p_iter10 capture's does). Then an all-reduce's one remaining hole is filled by the
    one whole point-to-point send of exactly its size between the all-reduce's last send and the next
    collective's first; none or more than one such send: the hole stays. Off by default: nothing on
    the wire proves what a point-to-point send carries, and a foreign one of that size (a pipeline
    activation, a tensor-parallel exchange, the next all-reduce's fill when this one's was lost)
    would make a collective complete with wrong values."""

    def __init__(self, model: JobModel, collective_window: int = 8, p2p_fill: bool = False):
        memory.keep_freed_memory()  # a result buffer per collective, and (serve) the sends unpickled
        self._buffers = memory.buffers()  # result buffers, off the heap
        self.model = model
        self.p2p_fill = p2p_fill
        self.collective_window = collective_window
        self.settle_margin = min(2, collective_window)  # collectives past a complete one before it goes
        self.open: dict[int, CollectiveResult] = {}
        self.next_out = 0  # lowest collective not yet handed on
        self.frontier = -1  # highest collective any send was placed in
        # Per mirror stream, the highest collective it delivered: a collective is final once
        # every stream still running has moved past it (streams can be skewed in time).
        self.streams: dict[int, int] = {}
        self.ended: set[int] = set()
        self.expected: set[int] = set()  # streams known to exist: silent ones hold collectives back
        # Streams with sends held back before placement (a connection whose channel is not yet
        # known), each at the collective it had reached when the first was held: no collective
        # from there on is closed incomplete, since the held sends may complete it.
        self.holding: dict[int, int] = {}
        self.p2p: list[Unit] = []  # candidate extra sends for holes (point-to-point traffic)
        self.p2p_seen: list[tuple[int, int]] = []  # fill off: (bytes, time) of those sends, for the hint
        self.span: dict[int, list[int]] = {}  # per collective, [first, last] send time
        self._incomplete_at: dict[int, int] = {}  # the head collective's pieces when last found incomplete

    def _result(self, i: int) -> CollectiveResult:
        r = self.open.get(i)
        if r is None:
            c = self.model[i]
            n = 0 if c.kind == REDUCESCATTER else c.count * (self.model.ring.nranks if c.kind == ALLGATHER else 1)
            # An element's bytes are only ever read where it is covered, so they need no zeroing
            # (that cost as much as placing them); no conflict flags until copies disagree.
            b = self._buffers
            r = self.open[i] = CollectiveResult(i, c, b.empty(n * dtype_size(c.dtype)), b.zeros(n).view(bool),
                                                uniform_flags(False, n))
        return r

    def add(self, p: Placement) -> None:
        if p.coll < self.next_out:
            return  # already handed on: a late copy can no longer change it
        self.frontier = max(self.frontier, p.coll)
        k = getattr(p.send, "stream", 0)
        self.streams[k] = max(self.streams.get(k, -1), p.coll)
        sp, t = self.span.get(p.coll), p.send.ts_ns  # any phase: bounds when a fill may come
        if sp is None:
            self.span[p.coll] = [t, t]
        else:
            sp[0], sp[1] = min(sp[0], t), max(sp[1], t)
        c, st = p.spec, p.step
        if c.kind == REDUCESCATTER:
            self._result(p.coll)  # nothing to keep: complete, it goes once the traffic is past it
            return
        if c.kind == ALLREDUCE and st.phase != REDUCED:
            return
        if st.nelem == 0:
            return
        r = self._result(p.coll)
        es = dtype_size(c.dtype)
        start = st.offset
        if c.kind == ALLGATHER:
            origin = self.model.ring.orders()[p.channel][st.chunk]
            start += origin * c.count
        r.last_ts = max(r.last_ts, p.send.ts_ns)
        s, n = p.send, st.nelem
        if not s.holes and s.nbytes >= n * es:
            # a send still in the capture is placed from its packets, without a copy in between
            added = s.place_agreeing(r.data, r.covered.view(np.uint8), start, n, es)
            if added is not None and added >= 0:
                r.ncovered += added
                r.pieces += 1
                return
        self._put(r, start, n, s.data[: n * es], s.holes, s.connection)

    def _put(self, r: CollectiveResult, start: int, n: int, data: np.ndarray, byte_holes, origin) -> None:
        """``origin`` (a connection, or a description) is only formatted when copies conflict."""
        es = dtype_size(r.spec.dtype)
        if not byte_holes and len(data) >= n * es and data.dtype == np.uint8 and data.flags.c_contiguous:
            added = _merge.place_agreeing(r.data, r.covered.view(np.uint8), start, data, n, es)
            if added >= 0:  # the common case, in one compiled pass: every element arrived, no copy disagreed
                r.ncovered += added
                r.pieces += 1
                return
        ok = np.ones(n, bool)
        for a, ln in byte_holes:  # an element is only covered when all its bytes arrived
            lo, hi = a // es, -(-(a + ln) // es)
            ok[lo:min(hi, n)] = False
        if len(data) < n * es:
            ok[len(data) // es:] = False
            data = np.concatenate([data, np.zeros(n * es - len(data), np.uint8)])
        # One machine word per element (compare and copy whole elements; a boolean-masked copy of
        # (n, es) byte rows is ~20x slower), rows of bytes for any other element size.
        w = np.dtype(f"u{es}") if es in (1, 2, 4, 8) else None
        new = data[:n * es].view(w) if w is not None else data[:n * es].reshape(n, es)
        old = r.data[start * es:(start + n) * es]
        old = old.view(w) if w is not None else old.reshape(n, es)
        covered = r.covered[start:start + n]
        seen = covered & ok
        if seen.any():
            differ = seen & ((old != new) if w is not None else (old != new).any(axis=1))
            if differ.any():
                if not r.conflict.flags.writeable:  # the first disagreement: the flags are made now
                    r.conflict = self._buffers.zeros(r.count).view(bool)
                r.nconflict += int(np.count_nonzero(differ & ~r.conflict[start:start + n]))
                r.conflict[start:start + n] |= differ
                for a, ln in ranges(differ):
                    r.conflicts.append(f"elements [{start + a}, {start + a + ln}) differ in the copy from {origin}")
        put = ok & ~covered
        r.ncovered += int(np.count_nonzero(put))
        if put.all():
            old[...] = new
        elif w is not None:
            np.copyto(old, new, where=put)
        else:
            old[put] = new[put]
        covered |= ok
        r.pieces += 1

    def add_p2p(self, s: Unit) -> None:
        """A send outside the ring (point-to-point): kept as a candidate to fill a collective's hole
        when the job declares such fills (``p2p_fill``), else ignored."""
        if not (s.complete and s.nbytes):
            return
        if self.p2p_fill:
            self.p2p.append(s.keep())  # kept for the next collectives
            del self.p2p[:-64]
        else:
            self.p2p_seen.append((s.nbytes, s.ts_ns))
            del self.p2p_seen[:-64]

    def _fill_from_p2p(self, r: CollectiveResult) -> None:
        """With ``p2p_fill``: the one whole point-to-point send of exactly the all-reduce's one
        remaining hole, between its last send and the next collective's first, fills it."""
        holes = r.holes
        if r.spec.kind != ALLREDUCE or len(holes) != 1 or r.conflict.any():
            return
        a, n = holes[0]
        es = dtype_size(r.spec.dtype)
        lo = max(r.last_ts, self.span.get(r.index, [0, 0])[1])
        hi = min((sp[0] for c, sp in self.span.items() if c > r.index), default=None)
        sizes = [(s.nbytes, s.ts_ns) for s in self.p2p] if self.p2p_fill else self.p2p_seen
        fit = [i for i, (nb, ts) in enumerate(sizes) if nb == n * es and ts >= lo and (hi is None or ts < hi)]
        if len(fit) != 1:
            return  # none, or which of them carries the hole is not known
        if not self.p2p_fill:
            r.p2p_candidate = True
            return
        s = self.p2p.pop(fit[0])
        self._put(r, a, n, s.data, [], f"point-to-point send on {s.connection}")
        r.filled_by_p2p.append((a, n))

    def settled(self, held: bool = False) -> int:
        """The collective every running stream has reached (the global one when all ended); with
        ``held``, a stream with sends held back counts as where it was when the first was held."""
        running = [self.streams.get(k, -1) for k in self.expected | set(self.streams) if k not in self.ended]
        if held and self.holding:
            running += [c for k, c in self.holding.items() if k not in self.ended]
        return min(running) if running else self.frontier

    def hold_from(self, stream: int) -> None:
        """A send of ``stream`` is held back before placement, here in the stream's order."""
        if stream not in self.holding:
            self.holding[stream] = self.streams.get(stream, -1)

    def hold(self, streams: set[int]) -> set[int]:
        """Only ``streams`` still have sends held back (see ``holding``); returns those that every
        running stream has moved a collective window past where their hold began: their held
        sends must be decided now, as they are, or the collectives behind them could never close."""
        self.holding = {k: c for k, c in self.holding.items() if k in streams}
        settled = self.settled()  # every stream: what another stream holds back may be seen late
        return {k for k, c in self.holding.items() if settled >= c + self.collective_window}

    def settle(self) -> list[CollectiveResult]:
        """Collectives already complete that the traffic has not yet moved the window past, handed
        on in order (the wire went quiet). The first incomplete one and all after it stay open:
        late data can still complete them, so this never makes a collective incomplete."""
        out = []
        while self.next_out <= self.frontier:
            r = self.open.get(self.next_out)
            if r is None or not r.complete:
                break
            r.seal()
            out.append(self.open.pop(self.next_out))
            self.next_out += 1
        return out

    def _complete_now(self, r: CollectiveResult) -> bool:
        """``r.complete``, asked again only once something was placed into it since the last no
        (each ask is a pass over its flags, and poll runs for every batch of sends)."""
        if self._incomplete_at.get(r.index) == r.pieces:
            return False
        if r.complete:
            return True
        self._incomplete_at = {r.index: r.pieces}
        return False

    def poll(self, final: bool = False) -> list[CollectiveResult]:
        """Collectives finished (every running stream moved ``collective_window`` past them, or ``final``),
        in order. A complete one goes as soon as every running stream is ``settle_margin`` past it: the
        copies of its final values travel within its own collective (ranks and channels are at most
        a collective apart), so waiting longer only delays the step."""
        out = []
        settled = self.settled()
        closing = self.settled(held=True) if self.holding else settled
        while True:
            if not (final and self.next_out <= self.frontier or self.next_out + self.collective_window <= closing):
                r = self.open.get(self.next_out)
                if r is None or self.next_out + self.settle_margin > settled or not self._complete_now(r):
                    break
            r = self.open.pop(self.next_out, None)
            if r is None:
                r = self._result(self.next_out)
                self.open.pop(self.next_out)
            if not r.complete:
                self._fill_from_p2p(r)
            for c in [c for c in self.span if c <= r.index]:  # later fills look only at later ones
                del self.span[c]
            r.seal()
            out.append(r)
            self.next_out += 1
        return out
