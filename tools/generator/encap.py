"""Mirror copies as a remote mirror delivers them: each frame wrapped in ERSPAN, GRE or VXLAN.

``--encap`` kinds (the layouts of parser.headers; ERSPAN as Linux include/net/erspan.h builds it):
  erspan1   GRE (4 bytes, protocol 0x88BE, no sequence number), no ERSPAN header;
  erspan2   GRE with a sequence number + ERSPAN type II (version 1, session id, VLAN, T bit);
  erspan3   GRE with a sequence number + ERSPAN type III (version 2, timestamp, hardware id),
            with ``platform`` the O flag and an 8-byte platform sub-header;
  gre       gretap (0x6558), a bare 4-byte GRE header;
  gretap    gretap with checksum, key and sequence number (Linux `gretap csum key K seq`);
  vxlan     UDP to port 4789 (or ``vxlan_port``), VXLAN header with the session as VNI;
  vendor:P:N  GRE protocol P and N zero bytes before the frame (SONiC on Spectrum: 0x8949:22).
Over an IPv4 or IPv6 underlay, with 0-2 VLAN tags outside (``outer_vlan``) and inside the mirrored
frames (``inner_vlan``, inserted after their MAC addresses: a port that mirrors tagged traffic);
a tag's VLAN id 0 is a priority-only tag. Sequence numbers count every frame of the session, so
a frame lost after the wrapping (a fault of the capture file) leaves a gap, as on a real mirror.
``mirror_mtu`` cuts each mirrored frame to that many bytes, as a session's MTU does (ERSPAN sets
its T bit). VXLAN's outer source port follows the inner flow, the same both ways, as Linux's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
from mirrorckpt.capture._pack import copy_ranges
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser.headers import (
    ERSPAN2,
    ERSPAN3,
    ERSPAN3_O,
    ERSPAN3_PLATFORM,
    ERSPAN_TRUNCATED,
    ERSPAN_VERSION_II,
    ERSPAN_VERSION_III,
    ERSPAN_VERSION_SHIFT,
    ETH,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ETHERTYPE_VLAN,
    GRE,
    GRE_CHECKSUM,
    GRE_CSUM,
    GRE_KEY,
    GRE_NUMBER,
    GRE_PROTO_ERSPAN,
    GRE_PROTO_ERSPAN3,
    GRE_PROTO_SPECTRUM,
    GRE_PROTO_TEB,
    GRE_SEQUENCE,
    GRE_SPECTRUM_BYTES,
    GRE_WORD,
    IPPROTO_GRE,
    IPPROTO_UDP,
    IPV4,
    IPV6,
    UDP,
    VLAN,
    VXLAN,
    VXLAN_PORT,
    VXLAN_VALID_VNI,
)
from mirrorckpt.parser.roce.split import flow_ports
from mirrorckpt.tools.generator.frames import (
    IPV4_DONT_FRAGMENT,
    IPV4_VERSION_IHL,
    IPV6_VERSION,
    FrameSet,
    ipv4_checksum,
    put,
)

KINDS = ("none", "erspan1", "erspan2", "erspan3", "gre", "gretap", "vxlan")
_VENDOR = re.compile(r"^vendor:(0x[0-9a-fA-F]{1,4}|\d+):(\d+)$")
TAG_PCP = 3  # priority of the tags written (RoCE's usual traffic class)
ERSPAN_EN_INFRAME = 3  # ERSPAN II encapsulation type: the VLAN tag kept in the frame
ERSPAN3_P = 0x8000  # the frame is Ethernet
ERSPAN3_HWID_SHIFT = 4
PLATFORM_ID_SHIFT = 58  # the platform sub-header's first 6 bits
# The underlay's two ends: the switch that encapsulates and the appliance's capture port.
SWITCH_MAC, COLLECTOR_MAC = bytes.fromhex("0289a0000001"), bytes.fromhex("0289a0000002")
SWITCH_IP = {False: bytes([10, 99, 0, 1]), True: bytes.fromhex("fd990000000000000000000000000001")}
COLLECTOR_IP = {False: bytes([10, 99, 0, 2]), True: bytes.fromhex("fd990000000000000000000000000002")}
VXLAN_SPORT_BASE, VXLAN_SPORT_RANGE = 49152, 16384
MAX_TAGS = 2


@dataclass(frozen=True)
class EncapOptions:
    kind: str = "none"  # KINDS, or vendor:PROTOCOL:BYTES
    outer_vlan: tuple[int, ...] = ()  # VLAN ids of the underlay's tags, outermost first
    inner_vlan: tuple[int, ...] = ()  # tags put into the mirrored frames
    ipv6: bool = False  # the underlay
    session: int = 1  # ERSPAN session id, GRE key, VXLAN VNI
    platform: bool = False  # erspan3: the O flag and a platform sub-header
    mirror_mtu: int | None = None  # mirrored frames cut to this many bytes
    vxlan_port: int = VXLAN_PORT
    seq_start: int = 1

    def __post_init__(self):
        if self.kind not in KINDS and not _VENDOR.match(self.kind):
            raise ValueError(f"--encap {self.kind!r} is not one of {', '.join(KINDS)} or vendor:PROTOCOL:BYTES")
        for name in ("outer_vlan", "inner_vlan"):
            tags = getattr(self, name)
            if len(tags) > MAX_TAGS or any(not 0 <= t < 4095 for t in tags):
                raise ValueError(f"--{name.replace('_', '-')}: up to {MAX_TAGS} VLAN ids 0..4094 (0: priority only), "
                                 f"got {tags}")
        if self.outer_vlan and self.kind == "none":
            raise ValueError("outer VLAN tags need an encapsulation (they belong to its underlay)")
        if self.mirror_mtu is not None and self.mirror_mtu < ETH.size:
            raise ValueError(f"mirror MTU {self.mirror_mtu} is below an Ethernet header")

    @property
    def vendor(self) -> tuple[int, int] | None:
        m = _VENDOR.match(self.kind)
        return (int(m.group(1), 0), int(m.group(2))) if m else None

    @property
    def wraps(self) -> bool:
        return self.kind != "none" or bool(self.inner_vlan) or self.mirror_mtu is not None

    def capture_keys(self) -> dict:
        """What the job file's [capture] must say for the decoder to take this encapsulation off
        (config.encap): nothing for what it detects by itself."""
        out = {}
        if self.vendor is not None and self.vendor != (GRE_PROTO_SPECTRUM, GRE_SPECTRUM_BYTES):
            out["gre_protocol"], out["gre_header_bytes"] = self.vendor
        if self.kind == "vxlan" and self.vxlan_port != VXLAN_PORT:
            out["vxlan_port"] = self.vxlan_port
        return out


def parse_tags(text: str | None) -> tuple[int, ...]:
    """'100' or '100,200' (outermost first; 0: a priority-only tag) -> VLAN ids."""
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"VLAN tags (--outer-vlan, --inner-vlan): expected 'ID' or 'ID,ID', got {text!r}") from None


class Encapsulator:
    """Wraps one mirror port's frames; keeps the session's sequence number from batch to batch."""

    def __init__(self, opts: EncapOptions):
        self.opts = opts
        self.seq = opts.seq_start
        self.head = _outer_bytes(opts)  # bytes before the mirrored frame

    def wrap_set(self, fs: FrameSet) -> FrameSet:
        data, offset, caplen, wirelen, shift = self._wrap(fs.data, fs.offset, fs.caplen, fs.wirelen, fs.ts)
        return replace(fs, data=data, offset=offset, caplen=caplen, wirelen=wirelen,
                       body_lo=np.minimum(fs.body_lo + shift, caplen), body_hi=np.minimum(fs.body_hi + shift, caplen))

    def wrap_batch(self, b: FrameBatch) -> FrameBatch:
        data, offset, caplen, wirelen, _ = self._wrap(b.data, b.offset, b.caplen, b.wirelen, b.ts_ns)
        return FrameBatch(data, offset, caplen, wirelen, b.ts_ns.copy(), b.iface.copy(), b.source)

    def ip_payloads(self, b: FrameBatch) -> FrameBatch:
        """Each wrapped frame from its GRE (VXLAN: UDP) header on: what a raw IP socket sends, the
        kernel writing the outer IP and Ethernet headers itself."""
        w = self.wrap_batch(b)
        skip = ETH.size + VLAN.size * len(self.opts.outer_vlan) + (IPV6.size if self.opts.ipv6 else IPV4.size)
        return FrameBatch(w.data, w.offset + skip, w.caplen - skip, w.wirelen - skip, w.ts_ns, w.iface, w.source)

    def _wrap(self, data, offset, caplen, wirelen, ts):
        o = self.opts
        n = len(offset)
        offset, caplen, wirelen = (np.asarray(x, np.int64) for x in (offset, caplen, wirelen))
        tags = len(o.inner_vlan) * VLAN.size
        macs = np.minimum(caplen, ETH["type"].offset)  # tags go in after the MAC addresses
        body = caplen - macs
        keep = macs + tags + body  # the mirrored frame as the port sends it
        cut = np.minimum(keep, o.mirror_mtu) if o.mirror_mtu is not None else keep
        was = wirelen - caplen  # what the capture itself left out stays left out
        head = self.head.size
        length = head + cut
        out_off = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(length[:-1], out=out_off[1:])
        buf = np.zeros(int(length.sum()), np.uint8)
        # the mirrored frame: MAC addresses, the tags put in, the rest (all as far as the cut allows)
        src = np.ascontiguousarray(data, np.uint8)
        first = np.minimum(macs, cut)
        copy_ranges(src, offset, buf, out_off + head, first)
        rest = np.clip(cut - macs - tags, 0, None)
        copy_ranges(src, offset + macs, buf, out_off + head + macs + tags, np.minimum(body, rest))
        if tags:
            tag_bytes = _tags(o.inner_vlan)
            room = np.clip(cut - macs, 0, tags)
            at = out_off + head + macs
            for k in range(tags):
                sel = np.flatnonzero(room > k)
                buf[at[sel] + k] = tag_bytes[k]
        buf[out_off[:, None] + np.arange(head)] = self.head
        seq = self.seq + np.arange(n, dtype=np.int64)
        self.seq += n
        self._fields(buf, out_off, cut, cut < keep, seq, ts)
        shift = np.full(n, head + tags, np.int64)
        return buf, out_off, length, length + np.where(cut < keep, 0, was), shift

    def _fields(self, buf, off, inner_len, cut, seq, ts) -> None:
        """The per-frame fields of the outer headers (lengths, checksums, sequence numbers...)."""
        o = self.opts
        if o.kind == "none":
            return
        before_ip = ETH.size + VLAN.size * len(o.outer_vlan)
        l3 = off + before_ip
        ip_size = IPV6.size if o.ipv6 else IPV4.size
        payload = self.head.size - before_ip - ip_size + inner_len  # what the outer IP carries
        if o.ipv6:
            put(buf, l3, IPV6, "payload_len", payload)
        else:
            put(buf, l3, IPV4, "total_len", IPV4.size + payload)
            put(buf, l3, IPV4, "id", seq & 0xFFFF)
            put(buf, l3, IPV4, "csum", ipv4_checksum(buf, l3))
        l4 = l3 + ip_size
        if o.kind == "vxlan":
            put(buf, l4, UDP, "len", payload)
            put(buf, l4, UDP, "sport", _outer_port(buf, off + self.head.size, inner_len))
            return
        h = l4 + GRE.size
        flags = _gre_flags(o)
        if flags & GRE_CHECKSUM:
            csum_at = h
            h = h + GRE_WORD
        if flags & GRE_KEY:
            h = h + GRE_WORD
        if flags & GRE_SEQUENCE:
            put(buf, h, GRE_NUMBER, "value", seq & 0xFFFFFFFF)
            h = h + GRE_WORD
        if o.kind == "erspan2":
            put(buf, h, ERSPAN2, "session", _erspan_session(o) | np.where(cut, ERSPAN_TRUNCATED, 0))
        elif o.kind == "erspan3":
            put(buf, h, ERSPAN3, "session", _erspan_session(o) | np.where(cut, ERSPAN_TRUNCATED, 0))
            put(buf, h, ERSPAN3, "timestamp", (np.asarray(ts, np.int64) // 100_000) & 0xFFFFFFFF)  # 100 us
        if flags & GRE_CHECKSUM:
            put(buf, csum_at, GRE_CSUM, "csum", _ones_complement(buf, l4, off + self.head.size + inner_len))


def _gre_flags(o: EncapOptions) -> int:
    if o.kind in ("erspan2", "erspan3"):
        return GRE_SEQUENCE
    if o.kind == "gretap":
        return GRE_CHECKSUM | GRE_KEY | GRE_SEQUENCE
    return 0


def _erspan_session(o: EncapOptions) -> int:
    en = ERSPAN_EN_INFRAME if o.inner_vlan and o.kind == "erspan2" else 0
    return (TAG_PCP << 13) | (en << 11) | (o.session & 0x3FF)


def _tags(vids: tuple[int, ...]) -> np.ndarray:
    """The bytes between the MAC addresses and the EtherType for tags ``vids``, outermost first:
    each tag's TPID (in the EtherType's place) and its TCI (VLAN's first field); 802.1ad outside
    802.1Q when two."""
    tpids = [ETHERTYPE_VLAN[1], ETHERTYPE_VLAN[0]] if len(vids) == 2 else [ETHERTYPE_VLAN[0]]
    out = b""
    for tpid, vid in zip(tpids, vids):
        out += tpid.to_bytes(2, "big") + VLAN.pack(tci=(TAG_PCP << 13) | vid)[:VLAN["type"].offset]
    return np.frombuffer(out, np.uint8)


def _outer_bytes(o: EncapOptions) -> np.ndarray:
    """The outer headers every frame shares (per-frame fields are written later)."""
    if o.kind == "none":
        return np.zeros(0, np.uint8)
    v6 = o.ipv6
    ip_type = ETHERTYPE_IPV6 if v6 else ETHERTYPE_IPV4
    out = ETH.pack(dst=COLLECTOR_MAC, src=SWITCH_MAC, type=ETHERTYPE_VLAN[0] if o.outer_vlan else ip_type)
    out = out[:ETH["type"].offset]
    out += _tags(o.outer_vlan).tobytes() + ip_type.to_bytes(2, "big")
    proto = IPPROTO_UDP if o.kind == "vxlan" else IPPROTO_GRE
    if v6:
        out += IPV6.pack(ver_tc_fl=IPV6_VERSION << 28, next=proto, hop=64, src=SWITCH_IP[v6], dst=COLLECTOR_IP[v6])
    else:
        out += IPV4.pack(ver_ihl=IPV4_VERSION_IHL, frag=IPV4_DONT_FRAGMENT, ttl=64, proto=proto, src=SWITCH_IP[v6],
                         dst=COLLECTOR_IP[v6])
    if o.kind == "vxlan":
        return np.frombuffer(out + UDP.pack(dport=o.vxlan_port) + VXLAN.pack(flags=VXLAN_VALID_VNI, vni=o.session),
                             np.uint8).copy()
    vendor = o.vendor
    proto = {"erspan1": GRE_PROTO_ERSPAN, "erspan2": GRE_PROTO_ERSPAN, "erspan3": GRE_PROTO_ERSPAN3}.get(
        o.kind, vendor[0] if vendor else GRE_PROTO_TEB)
    flags = _gre_flags(o)
    out += GRE.pack(flags=flags, proto=proto)
    if flags & GRE_CHECKSUM:
        out += bytes(GRE_WORD)
    if flags & GRE_KEY:
        out += o.session.to_bytes(GRE_WORD, "big")
    if flags & GRE_SEQUENCE:
        out += bytes(GRE_WORD)
    vlan = o.inner_vlan[0] if o.inner_vlan else 0
    if o.kind == "erspan2":
        out += ERSPAN2.pack(ver_vlan=(ERSPAN_VERSION_II << ERSPAN_VERSION_SHIFT) | vlan, session=_erspan_session(o))
    elif o.kind == "erspan3":
        flags3 = ERSPAN3_P | (1 << ERSPAN3_HWID_SHIFT) | (ERSPAN3_O if o.platform else 0)
        out += ERSPAN3.pack(ver_vlan=(ERSPAN_VERSION_III << ERSPAN_VERSION_SHIFT) | vlan, session=_erspan_session(o),
                            flags=flags3)
        if o.platform:
            out += ERSPAN3_PLATFORM.pack(platform=3 << PLATFORM_ID_SHIFT)
    elif vendor:
        out += bytes(vendor[1])
    return np.frombuffer(out, np.uint8).copy()


def _outer_port(buf: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """VXLAN's source port, the same for both directions of a flow: Linux hashes the inner flow's
    addresses and ports in a fixed order (udp_flow_src_port on a consistent flow hash). Here from
    the inner UDP source port, which RoCE's two directions share; one port for what has none."""
    n = len(start)
    inner = FrameBatch(buf, start, length, length, np.zeros(n, np.int64), np.zeros(n, np.int32))
    sport = flow_ports(inner, EncapSpec("none"))
    return VXLAN_SPORT_BASE + np.where(sport >= 0, sport * 2654435761 % VXLAN_SPORT_RANGE, 0)


def _ones_complement(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """RFC 1071 checksum of buf[start:end] per frame (its checksum field zero while summed): each
    byte weighs 256 at an even distance from its range's start, 1 at an odd one."""
    size = end - start
    first = np.zeros(len(start), np.int64)
    if len(start) > 1:
        np.cumsum(size[:-1], out=first[1:])
    pos = np.repeat(start - first, size) + np.arange(int(size.sum()))  # every byte's place in buf
    odd = (np.arange(int(size.sum())) - np.repeat(first, size)) % 2
    total = np.add.reduceat(buf[pos].astype(np.int64) << (8 * (1 - odd)), first) if len(pos) else first
    for _ in range(3):
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
