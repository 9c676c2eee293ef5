# cython: language_level=3
"""The compiled walk to each frame's mirrored frame and its flow, for every transport: where the
frame inside a remote mirror's encapsulation starts (``inner_frames``: the gloo/TCP path reads its
segments there) and the UDP source port of each frame's flow (``flow_ports``: how a port is split
over capture workers). The walk itself is parser/_walk.pxi, shared with the RoCEv2 decode."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

include "_walk.pxi"


def configure(offsets):
    """Field offsets, EtherTypes and protocol numbers (a sequence in K_* order), from parser.headers."""
    if len(offsets) != K_NKEYS:
        raise ValueError(f"expected {K_NKEYS} offsets, got {len(offsets)}")
    for i in range(K_NKEYS):
        K[i] = offsets[i]


def flow_ports(const uint8_t[::1] data, const int64_t[::1] offset, const int64_t[::1] caplen,
               const int64_t[::1] enc, int64_t[::1] out):
    """out[i]: the UDP source port of frame i as the decode walks it (through a mirror
    encapsulation ``enc`` allows: the mirrored flow's), -1 where it has no UDP header."""
    cdef Py_ssize_t n = offset.shape[0], i
    cdef int64_t nd = data.shape[0], scratch[NMIRROR]
    cdef int c
    cdef Walk w
    if caplen.shape[0] != n or out.shape[0] != n:
        raise ValueError(f"flow_ports: {n} offsets, {caplen.shape[0]} lengths, {out.shape[0]} outputs")
    if enc.shape[0] != E_SIZE:
        raise ValueError("flow_ports: encapsulation table of the wrong shape")
    for i in range(n):
        if offset[i] < 0 or caplen[i] < 0 or offset[i] + caplen[i] > nd:
            raise IndexError(f"frame {i}: {offset[i]}+{caplen[i]} of {nd} bytes")
    if n == 0:
        return
    memset(scratch, 0, sizeof(scratch))
    with nogil:
        for i in range(n):
            c = _walk(&data[0], offset[i], offset[i] + caplen[i], &enc[0], scratch, NULL, &w)
            out[i] = be(&data[0] + w.l4 + K[K_UDP_SPORT], 2) \
                if c == C_ROCE or c == C_UDP_OTHER or c == C_PTP_EV or c == C_PTP_GEN else -1


def inner_frames(const uint8_t[::1] data, const int64_t[::1] offset, const int64_t[::1] caplen,
                 int64_t[::1] inner_offset, int64_t[::1] inner_caplen, const int64_t[::1] enc,
                 int64_t[::1] mirror, uint8_t[:, ::1] session_keys, int64_t[:, ::1] session_rows,
                 int64_t[::1] sessions_used):
    """Where each frame's mirrored frame starts and how many of its bytes arrived: the frame itself,
    or the frame inside the mirror encapsulation ``enc`` allows (counted as decode_frames counts).
    Returns the frames taken out of an encapsulation."""
    cdef Py_ssize_t n = offset.shape[0], i
    cdef int64_t nd = data.shape[0], taken = 0
    cdef Walk w
    cdef Sessions ss
    if caplen.shape[0] != n or inner_offset.shape[0] != n or inner_caplen.shape[0] != n:
        raise ValueError(f"inner_frames: {n} offsets, {caplen.shape[0]} lengths, outputs "
                         f"{inner_offset.shape[0]} and {inner_caplen.shape[0]}")
    _check_walk_state(enc, mirror, session_keys, session_rows, sessions_used)
    for i in range(n):
        if offset[i] < 0 or caplen[i] < 0 or offset[i] + caplen[i] > nd:
            raise IndexError(f"frame {i}: {offset[i]}+{caplen[i]} of {nd} bytes")
    if n == 0:
        return 0
    ss.keys, ss.rows, ss.used = &session_keys[0, 0], &session_rows[0, 0], &sessions_used[0]
    ss.cap, ss.last = session_rows.shape[0], -1
    with nogil:
        for i in range(n):
            _walk(&data[0], offset[i], offset[i] + caplen[i], &enc[0], &mirror[0], &ss, &w)
            if w.outer_l3 >= 0:
                inner_offset[i], inner_caplen[i] = w.l2, w.end - w.l2
                taken += 1
            else:
                inner_offset[i], inner_caplen[i] = offset[i], caplen[i]
    return taken
