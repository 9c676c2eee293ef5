"""TCP from frame batches: a vectorised segment decode and per-direction byte-stream reassembly.

``decode`` turns a FrameBatch into one row per TCP segment (IPv4/IPv6, up to two VLAN tags),
through a mirror encapsulation: the compiled walk of the RoCE decoder finds each mirrored frame
(``_inner.inner_frames``), and the segments are read from there.
Checksums are never checked: mirrored copies of offloaded traffic carry partial checksums
(CHECKSUM_PARTIAL), and TSO/GSO super-frames up to 64 KiB are ordinary segments here.

``TcpReassembler`` places every payload byte by its sequence number in one buffer per direction
(32-bit sequence numbers unwrapped against the stream's highest byte). Bytes are copied once,
from the batch into the stream buffer. A byte received twice must agree with the copy held,
else both are distrusted: the range becomes a hole. A missing range waits until the stream has
moved ``window_bytes`` past it, or ``hole_ns`` of capture time passed (or ``flush``), then it
is declared lost. The consumer reads the
stream below ``settled``: every byte there is final, present or lost, and never changes again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.capture._pack import copy_ranges
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser import _inner, encap
from mirrorckpt.parser.headers import (
    ETH,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ETHERTYPE_VLAN,
    IPPROTO_TCP,
    IPV4,
    IPV4_FRAGMENT,
    IPV6,
    TCP,
    VLAN,
)

SEQ_MOD = 1 << 32
_HALF = 1 << 31
FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
MAX_JUMP = 1 << 30  # a segment this far past the stream's end is not believed
DEFAULT_WINDOW_BYTES = 4 << 20  # bytes a hole may wait for a late copy (above Linux's usual TCP window)
DEFAULT_HOLE_NS = 2_000_000_000  # capture time a hole may wait (a retransmission comes after an RTO)


@dataclass
class TcpCounters:
    frames: int = 0
    truncated_frames: int = 0
    bytes: int = 0
    classes: Counter = field(default_factory=Counter)  # tcp, udp/other, non_ip, ipv4_fragment...
    malformed: Counter = field(default_factory=Counter)

    def add(self, o: TcpCounters) -> None:
        self.frames += o.frames
        self.truncated_frames += o.truncated_frames
        self.bytes += o.bytes
        self.classes.update(o.classes)
        self.malformed.update(o.malformed)


@dataclass
class TcpSegments:
    """One row per TCP segment of a batch (struct of arrays)."""

    frame: np.ndarray
    ts_ns: np.ndarray
    src: np.ndarray  # (N, 16) uint8, IPv4 as mapped IPv6
    dst: np.ndarray
    sport: np.ndarray
    dport: np.ndarray
    seq: np.ndarray  # raw 32-bit
    ack: np.ndarray
    flags: np.ndarray
    pay_off: np.ndarray  # absolute offset in batch.data
    pay_len: np.ndarray

    def __len__(self) -> int:
        return int(self.frame.shape[0])

    def take(self, idx) -> TcpSegments:
        return TcpSegments(**{k: v[idx] for k, v in self.__dict__.items()})


def _u(hdr, data, pos, name):
    return hdr.read(data, pos, name).astype(np.int64)


def inner(batch: FrameBatch, encapsulation: EncapSpec | None = None,
          mirror: encap.MirrorHealth | None = None) -> FrameBatch:
    """``batch`` with each frame a mirror encapsulation carries in its place (the same bytes,
    seen from the mirrored frame's Ethernet header on); what the encapsulations showed is
    counted into ``mirror`` (a stream's, kept across batches)."""
    n = len(batch)
    if not n:
        return batch
    health = mirror if mirror is not None else encap.MirrorHealth()
    off, cap = np.empty(n, np.int64), np.empty(n, np.int64)
    data = np.ascontiguousarray(batch.data)
    taken = _inner.inner_frames(data, np.ascontiguousarray(batch.offset, np.int64),
                               np.ascontiguousarray(batch.caplen, np.int64), off, cap, encap.table(encapsulation),
                               *health.state())
    if not taken:
        return batch
    return FrameBatch(data, off, cap, cap + (batch.wirelen - batch.caplen), batch.ts_ns, batch.iface, batch.source,
                      batch.first_index, batch.linktypes)


def decode(batch: FrameBatch, encapsulation: EncapSpec | None = None,
           mirror: encap.MirrorHealth | None = None) -> tuple[TcpSegments, TcpCounters]:
    """The TCP segments of ``batch`` (malformed and truncated frames are counted, never read),
    through the mirror encapsulations ``encapsulation`` allows (see ``inner``)."""
    c = TcpCounters(frames=len(batch), bytes=batch.nbytes)
    batch = inner(batch, encapsulation, mirror)
    data, base, caplen = batch.data, batch.offset, batch.caplen
    trunc = batch.truncated
    c.truncated_frames = int(trunc.sum())
    idx = np.nonzero(batch.ethernet_mask() & ~trunc)[0]
    short = caplen[idx] < ETH.size
    c.malformed["short_ethernet"] += int(short.sum())
    idx = idx[~short]
    l3 = base[idx] + ETH.size
    et = _u(ETH, data, base[idx], "type")
    for _ in range(2):  # 802.1Q / 802.1ad
        tag = np.isin(et, ETHERTYPE_VLAN)
        if not tag.any():
            break
        ok = ~tag | (base[idx] + caplen[idx] >= l3 + VLAN.size)
        c.malformed["short_vlan"] += int((~ok).sum())
        idx, l3, et, tag = idx[ok], l3[ok], et[ok], tag[ok]
        t = np.nonzero(tag)[0]
        et[t] = _u(VLAN, data, l3[t], "type")
        l3[t] += VLAN.size
    end = base[idx] + caplen[idx]
    v4 = (et == ETHERTYPE_IPV4) & (end - l3 >= IPV4.size)
    v6 = (et == ETHERTYPE_IPV6) & (end - l3 >= IPV6.size)
    c.classes["non_ip"] += int((~(et == ETHERTYPE_IPV4) & ~(et == ETHERTYPE_IPV6)).sum())

    n = len(idx)
    proto = np.full(n, -1, np.int64)
    l4 = np.zeros(n, np.int64)
    ip_end = np.zeros(n, np.int64)
    i4 = np.nonzero(v4)[0]
    vihl = _u(IPV4, data, l3[i4], "ver_ihl")
    good = ((vihl >> 4) == 4) & ((vihl & 15) >= 5)
    c.malformed["bad_ipv4_header"] += int((~good).sum())
    i4, vihl = i4[good], vihl[good]
    frag = _u(IPV4, data, l3[i4], "frag") & IPV4_FRAGMENT
    c.classes["ipv4_fragment"] += int((frag != 0).sum())
    i4, vihl = i4[frag == 0], vihl[frag == 0]
    proto[i4] = _u(IPV4, data, l3[i4], "proto")
    l4[i4] = l3[i4] + (vihl & 15) * 4
    tot = _u(IPV4, data, l3[i4], "total_len")
    # total_len 0 is a GSO super-frame beyond 64 KiB (BIG TCP): the frame's end bounds it.
    ip_end[i4] = np.where(tot == 0, end[i4], l3[i4] + tot)
    i6 = np.nonzero(v6)[0]
    proto[i6] = _u(IPV6, data, l3[i6], "next")  # extension headers are not followed
    l4[i6] = l3[i6] + IPV6.size
    ip_end[i6] = l3[i6] + IPV6.size + _u(IPV6, data, l3[i6], "payload_len")

    ip = proto >= 0
    c.classes["ip_not_tcp"] += int((ip & (proto != IPPROTO_TCP)).sum())
    t = np.nonzero(proto == IPPROTO_TCP)[0]
    ok = (ip_end[t] <= end[t]) & (l4[t] + TCP.size <= ip_end[t])
    c.malformed["bad_ip_length"] += int((~ok).sum())
    t = t[ok]
    tl4 = l4[t]
    offf = _u(TCP, data, tl4, "off_flags")
    doff = (offf >> 12) * 4
    ok = (doff >= TCP.size) & (tl4 + doff <= ip_end[t])
    c.malformed["bad_tcp_offset"] += int((~ok).sum())
    t, tl4, offf, doff = t[ok], tl4[ok], offf[ok], doff[ok]
    c.classes["tcp"] += len(t)
    fr = idx[t]

    src = np.zeros((len(t), 16), np.uint8)
    dst = np.zeros((len(t), 16), np.uint8)
    is4 = np.nonzero(et[t] == ETHERTYPE_IPV4)[0]
    is6 = np.nonzero(et[t] == ETHERTYPE_IPV6)[0]
    src[is6] = IPV6.read_bytes(data, l3[t[is6]], "src")
    dst[is6] = IPV6.read_bytes(data, l3[t[is6]], "dst")
    src[is4, 10:12] = 0xFF
    dst[is4, 10:12] = 0xFF
    src[is4, 12:] = IPV4.read_bytes(data, l3[t[is4]], "src")
    dst[is4, 12:] = IPV4.read_bytes(data, l3[t[is4]], "dst")
    segs = TcpSegments(
        frame=fr, ts_ns=batch.ts_ns[fr], src=src, dst=dst,
        sport=_u(TCP, data, tl4, "sport"), dport=_u(TCP, data, tl4, "dport"),
        seq=_u(TCP, data, tl4, "seq"), ack=_u(TCP, data, tl4, "ack"), flags=offf & 0x1FF,
        pay_off=tl4 + doff, pay_len=ip_end[t] - tl4 - doff,
    )
    return segs, c


# -- reassembly -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamKey:
    """One direction of a TCP connection."""

    src: bytes  # 16 bytes
    dst: bytes
    sport: int
    dport: int

    def reverse(self) -> StreamKey:
        return StreamKey(self.dst, self.src, self.dport, self.sport)

    def __str__(self) -> str:
        return f"{address_text(self.src)}:{self.sport}->{address_text(self.dst)}:{self.dport}"


@dataclass
class StreamStats:
    segments: int = 0
    bytes: int = 0  # payload bytes received (with duplicates)
    duplicate_bytes: int = 0
    conflict_bytes: int = 0
    late_bytes: int = 0  # arrived below ``settled``: too late to be used
    lost_bytes: int = 0  # declared lost
    before_start: int = 0  # bytes before the first byte of a stream joined mid-way
    implausible: int = 0  # segments beyond MAX_JUMP: not believed
    syns: int = 0
    restarts: int = 0


def _merge(iv: list[list[int]], a: int, b: int) -> None:
    """Adds [a, b) to a sorted list of disjoint [start, end) ranges, merging neighbours."""
    k = 0
    while k < len(iv) and iv[k][1] < a:
        k += 1
    j = k
    while j < len(iv) and iv[j][0] <= b:
        a, b = min(a, iv[j][0]), max(b, iv[j][1])
        j += 1
    iv[k:j] = [[a, b]]


def _overlaps(iv: list[list[int]], a: int, b: int) -> list[tuple[int, int]]:
    return [(max(a, s), min(b, e)) for s, e in iv if s < b and e > a]


class TcpStream:
    """The bytes of one direction, addressed by unwrapped sequence number."""

    def __init__(self, key: StreamKey, window_bytes: int = DEFAULT_WINDOW_BYTES, hole_ns: int = DEFAULT_HOLE_NS):
        self.key = key
        self.window_bytes = window_bytes
        self.hole_ns = hole_ns
        self._hole: tuple[int, int] | None = None  # (where, capture time first seen) of the first hole
        self.stats = StreamStats()
        self.restart(None, 0)

    def restart(self, start: int | None, ts: int, from_syn: bool = False, initiator: bool = False) -> None:
        """A new connection on this 4-tuple (SYN) or the first segment ever seen."""
        self.start = start  # first byte of the stream (None until the first segment)
        self.from_syn = from_syn  # True: ``start`` is the connection's first data byte
        self.initiator = initiator  # this direction's SYN had no ACK: it opened the connection
        self.generation = getattr(self, "generation", -1) + 1
        self.hi = start if start is not None else 0  # end of the highest byte seen
        self.settled = start if start is not None else 0
        self.buf = np.zeros(0, np.uint8)
        self.buf_lo = start if start is not None else 0  # sequence number of buf[0]
        self.have: list[list[int]] = []  # received ranges
        self.bad: list[list[int]] = []  # ranges whose copies disagreed
        self._hole = None
        self.last_ts = ts

    # -- writing --------------------------------------------------------------------------------

    def unwrap(self, seq: np.ndarray) -> np.ndarray:
        ref = self.hi
        return ref + ((seq - (ref % SEQ_MOD) + _HALF) % SEQ_MOD) - _HALF

    def _room(self, end: int) -> None:
        need = end - self.buf_lo
        if need <= len(self.buf):
            return
        buf = np.zeros(max(need, 2 * len(self.buf), 1 << 16), np.uint8)
        buf[: len(self.buf)] = self.buf
        self.buf = buf

    def place(self, a: np.ndarray, ln: np.ndarray, off: np.ndarray, data: np.ndarray) -> None:
        """Payloads ``data[off:off+ln]`` at sequence numbers ``a`` (unwrapped), in arrival order."""
        st = self.stats
        lo = self.settled
        b = a + ln
        late = b <= lo
        if late.any():
            st.late_bytes += int(ln[late].sum())
        part = (a < lo) & ~late  # straddles the settled line: keep the part above it
        if part.any():
            cut = lo - a[part]
            st.late_bytes += int(cut.sum())
            a, off, ln = a.copy(), off.copy(), ln.copy()
            a[part] += cut
            off[part] += cut
            ln[part] -= cut
        keep = ~late & (ln > 0)
        a, ln, off = a[keep], ln[keep], off[keep]
        if not len(a):
            return
        b = a + ln
        # Fresh segments start at or above every byte seen before them: nothing to compare.
        run = np.maximum.accumulate(np.concatenate([[self.hi], b]))[:-1]
        fresh = a >= run
        self._room(int(b.max()))
        f = np.nonzero(fresh)[0]
        if len(f):
            copy_ranges(data, np.ascontiguousarray(off[f]), self.buf,
                              np.ascontiguousarray(a[f] - self.buf_lo), np.ascontiguousarray(ln[f]))
            fa, fb = a[f], b[f]
            brk = np.nonzero(fa[1:] != fb[:-1])[0] + 1  # consecutive fresh segments merge
            starts = np.concatenate([[0], brk])
            stops = np.concatenate([brk, [len(f)]]) - 1
            for s, e in zip(fa[starts].tolist(), fb[stops].tolist()):
                _merge(self.have, s, e)
        for k in np.nonzero(~fresh)[0].tolist():  # overlaps something: compare, then fill
            self._place_overlapping(int(a[k]), int(b[k]), int(off[k]), data)
        self.hi = max(self.hi, int(b.max()))

    def _place_overlapping(self, a: int, b: int, off: int, data: np.ndarray) -> None:
        st = self.stats
        new = data[off: off + (b - a)]
        held = _overlaps(self.have, a, b)
        for s, e in held:
            st.duplicate_bytes += e - s
            old = self.buf[s - self.buf_lo: e - self.buf_lo]
            diff = np.nonzero(old != new[s - a: e - a])[0]
            if len(diff):  # the copies disagree: neither is trusted
                ds, de = s + int(diff[0]), s + int(diff[-1]) + 1
                st.conflict_bytes += de - ds
                _merge(self.bad, ds, de)
        pos = a
        for s, e in held + [(b, b)]:
            if s > pos:
                self.buf[pos - self.buf_lo: s - self.buf_lo] = new[pos - a: s - a]
                _merge(self.have, pos, s)
            pos = max(pos, e)

    # -- reading --------------------------------------------------------------------------------

    def settle(self, final: bool = False, now: int | None = None) -> None:
        """Moves ``settled`` over received bytes and over holes the stream has left ``window_bytes``
        bytes behind or that waited ``hole_ns`` since capture time ``now`` first saw them
        (every hole when ``final``)."""
        s = self._run_end(max(self.settled, self.hi if final else self.hi - self.window_bytes))
        if not final and now is not None and s < self.hi:  # a hole starts at s
            if self._hole is None or self._hole[0] != s:
                self._hole = (s, now)
            elif now - self._hole[1] >= self.hole_ns:
                s = self._run_end(min((lo for lo, _ in self.have if lo > s), default=self.hi))
        if s > self.settled:
            self.stats.lost_bytes += (s - self.settled) - self._present(self.settled, s)
            self.settled = s

    def _run_end(self, s: int) -> int:
        for lo, hi in self.have:  # runs are merged: one step reaches the end of the run
            if lo <= s < hi:
                return hi
        return s

    def _present(self, a: int, b: int) -> int:
        return sum(e - s for s, e in _overlaps(self.have, a, b))

    def holes(self, a: int, b: int) -> list[tuple[int, int]]:
        """Missing or disputed byte ranges in [a, b), as (start relative to a, length)."""
        out: list[list[int]] = []
        pos = a
        for s, e in _overlaps(self.have, a, b):
            if s > pos:
                _merge(out, pos, s)
            pos = max(pos, e)
        if pos < b:
            _merge(out, pos, b)
        for s, e in _overlaps(self.bad, a, b):
            _merge(out, s, e)
        return [(s - a, e - s) for s, e in out]

    def runs(self, a: int, b: int) -> list[tuple[int, int]]:
        """Good (received, undisputed) ranges in [a, b), absolute."""
        out, pos = [], a
        for s, ln in self.holes(a, b):
            if a + s > pos:
                out.append((pos, a + s))
            pos = a + s + ln
        if pos < b:
            out.append((pos, b))
        return out

    def view(self, a: int, b: int) -> np.ndarray:
        """Bytes [a, b) (zeros where missing); a view that stays valid and unchanged."""
        return self.buf[a - self.buf_lo: b - self.buf_lo]

    def release(self, upto: int) -> None:
        """The consumer no longer needs bytes below ``upto``: drop them from the buffer."""
        upto = min(upto, self.settled)
        drop = upto - self.buf_lo
        if drop <= 0 or drop < len(self.buf) // 2:
            return  # compact only when it frees at least half the buffer
        keep = max(0, self.hi - upto)
        buf = np.zeros(max(keep, 1 << 16), np.uint8)
        buf[:keep] = self.buf[drop: drop + keep]
        self.buf, self.buf_lo = buf, upto
        self.have = [[max(s, upto), e] for s, e in self.have if e > upto]
        self.bad = [[max(s, upto), e] for s, e in self.bad if e > upto]


class TcpReassembler:
    """Streams by direction; ``feed`` places a batch's segments and settles the streams it
    touched and those waiting on a hole (by the batch's capture time)."""

    def __init__(self, window_bytes: int = DEFAULT_WINDOW_BYTES, hole_ns: int = DEFAULT_HOLE_NS):
        self.window_bytes = window_bytes
        self.hole_ns = hole_ns
        self.streams: dict[StreamKey, TcpStream] = {}

    def feed(self, segs: TcpSegments, data: np.ndarray, now: int | None = None) -> list[TcpStream]:
        touched = self._feed(segs, data, now)
        seen = {id(st) for st in touched}
        for st in self.streams.values():
            if id(st) not in seen and st.settled < st.hi:
                before = st.settled
                st.settle(now=now)
                if st.settled > before:
                    touched.append(st)
        return touched

    def _feed(self, segs: TcpSegments, data: np.ndarray, now: int | None) -> list[TcpStream]:
        if not len(segs):
            return []
        keys = np.concatenate([segs.src, segs.dst, segs.sport.astype(">u2").view(np.uint8).reshape(-1, 2),
                               segs.dport.astype(">u2").view(np.uint8).reshape(-1, 2)], axis=1)
        uniq, inv = np.unique(np.ascontiguousarray(keys).view(np.dtype((np.void, 36))).ravel(),
                              return_inverse=True)
        touched = []
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
        for g in range(len(uniq)):
            rows = order[bounds[g]:bounds[g + 1]]
            raw = uniq[g].tobytes()
            key = StreamKey(raw[:16], raw[16:32], int.from_bytes(raw[32:34], "big"),
                            int.from_bytes(raw[34:], "big"))
            st = self.streams.get(key)
            if st is None:
                st = self.streams[key] = TcpStream(key, self.window_bytes, self.hole_ns)
            self._feed_stream(st, segs.take(rows), data, now)
            touched.append(st)
        return touched

    def _feed_stream(self, st: TcpStream, s: TcpSegments, data: np.ndarray, now: int | None) -> None:
        st.stats.segments += len(s)
        st.stats.bytes += int(s.pay_len.sum())
        st.last_ts = max(st.last_ts, int(s.ts_ns.max()))
        syn = np.nonzero(s.flags & SYN)[0]
        lo = 0
        for k in syn.tolist():  # a SYN starts the stream at ISN + 1
            st.stats.syns += 1
            isn1 = (int(s.seq[k]) + 1) % SEQ_MOD
            if st.start is not None and st.from_syn and int(st.unwrap(np.array([isn1]))[0]) == st.start:
                continue  # a retransmitted SYN
            if k > lo:
                self._place(st, s.take(np.arange(lo, k)), data)
            if st.start is not None:
                st.stats.restarts += 1
            st.restart(isn1, int(s.ts_ns[k]), from_syn=True, initiator=not int(s.flags[k]) & ACK)
            lo = k
        rest = s.take(np.arange(lo, len(s)))
        if syn.size:
            # Data in a SYN segment starts one past its sequence number.
            rest.seq = np.where(rest.flags & SYN, (rest.seq + 1) % SEQ_MOD, rest.seq)
        self._place(st, rest, data)
        st.settle(now=now)

    def _place(self, st: TcpStream, s: TcpSegments, data: np.ndarray) -> None:
        d = s.pay_len > 0
        if not d.any():
            return
        s = s.take(np.nonzero(d)[0])
        if st.start is None:  # joined mid-way: the stream starts at its first segment
            first = int(s.seq[0])
            st.restart(first, int(s.ts_ns[0]))
        a = st.unwrap(s.seq)
        ln, off = s.pay_len, s.pay_off
        before = a < st.start
        if before.any():  # bytes before the first one of a stream joined mid-way
            cut = np.minimum(ln, st.start - a) * before
            st.stats.before_start += int(cut.sum())
            a, ln, off = a + cut, ln - cut, off + cut
        far = a + ln > st.hi + MAX_JUMP
        if far.any():
            st.stats.implausible += int(far.sum())
            a, ln, off = a[~far], ln[~far], off[~far]
        st.place(a, ln, off, data)

    def flush(self) -> list[TcpStream]:
        for st in self.streams.values():
            st.settle(final=True)
        return list(self.streams.values())
