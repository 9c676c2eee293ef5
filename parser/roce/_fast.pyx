# cython: language_level=3
"""Compiled kernels of the packet path: RoCEv2 ICRC and the frame walk.

The ICRC (IBTA annex A17.3.3) is a CRC-32 over 8 bytes of 0xFF, the IP header with its variant
fields set to ones (IPv4: TOS, TTL, header checksum; IPv6: traffic class, flow label, hop limit),
the UDP header with checksum 0xFFFF, the BTH with its reserved byte 4 set to 0xFF, and everything
after it up to the ICRC, which is stored little-endian. It is the CRC of zlib's crc32; ISA-L's
crc32_gzip_refl computes it with carry-less multiplies and is used when setup.py finds ISA-L
(MIRRORCKPT_ISAL); ICRC_BACKEND names the one compiled in.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

include "_ll.pxi"

cdef extern from * nogil:
    """
    #include <stdint.h>
    #ifdef MIRRORCKPT_ISAL
    #include <isa-l/crc.h>
    /* same pre/post inversion as zlib's crc32, so calls chain the same way */
    static inline uint32_t mck_crc32(uint32_t c, const uint8_t *p, uint64_t n) { return crc32_gzip_refl(c, p, n); }
    #define MCK_CRC_BACKEND "isa-l"
    #else
    #include <zlib.h>
    static inline uint32_t mck_crc32(uint32_t c, const uint8_t *p, uint64_t n) { return (uint32_t)crc32(c, p, (uInt)n); }
    #define MCK_CRC_BACKEND "zlib"
    #endif
    """
    uint32_t mck_crc32(uint32_t crc, const uint8_t *buf, uint64_t n)
    const char *MCK_CRC_BACKEND

ICRC_BACKEND = (<bytes>MCK_CRC_BACKEND).decode()  # "isa-l" or "zlib" (the slow fallback)

# Position of the UDP header relative to the IP header is the IP header length; the BTH follows
# the 8-byte UDP header. 80 bytes hold 8 + 60 (largest IPv4 header) ... we only mask the fixed
# 20-byte IPv4 header and the 40-byte IPv6 header; IPv4 options are covered unmasked.
DEF MASKED_MAX = 8 + 60 + 8 + 12


cdef inline uint32_t _icrc_one(const uint8_t *ip, int64_t ip_hlen, bint v6, int64_t icrc_pos) noexcept nogil:
    """CRC over [ip, ip + icrc_pos) with the RoCEv2 masks; icrc_pos is relative to ip."""
    cdef uint8_t buf[MASKED_MAX]
    cdef int64_t head = ip_hlen + 8 + 12  # IP + UDP + BTH
    cdef int64_t i
    for i in range(8):
        buf[i] = 0xFF
    memcpy(&buf[8], ip, head)
    if v6:
        # version(4) | traffic class(8) | flow label(20): keep the version nibble
        buf[8] = buf[8] | 0x0F
        buf[9] = 0xFF
        buf[10] = 0xFF
        buf[11] = 0xFF
        buf[8 + 7] = 0xFF  # hop limit
    else:
        buf[8 + 1] = 0xFF  # TOS
        buf[8 + 8] = 0xFF  # TTL
        buf[8 + 10] = 0xFF  # header checksum
        buf[8 + 11] = 0xFF
    buf[8 + ip_hlen + 6] = 0xFF  # UDP checksum
    buf[8 + ip_hlen + 7] = 0xFF
    buf[8 + ip_hlen + 8 + 4] = 0xFF  # BTH resv8a
    cdef uint32_t c = mck_crc32(0, buf, <uint64_t>(8 + head))
    return mck_crc32(c, ip + head, <uint64_t>(icrc_pos - head))


def icrc(const uint8_t[::1] data, const int64_t[::1] ip_off, const int64_t[::1] ip_hlen,
         const uint8_t[::1] is_v6, const int64_t[::1] icrc_off, uint32_t[::1] out):
    """ICRC of each packet: IP header at data[ip_off], ICRC field at data[icrc_off]."""
    cdef Py_ssize_t n = ip_off.shape[0], k
    with nogil:
        for k in range(n):
            if ip_hlen[k] + 20 > MASKED_MAX - 8 or icrc_off[k] - ip_off[k] < ip_hlen[k] + 20:
                out[k] = 0
                continue
            out[k] = _icrc_one(&data[ip_off[k]], ip_hlen[k], is_v6[k] != 0, icrc_off[k] - ip_off[k])


def icrc_check(const uint8_t[::1] data, const int64_t[::1] ip_off, const int64_t[::1] ip_hlen,
               const uint8_t[::1] is_v6, const int64_t[::1] icrc_off, uint8_t[::1] ok):
    """ok[k] = 1 when the stored ICRC (little-endian at icrc_off) matches the computed one."""
    cdef Py_ssize_t n = ip_off.shape[0], k
    cdef uint32_t got, want
    cdef const uint8_t *p
    with nogil:
        for k in range(n):
            if ip_hlen[k] + 20 > MASKED_MAX - 8 or icrc_off[k] - ip_off[k] < ip_hlen[k] + 20:
                ok[k] = 0
                continue
            want = _icrc_one(&data[ip_off[k]], ip_hlen[k], is_v6[k] != 0, icrc_off[k] - ip_off[k])
            p = &data[icrc_off[k]]
            got = p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)
            ok[k] = got == want


# --- Frame decode ---------------------------------------------------------------------------
# One pass per frame over Ethernet/VLAN/IP/UDP/BTH and the extended transport headers. Field
# offsets are not written here: parser.roce passes them from the tables of parser.headers.



cdef int64_t[64] K  # field offsets and EtherTypes, indexed by the K_* constants below
DEF K_ETH_TYPE = 0
DEF K_ETH_SIZE = 1
DEF K_VLAN_TYPE = 2
DEF K_VLAN_SIZE = 3
DEF K_V4_VIHL = 4
DEF K_V4_TOTLEN = 5
DEF K_V4_FRAG = 6
DEF K_V4_PROTO = 7
DEF K_V4_SRC = 8
DEF K_V4_DST = 9
DEF K_V4_SIZE = 10
DEF K_V6_PLEN = 11
DEF K_V6_NEXT = 12
DEF K_V6_SRC = 13
DEF K_V6_DST = 14
DEF K_V6_SIZE = 15
DEF K_UDP_SPORT = 16
DEF K_UDP_DPORT = 17
DEF K_UDP_LEN = 18
DEF K_UDP_SIZE = 19
DEF K_BTH_OPCODE = 20
DEF K_BTH_FLAGS = 21
DEF K_BTH_DQP = 22
DEF K_BTH_ACKREQ = 23
DEF K_BTH_PSN = 24
DEF K_BTH_SIZE = 25
DEF K_RETH_VA = 26
DEF K_RETH_RKEY = 27
DEF K_RETH_DLEN = 28
DEF K_RETH_SIZE = 29
DEF K_IMM_SIZE = 30
DEF K_AETH_SYN = 31
DEF K_AETH_MSN = 32
DEF K_AETH_SIZE = 33
DEF K_DETH_SIZE = 34
DEF K_ICRC = 35
DEF K_ROCE_PORT = 36
DEF K_PTP_EVENT = 37
DEF K_PTP_GENERAL = 38
DEF K_ET_IPV4 = 39
DEF K_ET_IPV6 = 40
DEF K_ET_VLAN = 41
DEF K_ET_QINQ = 42
DEF K_ET_ARP = 43
DEF K_ET_LLDP = 44
DEF K_ET_PTP = 45
DEF K_NKEYS = 46

cdef uint8_t[256] HAS_RETH, HAS_IMM, HAS_AETH, HAS_DETH

# The ICRC reads every payload byte once, from memory the walk has not touched. Frames longer than
# this (PMTU 2048/4096) are prefetched one frame ahead: the ICRC of cold Simple frames ran at twice
# the speed with it; at PMTU 1024 (frames of ~1.1 KB) the hardware prefetcher keeps up and the extra
# prefetches cost a few percent.
DEF PREFETCH_ABOVE = 2048

# Frame classes counted by decode (index into the `classes` output).
CLASSES = ("roce", "truncated", "not_ethernet", "arp", "lldp", "llc_stp", "ptp_l2", "ethertype_other",
           "ipv4_fragment", "tcp", "ip_other", "udp_ptp_event", "udp_ptp_general", "udp_other",
           "malformed:short_ethernet", "malformed:short_vlan", "malformed:bad_ipv4_header",
           "malformed:short_ip", "malformed:short_udp", "malformed:bad_udp_length",
           "malformed:short_roce_headers")
DEF C_ROCE = 0
DEF C_TRUNC = 1
DEF C_NOT_ETH = 2
DEF C_ARP = 3
DEF C_LLDP = 4
DEF C_LLC = 5
DEF C_PTP_L2 = 6
DEF C_ETYPE_OTHER = 7
DEF C_FRAG = 8
DEF C_TCP = 9
DEF C_IP_OTHER = 10
DEF C_PTP_EV = 11
DEF C_PTP_GEN = 12
DEF C_UDP_OTHER = 13
DEF M_SHORT_ETH = 14
DEF M_SHORT_VLAN = 15
DEF M_BAD_V4 = 16
DEF M_SHORT_IP = 17
DEF M_SHORT_UDP = 18
DEF M_BAD_ULEN = 19
DEF M_SHORT_ROCE = 20
DEF NCLASSES = 21


def configure(offsets, has_reth, has_imm, has_aeth, has_deth):
    """Field offsets and EtherTypes (a sequence in K_* order) and opcode lookup tables, from parser.headers."""
    if len(offsets) != K_NKEYS:
        raise ValueError(f"expected {K_NKEYS} offsets, got {len(offsets)}")
    for i in range(K_NKEYS):
        K[i] = offsets[i]
    for i in range(256):
        HAS_RETH[i] = has_reth[i]
        HAS_IMM[i] = has_imm[i]
        HAS_AETH[i] = has_aeth[i]
        HAS_DETH[i] = has_deth[i]


cdef extern from * nogil:
    """
    #include <stdint.h>
    #include <string.h>
    /* Big-endian fields by one unaligned load and a byte swap (x86 and any GCC/Clang target). */
    static inline uint64_t mck_be(const uint8_t *p, int n) {
        uint64_t v;
        uint32_t w;
        uint16_t h;
        switch (n) {
        case 1: return p[0];
        case 2: memcpy(&h, p, 2); return __builtin_bswap16(h);
        case 3: return ((uint64_t)p[0] << 16) | ((uint64_t)p[1] << 8) | p[2];
        case 4: memcpy(&w, p, 4); return __builtin_bswap32(w);
        case 8: memcpy(&v, p, 8); return __builtin_bswap64(v);
        default: v = 0; for (int i = 0; i < n; i++) v = (v << 8) | p[i]; return v;
        }
    }
    /* Every 64-byte line of [p, p + n) towards the cache; never faults. */
    static inline void mck_prefetch(const uint8_t *p, int64_t n) {
        for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
    }
    """
    uint64_t mck_be(const uint8_t *p, int n)
    void mck_prefetch(const uint8_t *p, int64_t n)


cdef inline uint64_t be(const uint8_t *p, int n) noexcept nogil:
    return mck_be(p, n)


def decode_frames(const uint8_t[::1] data, const int64_t[::1] offset, const int64_t[::1] caplen,
                  const int64_t[::1] wirelen, const uint8_t[::1] eth_ok, bint check_icrc,
                  int64_t[::1] frame, uint8_t[:, ::1] src, uint8_t[:, ::1] dst, int64_t[::1] sport,
                  int64_t[::1] opcode, int64_t[::1] pad, int64_t[::1] dqp, int64_t[::1] psn,
                  uint8_t[::1] ackreq, uint64_t[::1] va, int64_t[::1] rkey, int64_t[::1] dlen,
                  uint8_t[::1] has_reth, uint8_t[::1] has_imm, int64_t[::1] imm, int64_t[::1] syndrome,
                  int64_t[::1] msn, int64_t[::1] pay_off, int64_t[::1] pay_len, uint8_t[::1] icrc_ok,
                  int64_t[::1] classes, int64_t[::1] other_etype, const uint8_t[::1] is_write,
                  uint8_t[::1] llu, uint32_t[::1] llf, int ll_line, int ll_lo, int ll_f1, int ll_hi, int ll_f2):
    """Decodes every frame; writes one row per RoCEv2 packet. Returns (packets, other ethertypes).

    With ``llu`` (not empty: at least half the batch's bytes), each RDMA WRITE payload of whole LL
    lines is read as LL right after its ICRC, while it is in cache: llf[row] its flag (0: not
    intact LL, or not read), its data words at llu[pay_off // 2] on (8 bytes a line), so that
    reassembly need not copy the wire bytes of an intact LL message to read it."""
    cdef Py_ssize_t n = offset.shape[0], f
    cdef bint want_ll = llu.shape[0] > 0
    if want_ll and (llf.shape[0] < n or llu.shape[0] < data.shape[0] // 2 or is_write.shape[0] < 256
                    or ll_line < 16 or ll_line % 16):
        raise ValueError("decode_frames: LL outputs too small")
    cdef int64_t r = 0, no = 0, nbytes = data.shape[0]
    cdef int64_t base, end, l3, l4, hl, ip_end, etype, proto, ulen, udp_end, bth, h, icrc_at, po, pl, k
    cdef int64_t dport, op
    cdef const uint8_t *p
    cdef bint v6
    cdef uint32_t want, got
    with nogil:
        for f in range(n):
            if caplen[f] < wirelen[f]:
                classes[C_TRUNC] += 1
                continue
            if not eth_ok[f]:
                classes[C_NOT_ETH] += 1
                continue
            base = offset[f]
            end = base + caplen[f]
            p = &data[0]
            if check_icrc and f + 1 < n and caplen[f + 1] > PREFETCH_ABOVE \
                    and offset[f + 1] + caplen[f + 1] <= nbytes:
                mck_prefetch(p + offset[f + 1], caplen[f + 1])
            if caplen[f] < K[K_ETH_SIZE]:
                classes[M_SHORT_ETH] += 1
                continue
            etype = be(p + base + K[K_ETH_TYPE], 2)
            l3 = base + K[K_ETH_SIZE]
            for k in range(2):  # up to two VLAN tags (802.1Q, 802.1ad)
                if etype != K[K_ET_VLAN] and etype != K[K_ET_QINQ]:
                    break
                if l3 + K[K_VLAN_SIZE] > end:
                    etype = -1
                    break
                etype = be(p + l3 + K[K_VLAN_TYPE], 2)
                l3 += K[K_VLAN_SIZE]
            if etype == -1:
                classes[M_SHORT_VLAN] += 1
                continue
            if etype == K[K_ET_IPV4]:
                if l3 + K[K_V4_SIZE] > end:
                    classes[M_SHORT_IP] += 1
                    continue
                h = p[l3 + K[K_V4_VIHL]]
                if (h >> 4) != 4 or (h & 15) < 5:
                    classes[M_BAD_V4] += 1
                    continue
                hl = (h & 15) * 4
                if be(p + l3 + K[K_V4_FRAG], 2) & 0x3FFF:
                    classes[C_FRAG] += 1
                    continue
                proto = p[l3 + K[K_V4_PROTO]]
                ip_end = l3 + <int64_t>be(p + l3 + K[K_V4_TOTLEN], 2)
                v6 = False
            elif etype == K[K_ET_IPV6]:
                if l3 + K[K_V6_SIZE] > end:
                    classes[M_SHORT_IP] += 1
                    continue
                hl = K[K_V6_SIZE]
                proto = p[l3 + K[K_V6_NEXT]]
                ip_end = l3 + hl + <int64_t>be(p + l3 + K[K_V6_PLEN], 2)
                v6 = True
            else:
                if etype < 0x0600:
                    classes[C_LLC] += 1
                elif etype == K[K_ET_ARP]:
                    classes[C_ARP] += 1
                elif etype == K[K_ET_LLDP]:
                    classes[C_LLDP] += 1
                elif etype == K[K_ET_PTP]:
                    classes[C_PTP_L2] += 1
                else:
                    classes[C_ETYPE_OTHER] += 1
                    other_etype[no] = etype
                    no += 1
                continue
            if proto == 6:
                classes[C_TCP] += 1
                continue
            if proto != 17:
                classes[C_IP_OTHER] += 1
                continue
            l4 = l3 + hl
            if l4 + K[K_UDP_SIZE] > end:
                classes[M_SHORT_UDP] += 1
                continue
            dport = be(p + l4 + K[K_UDP_DPORT], 2)
            if dport != K[K_ROCE_PORT]:
                if dport == K[K_PTP_EVENT]:
                    classes[C_PTP_EV] += 1
                elif dport == K[K_PTP_GENERAL]:
                    classes[C_PTP_GEN] += 1
                else:
                    classes[C_UDP_OTHER] += 1
                continue
            ulen = be(p + l4 + K[K_UDP_LEN], 2)
            udp_end = l4 + ulen
            if ulen < K[K_UDP_SIZE] + K[K_BTH_SIZE] + K[K_ICRC] or udp_end > ip_end or udp_end > end:
                classes[M_BAD_ULEN] += 1
                continue
            bth = l4 + K[K_UDP_SIZE]
            op = p[bth + K[K_BTH_OPCODE]]
            h = bth + K[K_BTH_SIZE]
            po = h + HAS_RETH[op] * K[K_RETH_SIZE] + HAS_IMM[op] * K[K_IMM_SIZE] \
                + HAS_AETH[op] * K[K_AETH_SIZE] + HAS_DETH[op] * K[K_DETH_SIZE]
            icrc_at = udp_end - K[K_ICRC]
            pl = icrc_at - po - ((p[bth + K[K_BTH_FLAGS]] >> 4) & 3)
            if pl < 0:
                classes[M_SHORT_ROCE] += 1
                continue
            classes[C_ROCE] += 1
            frame[r] = f
            if v6:
                memcpy(&src[r, 0], p + l3 + K[K_V6_SRC], 16)
                memcpy(&dst[r, 0], p + l3 + K[K_V6_DST], 16)
            else:  # IPv4 as a mapped IPv6 address
                for k in range(10):
                    src[r, k] = 0
                    dst[r, k] = 0
                src[r, 10] = src[r, 11] = dst[r, 10] = dst[r, 11] = 0xFF
                memcpy(&src[r, 12], p + l3 + K[K_V4_SRC], 4)
                memcpy(&dst[r, 12], p + l3 + K[K_V4_DST], 4)
            sport[r] = be(p + l4 + K[K_UDP_SPORT], 2)
            opcode[r] = op
            pad[r] = (p[bth + K[K_BTH_FLAGS]] >> 4) & 3
            dqp[r] = be(p + bth + K[K_BTH_DQP], 3)
            psn[r] = be(p + bth + K[K_BTH_PSN], 3)
            ackreq[r] = p[bth + K[K_BTH_ACKREQ]] >> 7
            has_reth[r] = HAS_RETH[op]
            has_imm[r] = HAS_IMM[op]
            if HAS_RETH[op]:
                va[r] = be(p + h + K[K_RETH_VA], 8)
                rkey[r] = be(p + h + K[K_RETH_RKEY], 4)
                dlen[r] = be(p + h + K[K_RETH_DLEN], 4)
            else:
                va[r] = 0
                rkey[r] = 0
                dlen[r] = 0
            imm[r] = be(p + h + HAS_RETH[op] * K[K_RETH_SIZE], 4) if HAS_IMM[op] else 0
            if HAS_AETH[op]:
                syndrome[r] = p[h + K[K_AETH_SYN]]
                msn[r] = be(p + h + K[K_AETH_MSN], 3)
            else:
                syndrome[r] = 0
                msn[r] = 0
            pay_off[r] = po
            pay_len[r] = pl
            if check_icrc:
                want = _icrc_one(p + l3, hl, v6, icrc_at - l3)
                got = p[icrc_at] | (<uint32_t>p[icrc_at + 1] << 8) | (<uint32_t>p[icrc_at + 2] << 16) \
                    | (<uint32_t>p[icrc_at + 3] << 24)
                icrc_ok[r] = got == want
            else:
                icrc_ok[r] = 1
            if want_ll:
                llf[r] = _ll_one(p + po, pl, &llu[po // 2], ll_line, ll_lo, ll_f1, ll_hi, ll_f2) \
                    if is_write[op] and pl >= ll_line and pl % ll_line == 0 else 0
            r += 1
    return r, no
