# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled PSN reassembly of the common case (parser.reassembly's fast path).

One pass over a QP's table (held packets, then the batch's, PSNs unwrapped) that decides the
messages the careful path would place in bulk, when every row continues the QP's PSN line from
its cursor without a gap and the rows close complete, self-consistent messages. Stricter than
the careful path wherever it is cheaper to be: anything else is reported, and the caller takes
the careful path over the whole table with nothing changed.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t
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


def line_table(const int64_t[::1] rows, const int64_t[::1] psn24, const int64_t[::1] op,
               const uint64_t[::1] va, const int64_t[::1] rkey, const int64_t[::1] dlen,
               const int64_t[::1] imm_raw, const uint8_t[::1] has_imm, const int64_t[::1] ts,
               const int64_t[::1] plen, const int64_t[::1] pay_off, const int64_t[:, ::1] held,
               int64_t cursor, const uint8_t[::1] is_first, const uint8_t[::1] is_last, int64_t middle,
               int64_t[:, ::1] out):
    """A QP's table for the fast path, in one pass: the held rows (``held``: the table's nine
    columns, PSNs unwrapped) and then the batch's ``rows``, to ``out`` (columns psn, opcode, va,
    rkey, dlen, imm, ts, plen, src_off; va's bits as int64, imm -1 where the packet has none).
    Only when the batch's rows continue the PSN line held rows end on, from ``cursor`` on
    (24-bit PSNs): returns (True, the largest payload of a FIRST or MIDDLE packet among them, -1
    when none), else (False, -1) with ``out`` unusable."""
    cdef Py_ssize_t n = rows.shape[0], h = held.shape[1], i, c, nb = psn24.shape[0]
    cdef int64_t r, o, full = -1, base = cursor + h
    cdef bint ok = True
    if out.shape[0] != 9 or held.shape[0] != 9 or out.shape[1] != h + n or is_first.shape[0] < 256 \
            or is_last.shape[0] < 256:
        raise ValueError("line_table: table shapes differ")
    if op.shape[0] != nb or va.shape[0] != nb or rkey.shape[0] != nb or dlen.shape[0] != nb \
            or imm_raw.shape[0] != nb or has_imm.shape[0] != nb or ts.shape[0] != nb \
            or plen.shape[0] != nb or pay_off.shape[0] != nb:
        raise ValueError("line_table: column lengths differ")
    if n + 1 >= (1 << 23):
        return False, -1  # more rows than half the PSN space: not one line
    for i in range(n):
        if rows[i] < 0 or rows[i] >= nb:
            raise ValueError("line_table: row out of range")
    with nogil:
        for i in range(h):
            for c in range(9):
                out[c, i] = held[c, i]
        for i in range(n):
            r = rows[i]
            o = op[r]
            if psn24[r] != ((base + i) & 0xFFFFFF) or o < 0 or o > 255:
                ok = False
                break
            out[0, h + i] = base + i
            out[1, h + i] = o
            out[2, h + i] = <int64_t>va[r]
            out[3, h + i] = rkey[r]
            out[4, h + i] = dlen[r]
            out[5, h + i] = imm_raw[r] if has_imm[r] else -1
            out[6, h + i] = ts[r]
            out[7, h + i] = plen[r]
            out[8, h + i] = pay_off[r]
            if (is_first[o] and not is_last[o]) or o == middle:
                if plen[r] > full:
                    full = plen[r]
    if not ok:
        return False, -1
    return True, full


cdef inline uint64_t _le(const uint8_t *p, int k) noexcept nogil:
    """``k`` bytes at ``p``, little-endian."""
    cdef uint64_t v = 0
    cdef int i
    for i in range(k - 1, -1, -1):
        v = (v << 8) | p[i]
    return v


def opens_like_ll(const uint8_t[::1] data, const int64_t[:] first, const int64_t[:] length, int64_t line,
                  int64_t f1, int64_t f2):
    """Whether a message whose first packet lies at ``first`` (``length`` bytes) in ``data`` opens
    with an LL line (``line`` bytes, 32-bit flags at ``f1`` and ``f2``): its two flags equal and
    not zero. One pass, no index arrays: it is asked for every run a batch places."""
    cdef Py_ssize_t k, n = first.shape[0]
    cdef int64_t a
    cdef uint64_t x
    if length.shape[0] != n:
        raise ValueError("opens_like_ll: first and length differ in length")
    for k in range(n):
        if length[k] < line:
            continue
        a = first[k]
        if a < 0 or a + f1 + 4 > data.shape[0] or a + f2 + 4 > data.shape[0]:
            raise IndexError("opens_like_ll: a packet outside the data")
        x = _le(&data[a + f1], 4)
        if x != 0 and x == _le(&data[a + f2], 4):
            return True
    return False


def may_open_ll128(const uint8_t[::1] data, const int64_t[:] first, const int64_t[:] length,
                   const int64_t[:] dlen, int64_t group, int64_t line, int64_t flag_at):
    """Whether a message of ``dlen`` bytes whose first packet lies at ``first`` (``length`` bytes)
    could read as intact LL128: whole groups of ``group`` bytes and its first two lines'
    (``line`` bytes, a 64-bit flag at ``flag_at``) flags equal and positive as an int64; True
    when a message of whole groups has its first two lines beyond its first packet."""
    cdef Py_ssize_t k, n = first.shape[0]
    cdef int64_t a, x
    cdef bint short = False, found = False
    if length.shape[0] != n or dlen.shape[0] != n:
        raise ValueError("may_open_ll128: first, length and dlen differ in length")
    for k in range(n):
        if dlen[k] <= 0 or dlen[k] % group:
            continue
        if length[k] < 2 * line:
            short = True
            continue
        a = first[k]
        if a < 0 or a + line + flag_at + 8 > data.shape[0]:
            raise IndexError("may_open_ll128: a packet outside the data")
        x = <int64_t> _le(&data[a + flag_at], 8)
        if x > 0 and x == <int64_t> _le(&data[a + line + flag_at], 8):
            found = True
    return short or found
