# cython: language_level=3
"""A batch of NCCL sends placed in one compiled pass (``RingPlacer.add``) for the common case.

A send whose step is known (an LL/LL128 flag, a CTS index, or, proven by PSNs, the message after
the newest one placed on its QP: it begins at the PSN where that one ended), intact, of a connection
already mapped, of the planned size and protocol, and its QP's newest: the ring state machine's
placement (``RingStateMachine.place``, tabulating the connection's next collectives as it does), its
QP cursor and the concatenator's bookkeeping and copy (``Concatenator.add``) are done here, reading
and changing the same state the per-send path does. Every other send (the first ones of a
connection, lost bytes, out of order, a PSN-proven one after a gap, a size the plan does not
expect, a step past the job's sequence) goes the per-send Python way (``fallback``) in its turn, so
the outcome is the same send by send. A ``SendBlock``'s sends are read from its columns, and one is
made a ``LazySend`` only where it goes that way (or is put, or is no all-reduce's).
"""

from bisect import bisect_right

import numpy as np
from mirrorckpt.config.ddp import ALLREDUCE
from mirrorckpt.config.layout import dtype_size
from mirrorckpt.parser.placement import REDUCED, Placement
from mirrorckpt.parser.roce import nccl_versions, schedule
from mirrorckpt.parser.roce.sends import LazySend, NcclSend, SendBlock
from mirrorckpt.parser.roce.statemachine import MAX_AHEAD_STEPS, MAX_ANCHORS, _Cursor

cdef long long NCCL_STEPS = nccl_versions.NCCL_STEPS
_LL, _SIMPLE = nccl_versions.LL, nccl_versions.SIMPLE
cdef long long HALF = 1LL << 31
cdef long long WRAP = 1LL << 32


cdef class Window:
    """One collective of one connection, as the state machine's tables hold it: steps
    [t0, t_limit) and messages [m0, m0 + n) are this collective's, and no other's."""
    cdef readonly object track, spec, proto, steps, messages
    cdef object result, covered  # the collective's result as last placed into, its flags as bytes
    cdef readonly long long coll, t0, t_limit, m0, n, esize
    cdef readonly long long slot_bytes  # a receive slot of its protocol (0: no release known)
    cdef readonly bint allreduce

    def __init__(self, track, Py_ssize_t i, coll_entry, Py_ssize_t channel, Py_ssize_t pos, version):
        spec, proto, plan = coll_entry
        self.track = track
        self.coll = track.base + i
        self.t0 = track.t0[i]
        self.t_limit = track.t0[i + 1] if i + 1 < len(track.t0) else track.t_end
        self.m0, self.n = track.m0[i], track.n[i]
        self.spec, self.proto = spec, proto
        self.steps = plan.steps_at(pos, channel)
        self.messages = plan.messages(pos, channel)
        self.allreduce = spec.kind == ALLREDUCE
        self.esize = dtype_size(spec.dtype) if self.allreduce else 0
        # RingStateMachine._slot_agrees: step t lands at slot t mod NCCL_STEPS of this many bytes
        self.slot_bytes = schedule.recv_slot(1, proto, spec.kind, version).offset if version else 0


cdef Py_ssize_t _last_with_messages(track, Py_ssize_t i):
    """``i``, or the nearest collective before it that has messages on the connection (-1: none)."""
    while i >= 0 and track.n[i] == 0:
        i -= 1
    return i


cdef Window _by_step(sm, track, long long t, Py_ssize_t channel, Py_ssize_t pos):
    """``RingStateMachine._at_step``'s collective for step ``t``, from its tables as they are
    (None: past the job's sequence, or dropped: the per-send path decides). A step past the
    tables tabulates more collectives, as ``_at_step`` does: a collective's first send is placed
    here too."""
    cdef Py_ssize_t i
    if t >= track.t_end and not sm._extend(track, t=t):
        return None
    i = _last_with_messages(track, bisect_right(track.t0, t) - 1)
    return None if i < 0 else Window(track, i, sm._coll(track.base + i), channel, pos, sm.model.ring.nccl_version)


cdef Window _by_message(sm, track, long long m, Py_ssize_t channel, Py_ssize_t pos):
    """``RingStateMachine.by_message``'s collective for message ``m`` (None: as ``_by_step``)."""
    cdef Py_ssize_t i
    if m >= track.m_end and not sm._extend(track, m=m):
        return None
    i = _last_with_messages(track, bisect_right(track.m0, m) - 1)
    if i < 0 or m - track.m0[i] >= track.n[i]:
        return None
    return Window(track, i, sm._coll(track.base + i), channel, pos, sm.model.ring.nccl_version)


cdef class _Pass:
    """One ``place_batch``'s view of the state machine's and the concatenator's tables."""
    cdef object sm, concat, counts, fallback
    cdef dict mapped, where, last_placed, cursors, tracks, windows, streams, span, results
    cdef Py_ssize_t placed

    def __init__(self, placer, concat, fallback):
        sm = self.sm = placer.sm
        self.concat, self.fallback, self.counts = concat, fallback, sm.counts
        self.mapped, self.where, self.last_placed, self.cursors = sm.channels, sm._where, sm.last, sm.cursors
        self.tracks, self.windows = sm.tracks, placer.windows
        self.streams, self.span, self.results = concat.streams, concat.span, concat.open
        self.placed = 0

    cdef void other_way(self, s) except *:
        """``s`` the per-send way, in its turn (the sends placed before it counted first)."""
        if self.placed:
            self.counts["placed"] += self.placed
            self.placed = 0
        self.fallback(s)


def place_batch(placer, sends, concat, fallback):
    """Places ``sends`` in order: the common case here, any other send by ``fallback(send)``. A
    ``SendBlock`` is placed from its columns, a send made of a row only where it goes the other way."""
    cdef _Pass x = _Pass(placer, concat, fallback)
    cdef Py_ssize_t i, n
    cdef const long long[::1] flag, seq, psn, npkts, wire, ts, lo, hi, run, m
    for s in sends:
        if type(s) is SendBlock:
            n = len(s)
            flag, seq, psn, npkts, wire, ts = s.flag, s.seq, s.psn, s.npkts, s.wire, s.ts
            lo, hi, run, m = s.lo, s.hi, s.run, s.m
            vas, conns, qps, nqs, runs = s.va.tolist(), s.conns, s.qps, s.nqs, s.runs
            stream = s.stream
            for i in range(n):
                j = run[i]
                if not _place(x, None, s, i, conns[j], flag[i] if flag[i] else None, seq[i] if seq[i] >= 0 else None,
                              stream, psn[i], qps[j], nqs[j], False, vas[i], _LL if flag[i] else _SIMPLE,
                              wire[i], npkts[i], ts[i], runs[j], lo[i], hi[i], flag[i] != 0, m[i]):
                    x.other_way(s.send(i))
            continue
        # A send's fields read from its instance dict (the dataclass keeps them there; its
        # properties are not read): a send of any other class goes the per-send way.
        d = s.__dict__ if type(s) is LazySend or type(s) is NcclSend else None
        if d is None or d["form"] != "normal" or d["pieces"] or d["holes"] or not d["length_known"]:
            x.other_way(s)
            continue
        src = d.get("_source")  # (run, start, end, LL words or not, message): its bytes still in the batch
        if not (_place(x, s, None, 0, d["connection"], d["flag"], d["seq"], d["stream"], d["psn"], d["qp"],
                       d["nqps"], d["cut"], d["va"], d["protocol"], d["wire_bytes"], d["npkts"], d["ts_ns"],
                       None, 0, 0, False, 0) if src is None else
                _place(x, s, None, 0, d["connection"], d["flag"], d["seq"], d["stream"], d["psn"], d["qp"],
                       d["nqps"], d["cut"], d["va"], d["protocol"], d["wire_bytes"], d["npkts"], d["ts_ns"],
                       src[0], src[1], src[2], src[3], src[4])):
            x.other_way(s)
    if x.placed:
        x.counts["placed"] += x.placed


cdef bint _place(_Pass x, s, block, Py_ssize_t row, conn, flag, seq, stream, psn, qp, long long nqps, bint cut, va,
                 proto, long long wire_bytes, long long npkts, long long ts, run, long long lo, long long hi, bint ll,
                 long long msg) except -1:
    """Places one send (``s``, or row ``row`` of ``block``) from its fields, as the per-send path
    would; False, with nothing placed, when it must go the per-send way. ``run`` (None: none):
    its bytes still lie in the batch, message ``msg`` of that run, ``lo``:``hi`` of its wire bytes or
    (``ll``) of its LL words."""
    cdef Py_ssize_t channel, pos, k, n, start
    cdef long long t, m, ref, end, coll
    cdef Window w
    loc = x.where.get(conn)
    if loc is None or x.mapped.get(conn) != loc[0]:
        return False
    channel, pos = loc
    key = (stream, conn)
    last = x.last_placed.get(key)
    w = x.windows.get(loc)
    track = x.tracks.get(loc)
    sm = x.sm
    if track is None or (w is not None and w.track is not track):
        w = None
    if flag is not None:
        ref = last[0] if last is not None else 0
        t = ref + ((((<long long>flag) - 1) - ref + HALF) % WRAP) - HALF  # RingStateMachine._unwrap_flag
        if last is not None and t > last[0] + MAX_AHEAD_STEPS:
            w = None
        elif track is not None and (w is None or not (w.t0 <= t < w.t_limit) or w.coll < track.base):
            w = _by_step(sm, track, t, channel, pos)
        hit = w.steps.get(t - w.t0) if w is not None else None
        if hit is not None:
            k, st = hit
            m = w.m0 + k
    else:
        hit = None
        if seq is not None:
            m = seq - 1
        else:
            # RingStateMachine._next_on_qp without a gap: the send begins where the newest send
            # placed on its QP ended (its anchor), so it is the QP's next message
            m = -1
            anchors = x.cursors.get((stream, qp)) if psn is not None and qp is not None else None
            if anchors:
                cur = anchors[len(anchors) - 1]
                if cur.end == psn:
                    m = cur.m + (1 if cut or nqps == 1 else nqps)
        if m >= 0 and track is not None and (w is None or not (w.m0 <= m < w.m0 + w.n) or w.coll < track.base):
            w = _by_message(sm, track, m, channel, pos)
        if m >= 0 and w is not None:
            st = w.messages[m - w.m0]
            t = w.t0 + st.conn_step
            hit = st
            if seq is None and w.slot_bytes and cur.va is not None and va is not None and cur.proto == w.proto \
                    and va - cur.va != (t % NCCL_STEPS - cur.t % NCCL_STEPS) * w.slot_bytes:
                hit = None  # RingStateMachine._slot_agrees: not where step t lands
    if hit is None or wire_bytes != st.wire_bytes or (proto is not None and proto != w.proto):
        return False
    x.windows[loc] = w
    # RingStateMachine._advance for a QP's newest send (anything else went the per-send way)
    got = None
    if psn is not None and qp is not None:
        got = x.cursors.get((stream, qp))
        end = psn + npkts
        if not got or got[len(got) - 1].end >= end:
            return False
    if last is None or t >= last[0]:
        x.last_placed[key] = (t, m)
    if got is not None:
        cursor = _Cursor.__new__(_Cursor)  # its fields set one by one: no __init__ frame
        cursor.m, cursor.t, cursor.end, cursor.va, cursor.proto = m, t, end, va, w.proto
        got.append(cursor)
        if len(got) > MAX_ANCHORS:
            del got[0]
    x.placed += 1
    # Concatenator.add
    concat = x.concat
    coll = w.coll
    if not w.allreduce:
        concat.add(Placement(coll, w.spec, st, channel, pos, s if s is not None else block.send(row), t))
        return True
    if coll < concat.next_out:
        return True
    if coll > concat.frontier:
        concat.frontier = coll
    if x.streams.get(stream, -1) < coll:
        x.streams[stream] = coll
    bounds = x.span.get(coll)
    if bounds is None:
        x.span[coll] = [ts, ts]
    elif ts < bounds[0]:
        bounds[0] = ts
    elif ts > bounds[1]:
        bounds[1] = ts
    n = st.nelem
    if st.phase != REDUCED or n == 0:
        return True
    r = x.results.get(coll)
    if r is None:
        r = concat._result(coll)
    if r is not w.result:
        w.result, w.covered = r, r.covered.view(np.uint8)
    start = st.offset
    if ts > r.last_ts:
        r.last_ts = ts
    # a lazy send's bytes still in the batch: placed from there
    if run is not None and hi - lo >= n * w.esize:
        added = run.place_range(msg, r.data, w.covered, start, n, w.esize, ll)
    elif run is None and s.nbytes >= n * w.esize:
        added = s.place_agreeing(r.data, w.covered, start, n, w.esize)
    else:
        added = None
    if added is not None and added >= 0:
        r.ncovered += added
        r.pieces += 1
        return True
    if s is None:
        s = block.send(row)
    concat._put(r, start, n, s.data[: n * w.esize], s.holes, conn)
    return True
