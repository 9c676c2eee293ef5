# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled PSN reassembly of the common case (parser.reassembly's fast path).

One pass over a QP's table (held packets, then the batch's, PSNs unwrapped) that decides the
messages the careful path would place in bulk, when every row continues the QP's PSN line from
its cursor without a gap and the rows close complete, self-consistent messages. Stricter than
the careful path wherever it is cheaper to be: anything else is reported, and the caller takes
the careful path over the whole table with nothing changed.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
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


def run_layout(const int64_t[:, ::1] t, const int64_t[::1] heads, const int64_t[::1] npks, Py_ssize_t k0,
               Py_ssize_t k, int64_t npend, const uint8_t[::1] held, int64_t run_bytes,
               const uint8_t[::1] has_immdt, int64_t[::1] base, int64_t[::1] dst, int64_t[:, ::1] per):
    """The columns of one run of intact, consecutive messages from ``k0`` of ``k`` (their first
    rows and packet counts in the table ``t``: line_table's nine rows), in one pass. The table's
    held rows (packets of earlier batches) are its first ``npend`` (the fast path's table), or
    where ``held`` (not empty) is set (the careful path's, sorted by PSN).

    The run ends where its bytes first reach ``run_bytes`` (that message included), or at ``k``.
    Writes ``base`` (the messages' offsets in the run's buffer, one more than messages), ``dst``
    (each packet's offset in it) and, per message, ``per``'s rows: its first PSN, VA bits, rkey,
    RETH length, immediate (-1 unless its closing opcode carries one: ``has_immdt``), earliest
    timestamp, first packet's payload offset and length, packet count. Returns (the run's end k1,
    kx: its messages that open in held rows, rx: the row of message kx in the run, or its rows,
    whether every closing opcode carries an immediate)."""
    cdef Py_ssize_t j, kk, i, m, kx = 0
    cdef int64_t h, e, r, r0, r1, acc = 0, lo, d
    cdef bint all_imm = True
    if t.shape[0] != 9 or heads.shape[0] < k or npks.shape[0] < k or not 0 <= k0 < k \
            or has_immdt.shape[0] < 256 or per.shape[0] != 9 or (held.shape[0] and held.shape[0] != t.shape[1]):
        raise ValueError("run_layout: shapes differ")
    for j in range(k0, k):
        if heads[j] < 0 or npks[j] < 1 or heads[j] + npks[j] > t.shape[1] \
                or (j > k0 and heads[j] != heads[j - 1] + npks[j - 1]):
            raise ValueError("run_layout: messages not consecutive in the table")
    kk = 1  # the run: messages while its bytes stay under run_bytes, and one more
    acc = t[4, heads[k0]]
    while k0 + kk < k and acc < run_bytes:
        acc += t[4, heads[k0 + kk]]
        kk += 1
    r0 = heads[k0]
    r1 = heads[k0 + kk - 1] + npks[k0 + kk - 1]
    m = r1 - r0
    if base.shape[0] < kk + 1 or dst.shape[0] < m or per.shape[1] < kk:
        raise ValueError("run_layout: outputs too small")
    for j in range(kk):
        h = heads[k0 + j]
        e = h + npks[k0 + j]
        if t[1, e - 1] < 0 or t[1, e - 1] > 255:
            raise ValueError("run_layout: opcode out of range")
    with nogil:
        base[0] = 0
        for j in range(kk):
            h = heads[k0 + j]
            e = h + npks[k0 + j]
            per[0, j] = t[0, h]
            per[1, j] = t[2, h]
            per[2, j] = t[3, h]
            per[3, j] = t[4, h]
            if has_immdt[t[1, e - 1]]:
                per[4, j] = t[5, e - 1]
            else:
                per[4, j] = -1
                all_imm = False
            lo = t[6, h]
            for r in range(h + 1, e):
                if t[6, r] < lo:
                    lo = t[6, r]
            per[5, j] = lo
            per[6, j] = t[8, h]
            per[7, j] = t[7, h]
            per[8, j] = npks[k0 + j]
            base[j + 1] = base[j] + t[4, h]
            if h < npend:
                kx = j + 1
        if held.shape[0]:  # messages that open at or before the run's last held row
            lo = r1 - 1
            while lo >= r0 and not held[lo]:
                lo -= 1
            for j in range(kk):
                if heads[k0 + j] <= lo:
                    kx = j + 1
        d = 0
        for i in range(m):
            dst[i] = d
            d += t[7, r0 + i]
    return k0 + kk, kx, (heads[k0 + kx] - r0 if kx < kk else m), all_imm


def ll_columns(const int64_t[:, ::1] per, Py_ssize_t kx, Py_ssize_t kk, int64_t line, int64_t words,
               const uint32_t[::1] llf, const int64_t[::1] rows, int64_t first_row, int64_t npend,
               int64_t[::1] ll_n, int64_t[::1] ll_off, uint32_t[::1] ll_flag):
    """The LL layout of a run's messages from ``kx`` on (``run_layout``'s ``per``: ``kk`` of them):
    each one's LL words (``words`` a ``line`` of its bytes) and their offsets, one after the other;
    with ``llf`` (not empty: the decode's flag per packet of the batch, the table's row r being
    the batch's ``rows[r - npend]``, message kx's first row ``first_row``), each message's flag
    where all its packets carry one, else 0. Returns how many messages have a flag (-1 without
    ``llf``, or when a message opens in held rows)."""
    cdef Py_ssize_t j
    cdef int64_t r, e, off = 0, found = 0
    cdef uint32_t f
    cdef bint read = llf.shape[0] > 0
    if per.shape[0] != 9 or per.shape[1] < kk or not 0 <= kx <= kk or ll_n.shape[0] < kk \
            or ll_off.shape[0] < kk or ll_flag.shape[0] < kk or line < 1:
        raise ValueError("ll_columns: shapes differ")
    if read:
        if first_row < npend:
            read = False
        else:
            e = first_row
            for j in range(kx, kk):
                e += per[8, j]
            if e - npend > rows.shape[0]:
                raise ValueError("ll_columns: rows past the batch's")
            for r in range(first_row, e):
                if rows[r - npend] < 0 or rows[r - npend] >= llf.shape[0]:
                    raise ValueError("ll_columns: a row outside the decode's flags")
    with nogil:
        r = first_row
        for j in range(kx, kk):
            ll_n[j] = per[3, j] // line * words
            ll_off[j] = off
            off += ll_n[j]
            if read:
                f = llf[rows[r - npend]]
                for e in range(r + 1, r + per[8, j]):
                    if llf[rows[e - npend]] != f:
                        f = 0
                        break
                ll_flag[j] = f
                if f:
                    found += 1
                r += per[8, j]
    return found if read else -1
