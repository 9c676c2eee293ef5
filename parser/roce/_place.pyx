# cython: language_level=3
"""Compiled kernels that read NCCL's LL and LL128 lines from a send's wire bytes, for the common case.

Each kernel does the intact, in-order case in one pass and says so; anything else (a line whose
flags disagree, a copy that differs from what is already placed) returns "not intact" having
changed nothing the caller keeps, and the caller takes the careful numpy path. No offset of a
wire format is written here: parser.protocols passes them from parser.headers.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy


include "_ll.pxi"


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


cdef inline bint _ll128_groups(const uint8_t *wire, Py_ssize_t ng, uint8_t *out, uint64_t *flag, int line,
                               int flag_off, int group, const int64_t[:, ::1] runs, int group_data) noexcept nogil:
    """``ng`` groups of LL128 lines: every line's flag equal to ``flag[0]`` (0: the first line's,
    which must be positive as an int64), each group's data by ``runs`` to ``out``. False, with
    ``out`` partly written, when a flag differs."""
    cdef Py_ssize_t i, g, k, nl = ng * (group // line), nr = runs.shape[0]
    cdef uint64_t f
    cdef const uint8_t *w
    cdef uint8_t *o
    if ng <= 0:
        return True
    if flag[0] == 0:
        memcpy(&f, wire + flag_off, 8)
        if <int64_t>f <= 0:
            return False
        flag[0] = f
    for i in range(nl):
        memcpy(&f, wire + i * line + flag_off, 8)
        if f != flag[0]:
            return False
    for g in range(ng):
        w = wire + g * group
        o = out + g * group_data
        for k in range(nr):
            memcpy(o + runs[k, 1], w + runs[k, 0], runs[k, 2])
    return True


def ll128_intact(const uint8_t[::1] wire, uint8_t[::1] out, int line, int flag_off, int group,
                 const int64_t[:, ::1] runs, int group_data):
    """LL128: when every ``line``-byte line carries the same u64 flag at ``flag_off``, positive as
    an int64, copies each ``group``-byte group's data by ``runs`` (wire offset, data offset,
    length) to ``group_data`` bytes of ``out`` and returns the flag; else 0."""
    cdef uint64_t flag = 0
    cdef bint ok
    if wire.shape[0] == 0 or wire.shape[0] % group or out.shape[0] < wire.shape[0] // group * group_data:
        return 0
    with nogil:
        ok = _ll128_groups(&wire[0], wire.shape[0] // group, &out[0], &flag, line, flag_off, group, runs,
                           group_data)
    return flag if ok else 0


def gather_ll128(const uint8_t[::1] src, const int64_t[::1] src_off, const int64_t[::1] length, uint8_t[::1] out,
                 uint8_t[::1] scratch, int line, int flag_off, int group, const int64_t[:, ::1] runs,
                 int group_data):
    """``ll128_intact`` of a message still in its packets (packet r: ``length[r]`` bytes at
    src[src_off[r]:], the packets end to end): whole groups are read where they lie, a group cut
    by a packet's end is put together in ``scratch`` (a group at least) first. One pass over the
    wire bytes, none copied whole."""
    cdef Py_ssize_t nr = src_off.shape[0], r, ng, og = 0, fill = 0
    cdef int64_t total = 0, rem, m
    cdef uint64_t flag = 0
    cdef const uint8_t *p
    cdef bint ok = True
    if length.shape[0] != nr:
        raise ValueError("gather_ll128: offsets and lengths differ in number")
    for r in range(nr):
        if length[r] < 0 or src_off[r] < 0 or src_off[r] + length[r] > src.shape[0]:
            raise ValueError(f"gather_ll128: packet {r} lies outside the source")
        total += length[r]
    if total == 0 or total % group or out.shape[0] < total // group * group_data or scratch.shape[0] < group:
        return 0
    with nogil:
        for r in range(nr):
            p = &src[src_off[r]]
            rem = length[r]
            while rem > 0 and ok:
                if fill == 0 and rem >= group:  # whole groups where they lie
                    ng = rem // group
                    ok = _ll128_groups(p, ng, &out[og * group_data], &flag, line, flag_off, group, runs, group_data)
                    og += ng
                    p += ng * group
                    rem -= ng * group
                    continue
                m = min(rem, group - fill)  # the cut group only: the groups after it are whole again
                memcpy(&scratch[fill], p, m)
                fill += m
                p += m
                rem -= m
                if fill == group:  # the group put together
                    ok = _ll128_groups(&scratch[0], 1, &out[og * group_data], &flag, line, flag_off, group, runs,
                                       group_data)
                    og += 1
                    fill = 0
            if not ok:
                break
    return flag if ok and fill == 0 else 0
