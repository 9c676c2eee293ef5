"""Vectorised RoCEv2 decode: a FrameBatch in, one row per RoCE packet out.

Every stage works on index arrays of the frames still in play, so a frame too short for the next
header simply drops out (counted as malformed) and nothing reads past a frame's captured bytes.
Non-RoCE frames are only classified and counted (ARP, LLDP, STP, PTP, TCP, other UDP...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.parser import _fast, opcodes
from mirrorckpt.parser.headers import (
    AETH, BTH, DETH, ETH, ETHERTYPE_ARP, ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETHERTYPE_LLDP, ETHERTYPE_PTP,
    ETHERTYPE_VLAN, ICRC_BYTES, IMMDT, IPPROTO_TCP, IPPROTO_UDP, IPV4, IPV6, PTP_PORTS, RETH,
    ROCEV2_PORT, UDP, VLAN,
)


@dataclass
class Counters:
    """What a decode saw; adds up across batches."""

    frames: int = 0
    truncated_frames: int = 0
    bytes: int = 0
    classes: Counter = field(default_factory=Counter)  # "arp", "tcp", "roce:RC_ACKNOWLEDGE", ...
    icrc: Counter = field(default_factory=Counter)  # "RC_RDMA_WRITE_FIRST:ok", "0xaa:BAD"
    malformed: Counter = field(default_factory=Counter)  # reason -> frames

    def add(self, other: "Counters") -> None:
        self.frames += other.frames
        self.truncated_frames += other.truncated_frames
        self.bytes += other.bytes
        self.classes.update(other.classes)
        self.icrc.update(other.icrc)
        self.malformed.update(other.malformed)

    @property
    def icrc_failed(self) -> int:
        return sum(n for k, n in self.icrc.items() if k.endswith(":BAD"))

    def by_opcode(self) -> dict[str, int]:
        return {k[5:]: n for k, n in sorted(self.classes.items()) if k.startswith("roce:")}


@dataclass
class RocePackets:
    """One row per RoCEv2 packet of a batch (struct of arrays)."""

    frame: np.ndarray  # index of the frame in the batch
    ts_ns: np.ndarray
    src: np.ndarray  # (N, 16) uint8, IPv4 as mapped IPv6
    dst: np.ndarray
    sport: np.ndarray  # UDP source port: pairs both directions of a QP pair
    opcode: np.ndarray
    pad: np.ndarray  # BTH PadCnt
    dqp: np.ndarray
    psn: np.ndarray
    ackreq: np.ndarray
    va: np.ndarray  # RETH, 0 when absent
    rkey: np.ndarray
    dlen: np.ndarray
    has_reth: np.ndarray
    has_imm: np.ndarray
    imm_raw: np.ndarray  # ImmDt read big-endian (IBTA); NCCL's meaning: nccl_versions.decode_imm
    syndrome: np.ndarray  # AETH, 0 when absent
    msn: np.ndarray
    pay_off: np.ndarray  # absolute offset of the payload in batch.data
    pay_len: np.ndarray
    icrc_ok: np.ndarray

    def __len__(self) -> int:
        return int(self.frame.shape[0])

    def take(self, idx: np.ndarray) -> "RocePackets":
        return RocePackets(**{k: v[idx] for k, v in self.__dict__.items()})

    @staticmethod
    def concat(parts: list["RocePackets"]) -> "RocePackets":
        keys = RocePackets.__dataclass_fields__
        return RocePackets(**{k: np.concatenate([getattr(p, k) for p in parts]) for k in keys})


def _u(hdr, data, pos, name):
    return hdr.read(data, pos, name).astype(np.int64)


def decode(batch: FrameBatch, icrc: bool = True) -> tuple[RocePackets, Counters]:
    """Decodes the RoCEv2 packets of ``batch``; returns them with the batch's counters."""
    c = Counters(frames=len(batch), bytes=batch.nbytes)
    data = batch.data
    trunc = batch.truncated
    c.truncated_frames = int(trunc.sum())
    if c.truncated_frames:
        c.classes["truncated"] += c.truncated_frames
    eth_ok = batch.ethernet_mask()
    if not eth_ok.all():
        c.classes["not_ethernet"] += int((~eth_ok & ~trunc).sum())
    idx = np.nonzero(eth_ok & ~trunc)[0]
    caplen = batch.caplen
    base = batch.offset

    def drop_short(idx, need, reason):
        ok = caplen[idx] >= need
        if not ok.all():
            c.malformed[reason] += int((~ok).sum())
        return idx[ok]

    idx = drop_short(idx, ETH.size, "short_ethernet")
    l3 = np.full(len(batch), -1, np.int64)
    etype = np.zeros(len(batch), np.int64)
    l3[idx] = base[idx] + ETH.size
    etype[idx] = _u(ETH, data, base[idx], "type")
    # Up to two VLAN tags (802.1Q, 802.1ad).
    for _ in range(2):
        tagged = idx[np.isin(etype[idx], ETHERTYPE_VLAN)]
        if not len(tagged):
            break
        ok = caplen[tagged] >= (l3[tagged] - base[tagged]) + VLAN.size
        c.malformed["short_vlan"] += int((~ok).sum())
        bad = tagged[~ok]
        etype[bad] = -1
        tagged = tagged[ok]
        etype[tagged] = _u(VLAN, data, l3[tagged], "type")
        l3[tagged] += VLAN.size

    et = etype[idx]
    _classify_l2(c, et)
    idx4 = idx[et == ETHERTYPE_IPV4]
    idx6 = idx[et == ETHERTYPE_IPV6]

    # --- IPv4 / IPv6 -> UDP ---
    hl = np.zeros(len(batch), np.int64)
    proto = np.zeros(len(batch), np.int64)
    ip_end = np.zeros(len(batch), np.int64)  # end of the IP packet (payload length from the header)
    idx4 = idx4[caplen[idx4] - (l3[idx4] - base[idx4]) >= IPV4.size]
    vihl = _u(IPV4, data, l3[idx4], "ver_ihl")
    good = ((vihl >> 4) == 4) & ((vihl & 15) >= 5)
    c.malformed["bad_ipv4_header"] += int((~good).sum())
    idx4 = idx4[good]
    hl[idx4] = (vihl[good] & 15) * 4
    proto[idx4] = _u(IPV4, data, l3[idx4], "proto")
    ip_end[idx4] = l3[idx4] + _u(IPV4, data, l3[idx4], "total_len")
    frag = _u(IPV4, data, l3[idx4], "frag") & 0x3FFF  # MF flag or fragment offset
    if frag.any():
        c.classes["ipv4_fragment"] += int((frag != 0).sum())
        idx4 = idx4[frag == 0]
    idx6 = idx6[caplen[idx6] - (l3[idx6] - base[idx6]) >= IPV6.size]
    hl[idx6] = IPV6.size
    proto[idx6] = _u(IPV6, data, l3[idx6], "next")
    ip_end[idx6] = l3[idx6] + IPV6.size + _u(IPV6, data, l3[idx6], "payload_len")

    ipi = np.concatenate([idx4, idx6])
    ipi.sort()
    frame_end = base + caplen
    pr = proto[ipi]
    c.classes["tcp"] += int((pr == IPPROTO_TCP).sum())
    c.classes["ip_other"] += int(((pr != IPPROTO_TCP) & (pr != IPPROTO_UDP)).sum())
    udp = ipi[pr == IPPROTO_UDP]
    l4 = l3 + hl
    udp = udp[frame_end[udp] >= l4[udp] + UDP.size]
    dport = _u(UDP, data, l4[udp], "dport")
    sport_all = _u(UDP, data, l4[udp], "sport")
    ptp = np.isin(dport, PTP_PORTS)
    c.classes["udp_ptp_event"] += int((dport == PTP_PORTS[0]).sum())
    c.classes["udp_ptp_general"] += int((dport == PTP_PORTS[1]).sum())
    rocemask = dport == ROCEV2_PORT
    c.classes["udp_other"] += int((~rocemask & ~ptp).sum())
    r = udp[rocemask]
    sport = sport_all[rocemask]

    # --- UDP length sanity: the datagram must fit the IP packet and the captured frame ---
    ulen = _u(UDP, data, l4[r], "len")
    udp_end = l4[r] + ulen
    ok = (ulen >= UDP.size + BTH.size + ICRC_BYTES) & (udp_end <= ip_end[r]) & (udp_end <= frame_end[r])
    c.malformed["bad_udp_length"] += int((~ok).sum())
    r, sport, udp_end = r[ok], sport[ok], udp_end[ok]

    bth = l4[r] + UDP.size
    op = _u(BTH, data, bth, "opcode")
    flags = _u(BTH, data, bth, "flags")
    hdr_end = bth + BTH.size
    has_reth = opcodes.HAS_RETH[op]
    has_imm = opcodes.HAS_IMMDT[op]
    has_aeth = opcodes.HAS_AETH[op]
    has_deth = opcodes.HAS_DETH[op]
    ext = (has_reth * RETH.size + has_imm * IMMDT.size + has_aeth * AETH.size + has_deth * DETH.size)
    pad = (flags >> 4) & 3
    icrc_at = udp_end - ICRC_BYTES
    pay_off = hdr_end + ext
    pay_len = icrc_at - pay_off - pad
    ok = pay_len >= 0
    c.malformed["short_roce_headers"] += int((~ok).sum())
    keep = np.nonzero(ok)[0]
    r, sport, bth, op, flags, hdr_end, icrc_at, pay_off, pay_len, pad = (
        a[keep] for a in (r, sport, bth, op, flags, hdr_end, icrc_at, pay_off, pay_len, pad))
    has_reth, has_imm, has_aeth, has_deth = (a[keep] for a in (has_reth, has_imm, has_aeth, has_deth))

    n = len(r)
    va = np.zeros(n, np.uint64)
    rkey = np.zeros(n, np.int64)
    dlen = np.zeros(n, np.int64)
    sel = np.nonzero(has_reth)[0]
    va[sel] = RETH.read(data, hdr_end[sel], "va")
    rkey[sel] = _u(RETH, data, hdr_end[sel], "rkey")
    dlen[sel] = _u(RETH, data, hdr_end[sel], "dlen")
    imm = np.zeros(n, np.int64)
    sel = np.nonzero(has_imm)[0]
    imm[sel] = _u(IMMDT, data, hdr_end[sel] + has_reth[sel] * RETH.size, "imm")
    syn = np.zeros(n, np.int64)
    msn = np.zeros(n, np.int64)
    sel = np.nonzero(has_aeth)[0]
    syn[sel] = _u(AETH, data, hdr_end[sel], "syndrome")
    msn[sel] = _u(AETH, data, hdr_end[sel], "msn")

    if icrc:
        ok = np.zeros(n, np.uint8)
        _fast.icrc_check(data, np.ascontiguousarray(l3[r]), np.ascontiguousarray(hl[r]),
                         (etype[r] == ETHERTYPE_IPV6).astype(np.uint8), np.ascontiguousarray(icrc_at), ok)
        icrc_ok = ok.astype(bool)
    else:
        icrc_ok = np.ones(n, bool)

    src = np.zeros((n, 16), np.uint8)
    dst = np.zeros((n, 16), np.uint8)
    v6 = np.nonzero(etype[r] == ETHERTYPE_IPV6)[0]
    src[v6] = IPV6.read_bytes(data, l3[r[v6]], "src")
    dst[v6] = IPV6.read_bytes(data, l3[r[v6]], "dst")
    v4 = np.nonzero(etype[r] == ETHERTYPE_IPV4)[0]
    src[v4, 10:12] = 0xFF
    dst[v4, 10:12] = 0xFF
    src[v4, 12:] = IPV4.read_bytes(data, l3[r[v4]], "src")
    dst[v4, 12:] = IPV4.read_bytes(data, l3[r[v4]], "dst")

    pk = RocePackets(
        frame=r, ts_ns=batch.ts_ns[r], src=src, dst=dst, sport=sport, opcode=op, pad=pad,
        dqp=_u(BTH, data, bth, "dqp"), psn=_u(BTH, data, bth, "psn"),
        ackreq=(_u(BTH, data, bth, "ackreq") >> 7).astype(bool),
        va=va, rkey=rkey, dlen=dlen, has_reth=has_reth, has_imm=has_imm, imm_raw=imm,
        syndrome=syn, msn=msn, pay_off=pay_off, pay_len=pay_len, icrc_ok=icrc_ok,
    )
    _count_roce(c, op, icrc_ok, icrc)
    return pk, c


_L2_NAMES = {ETHERTYPE_ARP: "arp", ETHERTYPE_LLDP: "lldp", ETHERTYPE_PTP: "ptp_l2"}


def _classify_l2(c: Counters, et: np.ndarray) -> None:
    """Counts the frames that are not IP by kind (802.3 length field = LLC, e.g. STP)."""
    non_ip = et[(et != ETHERTYPE_IPV4) & (et != ETHERTYPE_IPV6)]
    if not len(non_ip):
        return
    c.classes["llc_stp"] += int(((non_ip >= 0) & (non_ip < 0x0600)).sum())
    vals, counts = np.unique(non_ip[non_ip >= 0x0600], return_counts=True)
    for v, k in zip(vals.tolist(), counts.tolist()):
        c.classes[_L2_NAMES.get(v, f"ethertype_0x{v:04x}")] += k


def _count_roce(c: Counters, op: np.ndarray, icrc_ok: np.ndarray, checked: bool) -> None:
    key = op * 2 + icrc_ok
    vals, counts = np.unique(key, return_counts=True)
    for v, k in zip(vals.tolist(), counts.tolist()):
        name = opcodes.name(v // 2)
        c.classes[f"roce:{name}"] += k
        if checked:
            c.icrc[f"{name}:{'ok' if v % 2 else 'BAD'}"] += k
