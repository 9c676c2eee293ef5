# cython: language_level=3
"""Compiled kernels of the packet path: RoCEv2 ICRC and bulk range copies.

The ICRC (IBTA annex A17.3.3) is a CRC-32 over 8 bytes of 0xFF, the IP header with its variant
fields set to ones (IPv4: TOS, TTL, header checksum; IPv6: traffic class, flow label, hop limit),
the UDP header with checksum 0xFFFF, the BTH with its reserved byte 4 set to 0xFF, and everything
after it up to the ICRC, which is stored little-endian. zlib's crc32 is the same CRC.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

cdef extern from "zlib.h" nogil:
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len)

# Position of the UDP header relative to the IP header is the IP header length; the BTH follows
# the 8-byte UDP header. 80 bytes hold 8 + 60 (largest IPv4 header) ... we only mask the fixed
# 20-byte IPv4 header and the 40-byte IPv6 header; IPv4 options are covered unmasked.
DEF MASKED_MAX = 8 + 60 + 8 + 12


cdef inline uint32_t _icrc_one(const uint8_t *ip, int64_t ip_hlen, bint v6, int64_t icrc_pos) nogil:
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
    cdef unsigned long c = crc32(0, buf, <unsigned int>(8 + head))
    c = crc32(c, ip + head, <unsigned int>(icrc_pos - head))
    return <uint32_t>c


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


def copy_ranges(const uint8_t[::1] src, const int64_t[::1] src_off, uint8_t[::1] dst,
                const int64_t[::1] dst_off, const int64_t[::1] length):
    """dst[dst_off[k] : +length[k]] = src[src_off[k] : +length[k]] for every k (bounds checked)."""
    cdef Py_ssize_t n = src_off.shape[0], k
    cdef int64_t ns = src.shape[0], nd = dst.shape[0]
    for k in range(n):
        if length[k] < 0 or src_off[k] < 0 or dst_off[k] < 0 or \
                src_off[k] + length[k] > ns or dst_off[k] + length[k] > nd:
            raise IndexError(f"range {k}: src {src_off[k]}+{length[k]} of {ns}, dst {dst_off[k]} of {nd}")
    with nogil:
        for k in range(n):
            if length[k] > 0:
                memcpy(&dst[dst_off[k]], &src[src_off[k]], length[k])
