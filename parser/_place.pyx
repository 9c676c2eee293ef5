# cython: language_level=3
"""Compiled kernels from a send's wire bytes to the collective's buffer, for the common case.

Each kernel does the intact, in-order case in one pass and says so; anything else (a line whose
flags disagree, a copy that differs from what is already placed) returns "not intact" having
changed nothing the caller keeps, and the caller takes the careful numpy path. No offset of a
wire format is written here: parser.protocols passes them from parser.headers.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset


include "_ll.pxi"

# A kernel lets go of the GIL only for this many bytes or more. Below, the hand-over costs more
# than it frees: a 22-step LL replay places 5,000 sends of 35 KB from the consumer's thread, and
# each release let the packet path's thread take the GIL first. Warm passes, interleaved, best of
# 8: LL 0.49-0.53 s vs 0.50-0.55 always released, LL128 0.18-0.19 vs 0.19-0.20, Simple (its
# sends larger) the same, 0.115-0.12; never released, Simple was 15 % slower.
cdef Py_ssize_t GIL_FREE_BYTES = 1 << 18


def ll_intact(const uint8_t[::1] wire, uint8_t[::1] out, int line, int lo, int f1, int hi, int f2):
    """LL: when every ``line``-byte line carries the same non-zero flag in both flag words, writes
    each line's two data words to ``out`` (8 bytes a line) and returns the flag; else 0."""
    cdef uint32_t flag
    if wire.shape[0] == 0 or wire.shape[0] % line or out.shape[0] < wire.shape[0] // line * 8:
        return 0
    with nogil:
        flag = _ll_one(&wire[0], wire.shape[0], &out[0], line, lo, f1, hi, f2)
    return flag


def gather_ll(const uint8_t[::1] src, const int64_t[::1] src_off, const int64_t[::1] length,
              const int64_t[::1] msg_rows, const int64_t[::1] msg_bytes, uint8_t[::1] buf,
              const int64_t[::1] msg_out, uint8_t[::1] out, uint32_t[::1] flags, int line, int lo, int f1, int hi,
              int f2):
    """Message k's packets (rows msg_rows[k] .. msg_rows[k + 1], laid end to end) are copied to
    ``buf`` from byte msg_bytes[k] on, and while they are in cache, ``ll_intact`` of them is written
    to ``out`` from byte msg_out[k] on (8 bytes a line), its flag (0: not intact LL) to flags[k].
    Lengths must add up (rows' lengths to each message's bytes): checked before anything is copied."""
    cdef Py_ssize_t nm = flags.shape[0], k, r, nr = src_off.shape[0]
    cdef int64_t pos, a, nb, ns = src.shape[0]
    if msg_rows.shape[0] != nm + 1 or msg_bytes.shape[0] != nm + 1 or msg_out.shape[0] != nm \
            or length.shape[0] != nr \
            or msg_rows[0] != 0 or msg_rows[nm] != nr or msg_bytes[0] != 0 or msg_bytes[nm] > buf.shape[0]:
        raise ValueError("gather_ll: message bounds do not match the rows")
    for k in range(nm):
        pos = msg_bytes[k]
        if msg_rows[k + 1] < msg_rows[k]:
            raise ValueError("gather_ll: message rows go backwards")
        for r in range(msg_rows[k], msg_rows[k + 1]):
            if length[r] < 0 or src_off[r] < 0 or src_off[r] + length[r] > ns:
                raise ValueError(f"gather_ll: packet {r} lies outside the source")
            pos += length[r]
        if pos != msg_bytes[k + 1]:
            raise ValueError(f"gather_ll: message {k}'s packets hold {pos - msg_bytes[k]} bytes, "
                             f"not {msg_bytes[k + 1] - msg_bytes[k]}")
        nb = msg_bytes[k + 1] - msg_bytes[k]
        if nb and nb % line == 0 and (msg_out[k] < 0 or msg_out[k] + nb // line * 8 > out.shape[0]):
            raise ValueError("gather_ll: out too small")
    with nogil:
        for k in range(nm):
            a = msg_bytes[k]
            pos = a
            for r in range(msg_rows[k], msg_rows[k + 1]):
                if length[r] > 0:
                    memcpy(&buf[pos], &src[src_off[r]], length[r])
                pos += length[r]
            nb = msg_bytes[k + 1] - a
            flags[k] = _ll_one(&buf[a], nb, &out[msg_out[k]], line, lo, f1, hi, f2) \
                if nb > 0 and nb % line == 0 else 0
    return nm


def ll128_intact(const uint8_t[::1] wire, uint8_t[::1] out, int line, int flag_off, int group,
                 const int64_t[:, ::1] runs, int group_data):
    """LL128: when every ``line``-byte line carries the same u64 flag at ``flag_off``, positive as
    an int64, copies each ``group``-byte group's data by ``runs`` (wire offset, data offset,
    length) to ``group_data`` bytes of ``out`` and returns the flag; else 0."""
    cdef Py_ssize_t ng, nl, i, g, k, nr = runs.shape[0]
    cdef uint64_t flag, f
    cdef const uint8_t *w
    cdef uint8_t *o
    cdef bint ok = True
    if wire.shape[0] == 0 or wire.shape[0] % group or out.shape[0] < wire.shape[0] // group * group_data:
        return 0
    ng = wire.shape[0] // group
    nl = wire.shape[0] // line
    memcpy(&flag, &wire[flag_off], 8)
    if <int64_t>flag <= 0:
        return 0
    with nogil:
        for i in range(nl):
            memcpy(&f, &wire[i * line + flag_off], 8)
            if f != flag:
                ok = False
                break
        if ok:
            for g in range(ng):
                w = &wire[g * group]
                o = &out[g * group_data]
                for k in range(nr):
                    memcpy(o + runs[k, 1], w + runs[k, 0], runs[k, 2])
    return flag if ok else 0


cdef inline Py_ssize_t _run_end(const uint8_t *c, Py_ssize_t i, Py_ssize_t n, uint8_t v) noexcept nogil:
    """First index at or after ``i`` whose flag is not ``v`` (flags are 0 or 1), eight at a time."""
    cdef uint64_t w, want = 0x0101010101010101 if v else 0
    while i + 8 <= n:
        memcpy(&w, c + i, 8)
        if w != want:
            break
        i += 8
    while i < n and c[i] == v:
        i += 1
    return i


def place_agreeing(uint8_t[::1] dst, uint8_t[::1] covered, Py_ssize_t start, const uint8_t[::1] src,
                   Py_ssize_t n, Py_ssize_t es):
    """Elements [start, start + n) of ``dst`` (``es`` bytes each) from ``src``: where already
    covered the bytes must agree, elsewhere they are copied and marked covered. Returns how many
    elements it newly covered, or -1, having written nothing, when a covered element differs (the
    caller reports the conflict)."""
    cdef Py_ssize_t added
    cdef uint8_t *d
    cdef const uint8_t *s
    cdef uint8_t *c
    if start < 0 or n < 0 or (start + n) > covered.shape[0] or (start + n) * es > dst.shape[0] \
            or src.shape[0] < n * es:
        raise ValueError("place_agreeing: range outside the buffers")
    if n == 0:
        return 0
    d = &dst[start * es]
    s = &src[0]
    c = &covered[start]
    if n * es >= GIL_FREE_BYTES:
        with nogil:
            added = _place(d, c, s, n, es)
    else:
        added = _place(d, c, s, n, es)
    return added


cdef Py_ssize_t _place(uint8_t *d, uint8_t *c, const uint8_t *s, Py_ssize_t n, Py_ssize_t es) noexcept nogil:
    cdef Py_ssize_t i = 0, j, added = 0
    while i < n:  # runs of covered elements: compare
        j = _run_end(c, i, n, 1)
        if j > i and memcmp(d + i * es, s + i * es, (j - i) * es) != 0:
            return -1
        i = _run_end(c, j, n, 0)
    i = 0
    while i < n:  # runs of uncovered elements: copy
        i = _run_end(c, i, n, 1)
        j = _run_end(c, i, n, 0)
        if j > i:
            memcpy(d + i * es, s + i * es, (j - i) * es)
            memset(c + i, 1, j - i)
            added += j - i
        i = j
    return added


cdef inline bint _gathered(uint8_t *d, const uint8_t *src, const int64_t *soff, const int64_t *moff,
                           const int64_t *ln, Py_ssize_t nrows, Py_ssize_t *k, int64_t x, int64_t y,
                           bint compare) noexcept nogil:
    """Bytes [x, y) of a message whose packet r holds its bytes [moff[r], moff[r] + ln[r]) at
    src[soff[r]:]: compared with (False when they differ) or copied to d[x:y]. Ranges come in
    increasing order; ``k`` keeps the row the last one ended in."""
    cdef int64_t m, a
    cdef Py_ssize_t r
    while k[0] < nrows and moff[k[0]] + ln[k[0]] <= x:
        k[0] += 1
    r = k[0]
    while x < y:
        a = x - moff[r]
        m = moff[r] + ln[r] - x
        if m > y - x:
            m = y - x
        if compare:
            if memcmp(d + x, src + soff[r] + a, m) != 0:
                return False
        else:
            memcpy(d + x, src + soff[r] + a, m)
        x += m
        r += 1
    return True


def place_agreeing_gather(uint8_t[::1] dst, uint8_t[::1] covered, Py_ssize_t start, const uint8_t[::1] src,
                          const int64_t[::1] src_off, const int64_t[::1] msg_off, const int64_t[::1] length,
                          Py_ssize_t n, Py_ssize_t es):
    """``place_agreeing`` from a message still in its packets: packet r carries the message's bytes
    [msg_off[r], msg_off[r] + length[r]) at src[src_off[r]:], the packets tiling the message from
    byte 0 in order. One pass from the capture to the collective's buffer."""
    cdef Py_ssize_t r, nr = src_off.shape[0], added
    cdef uint8_t *d
    cdef uint8_t *c
    if start < 0 or n < 0 or (start + n) > covered.shape[0] or (start + n) * es > dst.shape[0] \
            or msg_off.shape[0] != nr or length.shape[0] != nr:
        raise ValueError("place_agreeing_gather: range outside the buffers")
    for r in range(nr):
        if msg_off[r] != (msg_off[r - 1] + length[r - 1] if r else 0) or length[r] < 0 or src_off[r] < 0 \
                or src_off[r] + length[r] > src.shape[0]:
            raise ValueError(f"place_agreeing_gather: packet {r} does not follow the one before in the message")
    if nr == 0 or msg_off[nr - 1] + length[nr - 1] < n * es:
        raise ValueError("place_agreeing_gather: the packets hold fewer bytes than the elements placed")
    if n == 0:
        return 0
    d = &dst[start * es]
    c = &covered[start]
    if n * es >= GIL_FREE_BYTES:
        with nogil:
            added = _gather_place(d, c, &src[0], &src_off[0], &msg_off[0], &length[0], nr, n, es)
    else:
        added = _gather_place(d, c, &src[0], &src_off[0], &msg_off[0], &length[0], nr, n, es)
    return added


cdef Py_ssize_t _gather_place(uint8_t *d, uint8_t *c, const uint8_t *src, const int64_t *src_off,
                              const int64_t *msg_off, const int64_t *length, Py_ssize_t nr, Py_ssize_t n,
                              Py_ssize_t es) noexcept nogil:
    cdef Py_ssize_t i = 0, j, k = 0, added = 0
    while i < n:  # runs of covered elements: compare
        j = _run_end(c, i, n, 1)
        if j > i and not _gathered(d, src, src_off, msg_off, length, nr, &k, i * es, j * es, True):
            return -1
        i = _run_end(c, j, n, 0)
    i = 0
    k = 0
    while i < n:  # runs of uncovered elements: copy
        i = _run_end(c, i, n, 1)
        j = _run_end(c, i, n, 0)
        if j > i:
            _gathered(d, src, src_off, msg_off, length, nr, &k, i * es, j * es, False)
            memset(c + i, 1, j - i)
            added += j - i
        i = j
    return added
