"""Per-QP reassembly of RDMA WRITE messages, placing every payload by its PSN.

PSNs count packets per QP and are not reset per message, so on a WRITE-only QP the messages
tile the PSN line: a message starts where the previous one ended. A FIRST packet gives its
message's start, length (RETH DMA length) and the path MTU (its own payload length); ONLY is a
one-packet message; LAST closes one. Walking the line in PSN order from a cursor therefore
places every byte, and a lost or duplicated packet only ever damages its own bytes:

* duplicates (same PSN twice, or below the cursor) are dropped and counted;
* out-of-order packets are held until the cursor reaches them;
* a message with missing packets waits until the QP has moved ``psn_window`` PSNs past its end or
  opened ``MESSAGES_PAST_A_GAP`` messages past it (or ``flush``), then is emitted incomplete with its
  holes as byte ranges;
* a message whose FIRST was lost still ends at its LAST (or just before the next FIRST/ONLY), so
  its other bytes are placed with the QP's MTU; its VA and RETH length are unknown.

Payloads are copied once into the message buffer when their message is decided within the same
batch; only packets still waiting at the end of a batch are copied into a per-QP holding slab.
With ``defer`` (batches that stay valid, read on another thread) held packets are not copied
either: batches that are slices of one buffer (a capture file's mapping) name payloads by their
place in it, so a message begun in the batch before is read from there like the rest (the
caller gives those pages back only after: ``holds_from``). And a run of messages that cannot be
LL or LL128 is not copied at all: its payload stays in the batch until its sends are read
(``MessageRun.pending``, ``nccl.LazySend``). Nor is one that may be LL128: the decoder reads each
of its sends from the packets (``read_pending``, ``protocols.ll128_intact_pieces``). Nor is a run
of LL messages whose packets the decode already read as LL (``roce.decode(ll=True)``: each
packet's flag and data words, read while its ICRC had it in cache): a message whose packets all
carry one flag is that flag's LL message, its words still in the batch's word buffer
(``MessageRun.ll_pending``); the others are read from their wire bytes as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
from mirrorckpt.capture._pack import copy_ranges
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser import _merge, memory
from mirrorckpt.parser.headers import (
    LL128_FLAG_OFFSET,
    LL128_GROUP_WIRE,
    LL128_LINE_BYTES,
    LL_DATA_PER_LINE,
    LL_LINE_BYTES,
    PSN_MODULUS,
)
from mirrorckpt.parser.roce import _place, _reasm, opcodes
from mirrorckpt.parser.roce.frames import RocePackets
from mirrorckpt.parser.roce.protocols import LL_INTACT_ARGS as _LL_ARGS

_HALF = PSN_MODULUS // 2
RUN_BYTES = 32 << 20  # a run's buffer at most (and a message more): from memory.Buffers, used again
_MAX_GROUPS = 256  # QPs in a batch grouped in one compiled pass (_reasm.group_qps); more: numpy
_IS_FIRST = opcodes.IS_FIRST.astype(np.uint8)
_IS_LAST = opcodes.IS_LAST.astype(np.uint8)
_HAS_IMMDT = opcodes.HAS_IMMDT.astype(np.uint8)
_NO_FLAGS, _NO_ROWS = np.zeros(0, np.uint32), np.zeros(0, np.int64)  # ll_columns without the decode's reading
_NO_HELD = np.zeros(0, np.uint8)  # run_layout on the fast path's table: its held rows come first


class Key(tuple):
    """A record of plain fields used as a dict key on the per-message path (each send is looked up
    by its QP and connection about 15 times): a tuple, so hashing and equality run in C, as a
    frozen dataclass's Python ``__hash__`` did not; equal only to a key of its own class."""

    __slots__ = ()
    __hash__ = tuple.__hash__

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and tuple.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other


class QpKey(Key, NamedTuple("QpKeyFields", [("src", bytes), ("dst", bytes), ("dqp", int)])):
    """src, dst: 16 bytes (IPv4 as mapped IPv6); dqp: the destination QP number."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{address_text(self.src)}->{address_text(self.dst)}/qp{self.dqp:#x}"


@dataclass(slots=True)
class RdmaMessage:
    qp: QpKey
    sport: int
    psn: int  # unwrapped PSN of the first packet
    npkts: int
    data: np.ndarray  # uint8, the message's bytes (zeros in holes)
    holes: list[tuple[int, int]]  # missing byte ranges (start, length)
    va: int | None  # RETH, None when the FIRST/ONLY packet was lost
    rkey: int | None
    dlen: int | None  # RETH DMA length, None when unknown
    imm_raw: int | None  # ImmDt of the closing packet (big-endian read), None when absent or lost
    with_imm: bool | None  # closed by a ...WITH_IMMEDIATE opcode (None: closing packet lost)
    ts_ns: int  # timestamp of the earliest received packet
    length_known: bool = True  # False when neither RETH nor the closing packet fixed the length
    # (user bytes, flag) of ``data`` when ``_run`` read it as an intact LL message while its packets
    # were in cache (NcclDecoder._make then does not decode it again); None otherwise
    ll: tuple | None = None

    @property
    def complete(self) -> bool:
        return not self.holes and self.length_known

    @property
    def missing_bytes(self) -> int:
        return sum(n for _, n in self.holes)


def grown(pool: memory.Buffers, buf: np.ndarray | None, n: int) -> np.ndarray:
    """``buf`` if it holds ``n`` bytes, else a buffer of ``n`` bytes from ``pool`` that begins with
    ``buf``'s bytes."""
    if buf is not None and len(buf) >= n:
        return buf
    out = pool.empty(n)
    if buf is not None:
        out[:len(buf)] = buf
    return out


@dataclass(slots=True)
class MessageRun:
    """Intact messages of one QP, consecutive on its PSN line, as columns over one buffer: what
    ``Reassembler._run`` places at once. The NCCL decoder takes the common case a run at a time
    (``NcclDecoder.feed``); ``messages()`` gives the same messages one object each."""

    qp: QpKey
    sport: int
    psn: np.ndarray  # per message: unwrapped PSN of its first packet
    npkts: np.ndarray
    base: np.ndarray  # message k is buf[base[k]:base[k + 1]] (one entry more than messages)
    va: np.ndarray
    rkey: np.ndarray
    dlen: np.ndarray
    imm: np.ndarray  # ImmDt as read (big-endian), -1 when the closing opcode carries none
    ts: np.ndarray  # earliest packet timestamp
    buf: np.ndarray
    ll_user: np.ndarray | None  # LL readings of the messages (RdmaMessage.ll), where ll_flag != 0
    ll_off: np.ndarray
    ll_n: np.ndarray
    ll_flag: np.ndarray
    # (source, src_off, dst_off, length): payload not yet copied into ``buf`` (Reassembler.defer),
    # of messages none of which opens like LL or LL128 (so Simple wherever the protocol is not
    # pinned); ``fill`` copies it, and whatever reads ``buf`` fills first. ``buf`` is None until then
    # when none of the run was copied at once.
    pending: tuple | None = None
    # The same for LL messages read as the decode read their packets (RocePackets.llu): ``pending``
    # holds their wire bytes (read only by a reader of ``buf``: the careful path) and ``ll_pending``
    # their LL words, gathered into ``ll_user`` (ll_off/ll_n) only when read (``nccl.LazySend``
    # places them straight from the batch's words, and never copies the reduce-scatter half)
    ll_pending: tuple | None = None
    # ``pending`` holds messages that may be LL128 (or earlier ones, copied at once, that may be LL
    # or LL128): the decoder reads each of them, none is taken for Simple unread
    read_pending: bool = False
    pend_from: int = 0  # the first message in the pending pieces (those before were copied at once)
    _prow: list | None = None  # per pending message, its first piece (MessageRun._pieces)

    def __len__(self) -> int:
        return len(self.psn)

    def _own_buf(self) -> np.ndarray:
        """The run's whole buffer: ``buf`` until then holds only the messages copied at once (those
        begun in held packets), or is None."""
        self.buf = grown(memory.buffers(), self.buf, int(self.base[-1]))
        return self.buf

    def _own_user(self) -> np.ndarray:
        if self.ll_user is None:
            self.ll_user = memory.buffers().empty(int(self.ll_off[-1] + self.ll_n[-1]))
        return self.ll_user

    def _lazy(self, ll: bool) -> tuple:
        """(pieces still in the batch, the run's buffer of them, the one who makes it whole)."""
        return (self.ll_pending, self.ll_user, self._own_user) if ll else (self.pending, self.buf, self._own_buf)

    def fill(self) -> None:
        """Copies the payload (and LL words) ``Reassembler.defer`` left for the readers of the run's sends."""
        for ll in (False, True):
            pend, _, own = self._lazy(ll)
            if pend is not None:
                copy_ranges(pend[0], pend[1], own(), pend[2], pend[3])
        self.pending = self.ll_pending = None

    def bounds(self, k: int, ll: bool = False) -> tuple[int, int]:
        """Message ``k``'s bytes in ``buf`` (``ll``: its LL words in ``ll_user``)."""
        if ll:
            a = int(self.ll_off[k])
            return a, a + int(self.ll_n[k])
        return int(self.base[k]), int(self.base[k + 1])

    def _rows(self, k: int) -> tuple[int, int] | None:
        """Message ``k``'s rows in the pending pieces; None when it was copied at once. Both
        pending tuples list the same packets, a message's ``npkts`` of them in turn."""
        k -= self.pend_from
        if k < 0:
            return None
        if self._prow is None:
            self._prow = np.concatenate([[0], np.cumsum(self.npkts[self.pend_from:])]).tolist()
        return self._prow[k], self._prow[k + 1]

    def _pieces(self, pend: tuple, k: int, shift: bool = False) -> tuple | None:
        """Message ``k``'s pieces still in the batch (source, its offsets, offsets in the run's
        buffer or, ``shift``, in the message, lengths); None when it was copied at once."""
        rows = self._rows(k)
        if rows is None:
            return None
        i, j = rows
        src, src_off, dst_off, length = pend
        d = dst_off[i:j]
        return src, src_off[i:j], (d - d[0] if shift and j > i else d), length[i:j]

    def fill_range(self, k: int, ll: bool = False) -> None:
        """``fill`` for message ``k`` only (a ``LazySend``'s; one copied at once, or an empty one,
        needs nothing: no buffer is taken for it)."""
        pend, _, own = self._lazy(ll)
        p = self._pieces(pend, k) if pend is not None else None
        if p is not None and p[3].any():
            copy_ranges(p[0], p[1], own(), p[2], p[3])

    def copy_range(self, k: int, dst: np.ndarray, ll: bool = False) -> None:
        """Message ``k``'s bytes (``ll``: its LL words) copied into ``dst``, from the batch where
        they are still pending: neither filled into the run's buffer nor pool memory taken."""
        pend, have, _ = self._lazy(ll)
        p = self._pieces(pend, k, True) if pend is not None else None
        if p is None:  # filled already, or copied at once (begun in held packets)
            a, b = self.bounds(k, ll)
            dst[:] = have[a:b]
        else:
            copy_ranges(p[0], p[1], dst, p[2], p[3])

    def place_range(self, k: int, dst, covered, start: int, n: int, es: int, ll: bool = False) -> int | None:
        """``_merge.place_agreeing_gather`` of message ``k`` (``ll``: its LL words) straight from the
        batch (its first ``n`` elements); None once the run is filled, or it was copied at once."""
        pend = self.ll_pending if ll else self.pending
        rows = self._rows(k) if pend is not None else None
        # the run's columns as they are, the message's rows named: no slices of them per send
        return None if rows is None else _merge.place_agreeing_gather(dst, covered, start, *pend, n, es, *rows)

    def message(self, k: int) -> RdmaMessage:
        """Message ``k`` alone (its bytes filled, not the run's)."""
        self.fill_range(k)
        self.fill_range(k, True)
        return self._messages(slice(k, k + 1))[0]

    def messages(self, which: slice = slice(None)) -> list[RdmaMessage]:
        self.fill()
        return self._messages(which)

    def _messages(self, which: slice) -> list[RdmaMessage]:
        key, sport, buf, user = self.qp, self.sport, self.buf, self.ll_user
        if buf is None:  # nothing filled: empty messages only
            buf = np.zeros(0, np.uint8)
        a, b = self.base[:-1][which].tolist(), self.base[1:][which].tolist()
        cols = zip(self.psn[which].tolist(), self.npkts[which].tolist(), a, b, self.va[which].tolist(),
                   self.rkey[which].tolist(), self.dlen[which].tolist(), self.imm[which].tolist(),
                   self.ts[which].tolist(), self.ll_off[which].tolist(), self.ll_n[which].tolist(),
                   self.ll_flag[which].tolist())
        return [RdmaMessage(key, sport, p0, npk, buf[a:b], [], va, rkey, size, imm if imm >= 0 else None, imm >= 0,
                            t, True, (user[o:o + n], f) if f else None)
                for p0, npk, a, b, va, rkey, size, imm, t, o, n, f in cols]  # positional: the hot loop


@dataclass
class QpStats:
    sport: int = 0
    packets: int = 0
    duplicates: int = 0
    reordered: int = 0
    lost_packets: int = 0
    orphans: int = 0  # packets before the first message start ever seen
    malformed: int = 0  # payload lengths that contradict the MTU or RETH
    psn_first: int | None = None  # raw 24-bit PSNs
    psn_last: int | None = None
    messages: int = 0
    incomplete: int = 0
    pmtu: int = 0


class _Rows:
    """A QP's rows of a batch's packets; columns are taken only when read."""

    def __init__(self, pk: RocePackets, rows: np.ndarray):
        self._pk, self._rows = pk, rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getattr__(self, name):
        v = getattr(self._pk, name)[self._rows]
        setattr(self, name, v)
        return v


@dataclass
class _Intact:
    """Per opening packet of a table: its message's shape and whether it can be placed in bulk."""

    heads: np.ndarray  # row of each FIRST/ONLY
    npk: np.ndarray
    pm: np.ndarray  # path MTU (payload of the FIRST)
    dlen: np.ndarray
    end_row: np.ndarray  # one past the message's last row
    good: np.ndarray  # complete and self-consistent
    run_end: np.ndarray  # one past the last message of the run of intact, chained messages from here
    head_at: np.ndarray  # row -> head index, -1 elsewhere
    cum_dlen: np.ndarray  # bytes of the messages before each head (for bounded runs)


# Columns of a QP's pending-packet table (packets received, not yet placed).
_COLS = ("psn", "opcode", "va", "rkey", "dlen", "imm", "ts", "plen", "src_off")


@dataclass
class _Qp:
    key: QpKey
    stats: QpStats = field(default_factory=QpStats)
    ref: int | None = None  # highest unwrapped PSN seen
    cursor: int | None = None  # PSN where the next message starts
    pmtu: int = 0
    pend: dict = field(default_factory=dict)  # column -> array (src_off into slab)
    slab: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))


def _root(data: np.ndarray) -> tuple[np.ndarray, int]:
    """The buffer ``data`` is a view of (a capture file's mapping, whose batches are its slices) and
    where ``data`` begins in it; ``data`` itself and 0 when it is no such view."""
    base = data.base
    if isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1 and base.flags.c_contiguous \
            and data.flags.c_contiguous and data.dtype == np.uint8 and data.ndim == 1:
        shift = data.ctypes.data - base.ctypes.data
        if 0 <= shift and shift + len(data) <= len(base):
            return base, shift
    return data, 0


def _looks_ll(data, first: np.ndarray, length: np.ndarray) -> bool:
    """Whether a message whose first packet lies at ``first`` (``length`` bytes) in ``data`` opens
    with an LL line: its two flag words equal and not zero."""
    return _reasm.opens_like_ll(data, first, length, LL_LINE_BYTES, _LL_ARGS[2], _LL_ARGS[4])


def _may_be_ll128(data, first: np.ndarray, length: np.ndarray, dlen: np.ndarray) -> bool:
    """Whether a message of ``dlen`` bytes whose first packet lies at ``first`` (``length`` bytes)
    in ``data`` could read as intact LL128 (``protocols.ll128_intact``): whole groups, and its first
    two lines' flags equal and positive as an int64 (Simple data in whole groups passes the first
    line's test half of the time)."""
    return _reasm.may_open_ll128(data, first, length, dlen, LL128_GROUP_WIRE, LL128_LINE_BYTES, LL128_FLAG_OFFSET)


# A message with missing packets is given up once its QP has opened this many messages past it,
# if the QP has not moved ``psn_window`` PSNs on first: RC delivers a QP's packets in order, and a
# mirror does not hold one back for whole messages. On a QP of small messages 1024 PSNs are over
# ten collectives, and the QP's later messages waited behind the gap while the concatenator closed
# the collectives they complete (a lost 0-byte step message left six iterations incomplete).
MESSAGES_PAST_A_GAP = 4


def _message_ts(ts: np.ndarray, i: int, k: int) -> int:
    """A message's time: its first packet's, from table rows ``i:k``; a message none of whose
    packets came sits just before the packet after it (or after the last one): the NCCL decoder
    orders a batch's messages by time, and a lost message must not come before those it followed."""
    if k > i:
        return int(ts[i:k].min())
    if k < len(ts):
        return int(ts[k])
    return int(ts.max()) if len(ts) else 0


class Reassembler:
    """Streaming per-QP PSN reassembly; feed decoded packets batch by batch, then flush."""

    def __init__(self, psn_window: int = 1024, max_message: int = 64 << 20, fast: bool = True, runs: bool = False,
                 defer: bool = False):
        memory.keep_freed_memory()  # message buffers come and go at line rate
        self._buffers = memory.buffers()  # run buffers, off the heap
        self.psn_window = psn_window
        self.max_message = max_message  # bigger RETH lengths are corruption, never allocated
        self.fast = fast  # the compiled common case (_fast); False: every table the careful way (tests)
        self.runs = runs  # hand on runs of intact messages as MessageRun (columns), not one object each
        # Leave a run's plain copy from the batch to whoever reads it (MessageRun.pending): only for
        # batches that stay valid after the next (a capture file's mapping), read on another thread
        self.defer = defer
        # With ``defer``, the address of the first byte of a batch buffer that the runs of the last
        # ``feed`` may still read outside that batch (packets held before it); None: none.
        self.holds_from: int | None = None
        self._shift = 0
        self.qps: dict[QpKey, _Qp] = {}

    def feed(self, pk: RocePackets, data: np.ndarray) -> list:
        """Places the RC WRITE packets of one batch (``data`` is the batch buffer): its messages
        (RdmaMessage; with ``runs``, runs of intact ones as MessageRun)."""
        sel = np.nonzero(opcodes.IS_WRITE[pk.opcode] & pk.icrc_ok)[0]
        if not len(sel):
            return []
        self._shift = 0
        self.holds_from = None
        if self.defer:
            # A batch that is a view of a larger buffer that stays valid (a capture file's mapping):
            # payloads are named by their place in that buffer, so that packets held for the next
            # batch stay where they lie (``_hold``) and a message begun in them is read from there
            # like any other (``_run``), not copied first.
            root, self._shift = _root(data)
            if root is not data:
                pk = replace(pk, pay_off=pk.pay_off + self._shift)
                data = root
                # the runs made now may read packets held before, where they lie: not given back yet
                lows = [int(q.pend["src_off"].min()) for q in self.qps.values()
                        if q.slab is root and q.pend and len(q.pend["src_off"])]
                self.holds_from = root.ctypes.data + min(lows) if lows else None
        out = []
        for rows, key in self._groups(pk, sel):
            qp = self.qps.get(key)
            if qp is None:
                qp = self.qps[key] = _Qp(key)
                qp.stats.sport = int(pk.sport[rows[0]])
            out += self._feed_qp(qp, _Rows(pk, rows), data, final=False)
        return out

    @staticmethod
    def _groups(pk: RocePackets, sel: np.ndarray):
        """Rows of each QP (source, destination, destination QP number), in arrival order, QPs in
        order of number and addresses. One compiled pass when the batch has at most _MAX_GROUPS QPs."""
        order = np.empty(len(sel), np.int64)
        first, count = np.empty(_MAX_GROUPS, np.int64), np.empty(_MAX_GROUPS, np.int64)
        ng = -1
        if pk.src.flags.c_contiguous and pk.dst.flags.c_contiguous and pk.dqp.dtype == np.int64:
            ng = _reasm.group_qps(np.ascontiguousarray(sel, np.int64), pk.dqp, pk.src, pk.dst, order, first, count)
        if ng < 0:
            yield from Reassembler._groups_sorted(pk, sel)
            return
        bounds = np.concatenate([[0], np.cumsum(count[:ng])]).tolist()
        heads = first[:ng].tolist()
        keys = [QpKey(pk.src[r].tobytes(), pk.dst[r].tobytes(), int(pk.dqp[r])) for r in heads]
        for g in sorted(range(ng), key=lambda g: (keys[g].dqp, keys[g].src, keys[g].dst)):
            yield order[bounds[g]:bounds[g + 1]], keys[g]

    @staticmethod
    def _groups_sorted(pk: RocePackets, sel: np.ndarray):
        """``_groups`` with numpy, for any number of QPs."""
        dqp = pk.dqp[sel]
        order = np.argsort(dqp, kind="stable")
        bounds = np.flatnonzero(np.diff(dqp[order])) + 1
        for rows in np.split(sel[order], bounds):
            addr = np.concatenate([pk.src[rows], pk.dst[rows]], axis=1)
            uniq, inv = np.unique(np.ascontiguousarray(addr).view(np.dtype((np.void, 32))).ravel(),
                                  return_inverse=True)
            for g in range(len(uniq)):
                a = uniq[g].tobytes()
                yield rows[inv == g], QpKey(a[:16], a[16:], int(pk.dqp[rows[0]]))

    def flush(self) -> list:
        """Emits every message still waiting, complete or not (end of capture)."""
        out = []
        for qp in self.qps.values():
            out += self._feed_qp(qp, None, None, final=True)
        return out

    # -- one QP --------------------------------------------------------------------------------

    def _unwrap(self, qp: _Qp, psn: np.ndarray) -> np.ndarray:
        if qp.ref is None:
            qp.ref = int(psn[0])
        d = (psn - (qp.ref % PSN_MODULUS) + _HALF) % PSN_MODULUS - _HALF
        return qp.ref + d

    def _feed_qp(self, qp: _Qp, pk: _Rows | None, data, final: bool) -> list[RdmaMessage]:
        if pk is not None and len(pk) and qp.cursor is not None and self.fast:
            out = self._fast(qp, pk, data)
            if out is not None:
                return out
        st = qp.stats
        if pk is not None and len(pk):
            psn = self._unwrap(qp, pk.psn)
            st.packets += len(psn)
            prev = qp.ref
            runmax = np.maximum.accumulate(np.concatenate([[prev], psn]))[:-1]
            st.reordered += int((psn < runmax).sum())
            top = int(np.argmax(psn))
            if st.psn_first is None:
                st.psn_first = int(pk.psn[0])
            if int(psn[top]) >= prev:
                st.psn_last = int(pk.psn[top])
            qp.ref = max(prev, int(psn[top]))
            full = (opcodes.IS_FIRST[pk.opcode] & ~opcodes.IS_LAST[pk.opcode]
                    | (pk.opcode == opcodes.RC_RDMA_WRITE_MIDDLE))
            if full.any():
                qp.pmtu = max(qp.pmtu, int(pk.pay_len[full].max()))
                st.pmtu = qp.pmtu
            new = {"psn": psn, "opcode": pk.opcode, "va": pk.va, "rkey": pk.rkey, "dlen": pk.dlen,
                   "imm": np.where(pk.has_imm, pk.imm_raw, -1), "ts": pk.ts_ns, "plen": pk.pay_len,
                   "src_off": pk.pay_off}
            src_is_new = np.ones(len(psn), bool)
        else:
            new, src_is_new = None, np.zeros(0, bool)
        # Working table: pending packets (payload in the slab) + this batch's (payload in data).
        if qp.pend:
            tab = {c: np.concatenate([qp.pend[c], new[c]]) if new else qp.pend[c] for c in _COLS}
            src_is_new = np.concatenate([np.zeros(len(qp.pend["psn"]), bool), src_is_new])
        elif new:
            tab = new
        else:
            return []
        # Sort by PSN; a repeated PSN keeps its first arrival (pending rows come first).
        if not (np.diff(tab["psn"]) > 0).all():
            order = np.lexsort((np.arange(len(tab["psn"])), tab["psn"]))
            tab = {c: v[order] for c, v in tab.items()}
            src_is_new = src_is_new[order]
            first = np.ones(len(order), bool)
            first[1:] = tab["psn"][1:] != tab["psn"][:-1]
            st.duplicates += int((~first).sum())
            tab = {c: v[first] for c, v in tab.items()}
            src_is_new = src_is_new[first]

        if qp.cursor is None:
            starts = np.nonzero(opcodes.IS_FIRST[tab["opcode"]])[0]
            if not len(starts):
                if final:
                    st.orphans += len(tab["psn"])
                    tab = {c: v[:0] for c, v in tab.items()}
                qp.pend, qp.slab = self._hold(tab, src_is_new, data, qp.slab)
                return []
            qp.cursor = int(tab["psn"][starts[0]])
            st.orphans += int(starts[0])
        stale = tab["psn"] < qp.cursor
        st.duplicates += int(stale.sum())
        tab = {c: v[~stale] for c, v in tab.items()}
        src_is_new = src_is_new[~stale]

        out, used = self._walk(qp, tab, src_is_new, data, final)
        keep = np.ones(len(tab["psn"]), bool)
        keep[:used] = False
        tab = {c: v[keep] for c, v in tab.items()}
        qp.pend, qp.slab = self._hold(tab, src_is_new[keep], data, qp.slab)
        return out

    def _fast(self, qp: _Qp, pk: _Rows, data) -> list[RdmaMessage] | None:
        """The common case, decided in two compiled passes (``_reasm.line_table``, then
        ``_reasm.intact_messages``): the held packets and the batch's continue the QP's PSN line
        from its cursor without a gap, close intact messages and end, at most, inside one message
        that waits for its other packets.
        Places exactly what the careful path below would (same messages, runs and held packets,
        same counters); None, with nothing changed, when the table is anything else."""
        pend = qp.pend
        npend = len(pend["psn"]) if pend else 0
        if qp.ref != qp.cursor + npend - 1:
            return None  # a PSN above the held ones was seen: duplicates or reordering
        b, rows = pk._pk, np.ascontiguousarray(pk._rows, np.int64)
        n = npend + len(rows)
        held = np.empty((len(_COLS), npend), np.int64)
        for i, c in enumerate(_COLS if npend else ()):
            held[i] = pend[c].view(np.int64) if c == "va" else pend[c]
        t = np.empty((len(_COLS), n), np.int64)
        i64 = lambda a: np.ascontiguousarray(a, np.int64)  # noqa: E731 - no copy for decode's columns
        ok, full = _reasm.line_table(rows, i64(b.psn), i64(b.opcode), np.ascontiguousarray(b.va, np.uint64),
                                     i64(b.rkey), i64(b.dlen), i64(b.imm_raw),
                                     np.ascontiguousarray(b.has_imm, bool).view(np.uint8), i64(b.ts_ns),
                                     i64(b.pay_len), i64(b.pay_off), held, qp.cursor, _IS_FIRST, _IS_LAST,
                                     opcodes.RC_RDMA_WRITE_MIDDLE, t)
        if not ok:
            return None  # the batch's rows do not continue the line
        tab = dict(zip(_COLS, t))
        tab["va"] = tab["va"].view(np.uint64)
        src_is_new = np.zeros(n, bool)
        src_is_new[npend:] = True
        heads, npks = np.empty(n, np.int64), np.empty(n, np.int64)
        k, used, tail_ok = _reasm.intact_messages(tab["psn"], tab["opcode"], tab["plen"], tab["dlen"],
                                                  _IS_FIRST, _IS_LAST, qp.cursor, self.max_message, heads, npks)
        if k < 0 or not tail_ok:
            return None
        # What _feed_qp's prologue counts for rows that continue the line: no reordering, the
        # newest PSN last.
        st = qp.stats
        st.packets += len(rows)
        if st.psn_first is None:
            st.psn_first = int(b.psn[rows[0]])
        st.psn_last = int(b.psn[rows[-1]])
        qp.ref = int(tab["psn"][-1])
        if full >= 0:
            qp.pmtu = max(qp.pmtu, full)
            st.pmtu = qp.pmtu
        out: list[RdmaMessage] = []
        # the decode's LL flags of the batch's rows (table row npend + i is rows[i]) and its words
        ll = (b.llf, rows, npend, b.llu, self._shift) if self.defer and b.llu is not None else None
        k0 = 0
        while k0 < k:  # runs of at most RUN_BYTES, cut where _walk cuts them
            runs, k0 = self._run(qp, t, npend, None, data, heads, npks, k0, k, ll)
            out += runs
        rest = {c: v[used:] for c, v in tab.items()}
        qp.pend, qp.slab = self._hold(rest, src_is_new[used:], data, qp.slab)
        return out

    def _walk(self, qp: _Qp, tab: dict, src_is_new: np.ndarray, data, final: bool):
        """Decides messages from the cursor on; returns them and how many rows they used.

        Runs of intact, well-formed messages (the normal case) are placed in bulk; a message with
        missing, malformed or late packets goes through ``_one``, one at a time."""
        out: list[RdmaMessage] = []
        psn, op = tab["psn"], tab["opcode"]
        is_first = opcodes.IS_FIRST[op]
        is_last = opcodes.IS_LAST[op]
        bounds = np.nonzero(is_first | is_last)[0]
        g = self._intact(qp, tab, is_first, is_last)
        n = len(psn)
        i = 0
        while i < n:
            k0 = int(g.head_at[i])
            if k0 >= 0 and psn[i] == qp.cursor and g.good[k0]:
                k1 = int(g.run_end[k0])
                # Runs of at most RUN_BYTES: one buffer each, used again from memory.Buffers.
                k1 = min(k1, k0 + max(1, int(np.searchsorted(g.cum_dlen[k0 + 1:], g.cum_dlen[k0] + RUN_BYTES)) + 1))
                out += self._bulk(qp, tab, src_is_new, data, g, k0, k1)
                i = int(g.end_row[k1 - 1])
                continue
            got = self._one(qp, tab, src_is_new, data, final, i, is_first, is_last, bounds)
            if got is None:
                break
            msg, i = got
            out.append(msg)
        return out, i

    def _intact(self, qp: _Qp, tab: dict, is_first, is_last) -> _Intact:
        """Per FIRST/ONLY row: is its message complete and self-consistent in this table?"""
        psn, plen, dlen = tab["psn"], tab["plen"], tab["dlen"]
        n = len(psn)
        heads = np.nonzero(is_first)[0]
        only = is_last[heads]
        hp = plen[heads]
        hd = dlen[heads]
        pm = np.where(only, np.maximum(hp, 1), np.maximum(hp, 1))
        npk = np.where(only, 1, -(-hd // pm))
        end_psn = psn[heads] + npk
        end_row = np.searchsorted(psn, end_psn)
        last_row = np.maximum(end_row - 1, 0)
        nb = np.concatenate([[0], np.cumsum(is_first | is_last)])
        good = ((end_row - heads == npk) & (npk >= 1) & (hd <= self.max_message)
                & (n > 0) & is_last[last_row] & (psn[last_row] == end_psn - 1)
                & (nb[end_row] - nb[heads] == np.where(only, 1, 2))
                & (only | (npk >= 2)) & (only & (hd == hp) | ~only))
        # Payload lengths: one MTU per packet, the rest in the last one.
        head_of_row = np.searchsorted(heads, np.arange(n), side="right") - 1
        inside = (head_of_row >= 0)
        h = np.where(inside, head_of_row, 0)
        inside &= np.arange(n) < end_row[h] if len(heads) else False
        if len(heads):
            is_tail = np.arange(n) == last_row[h]
            exp = np.where(is_tail, hd[h] - (npk[h] - 1) * pm[h], pm[h])
            bad_row = inside & (plen != np.where(only[h], hd[h], exp))
            bad = np.zeros(len(heads), bool)
            np.logical_or.at(bad, h[bad_row], True)
            good &= ~bad
        # Runs: message k+1 continues a run when it starts where k ended.
        chain = np.zeros(len(heads), bool)
        if len(heads) > 1:
            chain[1:] = (psn[heads[1:]] == end_psn[:-1]) & good[1:]
        run_end = np.arange(len(heads)) + 1
        if len(heads):
            # next index >= k+1 where the chain breaks
            breaks = np.nonzero(~chain)[0]
            nxt = np.searchsorted(breaks, np.arange(len(heads)), side="right")
            run_end = np.where(nxt < len(breaks), breaks[np.minimum(nxt, len(breaks) - 1)], len(heads))
        head_at = np.full(n + 1, -1, np.int64)
        head_at[heads] = np.arange(len(heads))
        cum = np.concatenate([[0], np.cumsum(np.where(good, hd, 0))])
        return _Intact(heads, npk, pm, hd, end_row, good, run_end, head_at, cum)

    def _bulk(self, qp, tab, src_is_new, data, g: _Intact, k0: int, k1: int) -> list:
        """Places intact messages k0..k1-1 of the careful path's table (consecutive rows, held
        packets where ``src_is_new`` is not set) with one copy for all of them: ``_run`` on the
        table's columns."""
        t = np.empty((len(_COLS), len(src_is_new)), np.int64)
        for i, c in enumerate(_COLS):
            t[i] = tab[c].view(np.int64) if c == "va" else tab[c]
        heads, npks = np.ascontiguousarray(g.heads, np.int64), np.ascontiguousarray(g.npk, np.int64)
        out, end = self._run(qp, t, 0, (~src_is_new).view(np.uint8), data, heads, npks, k0, k1, None)
        if end != k1:
            raise AssertionError(f"{qp.key}: a run cut at message {end}, not at {k1}")
        return out

    def _run(self, qp: _Qp, t: np.ndarray, npend: int, held: np.ndarray | None, data, heads: np.ndarray,
             npks: np.ndarray, k0: int, k: int, ll: tuple | None) -> tuple[list, int]:
        """Places the intact messages from ``k0`` on (of ``k``: first rows ``heads``, packet counts
        ``npks`` in the table ``t``, line_table's nine rows), at most RUN_BYTES and a message more,
        with one copy for all of them. The table's held packets (an earlier batch's, in ``qp.slab``)
        are its first ``npend`` rows (``_fast``'s table) or those ``held`` marks (the careful
        path's). The run's columns come from one compiled pass (``_reasm.run_layout``,
        ``_reasm.ll_columns``): computed numpy call by numpy call, those calls, not the bytes, were
        the reassembly's cost per QP and batch. Returns its messages (one ``MessageRun`` with
        ``runs``) and where the next run starts.

        ``ll``: the decode's LL reading of the batch (``_fast``, with ``defer``)."""
        st, kmax = qp.stats, k - k0
        r0 = int(heads[k0])
        base, dst = np.empty(kmax + 1, np.int64), np.empty(t.shape[1] - r0, np.int64)
        per = np.empty((9, kmax), np.int64)
        k1, kx, rx, all_imm = _reasm.run_layout(t, heads, npks, k0, k, npend, _NO_HELD if held is None else held,
                                                RUN_BYTES, _HAS_IMMDT, base, dst, per)
        n = k1 - k0
        r1 = int(heads[k1 - 1] + npks[k1 - 1])
        base, dst, per = base[:n + 1], dst[:r1 - r0], per[:, :n]
        src, plen, sizes = t[8, r0:r1], t[7, r0:r1], per[3]
        opens_ll = None  # whether a message from kx on opens like LL (asked once)
        if rx and self.defer and qp.slab is data:
            opens_ll = _looks_ll(data, per[6], per[7])
            if not opens_ll:
                kx = rx = 0  # the held packets lie in the batch's buffer too: none copied at once
        # A run whose copy is left to the readers of its sends (``defer``) gets a buffer for the
        # messages copied at once, its whole buffer only if one of the others is read
        # (MessageRun._own_buf): most runs of a batch begin in held packets, and whole buffers
        # taken for them were most of a Simple replay's memory.
        if not self.defer:
            buf = self._buffers.empty(int(base[-1]))
        else:
            buf = self._buffers.empty(int(base[kx]) if kx < n else int(base[-1])) if rx else None
        # Messages up to the last held packet are copied from both places; the rest, read from this
        # batch only, are copied and, while in cache, read as LL (a pass over cold bytes less for LL;
        # a line or two read for the other protocols). Where the slab is the batch's own buffer
        # (``feed``, from a capture file) and none opens like LL, no message is copied at once.
        if held is None:  # held rows come first in the table
            old = min(max(npend - r0, 0), rx)
            if rx > old:
                copy_ranges(data, src[old:rx], buf, dst[old:rx], plen[old:rx])
            if old:
                copy_ranges(qp.slab, src[:old], buf, dst[:old], plen[:old])
        else:
            for from_old in (False, True):
                m = held[r0:r0 + rx].view(bool) == from_old
                if m.any():
                    copy_ranges(qp.slab if from_old else data, np.ascontiguousarray(src[:rx][m]), buf,
                                np.ascontiguousarray(dst[:rx][m]), np.ascontiguousarray(plen[:rx][m]))
        lay = np.zeros((2, n), np.int64)
        ll_off, ll_n, ll_flag, user = lay[0], lay[1], np.zeros(n, np.uint32), None
        pending = ll_pending = None
        read_pending = False
        if opens_ll is None or kx:
            opens_ll = kx < n and _looks_ll(data, per[6, kx:], per[7, kx:])
        if kx < n and not opens_ll:
            # No new message opens like LL (Simple, LL128): no LL reading to keep. Deferred (see
            # ``defer``) unless a CTS post is among them (read at once); when none could be LL128
            # either, the decoder knows them Simple without reading them (MessageRun.pending), else
            # it reads each where it lies (``read_pending``: LL128 decoded from the batch).
            if self.defer and all_imm:
                pending = (data, src[rx:], dst[rx:], plen[rx:])
                read_pending = not self._plain(data, per[6], per[7], sizes, kx, buf, base)
            else:
                buf = grown(self._buffers, buf, int(base[-1]))
                copy_ranges(data, src[rx:], buf, dst[rx:], plen[rx:])
        elif kx < n:
            read = ll is not None and all_imm
            found = _reasm.ll_columns(per, kx, n, LL_LINE_BYTES, LL_DATA_PER_LINE, ll[0] if read else _NO_FLAGS,
                                      ll[1] if read else _NO_ROWS, r0 + rx, npend, ll_n, ll_off, ll_flag)
            if found > 0:
                # The new messages as the decode read their packets: LL words and wire bytes both
                # stay in the batch until a send is read (MessageRun.ll_pending, pending)
                ll_pending = (ll[3], (src[rx:] - ll[4]) >> 1, (dst[rx:] - dst[rx]) >> 1, plen[rx:] >> 1)
                pending = (data, src[rx:], dst[rx:], plen[rx:])
            else:
                buf = grown(self._buffers, buf, int(base[-1]))
                user = self._buffers.empty(int(ll_off[-1] + ll_n[-1]))
                starts = np.concatenate([[0], np.cumsum(per[8, kx:])])  # each message's first row from rx
                _place.gather_ll(data, src[rx:], plen[rx:], starts, base[kx:] - base[kx], buf[base[kx]:],
                                 ll_off[kx:], user, ll_flag[kx:], *_LL_ARGS)
        run = MessageRun(qp.key, st.sport, per[0], per[8], base, per[1].view(np.uint64), per[2], sizes, per[4],
                         per[5], buf, user, ll_off, ll_n, ll_flag, pending, ll_pending, read_pending, kx)
        st.messages += n
        qp.cursor = int(run.psn[-1] + run.npkts[-1])
        return ([run] if self.runs else run.messages()), k1

    @staticmethod
    def _plain(data, first, length, sizes, kx, buf, base) -> bool:
        """No message of a run opens like LL or LL128 (each one's first packet: ``first``,
        ``length``): those from ``kx`` on read in the batch, the ones before (already in ``buf``,
        from held packets) read there."""
        if _may_be_ll128(data, first[kx:], length[kx:], sizes[kx:]):
            return False
        return not kx or not (_looks_ll(buf, base[:kx], length[:kx])
                              or _may_be_ll128(buf, base[:kx], length[:kx], sizes[:kx]))

    def _one(self, qp: _Qp, tab, src_is_new, data, final, i, is_first, is_last, bounds):
        """One message from row ``i`` the careful way; None while it must wait for packets."""
        psn = tab["psn"]
        horizon = qp.ref  # highest PSN seen on the QP
        cur = qp.cursor
        head = i if psn[i] == cur and is_first[i] else None
        # The next closing packet, or the next message's opening one, bounds this message.
        b = int(np.searchsorted(bounds, i))
        while b < len(bounds) and psn[bounds[b]] == cur:
            b += 1
        j = int(bounds[b]) if b < len(bounds) else None
        if j is None:
            s_end, s_known = None, False
        elif is_first[j]:
            s_end, s_known = int(psn[j]), False  # the next message starts there
        else:
            s_end, s_known = int(psn[j]) + 1, True
        if head is not None and is_last[head]:
            end, dlen, length_known = cur + 1, int(tab["dlen"][head]), True
        else:
            dlen, end, length_known = None, None, False
            if head is not None:
                pm = int(tab["plen"][head])
                dlen = int(tab["dlen"][head])
                npk = -(-dlen // pm) if pm > 0 else 0
                end, length_known = cur + npk, True
                # A RETH length that contradicts the packets (or no sane length at all) is not
                # trusted: the structure decides, and the message is malformed.
                if npk < 2 or dlen > self.max_message or (s_end is not None and (
                        s_end < end or (s_end == end and not s_known and psn[j] == end - 1))):
                    qp.stats.malformed += 1
                    dlen, end = None, None
            if end is None:
                if s_end is None:
                    if not final:
                        return None
                    end, length_known = int(psn[-1]) + 1, False
                else:
                    end, length_known = s_end, s_known
        k = i + int(np.searchsorted(psn[i:], end))
        if (k - i < end - cur or head is None) and not final and horizon < end - 1 + self.psn_window \
                and int(np.count_nonzero(is_first[k:])) < MESSAGES_PAST_A_GAP:
            return None  # still waiting for packets of this message (its FIRST may still arrive late)
        msg = self._build(qp, tab, src_is_new, data, i, k, cur, end, head, dlen, length_known)
        qp.cursor = end
        return msg, k

    def _build(self, qp, tab, src_is_new, data, i, k, start, end, head, dlen, length_known):
        st = qp.stats
        pmtu = qp.pmtu or (int(tab["plen"][i]) if k > i else 0)
        rows = np.arange(i, k)
        psn = tab["psn"][rows]
        plen = tab["plen"][rows]
        op = tab["opcode"][rows]
        npk = end - start
        last_row = rows[psn == end - 1]
        closed = len(last_row) == 1 and opcodes.IS_LAST[op[psn == end - 1][0]]
        if dlen is None and closed and length_known:
            dlen = (npk - 1) * pmtu + int(tab["plen"][last_row[0]])
        size = dlen if dlen is not None else npk * pmtu
        if size > self.max_message:  # only corrupt PSNs/lengths get here: place nothing
            st.malformed += 1
            st.messages += 1
            st.incomplete += 1
            return RdmaMessage(qp=qp.key, sport=st.sport, psn=start, npkts=npk, data=np.zeros(0, np.uint8),
                               holes=[], va=None, rkey=None, dlen=None, imm_raw=None, with_imm=None,
                               ts_ns=_message_ts(tab["ts"], i, k), length_known=False)
        # Every packet but the last carries exactly one MTU; a payload that disagrees is not data.
        expect = np.where(psn == end - 1, size - (npk - 1) * pmtu, pmtu)
        good = plen == expect
        if not good.all():
            st.malformed += int((~good).sum())
        buf = np.zeros(max(size, 0), np.uint8)
        dst = (psn - start) * pmtu
        for from_new in (True, False):
            m = good & (src_is_new[rows] == from_new)
            if m.any():
                copy_ranges(data if from_new else qp.slab, np.ascontiguousarray(tab["src_off"][rows][m]),
                                  buf, np.ascontiguousarray(dst[m]), np.ascontiguousarray(plen[m]))
        present = np.zeros(npk, bool)
        present[(psn - start)[good]] = True
        holes = _holes(present, pmtu, size)
        st.lost_packets += int((~present).sum())
        st.messages += 1
        with_imm = imm = None
        if closed:
            with_imm = bool(opcodes.HAS_IMMDT[op[psn == end - 1][0]])
            imm = int(tab["imm"][last_row[0]]) if with_imm else None
        msg = RdmaMessage(
            qp=qp.key, sport=st.sport, psn=start, npkts=npk, data=buf, holes=holes,
            va=int(tab["va"][head]) if head is not None else None,
            rkey=int(tab["rkey"][head]) if head is not None else None,
            dlen=dlen if head is not None else None,  # None: lost with its packet, or untrusted
            imm_raw=imm, with_imm=with_imm,
            ts_ns=_message_ts(tab["ts"], i, k),
            length_known=length_known and (dlen is not None),
        )
        if not msg.complete:
            st.incomplete += 1
        return msg

    def _hold(self, tab: dict, src_is_new: np.ndarray, data, slab: np.ndarray):
        """Copies the payloads of rows still waiting into a fresh slab (one copy per held packet);
        with ``defer`` (batches that stay valid) rows that all lie in one buffer stay there, and it
        is their slab."""
        if not len(tab["psn"]):
            return {}, np.zeros(0, np.uint8)
        if self.defer:
            where = [data if new else slab for new in (True, False) if (src_is_new == new).any()]
            if len(where) == 1 or where[0] is where[1]:
                return dict(tab), where[0]
        plen = tab["plen"]
        new_off = np.zeros(len(plen), np.int64)
        if len(plen) > 1:
            np.cumsum(plen[:-1], out=new_off[1:])
        out = np.zeros(int(plen.sum()), np.uint8)
        for from_new in (True, False):
            m = src_is_new == from_new
            if m.any():
                copy_ranges(data if from_new else slab, np.ascontiguousarray(tab["src_off"][m]), out,
                                  np.ascontiguousarray(new_off[m]), np.ascontiguousarray(plen[m]))
        tab = dict(tab)
        tab["src_off"] = new_off
        return tab, out


def _holes(present: np.ndarray, pmtu: int, size: int) -> list[tuple[int, int]]:
    """Byte ranges of the message not covered by the packets present."""
    if present.all():
        return []
    miss = ~present
    edges = np.diff(np.concatenate([[0], miss.view(np.int8), [0]]))
    starts = np.nonzero(edges == 1)[0]
    stops = np.nonzero(edges == -1)[0]
    out = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        lo = a * pmtu
        hi = min(b * pmtu, size)
        if hi > lo:
            out.append((lo, hi - lo))
    return out
