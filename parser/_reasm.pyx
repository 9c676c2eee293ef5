# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled PSN reassembly of the common case (parser.reassembly's fast path).

One pass over a QP's table (held packets, then the batch's, PSNs unwrapped) that decides the
messages the careful path would place in bulk, when every row continues the QP's PSN line from
its cursor without a gap and the rows close complete, self-consistent messages. Stricter than
the careful path wherever it is cheaper to be: anything else is reported, and the caller takes
the careful path over the whole table with nothing changed.
"""

from libc.stdint cimport int64_t, uint8_t


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
