"""Background traffic on a mirrored port, as the real captures show it next to NCCL's.

Kinds (each a Poisson stream of ``rate_hz`` events per simulated second, per direction):
  arp     ARP who-has for a ring peer's IPv4 address, and its reply;
  ptp     PTPv2 over IPv4 multicast (224.0.1.129): Sync on port 319, Follow_Up and Announce on 320
          (rdma32 and allreduce+p2p carry them);
  tcp     segments of a TCP connection between the rank and rank 0's IPv4 address (NCCL's bootstrap;
          iter_40000_p2p_iter10_2 carries one);
  probes  pairs of UD SEND ONLY to QP 1 on the UDP source port of one of the rank's QP pairs,
          P_Key 0x7FFF, Q_Key 0x80010000, 64-byte payload (the NIC's congestion-control probes of
          iter_40000_p2p_iter10; layout copied field by field: constant words, a counter, times);
  vendor  opcode 0xAA packets whose ICRC does not verify (rdma32).
Frames are built from header tables (parser.headers, and ARP/PTP below: only the generator writes
them), so noise never carries an offset of its own.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.parser.headers import (
    BTH,
    DETH,
    ETH,
    ETHERTYPE_ARP,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ICRC_BYTES,
    IPPROTO_TCP,
    IPPROTO_UDP,
    IPV4,
    IPV6,
    PTP_PORTS,
    ROCEV2_PORT,
    TCP,
    UDP,
    Field,
    Header,
)
from mirrorckpt.parser.roce import _fast
from mirrorckpt.tools.generator import frames
from mirrorckpt.tools.generator.frames import FrameSet
from mirrorckpt.tools.generator.messages import UD, MessageLog
from mirrorckpt.tools.generator.topology import Topology

KINDS = ("arp", "ptp", "tcp", "probes", "vendor")

# RFC 826 for Ethernet/IPv4.
ARP = Header("arp", 28, [
    Field("htype", 0, 2), Field("ptype", 2, 2), Field("hlen", 4, 1), Field("plen", 5, 1), Field("oper", 6, 2),
    Field("sha", 8, 6), Field("spa", 14, 4), Field("tha", 18, 6), Field("tpa", 24, 4),
])
ARP_REQUEST, ARP_REPLY = 1, 2
# IEEE 1588-2008 common header (34 bytes) + a 10-byte timestamp body.
PTP = Header("ptp", 44, [
    Field("type", 0, 1), Field("version", 1, 1), Field("length", 2, 2), Field("domain", 4, 1),
    Field("flags", 6, 2), Field("correction", 8, 8), Field("clock", 20, 8), Field("port", 28, 2),
    Field("seq", 30, 2), Field("control", 32, 1), Field("interval", 33, 1), Field("ts_sec", 34, 6),
    Field("ts_ns", 40, 4),
])
PTP_SYNC, PTP_FOLLOW_UP, PTP_ANNOUNCE = 0x0, 0x8, 0xB
PTP_MCAST_IP = bytes([224, 0, 1, 129])
PTP_MCAST_MAC = bytes([0x01, 0x00, 0x5E, 0x00, 0x01, 0x81])
BROADCAST_MAC = b"\xff" * 6
MIN_FRAME = 60  # Ethernet minimum without FCS
TCP_ACK, TCP_PSH = 0x10, 0x08
# Congestion-control probe (iter_40000_p2p_iter10): UD to QP 1 from QP 1.
PROBE_QP, PROBE_QKEY, PROBE_PKEY, PROBE_TCLASS, PROBE_HOP = 1, 0x80010000, 0x7FFF, 0x8A, 255
PROBE_WORDS = (0x010D0181, 0, 0x7D7B81DE)  # the constant words that open every probe payload
PROBE_BYTES = 64
VENDOR_OPCODE, VENDOR_TCLASS = 0xAA, 0x88


@dataclass
class NoiseOptions:
    kinds: frozenset = field(default_factory=frozenset)
    rate_hz: float = 2000.0
    seed: int = 0

    def __post_init__(self):
        bad = set(self.kinds) - set(KINDS)
        if bad:
            raise ValueError(f"noise kind(s) {', '.join(sorted(bad))} not one of {', '.join(KINDS)}")
        if self.rate_hz < 0:
            raise ValueError("noise rate must not be negative")


def _eth(dst: bytes, src: bytes, etype: int) -> bytes:
    return ETH.pack(dst=dst, src=src, type=etype)


def _ipv4(src: bytes, dst: bytes, proto: int, payload_len: int, ttl: int = 64, ident: int = 0) -> bytes:
    hdr = bytearray(IPV4.pack(ver_ihl=frames.IPV4_VERSION_IHL, total_len=IPV4.size + payload_len, id=ident,
                              frag=frames.IPV4_DONT_FRAGMENT, ttl=ttl, proto=proto, src=src, dst=dst))
    a = np.frombuffer(bytes(hdr), np.uint8).copy()
    csum = int(frames.ipv4_checksum(a, np.array([0]))[0])
    return IPV4.pack(ver_ihl=frames.IPV4_VERSION_IHL, total_len=IPV4.size + payload_len, id=ident,
                     frag=frames.IPV4_DONT_FRAGMENT, ttl=ttl, proto=proto, src=src, dst=dst, csum=csum)


def _inet_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = int(np.frombuffer(data, ">u2").astype(np.uint64).sum())
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _pad(frame: bytes) -> bytes:
    return frame + b"\0" * max(0, MIN_FRAME - len(frame))


class NoiseSource:
    """Noise for one mirrored port (``rank``; ``egress``/``ingress`` say which directions)."""

    def __init__(self, opts: NoiseOptions, topo: Topology, rank: int, egress: bool, ingress: bool, v6: bool,
                 name: str):
        self.opts, self.topo, self.rank, self.v6 = opts, topo, rank, v6
        self.dirs = [d for d, on in (("egress", egress), ("ingress", ingress)) if on]
        self.rng = np.random.default_rng([opts.seed, zlib.crc32(name.encode()), 0x4015E])
        self.seq = {}  # per stream: PTP sequence ids, TCP sequence numbers, probe counters
        self.counts = {k: 0 for k in KINDS}
        me = topo.nics[rank]
        # peers: the ring neighbours of this rank (any channel) and the QP pairs it belongs to
        self.pairs = [p for p in list(topo.ring.values()) + list(topo.p2p.values()) if rank in (p.sender, p.receiver)]
        self.peers = sorted({p.receiver if p.sender == rank else p.sender for p in self.pairs}) or \
            [(rank + 1) % topo.nranks]
        self.master_mac = bytes([0x80, 0x61, 0x6C, 0x7F, 0xBA, 0x7C])  # the switch (PTP grandmaster)
        self.master_ip = bytes([10, 88, 0, 1])
        self.me = me

    def frames(self, t0: int, t1: int) -> FrameSet:
        """Noise frames with timestamps in [t0, t1)."""
        if not self.opts.kinds or t1 <= t0 or self.opts.rate_hz == 0:
            return FrameSet.empty()
        self.pairs = [p for p in list(self.topo.ring.values()) + list(self.topo.p2p.values())
                      if self.rank in (p.sender, p.receiver)]
        events = []
        for kind in KINDS:
            if kind not in self.opts.kinds:
                continue
            for d in self.dirs:
                n = self.rng.poisson(self.opts.rate_hz * (t1 - t0) / 1e9)
                events += [(ts, KINDS.index(kind), d) for ts in self.rng.integers(t0, t1, n).tolist()]
        out: list[tuple[int, bytes]] = []
        probes = MessageLog()
        for ts, k, d in sorted(events):  # in time order: a TCP segment ACKs what came before it
            self.counts[KINDS[k]] += 1
            if KINDS[k] == "probes":
                self._probe(probes, d, ts)
            else:
                out += getattr(self, "_" + KINDS[k])(d, ts)
        parts = [self._raw(out)]
        if len(probes):
            parts.append(self._built(probes))
        fs = FrameSet.merge(parts)
        return fs.take(np.flatnonzero(fs.ts < t1))  # a pair's second frame may fall past the window

    # -- assembling ------------------------------------------------------------------------------

    @staticmethod
    def _raw(items: list[tuple[int, bytes]]) -> FrameSet:
        if not items:
            return FrameSet.empty()
        items.sort(key=lambda x: x[0])
        lens = np.array([len(f) for _, f in items], np.int64)
        off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        z = np.zeros(len(items), np.int64)
        return FrameSet(np.frombuffer(b"".join(f for _, f in items), np.uint8).copy(), off, lens, lens.copy(),
                        np.array([t for t, _ in items], np.int64), np.zeros(len(items), bool), z, z, z, z, z)

    def _built(self, log: MessageLog) -> FrameSet:
        pk, ts = log.packets()
        macs = np.array([list(n.mac) for n in self.topo.nics], np.uint8)
        ips = np.array([list(n.ip(self.v6)) for n in self.topo.nics], np.uint8)
        b = frames.build(pk, log.pool_array(), macs, ips, self.v6)
        z = np.zeros(len(pk), np.int64)
        fs = FrameSet(b.data, b.offset, b.length, b.length.copy(), ts, np.zeros(len(pk), bool), z, z, z, z, z)
        return fs.take(np.argsort(ts, kind="stable"))

    def _ends(self, d: str) -> tuple[int, int]:
        """(from rank, to rank) of a frame in direction ``d`` between this rank and a random peer."""
        peer = int(self.peers[self.rng.integers(len(self.peers))])
        return (self.rank, peer) if d == "egress" else (peer, self.rank)

    # -- kinds -----------------------------------------------------------------------------------

    def _arp(self, d: str, ts: int) -> list[tuple[int, bytes]]:
        a, b = self._ends(d)
        na, nb = self.topo.nics[a], self.topo.nics[b]
        req = _pad(_eth(BROADCAST_MAC, na.mac, ETHERTYPE_ARP) + ARP.pack(
            htype=1, ptype=ETHERTYPE_IPV4, hlen=6, plen=4, oper=ARP_REQUEST, sha=na.mac, spa=na.ipv4,
            tpa=nb.ipv4))
        rep = _pad(_eth(na.mac, nb.mac, ETHERTYPE_ARP) + ARP.pack(
            htype=1, ptype=ETHERTYPE_IPV4, hlen=6, plen=4, oper=ARP_REPLY, sha=nb.mac, spa=nb.ipv4, tha=na.mac,
            tpa=na.ipv4))
        # the mirror sees the request leave (egress) or the peer's reply arrive (ingress)
        return [(ts, req)] if d == "egress" else [(ts, rep)]

    def _ptp(self, d: str, ts: int) -> list[tuple[int, bytes]]:
        if d == "egress":
            mac, ip, clock = self.me.mac, self.me.ipv4, self.me.mac[:3] + b"\xff\xfe" + self.me.mac[3:]
        else:
            mac, ip, clock = self.master_mac, self.master_ip, self.master_mac[:3] + b"\xff\xfe" + self.master_mac[3:]
        seq = self.seq[("ptp", d)] = (self.seq.get(("ptp", d), 0) + 1) & 0xFFFF
        out = []
        for k, (mtype, port, ctrl) in enumerate(((PTP_SYNC, PTP_PORTS[0], 0), (PTP_FOLLOW_UP, PTP_PORTS[1], 2))):
            body = PTP.pack(type=mtype, version=2, length=PTP.size, flags=0x0200 if mtype == PTP_SYNC else 0,
                            clock=clock, port=1, seq=seq, control=ctrl, interval=0, ts_sec=ts // 10**9,
                            ts_ns=ts % 10**9)
            udp = UDP.pack(sport=port, dport=port, len=UDP.size + len(body))
            frame = _eth(PTP_MCAST_MAC, mac, ETHERTYPE_IPV4) + _ipv4(ip, PTP_MCAST_IP, IPPROTO_UDP,
                                                                     UDP.size + len(body), ttl=1) + udp + body
            out.append((ts + k * 15_000, _pad(frame)))
        if seq % 8 == 0:
            body = PTP.pack(type=PTP_ANNOUNCE, version=2, length=PTP.size, clock=clock, port=1, seq=seq, control=5)
            udp = UDP.pack(sport=PTP_PORTS[1], dport=PTP_PORTS[1], len=UDP.size + len(body))
            out.append((ts + 30_000, _pad(_eth(PTP_MCAST_MAC, mac, ETHERTYPE_IPV4) + _ipv4(
                ip, PTP_MCAST_IP, IPPROTO_UDP, UDP.size + len(body), ttl=1) + udp + body)))
        return out

    def _tcp(self, d: str, ts: int) -> list[tuple[int, bytes]]:
        peer = 0 if self.rank != 0 else self.peers[0]
        a, b = (self.rank, peer) if d == "egress" else (peer, self.rank)
        na, nb = self.topo.nics[a], self.topo.nics[b]
        # one connection per pair of ranks: each side's next sequence number, and it ACKs the other's
        for x, y in ((a, b), (b, a)):
            self.seq.setdefault(("tcp", x, y), int(self.rng.integers(0, 1 << 32)))
        seq, ack = self.seq[("tcp", a, b)], self.seq[("tcp", b, a)]
        payload = self.rng.integers(0, 256, int(self.rng.integers(8, 200)), dtype=np.uint8).tobytes()
        sport, dport = (47144, 43239) if a < b else (43239, 47144)
        flags = (5 << 12) | TCP_ACK | TCP_PSH
        seg = TCP.pack(sport=sport, dport=dport, seq=seq, ack=ack, off_flags=flags, window=502)
        pseudo = na.ipv4 + nb.ipv4 + bytes([0, IPPROTO_TCP]) + (len(seg) + len(payload)).to_bytes(2, "big")
        csum = (~_inet_sum(pseudo + seg + payload)) & 0xFFFF
        seg = TCP.pack(sport=sport, dport=dport, seq=seq, ack=ack, off_flags=flags, window=502, csum=csum)
        self.seq[("tcp", a, b)] = (seq + len(payload)) & 0xFFFFFFFF
        frame = _eth(nb.mac, na.mac, ETHERTYPE_IPV4) + _ipv4(na.ipv4, nb.ipv4, IPPROTO_TCP, len(seg) + len(payload),
                                                             ident=int(self.rng.integers(0, 1 << 16))) + seg + payload
        return [(ts, _pad(frame))]

    def _probe(self, log: MessageLog, d: str, ts: int) -> None:
        pairs = self.pairs
        if not pairs:
            return
        p = pairs[int(self.rng.integers(len(pairs)))]
        peer = p.receiver if p.sender == self.rank else p.sender
        a, b = (self.rank, peer) if d == "egress" else (peer, self.rank)
        n = self.seq[("probe", a, p.sport)] = self.seq.get(("probe", a, p.sport), 0) + 1
        t = (ts // 16) & 0xFFFFFFFF
        for k in range(2):  # probes come in pairs with the same counter
            words = np.zeros(PROBE_BYTES // 4, ">u4")
            words[:3] = PROBE_WORDS
            words[3] = n & 0xFF
            words[4] = 0x00100000
            words[10] = 0x8811_0000 | (t & 0xFFFF)
            words[11] = (t + 0x1000 * k) & 0xFFFFFFFF
            words[12] = (t + 0x1000 * k + 0x90) & 0xFFFFFFFF
            log.add(UD, a, b, p.sport, PROBE_QP, 0, ts + 1000 * k, length=PROBE_BYTES,
                    pay_off=log.payload(words.view(np.uint8)), qkey=PROBE_QKEY, srcqp=PROBE_QP, pkey=PROBE_PKEY,
                    tclass=PROBE_TCLASS, hop=PROBE_HOP)

    def _vendor(self, d: str, ts: int) -> list[tuple[int, bytes]]:
        p = self.pairs[int(self.rng.integers(len(self.pairs)))] if self.pairs else None
        peer = (p.receiver if p.sender == self.rank else p.sender) if p else self.peers[0]
        a, b = (self.rank, peer) if d == "egress" else (peer, self.rank)
        na, nb = self.topo.nics[a], self.topo.nics[b]
        bth = BTH.pack(opcode=VENDOR_OPCODE, flags=0xAA, pkey=0xAAAA, resv8a=0xBB, dqp=0xBBBBBB, ackreq=0x01,
                       psn=0x030001)
        # a vendor preamble, then what looks like an embedded probe (rdma32's 0xAA frames)
        inner = BTH.pack(opcode=0x64, pkey=0xFFFF, dqp=PROBE_QP) + DETH.pack(qkey=PROBE_QKEY, srcqp=PROBE_QP)
        body = bytes.fromhex("0000000f0500000000a0000000000000") + inner + self.rng.integers(
            0, 256, 56, dtype=np.uint8).tobytes()
        udp = UDP.pack(sport=p.sport if p else 0xC000, dport=ROCEV2_PORT,
                       len=UDP.size + len(bth) + len(body) + ICRC_BYTES)
        l4 = udp + bth + body + b"\0" * ICRC_BYTES
        if self.v6:
            ip = IPV6.pack(ver_tc_fl=(6 << 28) | (VENDOR_TCLASS << 20), payload_len=len(l4), next=IPPROTO_UDP,
                           hop=255, src=na.ipv6, dst=nb.ipv6)
            frame = _eth(nb.mac, na.mac, ETHERTYPE_IPV6) + ip + l4
        else:
            frame = _eth(nb.mac, na.mac, ETHERTYPE_IPV4) + _ipv4(na.ipv4, nb.ipv4, IPPROTO_UDP, len(l4), ttl=255) + l4
        # the ICRC field holds anything but the ICRC of the packet
        buf = np.frombuffer(frame, np.uint8).copy()
        crc = np.zeros(1, np.uint32)
        _fast.icrc(buf, np.array([ETH.size]), np.array([len(ip) if self.v6 else IPV4.size]),
                   np.array([int(self.v6)], np.uint8), np.array([len(frame) - ICRC_BYTES]), crc)
        bad = int(crc[0]) ^ int(self.rng.integers(1, 1 << 32))
        return [(ts, frame[:-ICRC_BYTES] + bad.to_bytes(ICRC_BYTES, "little"))]
