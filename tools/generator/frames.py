"""Vectorised RoCEv2 frame building: one numpy pass writes every header of a whole batch.

A batch is described column-wise (``Packets``: one row per packet, no per-packet Python objects).
Every field is written through the header tables of ``parser.headers`` (``put`` is the vectorised
counterpart of ``Header.read``), payloads are copied from a pool with ``capture._pack.copy_ranges``
and the ICRCs of all packets come from one call of ``parser._fast.icrc``.

Layout: Ethernet | IPv6 or IPv4 | UDP (dport 4791, checksum 0) | BTH | RETH? ImmDt? AETH? DETH? |
payload | pad to 4 bytes (BTH PadCnt) | ICRC (little-endian).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from mirrorckpt.capture._pack import copy_ranges
from mirrorckpt.parser.headers import (
    AETH,
    BTH,
    DETH,
    ETH,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ICRC_BYTES,
    IMMDT,
    IPPROTO_UDP,
    IPV4,
    IPV6,
    RETH,
    ROCEV2_PORT,
    UDP,
    Header,
)
from mirrorckpt.parser.roce import _fast, opcodes

# BTH byte 1: SE(1) M(1) PadCnt(2) TVer(4). ConnectX sets M (MigReq) on RC traffic (real captures).
BTH_MIGREQ = 0x40
BTH_PAD_SHIFT = 4
ACKREQ = 0x80  # BTH byte 8, top bit
IPV4_DONT_FRAGMENT = 0x4000
IPV4_VERSION_IHL = 0x45
IPV6_VERSION = 6


def put(buf: np.ndarray, base: np.ndarray, header: Header, name: str, values) -> None:
    """Write field ``name`` of the headers starting at ``buf[base]`` (one value per row, or one
    value for all rows; byte fields take an (N, size) uint8 matrix or one bytes value)."""
    f = header[name]
    pos = np.asarray(base, dtype=np.int64) + f.offset
    n = pos.shape[0]
    if not n:
        return
    if isinstance(values, (bytes, bytearray)) or (isinstance(values, np.ndarray) and values.dtype == np.uint8
                                                  and values.ndim == 2):
        raw = np.frombuffer(bytes(values), np.uint8) if isinstance(values, (bytes, bytearray)) else values
        raw = np.broadcast_to(raw.reshape(-1, f.size), (n, f.size))
    else:
        # as 8-byte integers in the field's byte order, then the field's low bytes
        dt = np.dtype(f"{'>' if f.order == 'big' else '<'}{'i' if f.signed else 'u'}8")
        v = np.broadcast_to(np.asarray(values).astype(np.int64 if f.signed else np.uint64), (n,)).astype(dt)
        raw = v.view(np.uint8).reshape(n, 8)
        raw = raw[:, 8 - f.size:] if f.order == "big" else raw[:, :f.size]
    buf[pos[:, None] + np.arange(f.size)] = raw


def ipv4_checksum(buf: np.ndarray, ip_off: np.ndarray) -> np.ndarray:
    """RFC 791 header checksums of the 20-byte IPv4 headers at ``ip_off`` (checksum field zero)."""
    words = buf[ip_off[:, None] + np.arange(IPV4.size)].astype(np.uint32).reshape(-1, IPV4.size // 2, 2)
    s = (words[:, :, 0] << 8 | words[:, :, 1]).sum(axis=1)
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


@dataclass
class Packets:
    """RoCEv2 packets, one row each. Fields absent from an opcode's headers are ignored."""

    src: np.ndarray  # rank of the sending NIC
    dst: np.ndarray  # rank of the receiving NIC
    sport: np.ndarray
    opcode: np.ndarray
    dqp: np.ndarray
    psn: np.ndarray
    ackreq: np.ndarray  # bool
    pay_off: np.ndarray  # payload offset in the pool
    pay_len: np.ndarray
    va: np.ndarray
    rkey: np.ndarray
    dlen: np.ndarray
    imm: np.ndarray  # ImmDt as read big-endian (parser.nccl_versions.encode_imm)
    syndrome: np.ndarray
    msn: np.ndarray
    qkey: np.ndarray
    srcqp: np.ndarray
    pkey: np.ndarray
    migreq: np.ndarray  # bool: BTH M bit
    tclass: np.ndarray  # IPv6 traffic class / IPv4 TOS
    hop: np.ndarray  # hop limit / TTL
    bad_icrc: np.ndarray  # bool: write a wrong ICRC (vendor probes)

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def take(self, idx) -> Packets:
        return Packets(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @staticmethod
    def concat(parts: list[Packets]) -> Packets:
        return Packets(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Packets)})


@dataclass
class Built:
    """Frames of a batch laid out back to back in ``data``; per frame its offset and length, the
    offset of the BTH and the end of the BTH's extension headers (payload start) and of the ICRC."""
    data: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    bth: np.ndarray  # relative to the frame
    pay: np.ndarray
    icrc: np.ndarray


def build(pk: Packets, pool: np.ndarray, macs: np.ndarray, ips: np.ndarray, v6: bool) -> Built:
    """Frames for ``pk``; ``macs`` (R, 6) and ``ips`` (R, 16 or 4) are the NICs' addresses by rank."""
    n = len(pk)
    op = pk.opcode.astype(np.int64)
    ext = (opcodes.HAS_RETH[op] * RETH.size + opcodes.HAS_IMMDT[op] * IMMDT.size
           + opcodes.HAS_AETH[op] * AETH.size + opcodes.HAS_DETH[op] * DETH.size)
    pay_len = pk.pay_len.astype(np.int64)
    pad = (-pay_len) % 4
    ip_size = IPV6.size if v6 else IPV4.size
    udp_len = UDP.size + BTH.size + ext + pay_len + pad + ICRC_BYTES
    length = ETH.size + ip_size + udp_len
    offset = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(length[:-1], out=offset[1:])
    buf = np.zeros(int(length.sum()), np.uint8)

    ip = offset + ETH.size
    udp = ip + ip_size
    bth = udp + UDP.size
    hdr_end = bth + BTH.size
    src, dst = pk.src.astype(np.int64), pk.dst.astype(np.int64)
    put(buf, offset, ETH, "dst", macs[dst])
    put(buf, offset, ETH, "src", macs[src])
    put(buf, offset, ETH, "type", ETHERTYPE_IPV6 if v6 else ETHERTYPE_IPV4)
    if v6:
        put(buf, ip, IPV6, "ver_tc_fl", (IPV6_VERSION << 28) | (pk.tclass.astype(np.int64) << 20))
        put(buf, ip, IPV6, "payload_len", udp_len)
        put(buf, ip, IPV6, "next", IPPROTO_UDP)
        put(buf, ip, IPV6, "hop", pk.hop)
        put(buf, ip, IPV6, "src", ips[src])
        put(buf, ip, IPV6, "dst", ips[dst])
    else:
        put(buf, ip, IPV4, "ver_ihl", IPV4_VERSION_IHL)
        put(buf, ip, IPV4, "tos", pk.tclass)
        put(buf, ip, IPV4, "total_len", IPV4.size + udp_len)
        put(buf, ip, IPV4, "frag", IPV4_DONT_FRAGMENT)
        put(buf, ip, IPV4, "ttl", pk.hop)
        put(buf, ip, IPV4, "proto", IPPROTO_UDP)
        put(buf, ip, IPV4, "src", ips[src])
        put(buf, ip, IPV4, "dst", ips[dst])
        put(buf, ip, IPV4, "csum", ipv4_checksum(buf, ip))
    put(buf, udp, UDP, "sport", pk.sport)
    put(buf, udp, UDP, "dport", ROCEV2_PORT)
    put(buf, udp, UDP, "len", udp_len)
    put(buf, bth, BTH, "opcode", op)
    put(buf, bth, BTH, "flags", np.where(pk.migreq, BTH_MIGREQ, 0) | (pad << BTH_PAD_SHIFT))
    put(buf, bth, BTH, "pkey", pk.pkey)
    put(buf, bth, BTH, "dqp", pk.dqp)
    put(buf, bth, BTH, "ackreq", np.where(pk.ackreq, ACKREQ, 0))
    put(buf, bth, BTH, "psn", pk.psn)

    at = hdr_end.copy()
    sel = np.flatnonzero(opcodes.HAS_RETH[op])
    put(buf, at[sel], RETH, "va", pk.va[sel])
    put(buf, at[sel], RETH, "rkey", pk.rkey[sel])
    put(buf, at[sel], RETH, "dlen", pk.dlen[sel])
    at[sel] += RETH.size
    sel = np.flatnonzero(opcodes.HAS_IMMDT[op])
    put(buf, at[sel], IMMDT, "imm", pk.imm[sel])
    at[sel] += IMMDT.size
    sel = np.flatnonzero(opcodes.HAS_AETH[op])
    put(buf, at[sel], AETH, "syndrome", pk.syndrome[sel])
    put(buf, at[sel], AETH, "msn", pk.msn[sel])
    at[sel] += AETH.size
    sel = np.flatnonzero(opcodes.HAS_DETH[op])
    put(buf, at[sel], DETH, "qkey", pk.qkey[sel])
    put(buf, at[sel], DETH, "srcqp", pk.srcqp[sel])
    at[sel] += DETH.size

    sel = np.flatnonzero(pay_len > 0)
    if sel.size:
        copy_ranges(np.ascontiguousarray(pool, np.uint8), np.ascontiguousarray(pk.pay_off[sel], np.int64), buf,
                          np.ascontiguousarray(at[sel]), np.ascontiguousarray(pay_len[sel]))
    icrc_at = offset + length - ICRC_BYTES
    crc = np.zeros(n, np.uint32)
    _fast.icrc(buf, ip, np.full(n, ip_size, np.int64), np.full(n, int(v6), np.uint8), icrc_at, crc)
    crc ^= np.where(pk.bad_icrc, np.uint32(0xFFFFFFFF), np.uint32(0))
    buf[icrc_at[:, None] + np.arange(ICRC_BYTES)] = crc.astype("<u4").view(np.uint8).reshape(n, ICRC_BYTES)
    return Built(buf, offset, length, bth - offset, at - offset, icrc_at - offset)


@dataclass
class FrameSet:
    """Frames of one capture file in time order: bytes in ``data``, per frame where they are, the
    timestamp, and for generated RC frames (``rc``) what a fault record names and where the bytes
    after the BTH start and stop (a corrupted byte goes there)."""
    data: np.ndarray
    offset: np.ndarray
    caplen: np.ndarray
    wirelen: np.ndarray
    ts: np.ndarray
    rc: np.ndarray  # bool
    opcode: np.ndarray
    dqp: np.ndarray
    psn: np.ndarray
    body_lo: np.ndarray  # relative to the frame: first byte after the BTH
    body_hi: np.ndarray  # relative to the frame: the ICRC

    def __len__(self) -> int:
        return int(self.offset.shape[0])

    def take(self, idx) -> FrameSet:
        out = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "data"}
        return FrameSet(data=self.data, **out)

    @staticmethod
    def empty() -> FrameSet:
        z = np.zeros(0, np.int64)
        return FrameSet(np.zeros(0, np.uint8), z, z, z, z, np.zeros(0, bool), z, z, z, z, z)

    @staticmethod
    def merge(parts: list[FrameSet]) -> FrameSet:
        """One set of ``parts``' frames in time order (stable: ties keep the parts' order)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return FrameSet.empty()
        if len(parts) == 1:
            return parts[0]
        base = np.cumsum([0] + [p.data.size for p in parts[:-1]])
        cols = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(FrameSet)
                if f.name not in ("data", "offset")}
        cols["offset"] = np.concatenate([p.offset + b for p, b in zip(parts, base)])
        merged = FrameSet(data=np.concatenate([p.data for p in parts]), **cols)
        return merged.take(np.argsort(merged.ts, kind="stable"))
