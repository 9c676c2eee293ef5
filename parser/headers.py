"""Every header the appliance reads or writes, declared once as a table of fields.

A ``Header`` is a list of ``Field(name, offset, size, order)``; decoders read fields for many
frames at once with ``Header.read`` (a numpy gather), and the generator and tests build bytes with
``Header.pack``. No byte offset of these headers appears anywhere else in the code.

Sources: IEEE 802.3/802.1Q; RFC 791 and 8200; RFC 768; InfiniBand Architecture Specification
vol. 1 rel. 1.4, 9.2-9.3 and annex A17 (RoCEv2); NCCL net_ib.cc (CTS entry, see
``parser.nccl_versions``) and net_socket.cc (socket transport, ``parser.roce.ncclsock``); gloo
``transport/tcp/pair.h`` (Op preamble).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _as_struct(fields: list[Field]):
    """(struct.Struct, field names) reading every field at once, or None: fields that overlap, mix
    byte orders or have sizes of no C type (a 24-bit PSN) are read one by one."""
    order = {f.order for f in fields if f.size > 1}
    if len(order) > 1 or not fields or [f.offset for f in fields] != sorted(f.offset for f in fields):
        return None  # (declared out of offset order: the dict keeps the declared order)
    fmt, pos = ">" if order != {"little"} else "<", 0
    for f in fields:
        if f.offset < pos or (f.size > 8 and f.signed) or (f.size <= 8 and f.size not in _CODES):
            return None
        fmt += f"{f.offset - pos}x" if f.offset > pos else ""
        code = f"{f.size}s" if f.size > 8 else _CODES[f.size]
        fmt += code.lower() if f.signed else code
        pos = f.offset + f.size
    return struct.Struct(fmt), [f.name for f in fields]


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int  # bytes, 1..16
    order: str = "big"  # "big" or "little"
    signed: bool = False


class Header:
    def __init__(self, name: str, size: int, fields: list[Field]):
        self.name = name
        self.size = size
        self.fields = {f.name: f for f in fields}
        for f in fields:
            if f.offset + f.size > size:
                raise ValueError(f"{name}.{f.name} runs past the header's {size} bytes")
        self._struct = _as_struct(fields)  # unpack's fast form, None when the fields do not fit one

    def __getitem__(self, name: str) -> Field:
        return self.fields[name]

    def read(self, data: np.ndarray, base: np.ndarray, name: str) -> np.ndarray:
        """Field ``name`` of the headers starting at ``data[base]`` (vectorised; uint64 or int64)."""
        return read_uint(data, base + self.fields[name].offset, self.fields[name].size,
                         self.fields[name].order, self.fields[name].signed)

    def read_fields(self, data: np.ndarray, base: np.ndarray, names) -> dict[str, np.ndarray]:
        """``read`` of each of ``names``, the headers gathered once as records where every field
        is a C integer (else field by field)."""
        rec = self._records()
        if rec is None or len(data) < self.size or not data.flags.c_contiguous:
            return {n: self.read(data, base, n) for n in names}
        got = np.ndarray((len(data) - self.size + 1,), rec, buffer=data, strides=(1,))[np.asarray(base, np.int64)]
        return {n: got[n].astype(np.int64 if self.fields[n].signed else np.uint64) for n in names}

    def _records(self) -> np.dtype | None:
        """The header as a record dtype, made once; None when a field is no C integer."""
        if not hasattr(self, "_rec"):
            fs = self.fields.values()
            self._rec = None if any(f.size not in _NP_UINT for f in fs) else np.dtype({
                "names": [f.name for f in fs], "offsets": [f.offset for f in fs], "itemsize": self.size,
                "formats": [(">" if f.order == "big" else "<") + ("i" if f.signed else "u") + str(f.size) for f in fs]})
        return self._rec

    def read_bytes(self, data: np.ndarray, base: np.ndarray, name: str) -> np.ndarray:
        """Field ``name`` as an (N, size) uint8 matrix (addresses)."""
        f = self.fields[name]
        pos = np.asarray(base, dtype=np.int64) + f.offset
        if f.size % 8 == 0:  # whole 8-byte words: gather words, not bytes
            w = _words(data, 8, "little")
            cols = np.stack([w[pos + 8 * k] for k in range(f.size // 8)], axis=1)
            return np.ascontiguousarray(cols).view(np.uint8).reshape(-1, f.size)
        return data[pos[:, None] + np.arange(f.size)]

    def unpack(self, buf: bytes | memoryview, at: int = 0) -> dict:
        """One header as a dict of ints (fields above 8 bytes as bytes); the parser reads CTS posts with it."""
        if self._struct is not None and at >= 0 and len(buf) - at >= self._struct[0].size \
                and getattr(buf, "itemsize", 1) == 1 and getattr(buf, "ndim", 1) == 1:
            st, names = self._struct
            try:
                return dict(zip(names, st.unpack_from(buf, at)))
            except (TypeError, ValueError, BufferError):  # not a contiguous byte buffer: field by field
                pass
        out = {}
        for f in self.fields.values():
            raw = bytes(buf[at + f.offset : at + f.offset + f.size])
            out[f.name] = int.from_bytes(raw, f.order, signed=f.signed) if f.size <= 8 else raw
        return out

    def pack(self, **values) -> bytes:
        """One header built from field values; unnamed fields are zero (generator, tests)."""
        out = bytearray(self.size)
        for name, v in values.items():
            f = self.fields[name]
            if isinstance(v, (bytes, bytearray)):
                if len(v) != f.size:
                    raise ValueError(f"{self.name}.{name} takes {f.size} bytes, got {len(v)}")
                out[f.offset : f.offset + f.size] = v
            else:
                out[f.offset : f.offset + f.size] = int(v).to_bytes(f.size, f.order, signed=f.signed)
        return bytes(out)


_NP_UINT = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}


def _words(data: np.ndarray, size: int, order: str) -> np.ndarray:
    """``data`` seen as a word of ``size`` bytes starting at every byte (an unaligned strided
    view: no copy), so a field is gathered with one fancy index."""
    dt = np.dtype(_NP_UINT[size]).newbyteorder(">" if order == "big" else "<")
    return np.ndarray((max(data.shape[0] - size + 1, 0),), dtype=dt, buffer=data, strides=(1,))


def read_uint(data: np.ndarray, pos: np.ndarray, size: int, order: str = "big",
              signed: bool = False) -> np.ndarray:
    """Integers of ``size`` bytes at positions ``pos`` of ``data``, one per position."""
    pos = np.asarray(pos, dtype=np.int64)
    if size > 8:
        raise ValueError("fields wider than 8 bytes are read with read_bytes")
    if size in _NP_UINT:
        v = _words(data, size, order)[pos]
        if signed:
            v = v.view(v.dtype.str.replace("u", "i"))
            return v.astype(np.int64)
        return v.astype(np.uint64)
    # 3, 5, 6, 7 bytes: read the enclosing 4- or 8-byte word and keep the field's bytes
    # (big-endian: the word ending at the field's end; little-endian: the one starting there).
    wide = 4 if size < 4 else 8
    shift = wide - size if order == "big" else 0
    ok = (pos >= shift) & (pos - shift + wide <= data.shape[0])
    v = np.zeros(pos.shape[0], np.uint64)
    v[ok] = _words(data, wide, order)[pos[ok] - shift].astype(np.uint64) & np.uint64((1 << (8 * size)) - 1)
    for k in np.nonzero(~ok)[0]:  # a field at the very edge of the buffer
        v[k] = int.from_bytes(data[pos[k]:pos[k] + size].tobytes(), order)
    return v


# --- Link and network layers ------------------------------------------------------------------

ETH = Header("eth", 14, [Field("dst", 0, 6), Field("src", 6, 6), Field("type", 12, 2)])
VLAN = Header("vlan", 4, [Field("tci", 0, 2), Field("type", 2, 2)])
ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_IPV6 = 0x86DD
ETHERTYPE_VLAN = (0x8100, 0x88A8)
ETHERTYPE_ARP = 0x0806
ETHERTYPE_LLDP = 0x88CC
ETHERTYPE_PTP = 0x88F7

IPV4 = Header("ipv4", 20, [
    Field("ver_ihl", 0, 1), Field("tos", 1, 1), Field("total_len", 2, 2), Field("id", 4, 2),
    Field("frag", 6, 2), Field("ttl", 8, 1), Field("proto", 9, 1), Field("csum", 10, 2),
    Field("src", 12, 4), Field("dst", 16, 4),
])
IPV4_FRAGMENT = 0x3FFF  # frag: MF and the fragment offset (a fragment when any is set)
IPV6 = Header("ipv6", 40, [
    Field("ver_tc_fl", 0, 4), Field("payload_len", 4, 2), Field("next", 6, 1), Field("hop", 7, 1),
    Field("src", 8, 16), Field("dst", 24, 16),
])
IPPROTO_TCP = 6
IPPROTO_UDP = 17

UDP = Header("udp", 8, [Field("sport", 0, 2), Field("dport", 2, 2), Field("len", 4, 2), Field("csum", 6, 2)])
ROCEV2_PORT = 4791
PTP_PORTS = (319, 320)

TCP = Header("tcp", 20, [
    Field("sport", 0, 2), Field("dport", 2, 2), Field("seq", 4, 4), Field("ack", 8, 4),
    Field("off_flags", 12, 2), Field("window", 14, 2), Field("csum", 16, 2), Field("urg", 18, 2),
])

# --- Mirror encapsulations --------------------------------------------------------------------
# GRE (RFC 2784, 2890): flags C(0x8000) R(0x4000) K(0x2000) S(0x1000), version in the low 3 bits;
# each of checksum(+reserved), key and sequence number present adds one 4-byte word, in that order.
IPPROTO_GRE = 47
GRE = Header("gre", 4, [Field("flags", 0, 2), Field("proto", 2, 2)])
GRE_CHECKSUM, GRE_ROUTING, GRE_KEY, GRE_SEQUENCE = 0x8000, 0x4000, 0x2000, 0x1000
GRE_VERSION = 0x0007
GRE_CSUM = Header("gre_checksum", 4, [Field("csum", 0, 2), Field("reserved", 2, 2)])
GRE_NUMBER = Header("gre_number", 4, [Field("value", 0, 4)])  # the key word, the sequence number word
GRE_WORD = 4  # each optional word
GRE_PROTO_ERSPAN = 0x88BE  # ERSPAN type II (sequence number, ERSPAN header) and type I (neither)
GRE_PROTO_ERSPAN3 = 0x22EB
GRE_PROTO_TEB = 0x6558  # transparent Ethernet bridging: gretap
# SONiC on NVIDIA Spectrum: GRE protocol 0x8949, then a 22-byte vendor header before the frame
# (sonic-mgmt tests/everflow); other ASICs' variants are configured ([capture] gre_protocol).
GRE_PROTO_SPECTRUM, GRE_SPECTRUM_BYTES = 0x8949, 22

# ERSPAN (Linux include/net/erspan.h): ver(4) vlan(12) | cos(3) en/bso(2) T(1) session id(10), then
# type II: reserved(12) index(20); type III: timestamp(32), SGT(16), P FT HwID D Gra O(16), and an
# 8-byte platform sub-header when O is set.
ERSPAN2 = Header("erspan2", 8, [Field("ver_vlan", 0, 2), Field("session", 2, 2), Field("index", 4, 4)])
ERSPAN3 = Header("erspan3", 12, [Field("ver_vlan", 0, 2), Field("session", 2, 2), Field("timestamp", 4, 4),
                                 Field("sgt", 8, 2), Field("flags", 10, 2)])
ERSPAN3_PLATFORM = Header("erspan3_platform", 8, [Field("platform", 0, 8)])
ERSPAN_VERSION_SHIFT = 12
ERSPAN_VERSION_II, ERSPAN_VERSION_III = 1, 2
ERSPAN_TRUNCATED = 0x0400  # T: the original frame was cut to fit the mirror session
ERSPAN_SESSION = 0x03FF
ERSPAN3_O = 0x0001  # a platform sub-header follows

# VXLAN (RFC 7348): flags (I = a valid VNI), 24 reserved bits, VNI, 8 reserved bits.
VXLAN = Header("vxlan", 8, [Field("flags", 0, 1), Field("vni", 4, 3)])
VXLAN_VALID_VNI = 0x08
VXLAN_PORT = 4789

# --- InfiniBand transport headers (IBTA vol. 1, 9.2) ------------------------------------------

# byte 1: SE(1) M(1) PadCnt(2) TVer(4); byte 8: AckReq(1) resv(7)
BTH = Header("bth", 12, [
    Field("opcode", 0, 1), Field("flags", 1, 1), Field("pkey", 2, 2), Field("resv8a", 4, 1),
    Field("dqp", 5, 3), Field("ackreq", 8, 1), Field("psn", 9, 3),
])
RETH = Header("reth", 16, [Field("va", 0, 8), Field("rkey", 8, 4), Field("dlen", 12, 4)])
# ImmDt is a 4-byte field; NCCL writes it in host order up to 2.28 (little-endian on x86) and
# big-endian from 2.29: the raw bytes are kept and read through nccl_versions.
IMMDT = Header("immdt", 4, [Field("imm", 0, 4, "big")])
AETH = Header("aeth", 4, [Field("syndrome", 0, 1), Field("msn", 1, 3)])
DETH = Header("deth", 8, [Field("qkey", 0, 4), Field("srcqp", 5, 3)])
ATOMIC_ETH = Header("atomiceth", 28, [Field("va", 0, 8), Field("rkey", 8, 4), Field("swap_add", 12, 8),
                                      Field("compare", 20, 8)])
ATOMIC_ACK_ETH = Header("atomicacketh", 8, [Field("orig", 0, 8)])
IETH = Header("ieth", 4, [Field("rkey", 0, 4)])
ICRC_BYTES = 4
PSN_MODULUS = 1 << 24

# --- NCCL ------------------------------------------------------------------------------------

# CTS ("clear to send") FIFO entry, NCCL 2.12-2.19 (32 B). Later layouts: parser.nccl_versions.
CTS32 = Header("cts32", 32, [
    Field("addr", 0, 8, "little"), Field("size", 8, 4, "little", signed=True),
    Field("rkey", 12, 4, "little"), Field("nreqs", 16, 4, "little"), Field("tag", 20, 4, "little"),
    Field("idx", 24, 8, "little"),
])
CTS64_V220 = Header("cts64_v2.20", 64, [
    Field("addr", 0, 8, "little"), Field("size", 8, 4, "little", signed=True),
    Field("rkey", 12, 4, "little"), Field("rkey1", 16, 4, "little"), Field("nreqs", 20, 4, "little"),
    Field("tag", 24, 4, "little"), Field("idx", 32, 8, "little"),
])
CTS64_V224 = Header("cts64_v2.24", 64, [
    Field("addr", 0, 8, "little"), Field("size", 8, 8, "little"), Field("rkey", 16, 4, "little"),
    Field("nreqs", 32, 4, "little"), Field("tag", 36, 4, "little"), Field("idx", 40, 8, "little"),
])
CTS64_V230 = Header("cts64_v2.30", 64, [
    Field("addr", 0, 8, "little"), Field("size", 8, 8, "little"), Field("rkey", 16, 4, "little"),
    Field("nreqs", 48, 4, "little"), Field("tag", 52, 4, "little"), Field("idx", 56, 8, "little"),
])
# Port speeds a receiver WRITEs to its sender after a port speed change (2.31+ with
# NCCL_IB_EVENT_BASED_LB=1; nccl_versions.SPEED_UPDATE_SINCE): {u64 counter, u16 speedGbps[8]}.
SPEED_UPDATE = Header("speed_update", 32, [Field("counter", 0, 8, "little"), Field("speeds", 8, 16)])

# LL line: {u32 data_lo, u32 flag, u32 data_hi, u32 flag} (NCCL devcomm.h union ncclLLFifoLine).
LL_LINE = Header("ll_line", 16, [
    Field("data_lo", 0, 4, "little"), Field("flag1", 4, 4, "little"),
    Field("data_hi", 8, 4, "little"), Field("flag2", 12, 4, "little"),
])
LL_LINE_BYTES = 16
LL_DATA_PER_LINE = 8
# LL128: 128-byte lines, word 15 (bytes 120..127) of every line is the u64 flag.
LL128_LINE_BYTES = 128
LL128_FLAG_OFFSET = 120
LL128_GROUP_WIRE = 2048
LL128_GROUP_DATA = 1920

# --- NCCL's socket transport (NCCL_NET=Socket; net_socket.cc, misc/socket.cc; parser.roce.ncclsock) ----

# Every TCP connection of a net connection opens with the socket layer's hello (u64 magic, u32
# socket type) and the transport's one-byte socket index.
NCCL_SOCK_HELLO = Header("nccl_sock_hello", 13, [
    Field("magic", 0, 8, "little"), Field("type", 8, 4, "little"), Field("index", 12, 1),
])
# Each message's size, on the control socket before it (int, host order).
NCCL_SOCK_SIZE = Header("nccl_sock_size", 4, [Field("size", 0, 4, "little", signed=True)])

# --- gloo over TCP -----------------------------------------------------------------------------

GLOO_OP = Header("gloo_op", 48, [
    Field("nbytes", 0, 8, "little"), Field("opcode", 8, 8, "little"), Field("slot", 16, 8, "little"),
    Field("offset", 24, 8, "little"), Field("length", 32, 8, "little"), Field("roffset", 40, 8, "little"),
])
