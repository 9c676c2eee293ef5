"""NCCL sends from RDMA WRITE messages: CTS pairing, the split (adaptive-routing) form, protocols.

One NCCL connection (sender S -> receiver R, one channel) is one RC QP pair: data flows S -> R,
and R posts "clear to send" (CTS) FIFO entries R -> S on the same pair; both directions use
the same UDP source port, which is what pairs them here (``ConnKey``). A send is one RDMA WRITE
WITH IMMEDIATE (immediate = size), or in the split form a bulk WRITE without immediate closed by
a 0-byte WRITE WITH IMMEDIATE at VA 0. The k-th CTS of a connection announces the buffer of its
k-th send, which gives the send number (``seq``) and slot when the receiver's egress is mirrored;
LL and LL128 sends also carry their connection step in every line's flag.

With NCCL_IB_QPS_PER_CONNECTION > 1 a connection has several QP pairs, each with its own UDP port,
and the CTS uses QP 0 only. Their WRITEs land in the same receive buffers, so they carry the same
rkeys (a buffer's registration is the connection's alone): QPs are joined into one connection by
the rkeys they write with (and a CTS by the rkey it announces), and numbered by QP number (the
receiver creates them one after the other). Cut messages (<= 2.19, or NCCL_IB_SPLIT_DATA_ON_QPS=1)
come back as one piece per QP at ``addr + i·piece`` with the full size as immediate. Pieces are
joined only when their PSNs prove them one message: NCCL starts every QP at PSN 0 and posts the
pieces of each message on every QP in message order, so the k-th piece of every QP belongs to the
connection's k-th message. A piece's number on its QP is proven by PSN 0, by following on the PSN
after its QP's last proven piece, or by a PSN gap that exactly the pieces of the messages in
between (sizes known from the other QPs) fill; nothing else (equal sizes, equal slots) joins
pieces. A piece whose number is not proven goes out alone, its message's other bytes holes, for
the state machine to place by its flag or by its QP's PSNs against the plan; a joined message
missing a piece has that piece as a hole. Whole messages round robin (2.20+) need no joining.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.errors import VersionMismatch
from mirrorckpt.parser.headers import LL128_FLAG_OFFSET, LL128_GROUP_WIRE, LL128_LINE_BYTES, LL_LINE_BYTES
from mirrorckpt.parser.roce import _cts, nccl_versions, protocols
from mirrorckpt.parser.roce.nccl_runs import RunLane, cts_fits, cts_plausible, cts_sized
from mirrorckpt.parser.roce.reassembly import MessageRun, QpKey, RdmaMessage
from mirrorckpt.parser.roce.sends import ConnKey, Cts, LazySend, NcclSend, SendBlock  # noqa: F401 (LazySend: importable here)

nv_piece = nccl_versions.qp_piece_bytes
# Messages of a cut connection held open for their missing pieces; past it the oldest goes out with holes
# (reassembly holds a QP's messages behind a lossy one for up to its PSN window, 1024 PSNs by default).
MAX_OPEN_CUT = 1024

# Unmatched CTS posts kept per connection (NcclDecoder._post): per receive address (a real capture
# had 20 posts queued at one address when its send came), and addresses.
CTS_KEPT_PER_ADDR = 64
CTS_ADDRS_KEPT = 256
# Sends held per connection until it shows NCCL (NcclDecoder._vouch); older ones are not NCCL's.
UNPROVEN_KEPT = 64


@dataclass
class _Conn:
    key: ConnKey
    cts: dict[int, tuple] = field(default_factory=dict)  # idx -> a post not yet taken (Cts's fields)
    by_addr: dict[int, list[int]] = field(default_factory=dict)  # addr -> unmatched idx, in order
    tags: set[int] = field(default_factory=set)  # every CTS post's tag (the data sender's rank)
    # per QP: split-form pieces awaiting their close
    bulks: dict[QpKey, list[RdmaMessage]] = field(default_factory=dict)
    protocol: str | None = None
    split_seen: bool = False  # the connection has used the split (adaptive-routing) form
    # messages cut over the QPs, by their proven number on the connection (0: the first)
    cut: dict[int, dict[QpKey, _Piece]] = field(default_factory=dict)  # number -> QP -> piece
    cut_size: dict[int, int] = field(default_factory=dict)  # number -> message size (immediate)
    # QP -> (number, end PSN) of its last proven piece
    chain: dict[QpKey, tuple[int, int]] = field(default_factory=dict)
    broken: set[QpKey] = field(default_factory=set)  # QPs whose latest piece was not proven
    nq: int = 0  # QPs proven to be all of the connection's (0: not yet; pieces wait)
    qp_low: int = 0  # the lowest QP number when they were proven
    cut_done: set[int] = field(default_factory=set)  # numbers already sent on (never joined twice)
    qp_mode: str | None = None  # several QPs: "cut" (each message over all) or "whole"; None: undecided
    held: list = field(default_factory=list)  # WRITE sequences waiting for the mode to be decided
    nccl: bool = False  # the connection has shown NCCL (a CTS post, or a send that proves it: _proof)
    unproven: list = field(default_factory=list)  # its sends before that, held (at most UNPROVEN_KEPT)


@dataclass
class _Group:
    """The QPs of one connection (several with NCCL_IB_QPS_PER_CONNECTION > 1)."""

    key: ConnKey
    qps: set[QpKey] = field(default_factory=set)
    order: int = 0  # creation order: of two groups found to be one, the older keeps its key

    def index(self, qp: QpKey) -> int:
        return sorted(q.dqp for q in self.qps).index(qp.dqp) if qp in self.qps else 0


@dataclass
class _Piece:
    """One QP's part of a message cut over the QPs: its bytes as that QP's WRITEs gave them."""

    data: np.ndarray
    holes: list
    msgs: list
    length_known: bool
    split: bool  # closed by the adaptive-routing form
    size: int = 0  # its message's size (the immediate)
    va: int = 0  # its own address

    @property
    def psn(self) -> int:
        return self.msgs[0].psn

    @property
    def npkts(self) -> int:
        return sum(m.npkts for m in self.msgs)


class NcclDecoder(RunLane):
    """Turns RDMA messages (any QP, any order across QPs) into NCCL sends, per connection."""

    def __init__(self, version: str | None = None, protocol: str | None = None, p2p_protocol: str = "Simple",
                 stream: int = 0, blocks: bool = False):
        """``version``: the NCCL release if stated (the wire must agree); None: read from the wire
        (CTS layout, immediate byte order: ``family``). ``blocks``: the run lane's sends whose bytes
        stay in the batch come as ``SendBlock``s (columns), not one ``LazySend`` each, for a reader
        that places them with ``RingPlacer`` (``sends.flat`` makes them objects)."""
        self.stream = stream
        self.blocks = blocks
        self.version = nccl_versions.version(version) if version else None
        self.cts_header = nccl_versions.cts_header(self.version) if self.version else None
        self.imm_order = nccl_versions.imm_byte_order(self.version) if self.version else None
        self.seen_cts: nccl_versions.Header | None = None  # layout of the CTS posts seen
        self.seen_imm: str | None = None  # byte order shown by an immediate equal to its message's length
        self.protocol = protocol  # None: decided per send from its content
        self.p2p_protocol = p2p_protocol
        self.conns: dict[ConnKey, _Conn] = {}
        self.cts_posts = 0
        self.orphan_bulk = 0  # split-form pieces whose closing immediate never came
        self.malformed_sends = 0  # sends whose length their protocol cannot have: all holes
        self.pmtu: dict[QpKey, int] = {}  # per QP: path MTU shown by its messages
        self.pmtu_exact: set[QpKey] = set()  # QPs whose PMTU a message of several packets proved
        self._qp_group: dict[QpKey, _Group] = {}
        self._rkey_group: dict[tuple[bytes, bytes, int], _Group] = {}
        self.cut_pieces = 0  # pieces of messages cut over several QPs
        self.lone_pieces = 0  # of them, sent on alone: their message number not proven by PSNs
        self.malformed_pieces = 0  # WRITE sequences of a cut connection that fit no piece: all holes
        self.lost_pieces = 0  # pieces whose message or place was never proven: dropped (holes)
        self.merged_tails = 0  # sends recovered from the end of messages run together by loss
        # WRITE sequences of connections that never showed NCCL (an RDMA application's WRITEs that no
        # immediate equal to their length, CTS post, split-form close or LL/LL128 line flag claims)
        self.not_nccl = 0
        self.proofs: Counter = Counter()  # what each connection first showed of NCCL (_proof)
        self._layouts: dict = {}  # CTS layouts to try, by the one known first

    def _conn(self, key: ConnKey) -> _Conn:
        c = self.conns.get(key)
        if c is None:
            c = self.conns[key] = _Conn(key)
        return c

    def feed(self, messages: list) -> list[NcclSend]:
        """The sends completed by ``messages`` (RdmaMessage, or MessageRun: see nccl_runs)."""
        if messages and all(type(m) is MessageRun for m in messages):
            out = self.take_runs(messages)
            if out is not None:
                return self._vouch(out)
        if any(type(m) is MessageRun for m in messages):
            messages = [x for m in messages for x in (m.messages() if type(m) is MessageRun else (m,))]
        # CTS first: a receiver posts it before the data it announces, whatever the QP order.
        data_msgs = []
        for m in messages:
            self._learn_pmtu(m)
            if not self._take_cts(m):
                data_msgs.append(m)
        # QPs are joined before any of them is decoded: a connection's first messages on its
        # several QPs usually come in one batch. In time order, so the first QP seen names it.
        data_msgs.sort(key=lambda m: (m.ts_ns, m.qp.dqp))
        for m in data_msgs:
            self._link(m)
        out = []
        for m in data_msgs:
            out += self._data(m)
        return self._vouch(out)

    def _vouch(self, sends: list[NcclSend]) -> list[NcclSend]:
        """The sends of connections that have shown NCCL; a connection's sends before it does are
        held (copies, at most UNPROVEN_KEPT) and go out ahead of the send that proves it. A WRITE is
        no NCCL send by itself: RDMA applications write too."""
        if any(type(s) is SendBlock for s in sends):
            # a block whose connections have all shown NCCL, with nothing held, goes as it is
            sends = [x for s in sends for x in (
                (s,) if type(s) is not SendBlock or all(self.conns[k].nccl and not self.conns[k].unproven
                                                          for k in set(s.conns)) else s.sends())]
        out = []
        for s in sends:
            if type(s) is SendBlock:
                out.append(s)
                continue
            conn = self.conns[s.connection]
            if not conn.nccl:
                why = _proof(s)
                if why is None:
                    conn.unproven.append(s.keep())
                    if len(conn.unproven) > UNPROVEN_KEPT:
                        conn.unproven.pop(0)
                        self.not_nccl += 1
                    continue
                self._proven(conn, why)
            if conn.unproven:
                out += conn.unproven
                conn.unproven = []
            out.append(s)
        return out

    def _proven(self, conn: _Conn, why: str) -> None:
        if not conn.nccl:
            conn.nccl = True
            self.proofs[why] += 1

    def flush(self) -> list[NcclSend]:
        """Split-form pieces never closed become incomplete sends of unknown size; messages cut
        over QPs that still miss pieces go out with those pieces as holes."""
        out = []
        for c in list(self.conns.values()):
            for qp in list(c.bulks):
                if c.bulks[qp]:
                    out += self._piece_or_send(c, *self._join(c, qp, None))
            g = self._qp_group.get(next(iter(c.cut[min(c.cut)].values())).msgs[0].qp) if c.cut else None
            for k in sorted(c.cut):
                if c.nq:
                    out += self._emit_cut(c, g, k)
                elif c.nccl:
                    self.lost_pieces += len(c.cut.pop(k))
                else:  # WRITEs shorter than their immediate on a connection that never showed NCCL
                    self.not_nccl += len(c.cut.pop(k))
            out += [self._make(c, *a) for a in c.held]
            c.held = []
        out = self._vouch(out)
        for c in self.conns.values():  # never shown NCCL: not NCCL's
            self.not_nccl += len(c.unproven)
            c.unproven = []
        return out

    # -- connections of several QPs ----------------------------------------------------------------

    def _group_for(self, sender: bytes, receiver: bytes, rkey: int | None, qp: QpKey | None, key: ConnKey) -> _Group:
        """The connection of ``qp`` / of buffer ``rkey``; groups found to be one are merged."""
        g = self._qp_group.get(qp) if qp is not None else None
        rk = (sender, receiver, rkey) if rkey else None
        h = self._rkey_group.get(rk) if rk is not None else None
        if g is None and h is None:
            g = _Group(key, order=len(self._rkey_group) + len(self._qp_group))
        elif g is None:
            g = h
        elif h is not None and h is not g:
            old, new = (g, h) if g.order <= h.order else (h, g)
            for q in new.qps:
                self._qp_group[q] = old
            old.qps |= new.qps
            for k, v in self._rkey_group.items():
                if v is new:
                    self._rkey_group[k] = old
            g = old
        if qp is not None:
            g.qps.add(qp)
            self._qp_group[qp] = g
        if rk is not None:
            self._rkey_group[rk] = g
        return g

    def qps_by_connection(self) -> dict[ConnKey, int]:
        """Data QPs seen per connection (QPs joined by the rkeys their WRITEs target)."""
        return {g.key: len(g.qps) for g in {id(g): g for g in self._qp_group.values()}.values()}

    def _link(self, m: RdmaMessage) -> None:
        g = self._qp_group.get(m.qp)
        if g is not None and (not m.rkey or self._rkey_group.get((m.qp.src, m.qp.dst, m.rkey)) is g):
            return  # already joined (every message after a QP's first): nothing to merge or record
        self._group_for(m.qp.src, m.qp.dst, m.rkey, m.qp, ConnKey(m.qp.src, m.qp.dst, m.sport))

    def _piece_or_send(self, c: _Conn, data, holes, msgs, size, va, form, length_known) -> list[NcclSend]:
        """A WRITE sequence of one QP: a whole send, or one QP's piece of a message cut over the
        QPs. Which of the two a connection of several QPs does shows in its first message bigger
        than a piece (whole on one QP), or its first piece shorter than its immediate (cut); small
        and empty messages before that are held."""
        g = self._qp_group.get(msgs[0].qp) if msgs else None
        args = (data, holes, msgs, size, va, form, length_known)
        # Shorter than its immediate: a piece of a message cut over QPs whose others are not seen yet
        # (one QP's WRITE is never a whole send then, whatever the QPs seen so far).
        short = size is not None and length_known and len(data) < size
        if g is None or (len(g.qps) == 1 and not short and c.qp_mode != "cut"):
            return [self._make(c, *args)]
        if c.qp_mode is None:
            c.qp_mode = _qp_mode(len(g.qps), data, size, length_known)
            if c.qp_mode is None:
                c.held.append(args)
                return []
            out = []
            for a in c.held:
                out += self._route(c, g, *a)
            c.held = []
            return out + self._route(c, g, *args)
        return self._route(c, g, *args)

    def _route(self, c: _Conn, g: _Group, data, holes, msgs, size, va, form, length_known) -> list[NcclSend]:
        if c.qp_mode == "cut":
            if size is not None and va is not None and length_known and len(data) <= size:
                return self._add_piece(c, g, size, va, _Piece(data, holes, msgs, length_known, form == "split"))
            # Longer than its immediate, or of unknown length (lost boundaries ran pieces together, or
            # cut one short): neither its message nor its place in it is known, so nothing of it is
            # placed. Never a whole send: its length would contradict every plan.
            self.malformed_pieces += 1
            n_wire = size if size is not None and length_known else len(data)
            s = self._make(c, np.zeros(n_wire, np.uint8), [(0, n_wire)] if n_wire else [], msgs, size, None,
                           form, False)
            s.form, s.cut, s.qp_index, s.nqps = "malformed", True, g.index(msgs[0].qp), len(g.qps)
            return [s]
        return [self._make(c, data, holes, msgs, size, va, form, length_known)]

    def _number(self, c: _Conn, g: _Group, qp: QpKey, p: _Piece) -> int | None:
        """The connection message number of ``qp``'s piece ``p``, when its PSNs prove it: PSN 0 (NCCL's
        first on every QP) is message 0; the PSN after the QP's last proven piece (or 0) is the message
        after it; a gap is the pieces of the messages in between, each ceil(piece / PMTU) PSNs (1 when
        empty), whose sizes must be known from other QPs' proven pieces, and they must fill it exactly
        (piece sizes by the QP's rank among those seen: ``_settle`` then checks that they are all).
        Else None: a piece after a whole message of unknown size lost, or a capture started late."""
        k, end = c.chain.get(qp, (-1, 0))
        if p.psn == end:
            return k + 1
        if p.psn < end or c.split_seen or qp not in self.pmtu_exact:
            return None
        pmtu, n, gap = self.pmtu[qp], c.nq or len(g.qps), p.psn - end
        k += 1
        while gap > 0:
            size, i = c.cut_size.get(k), self._piece_index(g, qp, k)
            if size is None or i is None:
                return None
            chunk = nv_piece(size, n)
            gap -= max(1, -(-max(0, min(chunk, size - i * chunk)) // pmtu))
            k += 1
        return k if gap == 0 else None

    def _add_piece(self, c: _Conn, g: _Group, size: int, va: int, p: _Piece) -> list[NcclSend]:
        """Joins a piece into its message when its number is proven (``_number``), else sends it on alone."""
        self.cut_pieces += 1
        qp = p.msgs[0].qp
        p.size, p.va = size, va
        k = self._number(c, g, qp, p)
        if k is not None and (c.cut_size.get(k, size) != size or qp in c.cut.get(k, ())):
            k = None  # the PSNs say message k, its size says otherwise: nothing is proven
        if k is None:
            c.broken.add(qp)
            return self._lone(c, g, p)
        c.chain[qp] = (k, p.psn + p.npkts)
        c.broken.discard(qp)
        if k in c.cut_done:  # its message already went out (held too long): this piece fills its own bytes
            return self._lone(c, g, p)
        c.cut_size[k] = size
        c.cut.setdefault(k, {})[qp] = p
        if c.nq and min(q.dqp for q in g.qps) < c.qp_low:
            c.nq = 0  # a QP below those proven: the pieces' places are unknown again
        if not c.nq:
            self._settle(c, g)
        out = []
        if c.nq:
            # Every QP posts its pieces in message order: a message is done once each QP has given its
            # piece, moved on past it, or lost its count (its pieces then go on alone).
            for j in sorted(c.cut):
                have = c.cut[j]
                if all(q in have or q in c.broken or c.chain.get(q, (-1,))[0] > j for q in g.qps):
                    out += self._emit_cut(c, g, j)
        while len(c.cut) > MAX_OPEN_CUT:
            j = min(c.cut)
            if c.nq:
                out += self._emit_cut(c, g, j)
            else:
                self.lost_pieces += len(c.cut.pop(j))
                c.cut_done.add(j)
        return out

    def _settle(self, c: _Conn, g: _Group) -> None:
        """The connection's QPs are proven all there once one message has a piece on each and they tile
        it: in QP-number order, piece i is ``qp_piece_bytes`` long at ``addr + i·piece``. A QP never
        seen would leave a gap (piece 0 is never empty), so a piece's index is then its QP's rank."""
        n = len(g.qps)
        for k in sorted(c.cut):
            got, size = c.cut[k], c.cut_size[k]
            if len(got) != n or not size:
                continue
            where = {q: self._place_ok(g, p, k) for q, p in got.items()}
            if all(w is not None for w in where.values()) and len({w[1] for w in where.values()}) == 1 \
                    and len({w[0] for w in where.values()}) == n:
                c.nq, c.qp_low = n, min(q.dqp for q in got)
                return

    def _piece_index(self, g: _Group, qp: QpKey, k: int | None) -> int | None:
        """Which piece of message ``k`` (None: its number unknown) ``qp`` carries, or None when that is
        not known: piece i goes on the QP of rank i, except in 2.29, where it rotates by the message
        number (``nccl_versions.data_qp``). Without a stated release, big-endian immediates (2.29 or
        2.30, which the wire does not tell apart) leave it unknown."""
        n, j = len(g.qps), g.index(qp)
        v = self.version
        if v is None:
            return None if (self.imm_order or self.seen_imm) == "big" else j
        if k is None:
            return j if all(nccl_versions.data_qp(v, True, n, m, 0) == 0 for m in range(n)) else None
        return next((i for i in range(n) if nccl_versions.data_qp(v, True, n, k, i) == j), None)

    def _place_ok(self, g: _Group, p: _Piece, k: int | None) -> tuple[int, int] | None:
        """(piece index, slot address) of a piece of message ``k``, when its length fits that place."""
        n, i = len(g.qps), self._piece_index(g, p.msgs[0].qp, k)
        if i is None:
            return None
        chunk = nv_piece(p.size, n)
        if len(p.data) != max(0, min(chunk, p.size - i * chunk)):
            return None
        return i, p.va - i * chunk

    def _emit_cut(self, c: _Conn, g: _Group, k: int) -> list[NcclSend]:
        """Message ``k`` from its pieces; a missing piece's bytes are holes. A piece that does not fit
        its QP's place is a hole too; pieces that disagree on the slot address are all dropped."""
        got = c.cut.pop(k)
        size = c.cut_size[k]
        c.cut_done.add(k)
        if len(c.cut_done) > 4 * MAX_OPEN_CUT:  # numbers far behind: only kept against joining twice
            floor = max(c.cut_done) - 2 * MAX_OPEN_CUT
            c.cut_done = {x for x in c.cut_done if x >= floor}
            c.cut_size = {x: v for x, v in c.cut_size.items() if x >= floor}
        placed = {}
        bases = set()
        for p in got.values():
            where = self._place_ok(g, p, k)
            if where is None:
                self.malformed_pieces += 1
                continue
            placed[where[0]] = p
            bases.add(where[1])
        if len(bases) != 1:
            self.lost_pieces += len(got)
            return []
        return [self._cut_send(c, g, placed, size, bases.pop())]

    def _lone(self, c: _Conn, g: _Group, p: _Piece) -> list[NcclSend]:
        where = self._place_ok(g, p, None) if c.nq else None
        if where is None:
            if c.nccl:
                self.lost_pieces += 1
            else:  # a WRITE shorter than its immediate where nothing shows NCCL: an application's
                self.not_nccl += 1
            return []
        self.lone_pieces += 1
        s = self._cut_send(c, g, {where[0]: p}, p.size, where[1])
        s.lone_piece = True
        return [s]

    def _cut_send(self, c: _Conn, g: _Group, got: dict[int, _Piece], size: int, addr: int) -> NcclSend:
        n = len(g.qps)
        chunk = nv_piece(size, n)
        data = np.zeros(size, np.uint8)
        holes, msgs, known, split = [], [], True, False
        for i in range(n):
            lo, hi = i * chunk, min(size, (i + 1) * chunk)
            p = got.get(i)
            if p is None:
                if hi > lo:
                    holes.append((lo, hi - lo))
                continue
            data[lo:lo + len(p.data)] = p.data
            holes += [(lo + a, k) for a, k in p.holes]
            msgs += p.msgs
            known &= p.length_known
            split |= p.split
        holes.sort()
        i0 = min(got)  # the QP whose PSNs place the send: the first piece that came
        s = self._make(c, data, holes, got[i0].msgs, size, addr, "split" if split else "normal", known)
        s.ts_ns = min(m.ts_ns for m in msgs)
        s.qp_index, s.nqps, s.cut = i0, n, True
        s.pieces = tuple((p.msgs[0].qp, p.psn, p.npkts) for _, p in sorted(got.items()))
        return s

    def _learn_pmtu(self, m: RdmaMessage) -> None:
        """Every packet but a message's last carries one PMTU (a power of two), so a message of L
        bytes in n >= 2 packets shows it as the power of two at or above L/n; a one-packet message
        only bounds it from below. The largest value seen is kept."""
        if m.dlen and m.length_known and m.npkts:
            self._pmtu_seen(m.qp, -(-m.dlen // m.npkts), m.npkts >= 2)

    def _pmtu_seen(self, qp: QpKey, per: int, several: bool) -> None:
        """A message of ``per`` bytes a packet (length over packets, rounded up) on ``qp``;
        ``several``: in two packets or more."""
        p = 1 << (per - 1).bit_length()
        if p > self.pmtu.get(qp, 0):
            self.pmtu[qp] = p
        if several:  # (n-1)·PMTU < L <= n·PMTU: L/n is above PMTU/2, so p is the PMTU
            self.pmtu_exact.add(qp)

    # -- CTS -----------------------------------------------------------------------------------

    @property
    def family(self) -> nccl_versions.WireFamily:
        """What this stream's traffic showed about the NCCL release."""
        return nccl_versions.WireFamily(self.seen_cts, self.seen_imm)

    def cut_connections(self) -> list:
        """Connections that cut messages over several QPs and whose QP set no message proved yet
        (``nq``): with a port split over workers, such a connection's other QPs are elsewhere."""
        return [c.key for c in self.conns.values() if c.qp_mode == "cut" and not c.nq and len(c.cut) >= 2]

    def _take_cts(self, m: RdmaMessage) -> bool:
        if m.with_imm or m.dlen is None or not cts_sized(m.dlen) or not m.complete:
            return False
        first = self.cts_header or self.seen_cts
        layouts = self._layouts.get(first)
        if layouts is None:  # the known layout first, then the others (built once per first layout)
            layouts = [first] if first else []
            layouts += [h for h, _, _ in nccl_versions.CTS_LAYOUTS if h not in layouts]
            self._layouts[first] = layouts
        for h in layouts:
            e = _cts_entry(h, m)
            if e is not None:
                break
        else:
            return False
        if h is not self.seen_cts:
            if self.seen_cts is not None or (self.cts_header is not None and h is not self.cts_header):
                self._contradiction(f"a CTS post in the {h.name} layout ({address_text(m.qp.src)}->"
                                    f"{address_text(m.qp.dst)} idx {int(e['idx'])})",
                                    nccl_versions.WireFamily(h, None))
            self.seen_cts = h
        rkey = int(e["rkey"])
        g = (self._rkey_group.get((m.qp.dst, m.qp.src, rkey)) if rkey else None) \
            or self._group_for(m.qp.dst, m.qp.src, rkey, None, ConnKey(m.qp.dst, m.qp.src, m.sport))
        conn = self._conn(g.key)
        self._post(conn, (int(e["idx"]), int(e["addr"]), int(e["size"]), int(e["rkey"]), int(e["nreqs"]),
                          int(e["tag"])))
        self.cts_posts += 1
        return True

    def _post(self, conn: _Conn, post: tuple) -> None:
        """Keeps a CTS post (``Cts``'s fields, made a ``Cts`` only if taken) until a send to its
        address takes it (``_match_cts``). An egress-only mirror shows a connection's posts and its
        data in different streams (they go opposite ways), so most posts are never taken: the
        newest are kept per address and a bounded number of addresses, the oldest going first
        (``_cts.post``; the run lane posts a batch's with ``_cts.post_all``)."""
        _cts.post(self, conn, post, CTS_ADDRS_KEPT, CTS_KEPT_PER_ADDR)

    def _post_all(self, conns: dict, posts: list) -> None:
        """``_post`` of each of ``posts`` in turn, on the connection of its rkey (``conns``)."""
        _cts.post_all(self, conns, posts, CTS_ADDRS_KEPT, CTS_KEPT_PER_ADDR)

    def _match_cts(self, c: _Conn, va: int | None) -> Cts | None:
        if va is None:
            return None
        pending = c.by_addr.get(va)
        if not pending:
            return None
        post = c.cts.pop(pending.pop(0), None)
        return Cts(*post) if post is not None else None

    # -- data ----------------------------------------------------------------------------------

    def _data(self, m: RdmaMessage) -> list[NcclSend]:
        g = self._qp_group[m.qp]
        c = self._conn(g.key)
        bulk = c.bulks.setdefault(m.qp, [])
        out = []
        # A bulk piece of the split form: closed without immediate, or (its closing packet lost)
        # on a connection that uses the split form, with a known VA. A message that lost its
        # closing packet anywhere else is a send of its own: joining it to its neighbour could
        # run two sends together.
        piece = m.with_imm is False or (m.with_imm is None and m.va is not None and c.split_seen)
        if piece:
            if bulk and not self._continues(bulk, m):
                out += self._piece_or_send(c, *self._join(c, m.qp, None))
            c.bulks[m.qp].append(m)
            return out
        size = self._imm(m, m.dlen if m.length_known and m.dlen and not bulk else None)
        if m.va == 0 and m.dlen == 0 and m.rkey == 0 and size:
            c.split_seen = True
            out += self._piece_or_send(c, *self._join(c, m.qp, m))  # the 0-byte closing WRITE of the split form
            return out
        if bulk:
            out += self._piece_or_send(c, *self._join(c, m.qp, None))
        if m.with_imm and size and m.length_known and size < len(m.data):
            tail = self._merged_tail(c, m, size)
            if tail is not None:
                out.append(tail)
                return out
        out += self._piece_or_send(c, m.data, m.holes, [m], size, m.va,
                                   "empty" if (m.dlen == 0 and not size) else "normal", m.length_known)
        return out

    def _merged_tail(self, c: _Conn, m: RdmaMessage, size: int) -> NcclSend | None:
        """The last send of a message longer than its closing immediate says. Loss of the packets
        between two sends (a FIRST and the LAST before it) makes reassembly return them as one
        message; its end is the closing packet's, and the immediate is the last send's size, so
        that send is the message's last ``size`` bytes. Only taken when its LL/LL128 lines carry
        one flag that no line before it carries (the flag then places it, and the plan checks its
        size); the part before it has no proven start and is dropped."""
        cut = len(m.data) - size
        wire = m.data[cut:]
        holes = [(max(a, cut) - cut, min(a + n, len(m.data)) - max(a, cut)) for a, n in m.holes if a + n > cut]
        proto, flag = _detect(wire, holes) if self.protocol is None else (self.protocol, None)
        if proto not in (protocols.LL, protocols.LL128):
            return None
        line = LL_LINE_BYTES if proto == protocols.LL else LL128_LINE_BYTES
        if cut % line:
            return None
        if flag is None:
            flag = _majority_flag(proto, wire, _line_mask(len(wire), line, holes))
        head_ok = _line_mask(cut, line, [(a, min(n, cut - a)) for a, n in m.holes if a < cut])
        head_flags = _flags(proto, m.data[:cut])[head_ok]
        if flag is None or (head_flags == flag).any():
            return None  # one send after all (or no flag to place it by): the immediate is what is wrong
        self.merged_tails += 1
        return self._make(c, wire, holes, [m], size, None, "normal", True, psn_known=False)

    def _contradiction(self, what: str, seen: nccl_versions.WireFamily) -> None:
        """Stop on traffic that the stated version (or this stream's earlier traffic) rules out."""
        if self.version is not None:
            why = seen.contradicts(self.version)
            raise VersionMismatch(f"stream {self.stream}: {what} contradicts the stated NCCL {self.version} "
                                  f"({why}): state the right version, or none (it is read from the wire)")
        raise VersionMismatch(f"stream {self.stream}: {what} contradicts this stream's earlier traffic "
                              f"({self.family.describe()}): more than one NCCL release in one capture")

    def _imm(self, m: RdmaMessage, nbytes: int | None = None) -> int | None:
        """The immediate's size. ``nbytes`` (the message's own length, when it is the whole send)
        shows the byte order: the first immediate that equals its length under exactly one order
        decides it for the stream."""
        if m.imm_raw is None:
            return None
        if nbytes and self.seen_imm is None:
            order = nccl_versions.imm_order_of(m.imm_raw, nbytes)
            if order is not None:
                if self.imm_order is not None and order != self.imm_order:
                    self._contradiction(f"a {order}-endian immediate ({nbytes}-byte send on "
                                        f"{address_text(m.qp.src)}->{address_text(m.qp.dst)})",
                                        nccl_versions.WireFamily(None, order))
                self.seen_imm = order
        order = self.imm_order or self.seen_imm
        if order is None:
            # Undecided yet (empty sends, or sizes that read the same both ways): the order under
            # which it is a plausible size, host order when both are.
            le = nccl_versions.decode_imm_order(m.imm_raw, "little")
            be = nccl_versions.decode_imm_order(m.imm_raw, "big")
            return be if (le > 1 << 26 and be <= 1 << 26) else le
        return nccl_versions.decode_imm_order(m.imm_raw, order)

    @staticmethod
    def _continues(bulk: list[RdmaMessage], m: RdmaMessage) -> bool:
        """Pieces of one split send have consecutive PSNs and VAs."""
        last = bulk[-1]
        if m.psn != last.psn + last.npkts:
            return False
        if m.va is None or bulk[0].va is None:
            return False  # no proof that it continues: keep the sends apart
        return m.va == bulk[0].va + sum(len(p.data) for p in bulk)

    def _join(self, c: _Conn, qp: QpKey, close: RdmaMessage | None):
        """The bulk WRITEs of one QP and their closing immediate, as ``_piece_or_send``'s arguments."""
        pieces, c.bulks[qp] = c.bulks.get(qp, []), []
        known_len = close is not None and all(p.length_known and p.complete for p in pieces)
        size = self._imm(close, sum(len(p.data) for p in pieces) if known_len else None) \
            if close is not None else None
        pos = 0
        holes: list[tuple[int, int]] = []
        chunks = []
        known = close is not None
        for p in pieces:
            chunks.append(p.data)
            holes += [(pos + a, n) for a, n in p.holes]
            known = known and p.length_known
            pos += len(p.data)
        data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        if size is not None and size != len(data):
            if size > len(data):
                holes.append((len(data), size - len(data)))
                data = np.concatenate([data, np.zeros(size - len(data), np.uint8)])
            else:
                data = data[:size]
        if close is None:
            self.orphan_bulk += len(pieces)
        va = pieces[0].va if pieces else None
        return data, holes, pieces + ([close] if close is not None else []), size, va, "split", known

    def _make(self, c: _Conn, wire: np.ndarray, wire_holes, msgs, size, va, form, length_known,
              psn_known: bool = True) -> NcclSend:
        cts = self._match_cts(c, va)
        # An empty step, or one whose bytes are all lost, has nothing to tell its protocol: it
        # takes its connection's (all-zero bytes are no evidence of Simple).
        flag = None
        # The common case (no lost bytes, every line intact) in one compiled pass; else the careful path.
        # A whole message reassembly already read as intact LL (``RdmaMessage.ll``) is not read again:
        # LL is what decode_intact finds first.
        pre = msgs[0].ll if len(msgs) == 1 and wire is msgs[0].data else None
        if pre is not None and not wire_holes and self.protocol in (None, protocols.LL):
            fast = (protocols.LL, pre[0], pre[1])
        else:
            fast = protocols.decode_intact(wire, self.protocol) if len(wire) and not wire_holes else None
        if fast is not None:
            proto, user, flag = fast
            holes = []
            c.protocol = proto
        else:
            if len(wire) and sum(n for _, n in wire_holes) < len(wire):
                if self.protocol:
                    proto = self.protocol
                else:
                    proto, flag = _detect(wire, wire_holes)
                c.protocol = proto
            else:
                proto = self.protocol or c.protocol
            try:
                user, holes, flag = decode(proto, wire, wire_holes, flag)
            except ValueError:  # a length the protocol cannot have (a piece cut off by loss): all holes
                self.malformed_sends += 1
                user = np.zeros(len(wire) // protocols.unit_bytes(proto) * protocols.unit_data(proto), np.uint8)
                holes, flag = ([(0, len(user))] if len(user) else []), None
                form = "malformed"  # never placed: it proves neither its step nor its bytes
        qp = msgs[0].qp if msgs else None
        g = self._qp_group.get(qp) if qp is not None else None
        send = NcclSend(
            connection=c.key, qp=msgs[0].qp if msgs else None, protocol=proto, data=user, holes=holes,
            wire_bytes=len(wire), size=size, va=va, form=form, flag=flag,
            seq=cts.idx if cts else None, cts=cts, ts_ns=min(m.ts_ns for m in msgs) if msgs else 0,
            length_known=length_known, stream=self.stream,
            psn=msgs[0].psn if msgs and psn_known else None, npkts=sum(m.npkts for m in msgs),
            pmtu=self.pmtu.get(qp, 0), qp_index=g.index(qp) if g and len(g.qps) > 1 else 0,
            nqps=len(g.qps) if g else 1,
        )
        if not c.nccl:  # known at once: pieces decoded later in the batch count on it (_lone)
            why = _proof(send)
            if why is not None:
                self._proven(c, why)
        return send


def _proof(s: NcclSend) -> str | None:
    """What in one send shows NCCL, or None: LL/LL128 line flags, the split form's closing WRITE,
    a CTS post it answers, or (every NCCL data send ends with one: doc 2) an immediate equal to
    its length (a message cut over QPs, once joined: the whole message's)."""
    if s.protocol in (protocols.LL, protocols.LL128) and s.flag is not None:
        return "LL/LL128 line flags"
    if s.cts is not None:
        return "CTS posts"
    if s.form == "split" and s.size is not None:
        return "split-form close"
    if s.size is not None and s.length_known and s.size == s.wire_bytes:
        return "immediate equal to the length"
    return None


def _qp_mode(n: int, data, size: int | None, length_known: bool) -> str | None:
    """"cut", "whole" or None (cannot tell) from one QP's WRITE sequence on a connection of ``n``
    QPs: a cut message's pieces are at most ``qp_piece_bytes`` and carry the full size."""
    if size is None or not length_known:
        return None
    if size > len(data):
        return "cut"
    if size == len(data) and size > nv_piece(size, n):
        return "whole"
    return None


def _cts_entry(h, m: RdmaMessage):
    """The CTS entry of WRITE ``m`` read in layout ``h``, or None when it is not one: a positive size
    no larger than a Simple slice pair, a request count matching the WRITE length, a small tag (a
    rank), a running index and a buffer address (``nccl_runs.cts_fits``, ``cts_plausible``)."""
    if not cts_fits(h, m.dlen):
        return None
    e = h.unpack(m.data, 0)
    return e if cts_plausible(h, e, m.dlen) else None


def _line_mask(nbytes: int, line: int, wire_holes) -> np.ndarray:
    """Lines of ``line`` bytes untouched by any wire hole."""
    ok = np.ones(-(-nbytes // line), bool)
    for a, n in wire_holes:
        ok[a // line: -(-(a + n) // line)] = False
    return ok


def decode(proto: str, wire: np.ndarray, wire_holes,
           flag: int | None = None) -> tuple[np.ndarray, list[tuple[int, int]], int | None]:
    """User bytes, their holes (lost wire bytes and lines whose flags disagree) and the flag
    (``flag``: the one every intact line carries, when detection already found it)."""
    if proto in (protocols.SIMPLE, None) or not len(wire):
        return wire, list(wire_holes), None
    unit = LL_LINE_BYTES if proto == protocols.LL else LL128_LINE_BYTES
    if len(wire) % unit:
        # Not whole lines: the length itself is damaged; nothing in it can be trusted.
        n = protocols.data_bytes(proto, len(wire) - len(wire) % unit) if len(wire) >= unit else 0
        return np.zeros(n, np.uint8), [(0, n)] if n else [], None
    ok = _line_mask(len(wire), unit, wire_holes)
    # Flags are only trusted from lines that arrived.
    if flag is None:
        flag = _majority_flag(proto, wire, ok)
    dec = (protocols.ll_decode if proto == protocols.LL else protocols.ll128_decode)(wire, expect_flag=flag)
    dec.line_ok &= ok
    # a message none of whose lines arrived (a lost one, from its PSN gap) shows no step: the flag
    # read off its zeros (0) put it at step -1, a send of no step, and refused a protocol read
    return dec.data, dec.holes, (dec.flag if ok.any() else None)


def _flags(proto: str, wire: np.ndarray) -> np.ndarray:
    if proto == protocols.LL:
        w = wire.view("<u4").reshape(-1, 4)
        return np.where(w[:, 1] == w[:, 3], w[:, 1].astype(np.int64), -1)
    w = wire.view("<u8").reshape(-1, LL128_LINE_BYTES // 8)
    return w[:, LL128_FLAG_OFFSET // 8].astype(np.int64)


def _majority_flag(proto: str, wire: np.ndarray, ok: np.ndarray) -> int | None:
    f = _flags(proto, wire)[ok]
    f = f[f > 0]
    if not f.size:
        return None
    if (f == f[0]).all():  # the usual case: one flag in the whole message
        return int(f[0])
    vals, counts = np.unique(f, return_counts=True)
    return int(vals[np.argmax(counts)])


def detect(wire: np.ndarray, wire_holes) -> str | None:
    """Protocol from the payload. LL: every intact 16-byte line carries two equal flags, the same
    non-zero value in all lines. LL128: every intact 128-byte line carries the same non-zero u64
    flag in word 15. LL is tried first: its signature is the stricter one, while an LL message
    whose data is constant (zero gradients) repeats one u64 at every 128th byte and looks like
    LL128. Anything else is Simple."""
    return _detect(wire, wire_holes)[0]


def _detect(wire: np.ndarray, wire_holes) -> tuple[str | None, int | None]:
    """``detect`` and, for LL/LL128, the flag every intact line carries."""
    for proto, unit in ((protocols.LL, LL_LINE_BYTES), (protocols.LL128, LL128_GROUP_WIRE)):
        if len(wire) % unit:
            continue
        line = LL_LINE_BYTES if proto == protocols.LL else LL128_LINE_BYTES
        ok = _line_mask(len(wire), line, wire_holes)
        if not ok.any():
            continue
        flags = _flags(proto, wire)[ok]
        if flags[0] > 0 and (flags == flags[0]).all():
            return proto, int(flags[0])
    return (protocols.SIMPLE if len(wire) else None), None
