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
from libc.string cimport memcmp, memcpy, memset

include "_ll.pxi"

cdef extern from * nogil:
    """
    #include <stdint.h>
    #ifdef MIRRORCKPT_ISAL
    #include <isa-l/crc.h>
    /* ISA-L's AVX-512 CRC returns with the upper halves of the vector registers in use (no
       vzeroupper: isa-l issue 24), and each legacy SSE instruction after it (this module's 16-byte
       copies) then pays for the mixed state: without the vzeroupper below, the decode of cold 1 KB
       frames with their ICRC took 0.32 CPU-s/GB, with it 0.13 (0.09: ISA-L over the same bytes
       alone). vzeroupper needs AVX, which the CPU and the OS must both allow (what
       __builtin_cpu_supports checks). */
    #if defined(__x86_64__) || defined(__i386__)
    static int mck_vzeroupper = 0;
    static void mck_cpu_init(void) { __builtin_cpu_init(); mck_vzeroupper = __builtin_cpu_supports("avx"); }
    #else
    static void mck_cpu_init(void) {}
    #endif
    /* same pre/post inversion as zlib's crc32, so calls chain the same way */
    static inline uint32_t mck_crc32(uint32_t c, const uint8_t *p, uint64_t n) {
        uint32_t r = crc32_gzip_refl(c, p, n);
    #if defined(__x86_64__) || defined(__i386__)
        if (mck_vzeroupper)
            __asm__ volatile("vzeroupper");
    #endif
        return r;
    }
    #define MCK_CRC_BACKEND "isa-l"
    #else
    #include <zlib.h>
    static inline uint32_t mck_crc32(uint32_t c, const uint8_t *p, uint64_t n) { return (uint32_t)crc32(c, p, (uInt)n); }
    static void mck_cpu_init(void) {}
    #define MCK_CRC_BACKEND "zlib"
    #endif
    """
    uint32_t mck_crc32(uint32_t crc, const uint8_t *buf, uint64_t n)
    void mck_cpu_init()
    const char *MCK_CRC_BACKEND

mck_cpu_init()

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


include "../_walk.pxi"

cdef uint8_t[256] HAS_RETH, HAS_IMM, HAS_AETH, HAS_DETH

# The ICRC reads every payload byte once, from memory the walk has not touched: every frame is
# prefetched PREFETCH_AHEAD frames before its turn, all its lines at once. Decode with ICRC and LL
# reading of cold 1.1 KB frames (Simple, LL, LL128; 0.4-0.8 GB, best of 5 thread CPU time,
# interleaved): 0.12-0.13 s/GB Simple and LL128, 0.19 LL, where ISA-L over the same bytes alone
# takes 0.09; no prefetch 0.16-0.21; four frames ahead, or a steady 2-16 KB ahead of the walk,
# or 1 KB steps inside the CRC, the same within the noise (+-5 %); prefetcht1/t2 the same,
# prefetchnta 0.18-0.29.
DEF PREFETCH_AHEAD = 2


def configure(offsets, has_reth, has_imm, has_aeth, has_deth):
    """Field offsets, EtherTypes and protocol numbers (a sequence in K_* order) and opcode lookup
    tables, from parser.headers."""
    if len(offsets) != K_NKEYS:
        raise ValueError(f"expected {K_NKEYS} offsets, got {len(offsets)}")
    for i in range(K_NKEYS):
        K[i] = offsets[i]
    for i in range(256):
        HAS_RETH[i] = has_reth[i]
        HAS_IMM[i] = has_imm[i]
        HAS_AETH[i] = has_aeth[i]
        HAS_DETH[i] = has_deth[i]


def decode_frames(const uint8_t[::1] data, const int64_t[::1] offset, const int64_t[::1] caplen,
                  const int64_t[::1] wirelen, const uint8_t[::1] eth_ok, bint check_icrc,
                  int64_t[::1] frame, uint8_t[:, ::1] src, uint8_t[:, ::1] dst, int64_t[::1] sport,
                  int64_t[::1] opcode, int64_t[::1] pad, int64_t[::1] dqp, int64_t[::1] psn,
                  uint8_t[::1] ackreq, uint64_t[::1] va, int64_t[::1] rkey, int64_t[::1] dlen,
                  uint8_t[::1] has_reth, uint8_t[::1] has_imm, int64_t[::1] imm, int64_t[::1] syndrome,
                  int64_t[::1] msn, int64_t[::1] pay_off, int64_t[::1] pay_len, uint8_t[::1] icrc_ok,
                  int64_t[::1] classes, int64_t[::1] other_etype, const uint8_t[::1] is_write,
                  uint8_t[::1] llu, uint32_t[::1] llf, int ll_line, int ll_lo, int ll_f1, int ll_hi, int ll_f2,
                  const int64_t[::1] enc, int64_t[::1] mirror, uint8_t[:, ::1] session_keys,
                  int64_t[:, ::1] session_rows, int64_t[::1] sessions_used):
    """Decodes every frame; writes one row per RoCEv2 packet. Returns (packets, other ethertypes).

    ``enc`` (parser.encap.table) says which mirror encapsulations are taken off; what they showed
    is added to ``mirror`` (MIRROR order) and, per GRE-sequenced session, to ``session_rows``
    (SESSION_COLUMNS, keys in ``session_keys``, ``sessions_used[0]`` rows in use): state a
    stream keeps from batch to batch.

    With ``llu`` (not empty: at least half the batch's bytes), each RDMA WRITE payload of whole LL
    lines is read as LL right after its ICRC, while it is in cache: llf[row] its flag (0: not
    intact LL, or not read), its data words at llu[pay_off // 2] on (8 bytes a line), so that
    reassembly need not copy the wire bytes of an intact LL message to read it."""
    cdef Py_ssize_t n = offset.shape[0], f
    cdef bint want_ll = llu.shape[0] > 0
    if want_ll and (llf.shape[0] < n or llu.shape[0] < data.shape[0] // 2 or is_write.shape[0] < 256
                    or ll_line < 16 or ll_line % 16):
        raise ValueError("decode_frames: LL outputs too small")
    _check_walk_state(enc, mirror, session_keys, session_rows, sessions_used)
    cdef int64_t r = 0, no = 0, nbytes = data.shape[0]
    cdef int64_t base, end, l3, l4, hl, ulen, udp_end, bth, h, icrc_at, po, pl, k
    cdef int64_t op
    cdef int c
    cdef const uint8_t *p
    cdef bint v6
    cdef uint32_t want, got
    cdef Walk w
    cdef Sessions ss
    ss.keys, ss.rows, ss.used = &session_keys[0, 0], &session_rows[0, 0], &sessions_used[0]
    ss.cap, ss.last = session_rows.shape[0], -1
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
            if check_icrc and f + PREFETCH_AHEAD < n \
                    and offset[f + PREFETCH_AHEAD] + caplen[f + PREFETCH_AHEAD] <= nbytes:
                mck_prefetch(p + offset[f + PREFETCH_AHEAD], caplen[f + PREFETCH_AHEAD])
            c = _walk(p, base, end, &enc[0], &mirror[0], &ss, &w)
            if c == C_ROCE and w.ip_end > w.end:  # whole as captured, yet shorter than its IP header says
                c = C_MIRROR_TRUNC
            if c != C_ROCE:
                classes[c] += 1
                if c == C_ETYPE_OTHER:
                    other_etype[no] = w.etype
                    no += 1
                elif c == C_MIRROR_TRUNC and not w.marked:
                    mirror[X_CUT_UNMARKED] += 1
                continue
            l3, l4, hl, v6, end = w.l3, w.l4, w.hl, w.v6, w.end
            ulen = be(p + l4 + K[K_UDP_LEN], 2)
            udp_end = l4 + ulen
            if ulen < K[K_UDP_SIZE] + K[K_BTH_SIZE] + K[K_ICRC] or udp_end > w.ip_end or udp_end > end:
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
