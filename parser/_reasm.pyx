# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled PSN reassembly of the common case (parser.reassembly's fast path).

One pass over a QP's table (held packets, then the batch's, PSNs unwrapped) that decides the
messages the careful path would place in bulk, when every row continues the QP's PSN line from
its cursor without a gap and the rows close complete, self-consistent messages. Stricter than
the careful path wherever it is cheaper to be: anything else is reported, and the caller takes
the careful path over the whole table with nothing changed.
"""

from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcmp

import numpy as np


def intact_messages(const int64_t[::1] psn, const int64_t[::1] op, const int64_t[::1] plen,
                    const int64_t[::1] dlen, const uint8_t[::1] is_first, const uint8_t[::1] is_last,
                    int64_t cursor, int64_t max_message, int64_t[::1] heads, int64_t[::1] npks):
    """Rows must carry PSNs cursor, cursor + 1, ... (else (-1, 0, False)). From row 0 on, each
    message must open with a FIRST (or be one ONLY) whose RETH length is at most ``max_message``,
    carry one path MTU (the FIRST's payload) in every packet but its last, hold only MIDDLE
    packets inside and close with a LAST whose payload completes the RETH length; an ONLY's
    payload is its RETH length. Writes each message's first row and packet count to ``heads`` and
    ``npks``; returns (messages, rows they use, tail_ok): tail_ok when the rows after them are
    the beginning of one such message still waiting for its other packets (or there are none)."""
    cdef Py_ssize_t n = psn.shape[0], i = 0, r, k = 0, npk
    cdef int64_t hp, hd, pm, o
    cdef bint tail_ok = False, ok
    if plen.shape[0] != n or op.shape[0] != n or dlen.shape[0] != n or heads.shape[0] < n \
            or npks.shape[0] < n or is_first.shape[0] < 256 or is_last.shape[0] < 256:
        raise ValueError("intact_messages: column lengths differ")
    for r in range(n):
        if psn[r] != cursor + r or op[r] < 0 or op[r] > 255:
            return -1, 0, False
    with nogil:
        while i < n:
            o = op[i]
            if not is_first[o]:
                break
            hp = plen[i]
            hd = dlen[i]
            if is_last[o]:  # ONLY: one packet
                if hd == hp and hd <= max_message:
                    heads[k] = i
                    npks[k] = 1
                    k += 1
                    i += 1
                    continue
                break
            if hp < 1 or hd > max_message:
                break
            pm = hp
            npk = (hd + pm - 1) // pm
            if npk < 2:
                break
            ok = True
            r = i + 1
            while r < n and r < i + npk - 1:  # inside: MIDDLE packets of one MTU
                if is_first[op[r]] or is_last[op[r]] or plen[r] != pm:
                    ok = False
                    break
                r += 1
            if not ok:
                break
            if i + npk > n:  # the batch ends inside it: it waits for the rest
                tail_ok = True
                break
            r = i + npk - 1
            if is_first[op[r]] or not is_last[op[r]] or plen[r] != hd - (npk - 1) * pm:
                break
            heads[k] = i
            npks[k] = npk
            k += 1
            i += npk
    return k, i, tail_ok or i == n


def group_qps(const int64_t[::1] sel, const int64_t[::1] dqp, const uint8_t[:, ::1] src,
              const uint8_t[:, ::1] dst, int64_t[::1] order, int64_t[::1] first, int64_t[::1] count):
    """Groups rows ``sel`` by QP (destination QP number and both addresses) in one pass: writes
    each group's rows, in arrival order, to ``order`` one group after the other (groups in the
    order they first appear), and each group's first row and size to ``first`` and ``count``.
    Returns the number of groups, or -1 (``order`` unusable) when there are more than ``first``
    holds."""
    cdef Py_ssize_t n = sel.shape[0], cap = first.shape[0], i, g, f, ng = 0, last = -1
    cdef int64_t r, q, acc = 0
    if order.shape[0] < n or count.shape[0] < cap or src.shape[1] != 16 or dst.shape[1] != 16 \
            or dqp.shape[0] != src.shape[0] or dqp.shape[0] != dst.shape[0]:
        raise ValueError("group_qps: column shapes differ")
    for i in range(n):
        if sel[i] < 0 or sel[i] >= dqp.shape[0]:
            raise ValueError("group_qps: row out of range")
    cdef int64_t[::1] gid = np.empty(n, np.int64)
    cdef int64_t[::1] start = np.empty(cap, np.int64)
    with nogil:
        for i in range(n):
            r = sel[i]
            q = dqp[r]
            g = last  # packets of one QP come in runs: try the last one's group first
            if g < 0 or not _same(dqp, src, dst, first[g], r, q):
                g = -1
                for f in range(ng):
                    if _same(dqp, src, dst, first[f], r, q):
                        g = f
                        break
                if g < 0:
                    if ng == cap:
                        ng = -1
                        break
                    g = ng
                    first[g] = r
                    count[g] = 0
                    ng += 1
                last = g
            count[g] += 1
            gid[i] = g
    if ng < 0:
        return -1
    with nogil:
        for g in range(ng):  # counting sort, stable
            start[g] = acc
            acc += count[g]
        for i in range(n):
            order[start[gid[i]]] = sel[i]
            start[gid[i]] += 1
    return ng


cdef inline bint _same(const int64_t[::1] dqp, const uint8_t[:, ::1] src, const uint8_t[:, ::1] dst,
                       int64_t a, int64_t b, int64_t q) noexcept nogil:
    return dqp[a] == q and memcmp(&src[a, 0], &src[b, 0], 16) == 0 and memcmp(&dst[a, 0], &dst[b, 0], 16) == 0
