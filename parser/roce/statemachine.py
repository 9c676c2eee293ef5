"""The ring state machine: which collective, and which of its messages, each NCCL send is.

Each ring connection (channel ``ch``, sender at ring position ``r``) has one step counter shared
by every collective that uses it. Walking the job's collective sequence with NCCL's plans gives,
per connection, the step range and the message count of every collective, so a send is placed
by its connection step: from its LL/LL128 flag (``t = flag - 1``), else from its CTS index (the
connection's message number), else as the message after the last one placed on its QP. That
last case has no number of its own, so it is proven from the QP's PSNs: NCCL starts every QP at
PSN 0 and each message takes ceil(bytes / PMTU) PSNs, so the PSNs between the last placed send
and this one must be exactly those of the planned messages in between (lost, or not placed), and
its receive slot (VA) and size must then agree with the plan. A send whose size disagrees with
the plan is never placed: it is counted as a mismatch, since it means the configuration does not
describe the traffic.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from mirrorckpt.config.ddp import CollSpec
from mirrorckpt.parser.placement import Placement, RingStep
from mirrorckpt.parser.roce import nccl_versions, schedule
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.reassembly import QpKey

# A send more than this many steps ahead of its connection is taken for garbage, not followed.
MAX_AHEAD_STEPS = 1 << 20
# Planned messages walked to account for a PSN gap before a flagless send; past it, unplaced.
MAX_GAP_MESSAGES = 1 << 14
# Sends placed per QP kept to count PSN gaps from (they come out of order by at most a few).
MAX_ANCHORS = 64
# NCCL_IB_AR_THRESHOLD's default: larger sends use the split form on a QP that uses it at all.
AR_THRESHOLD = 8192
# Collectives tabulated per connection before the oldest half is dropped: a serve of a job with
# hundreds of buckets an iteration would otherwise grow the tables for as long as it runs. A send
# of a collective this far back is long past the concatenator's window and stays unplaced.
TRACK_KEPT = 1 << 16
# Collectives whose spec, protocol and plan are kept at hand (asked for several times per send).
COLLS_KEPT = 1 << 10


@dataclass(slots=True)  # one per placed send
class _Cursor:
    """The last send placed on one QP of one mirror stream."""

    m: int  # its connection message number
    t: int  # its connection step
    end: int  # the PSN after it
    va: int | None
    proto: str


@dataclass
class _Track:
    """Step accounting of one (channel, ring position) send connection."""

    channel: int
    pos: int
    t0: list[int] = field(default_factory=list)  # per collective: first connection step
    m0: list[int] = field(default_factory=list)  # per collective: first message number
    n: list[int] = field(default_factory=list)  # per collective: messages on this connection
    t_end: int = 0  # counter after the last collective tabulated
    m_end: int = 0
    period_mark: tuple[int, int] = (-1, -1)  # (collectives, t_end) at the last period boundary
    base: int = 0  # collective index of t0[0]: the ones before were dropped (TRACK_KEPT)

    @property
    def tabulated(self) -> int:
        """Collectives tabulated so far, dropped ones included."""
        return self.base + len(self.t0)

    def trim(self) -> None:
        if len(self.t0) > TRACK_KEPT:
            k = len(self.t0) - TRACK_KEPT // 2
            del self.t0[:k], self.m0[:k], self.n[:k]
            self.base += k


class RingStateMachine:
    def __init__(self, model: NcclJobModel, ranks: dict[bytes, int], channels: dict[ConnKey, int]):
        """``ranks``: address (16 bytes) -> global rank; ``channels``: ring connection -> channel."""
        self.model = model
        self.ranks = ranks
        self.channels = channels
        self.tracks: dict[tuple[int, int], _Track] = {}
        self.last: dict[tuple[int, ConnKey], tuple[int, int]] = {}  # (stream, conn) -> (t, message) last placed
        # (stream, QP) -> the last sends placed on it, by PSN
        self.cursors: dict[tuple[int, QpKey], list[_Cursor]] = {}
        self.split_qps: set[tuple[int, QpKey]] = set()  # QPs that carried a split-form send
        self.counts = Counter()  # placed, mismatch, unplaced reasons
        self._pos: dict[tuple[int, int], int] = {}  # (channel, rank) -> ring position
        self._where: dict[ConnKey, tuple[int, int]] = {}  # connection -> where() once mapped
        self._colls: dict[int, tuple[CollSpec, str, schedule.RingPlan]] = {}  # see _coll
        self.mismatches: list[str] = []

    # -- tables ----------------------------------------------------------------------------------

    def _coll(self, i: int) -> tuple[CollSpec, str, schedule.RingPlan]:
        """Collective ``i``'s spec, protocol and plan, from one lookup once asked for (the model's
        protocols are settled before a state machine places: inference makes its own)."""
        got = self._colls.get(i)
        if got is None:
            c = self.model[i]
            p = self.model.protocol(c)
            if len(self._colls) >= COLLS_KEPT:
                self._colls.clear()
            got = self._colls[i] = (c, p, self.model.plan_as(c, p))
        return got

    def track(self, channel: int, pos: int) -> _Track:
        tr = self.tracks.get((channel, pos))
        if tr is None:
            tr = self.tracks[(channel, pos)] = _Track(channel, pos)
        return tr

    def _extend(self, tr: _Track, t: int | None = None, m: int | None = None, coll: int | None = None) -> bool:
        """Tabulates collectives until step ``t``, message ``m`` or collective ``coll`` is
        covered; False when the job's sequence ends first."""
        if (t is not None and t > tr.t_end + MAX_AHEAD_STEPS) or (m is not None and m > tr.m_end + MAX_AHEAD_STEPS):
            return False  # a step (a message: one step at least) no plausible sequence reaches: garbage
        while (t is not None and tr.t_end <= t) or (m is not None and tr.m_end <= m) or \
                (coll is not None and tr.tabulated <= coll):
            c = self.model[tr.tabulated]
            if c is None:
                return False
            if (t is not None or m is not None) and self._idle_period(tr):
                return False
            plan = self.model.plan(c)
            msgs = plan.messages(tr.pos, tr.channel) if tr.channel in plan.channels else []
            if msgs:
                start = schedule.conn_step_start(tr.t_end, self.model.protocol(c), c.kind)
                tr.t0.append(start)
                tr.t_end = start + plan.conn_steps(tr.channel, tr.pos)
            else:
                tr.t0.append(tr.t_end)
            tr.m0.append(tr.m_end)
            tr.n.append(len(msgs))
            tr.m_end += len(msgs)
        tr.trim()
        return True

    def _idle_period(self, tr: _Track) -> bool:
        """From iteration 2 on the sequence repeats; a connection that a whole iteration left
        untouched (a channel small collectives never use) will never reach a later step."""
        n = tr.tabulated
        start = self.model.first_of_iteration(2)
        period = self.model.first_of_iteration(3) - start
        if n < start or (n - start) % period:
            return False
        idle = tr.period_mark[0] >= 0 and tr.period_mark[1] == tr.m_end
        tr.period_mark = (n, tr.m_end)
        return idle

    def expected(self, channel: int, pos: int, t: int) -> tuple[int, RingStep] | None:
        """(collective index, message) at absolute connection step ``t``, or None (no message)."""
        hit = self._at_step(channel, pos, t)
        return None if hit is None else hit[:2]

    def _at_step(self, channel: int, pos: int, t: int) -> tuple[int, RingStep, int] | None:
        """``expected`` and the connection message number of that message, from one plan lookup."""
        tr = self.tracks.get((channel, pos)) or self.track(channel, pos)
        if not (tr.t_end > t or self._extend(tr, t=t)):  # (_extend does nothing once t is tabulated)
            return None
        i = bisect.bisect_right(tr.t0, t) - 1  # on the list itself: no array of every collective per send
        while i >= 0 and tr.n[i] == 0:
            i -= 1
        if i < 0:  # before the first collective, or one dropped long ago
            return None
        hit = self._coll(tr.base + i)[2].message_at(pos, channel, t - tr.t0[i])
        return None if hit is None else (tr.base + i, hit[1], tr.m0[i] + hit[0])

    def by_message(self, channel: int, pos: int, m: int) -> tuple[int, RingStep, int] | None:
        """(collective, message, absolute step) of the connection's message number ``m``."""
        tr = self.track(channel, pos)
        if not self._extend(tr, m=m):
            return None
        i = bisect.bisect_right(tr.m0, m) - 1
        while i >= 0 and tr.n[i] == 0:
            i -= 1
        if i < 0 or m - tr.m0[i] >= tr.n[i]:
            return None
        st = self._coll(tr.base + i)[2].messages(pos, channel)[m - tr.m0[i]]
        return tr.base + i, st, tr.t0[i] + st.conn_step

    def collective_steps(self, channel: int, pos: int, coll: int) -> tuple[int, int]:
        """(first connection step, messages) of collective ``coll`` on a connection."""
        tr = self.track(channel, pos)
        if not self._extend(tr, coll=coll) or coll < tr.base:
            return 0, 0
        return tr.t0[coll - tr.base], tr.n[coll - tr.base]

    def message_number(self, channel: int, pos: int, coll: int, st: RingStep) -> int | None:
        """The connection's message number of message ``st`` of collective ``coll`` (None: dropped)."""
        tr = self.track(channel, pos)
        if not self._extend(tr, coll=coll) or coll < tr.base:
            return None
        return tr.m0[coll - tr.base] + self._coll(coll)[2].message_index(pos, channel, st.conn_step)

    # -- placing sends ---------------------------------------------------------------------------

    def where(self, conn: ConnKey) -> tuple[int, int] | None:
        """(channel, ring position of the sender) of a ring connection, None for other traffic."""
        ch = self.channels.get(conn)
        got = self._where.get(conn)
        if got is not None and got[0] == ch:  # a connection is mapped once; checked all the same
            return got
        rank = self.ranks.get(conn.sender)
        if ch is None or rank is None:
            return None
        pos = self._pos.get((ch, rank))
        if pos is None:  # ring orders are fixed: each (channel, rank) looked up once
            pos = self._pos[(ch, rank)] = self.model.ring.ring_index(ch, rank)
        got = self._where[conn] = (ch, pos)
        return got

    def place(self, s: NcclSend) -> Placement | None:
        if s.form == "malformed":  # a length its protocol cannot have (a piece cut off by loss)
            self.counts["unplaced_malformed"] += 1
            return None
        loc = self.where(s.connection)
        if loc is None:
            self.counts["not_ring"] += 1
            return None
        ch, pos = loc
        # Per stream: the same link seen by two mirror streams (one rank's egress is the next one's
        # ingress) delivers each send twice, and "the message after the last one" is per copy.
        key = (s.stream, s.connection)
        last = self.last.get(key)
        t = m = None
        if s.flag is not None:
            t = self._unwrap_flag(s.flag - 1, last[0] if last else 0)
        elif s.seq is not None:
            m = s.seq - 1  # one CTS per message: its index counts the connection's messages
        by_psn = t is None and m is None
        if by_psn:
            if not s.length_known:
                # Neither flag, CTS nor size to confirm it: maybe several messages run together
                # after a loss. Its bytes are lost, never placed by guess.
                self.counts["unplaced_unconfirmed"] += 1
                return None
            m = self._next_on_qp(s, ch, pos)
            if m is None:
                return None
        if t is not None:
            if last is not None and t > last[0] + MAX_AHEAD_STEPS:
                self.counts["unplaced_implausible_step"] += 1
                return None
            hit = self._at_step(ch, pos, t)
            if hit is None:
                self.counts["unplaced_no_message_at_step"] += 1
                return None
            coll, st, m = hit
        else:
            hit = self.by_message(ch, pos, m)
            if hit is None:
                self.counts["unplaced_past_end"] += 1
                return None
            coll, st, t = hit
        spec, proto, _ = self._coll(coll)
        if by_psn and not self._slot_agrees(s, proto, spec.kind, t):
            self.counts["unplaced_slot"] += 1
            return None
        if s.protocol is not None and s.protocol != proto and s.nbytes:
            # e.g. an LL message whose lines were read as raw bytes: never data of this collective
            self.counts["protocol_mismatch"] += 1
            return None
        if s.length_known and s.wire_bytes != st.wire_bytes:
            self.counts["mismatch"] += 1
            if len(self.mismatches) < 20:
                self.mismatches.append(
                    f"{s.connection} step {t}: {s.wire_bytes} wire bytes, but the configuration expects "
                    f"{st.wire_bytes} ({spec.label} #{coll}, {st.phase} chunk {st.chunk})")
            return None
        self.last[key] = (t, m) if last is None or t >= last[0] else last
        self._advance(s, m, t, proto)
        self.counts["placed"] += 1
        return Placement(coll, spec, st, ch, pos, s, t)

    # -- the message after the last one, proven by PSNs -----------------------------------------

    def _next_on_qp(self, s: NcclSend, ch: int, pos: int) -> int | None:
        """Connection message number of a flagless, CTS-less send: the planned messages between the
        last send placed on its QP and it must use exactly the PSNs between them."""
        if s.psn is None:
            self.counts["unplaced_unconfirmed"] += 1
            return None
        # Several QPs: a message cut over them has a piece on every QP; whole messages go to QP
        # ``m mod nqps`` (nccl_versions.data_qp), so a QP carries every nqps-th message.
        stride = 1 if s.cut or s.nqps == 1 else s.nqps
        cur = self._anchor(s)
        if cur is not None:
            m, end = cur.m + stride, cur.end
        elif self.model.from_start:
            # a capture that starts with the job: NCCL's first PSN is 0
            m, end = (0 if stride == 1 else s.qp_index), 0
        else:
            self.counts["unplaced_no_step"] += 1
            return None
        gap = s.psn - end
        split = (s.stream, s.qp) in self.split_qps
        for _ in range(MAX_GAP_MESSAGES):
            if gap <= 0 or not s.pmtu:
                break
            hit = self.by_message(ch, pos, m)
            if hit is None:
                break
            w = hit[1].wire_bytes
            if s.cut:  # this QP's piece of it
                k = nccl_versions.qp_piece_bytes(w, s.nqps)
                nb = max(0, min(k, w - s.qp_index * k))
            else:
                nb = w
            gap -= max(1, -(-nb // s.pmtu)) + (1 if split and w > AR_THRESHOLD else 0)
            m += stride
        if gap:
            self.counts["unplaced_psn_gap"] += 1
            return None
        return m

    def _anchor(self, s: NcclSend) -> _Cursor | None:
        """The send placed on ``s``'s QP that ends last at or before ``s`` begins (sends of a QP
        can come out of order: a message cut over QPs waits for its slowest piece)."""
        got = self.cursors.get((s.stream, s.qp))
        if not got:
            return None
        k = bisect.bisect_right(got, s.psn, key=lambda c: c.end) - 1
        return got[k] if k >= 0 else None

    def _slot_agrees(self, s: NcclSend, proto: str, kind: str, t: int) -> bool:
        """A flagless send's receive address against the last one placed on its QP in the same
        protocol's buffer: NCCL writes step t into slot t mod 8."""
        cur = self._anchor(s)
        v = self.model.ring.nccl_version
        if cur is None or cur.va is None or s.va is None or cur.proto != proto or not v:
            return True
        return s.va - cur.va == (schedule.recv_slot(t, proto, kind, v).offset
                                 - schedule.recv_slot(cur.t, proto, kind, v).offset)

    def _advance(self, s: NcclSend, m: int, t: int, proto: str) -> None:
        if s.form == "split":
            self.split_qps.add((s.stream, s.qp))
        if s.psn is None or s.qp is None:
            return
        if not s.pieces:  # the usual case, without the loop below: one QP, its newest send
            got = self.cursors.get((s.stream, s.qp))
            end = s.psn + s.npkts
            if got and got[-1].end < end:
                got.append(_Cursor(m, t, end, s.va, proto))
                if len(got) > MAX_ANCHORS:
                    del got[0]
                return
        # A message cut over the QPs anchors each QP it has a piece on (a piece sent on alone: its own).
        for qp, psn, npkts in s.pieces or ((s.qp, s.psn, s.npkts),):
            got = self.cursors.setdefault((s.stream, qp), [])
            c = _Cursor(m, t, psn + npkts, s.va, proto)
            if not got or got[-1].end < c.end:  # the usual case: the QP's newest send, in PSN order
                got.append(c)
            else:
                k = bisect.bisect_right(got, c.end, key=lambda x: x.end)
                if k and got[k - 1].end == c.end:
                    continue  # placed once already (a copy)
                got.insert(k, c)
            if len(got) > MAX_ANCHORS:
                del got[0]

    @staticmethod
    def _unwrap_flag(t32: int, ref: int) -> int:
        """LL flags are 32-bit: the step nearest the connection's last one."""
        half = 1 << 31
        return ref + ((t32 - ref + half) % (1 << 32)) - half
