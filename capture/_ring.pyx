# cython: language_level=3
"""Walk of TPACKET_V3 ring blocks (Linux AF_PACKET): one row per packet, no Python object per
packet. Inside a block the packets form a chain (`tp_next_offset`) whose steps differ with
the packet sizes, which numpy cannot follow, hence this loop.

Layouts (linux/if_packet.h, a stable kernel ABI):
  struct tpacket_block_desc: version u32, offset_to_priv u32, then tpacket_hdr_v1:
    block_status u32 @8, num_pkts u32 @12, offset_to_first_pkt u32 @16, blk_len u32 @20, ...
  struct tpacket3_hdr: tp_next_offset u32 @0, tp_sec @4, tp_nsec @8, tp_snaplen @12,
    tp_len @16, tp_status @20, tp_mac u16 @24, tp_net u16 @26, tp_vlan_tci u32 @32,
    tp_vlan_tpid u16 @36; the frame starts tp_mac bytes after the header.
"""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memmove

cdef enum:
    BLK_NUM_PKTS = 12
    BLK_FIRST = 16
    HDR_SEC = 4
    HDR_NSEC = 8
    HDR_SNAPLEN = 12
    HDR_LEN = 16
    HDR_STATUS = 20
    HDR_MAC = 24
    HDR_VLAN_TCI = 32
    HDR_VLAN_TPID = 36
    # TPACKET3_HDRLEN: the aligned header plus the sockaddr_ll the kernel writes after it.
    HDR_SPACE = 68
    TP_STATUS_VLAN_VALID = 0x10
    TP_STATUS_VLAN_TPID_VALID = 0x40

cdef enum:
    W_OK = 0
    W_PAST_BLOCK = 1
    W_ZERO_NEXT = 2
    W_TOO_MANY = 3

# Walk results (the status of `walk_blocks`).
OK = W_OK
PAST_BLOCK = W_PAST_BLOCK  # a header or frame runs past the end of its block
ZERO_NEXT = W_ZERO_NEXT  # a packet that is not the block's last has tp_next_offset 0
TOO_MANY = W_TOO_MANY  # more packets than the output columns hold


cdef inline uint32_t _u32(const uint8_t* p) noexcept nogil:
    return (<const uint32_t*>p)[0]


cdef inline uint16_t _u16(const uint8_t* p) noexcept nogil:
    return (<const uint16_t*>p)[0]


def walk_blocks(uint8_t[::1] ring, const int64_t[::1] starts, int64_t block_size, int64_t base,
                int64_t[::1] offset, int64_t[::1] caplen, int64_t[::1] wirelen,
                int64_t[::1] ts_ns):
    """Fills one row per packet of the blocks starting at byte offsets `starts` of `ring`.

    Offsets are relative to `base`. A frame whose outer VLAN tag the kernel moved into the
    header gets it written back in place (12 address bytes moved 4 bytes down into the gap
    the kernel leaves before each frame, then TPID and TCI), so it is byte-identical to the
    wire; its lengths grow by 4. Returns (frames, vlan_restored, vlan_left_out, status,
    block, packet): block/packet locate the damage when status is not OK."""
    cdef Py_ssize_t nb = starts.shape[0], cap = offset.shape[0], n = 0, b = 0
    cdef uint8_t* p = &ring[0] if ring.shape[0] else NULL
    cdef const uint8_t* h
    cdef int64_t start, end, pos, mac, snap, wire, limit = ring.shape[0]
    cdef uint32_t num, k = 0, status, tci, nxt
    cdef uint16_t tpid
    cdef int64_t restored = 0, left_out = 0
    cdef int err = W_OK
    with nogil:
        while b < nb and err == W_OK:
            start = starts[b]
            end = start + block_size
            if start < 0 or end > limit:
                err = W_PAST_BLOCK
                break
            num = _u32(p + start + BLK_NUM_PKTS)
            pos = start + _u32(p + start + BLK_FIRST)
            k = 0
            while k < num:
                if n >= cap:
                    err = W_TOO_MANY
                    break
                if pos < start or pos + HDR_SPACE > end:
                    err = W_PAST_BLOCK
                    break
                h = p + pos
                mac = pos + _u16(h + HDR_MAC)
                snap = _u32(h + HDR_SNAPLEN)
                wire = _u32(h + HDR_LEN)
                if mac < pos + HDR_SPACE or mac + snap > end:
                    err = W_PAST_BLOCK
                    break
                status = _u32(h + HDR_STATUS)
                if status & TP_STATUS_VLAN_VALID:
                    if snap >= 12 and mac - 4 >= pos + HDR_SPACE:
                        tci = _u32(h + HDR_VLAN_TCI)
                        tpid = _u16(h + HDR_VLAN_TPID) if status & TP_STATUS_VLAN_TPID_VALID else 0x8100
                        memmove(p + mac - 4, p + mac, 12)
                        p[mac + 8] = tpid >> 8
                        p[mac + 9] = tpid & 0xFF
                        p[mac + 10] = (tci >> 8) & 0xFF
                        p[mac + 11] = tci & 0xFF
                        mac -= 4
                        snap += 4
                        wire += 4
                        restored += 1
                    else:
                        left_out += 1
                offset[n] = mac - base
                caplen[n] = snap
                wirelen[n] = wire
                ts_ns[n] = <int64_t>_u32(h + HDR_SEC) * 1000000000 + _u32(h + HDR_NSEC)
                n += 1
                k += 1
                if k < num:
                    nxt = _u32(h)
                    if nxt == 0:
                        err = W_ZERO_NEXT
                        break
                    pos += nxt
            if err == W_OK:
                b += 1
    return n, restored, left_out, err, b, k
