# cython: language_level=3
"""Sequential walks over pcap records and pcapng blocks (layouts: capture/formats.py).

One call walks as many records or blocks as fit the output arrays and stops at the end of the
data, when the arrays are full, at a block the caller must parse itself (pcapng section header
and interface description) or at the first damaged record/block. Every step advances `pos` by
at least one whole header, so a walk always ends. The caller turns the status and the two
context values `a`, `b` into an error message.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef extern from *:
    void __builtin_prefetch(const void *addr) nogil

# What a walk asks for ahead of itself. A walk reads a few words per record or block, whose places
# depend on the lengths before them, so without a hint every record costs a memory latency. The
# file is read in order: behind records under ``stride_min`` bytes every cache line of the next
# AHEAD bytes is requested (2048 measured best on 1 KB frames); behind longer ones only the lines
# where the next AHEAD_BLOCKS records would start and end if they had the length of the ones
# before (one record of another length, an ACK between data frames, moves the predictions by the
# difference; two in a row start new ones), so that the walk does not pull the whole file through
# the cache (4 KB frames: the walk of a cached 661 MB capture took 0.02 s with every line, 0.009 s
# so). STRIDE_MIN: for a reader of the frames that asks for none itself; BOUNDS_STRIDE_MIN: for
# one that does (the RoCE decode, which prefetches each frame it checks the ICRC of). A generated
# 1.1 GB LL capture (1.1 KB frames, one ACK-sized record in 20), cold: the walk 105-129 ns a frame
# with every line (the file's bytes at memory speed) or with predictions that stayed in step with
# the first record instead of the records, 44-47 ns so; 9 ns with the records in L2.
cdef enum:
    AHEAD = 2048
    AHEAD_BLOCKS = 16

STRIDE_MIN = 2048
BOUNDS_STRIDE_MIN = 256


cdef struct Ahead:
    Py_ssize_t pf  # the next place to ask for: a line, or where a record is predicted to start
    int64_t dom    # the record length predicted for the records ahead (0: none yet)
    int64_t odd    # the length of the record before, when it was not ``dom`` (else 0)


cdef inline void _prefetch(const uint8_t *buf, Ahead *a, Py_ssize_t pos, int64_t step,
                           Py_ssize_t end, int64_t stride_min) noexcept nogil:
    """Prefetches ahead of ``pos`` (``step``: the length of the record before it, 0 at the first)."""
    if step < stride_min or step <= 0:
        if a.pf < pos:
            a.pf = pos
        while a.pf < pos + AHEAD and a.pf < end:
            __builtin_prefetch(&buf[a.pf])
            a.pf += 64
        a.dom = 0
        return
    if step != a.dom:
        if step == a.odd or a.dom == 0 or a.pf <= pos:
            # a new length, twice in a row (or nothing predicted): predicted from here on
            a.dom = step
            a.pf = pos
        else:
            # one record of another length (an ACK between the data): the records predicted after
            # it start that much further (or nearer)
            a.pf += step - a.dom
            if a.pf < pos:
                a.pf = pos
        a.odd = step
    else:
        a.odd = 0
    while a.pf < pos + AHEAD_BLOCKS * a.dom and a.pf < end:  # pos >= step: a record lies before it
        __builtin_prefetch(&buf[a.pf])
        __builtin_prefetch(&buf[a.pf - 4])
        a.pf += a.dom


cpdef enum Status:
    END = 0          # walked to the end of the data
    FULL = 1         # output arrays full; pos is the next record/block
    AT_SHB = 2       # pos is a section header block
    AT_IDB = 3       # pos is an interface description block (already length-checked)
    CUT_HEADER = 10  # fewer bytes left than a record/block header; a = bytes left
    SHORT = 11       # block length below its minimum; a = length, b = minimum
    UNALIGNED = 12   # block length not a multiple of 4; a = length
    PAST_END = 13    # record/block runs past the end; a = its length, b = bytes left
    TRAILER = 14     # trailing block length differs; a = trailing, b = leading
    CAPLEN_BODY = 15 # captured length does not fit the block; a = caplen, b = room
    CAPLEN_MAX = 16  # captured length beyond the sanity limit; a = caplen, b = limit
    IFACE = 17       # unknown interface id; a = id, b = interfaces in the section


cdef inline uint32_t rd32(const uint8_t *p, bint big) noexcept nogil:
    # Assembled from bytes so it is right on any host; gcc turns it into one load (+ bswap).
    if big:
        return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]
    return (<uint32_t>p[3] << 24) | (<uint32_t>p[2] << 16) | (<uint32_t>p[1] << 8) | p[0]


cdef inline uint32_t rd16(const uint8_t *p, bint big) noexcept nogil:
    if big:
        return (<uint32_t>p[0] << 8) | p[1]
    return (<uint32_t>p[1] << 8) | p[0]


def walk_pcap(const uint8_t[::1] buf, Py_ssize_t pos, bint big, uint64_t frac_per_sec,
              int64_t max_caplen, int64_t[::1] offset, int64_t[::1] caplen,
              int64_t[::1] wirelen, uint64_t[::1] ts, Py_ssize_t n, int64_t stride_min=STRIDE_MIN):
    """Walks 16-byte-header pcap records from pos, filling the arrays from index n.

    ts is seconds * frac_per_sec + fraction (raw units); stride_min: see _prefetch above.
    Returns (n, pos, status, a, b).
    """
    cdef Py_ssize_t end = buf.shape[0], cap = offset.shape[0]
    cdef const uint8_t *p
    cdef int64_t incl, a = 0, b = 0
    cdef Ahead ah
    ah.pf, ah.dom, ah.odd = pos, 0, 0
    cdef int64_t step = 0
    cdef Status status = END
    with nogil:
        while True:
            if pos == end:
                status = END
                break
            if n == cap:
                status = FULL
                break
            _prefetch(&buf[0], &ah, pos, step, end, stride_min)
            if end - pos < 16:
                status = CUT_HEADER
                a = end - pos
                break
            p = &buf[pos]
            incl = rd32(p + 8, big)
            if incl > max_caplen:
                status = CAPLEN_MAX
                a = incl
                b = max_caplen
                break
            if incl > end - pos - 16:
                status = PAST_END
                a = incl
                b = end - pos - 16
                break
            offset[n] = pos + 16
            caplen[n] = incl
            wirelen[n] = rd32(p + 12, big)
            ts[n] = <uint64_t>rd32(p, big) * frac_per_sec + rd32(p + 4, big)
            n += 1
            pos += 16 + incl
            step = 16 + incl
    return n, pos, status, a, b


def walk_pcapng(const uint8_t[::1] buf, Py_ssize_t pos, bint big, int32_t iface_base,
                int32_t n_ifaces, int64_t spb_snaplen, int64_t max_caplen,
                int64_t[::1] offset, int64_t[::1] caplen, int64_t[::1] wirelen,
                uint64_t[::1] ts, int32_t[::1] iface, Py_ssize_t n, int64_t stride_min=STRIDE_MIN):
    """Walks pcapng blocks of one section (big-endian if `big`) from pos, filling from index n.

    Packets of EPB, SPB and obsolete PB are recorded; interface ids are checked against the
    section's `n_ifaces` and stored as iface_base + id. SPBs belong to interface 0, whose
    snaplen (0: none) caps their captured length. Other block types are skipped. stride_min: see
    _prefetch above.
    Returns (n, pos, status, a, b, skipped).
    """
    cdef Py_ssize_t end = buf.shape[0], cap = offset.shape[0]
    cdef const uint8_t *p
    cdef uint32_t btype, local
    cdef int64_t blen, need, room, incl, orig, a = 0, b = 0, skipped = 0
    cdef Ahead ah
    ah.pf, ah.dom, ah.odd = pos, 0, 0
    cdef int64_t step = 0
    cdef Status status = END
    with nogil:
        while True:
            if pos == end:
                status = END
                break
            if n == cap:
                status = FULL
                break
            if end - pos < 8:
                status = CUT_HEADER
                a = end - pos
                break
            _prefetch(&buf[0], &ah, pos, step, end, stride_min)
            p = &buf[pos]
            btype = rd32(p, big)
            if btype == 0x0A0D0D0A:
                # A new section may change the byte order: the caller reads it.
                status = AT_SHB
                break
            blen = rd32(p + 4, big)
            need = 12
            if btype == 1:
                need = 20
            elif btype == 6 or btype == 2:
                need = 32
            elif btype == 3:
                need = 16
            if blen < need:
                status = SHORT
                a = blen
                b = need
                break
            if blen & 3:
                status = UNALIGNED
                a = blen
                break
            if blen > end - pos:
                status = PAST_END
                a = blen
                b = end - pos
                break
            if rd32(p + blen - 4, big) != blen:
                status = TRAILER
                a = rd32(p + blen - 4, big)
                b = blen
                break
            if btype == 1:
                status = AT_IDB
                break
            if btype == 6 or btype == 2:
                if btype == 6:
                    local = rd32(p + 8, big)
                else:
                    # obsolete PB: 16-bit interface id, then a 16-bit drops count
                    local = rd16(p + 8, big)
                if local >= <uint32_t>n_ifaces:
                    status = IFACE
                    a = local
                    b = n_ifaces
                    break
                incl = rd32(p + 20, big)
                room = blen - 32
                if incl > max_caplen:
                    status = CAPLEN_MAX
                    a = incl
                    b = max_caplen
                    break
                if incl > room:
                    status = CAPLEN_BODY
                    a = incl
                    b = room
                    break
                offset[n] = pos + 28
                caplen[n] = incl
                wirelen[n] = rd32(p + 24, big)
                ts[n] = (<uint64_t>rd32(p + 12, big) << 32) | rd32(p + 16, big)
                iface[n] = iface_base + <int32_t>local
                n += 1
            elif btype == 3:
                if n_ifaces == 0:
                    status = IFACE
                    a = 0
                    b = 0
                    break
                orig = rd32(p + 8, big)
                incl = orig
                if spb_snaplen > 0 and incl > spb_snaplen:
                    incl = spb_snaplen
                if incl > blen - 16:
                    incl = blen - 16
                if incl > max_caplen:
                    status = CAPLEN_MAX
                    a = incl
                    b = max_caplen
                    break
                offset[n] = pos + 12
                caplen[n] = incl
                wirelen[n] = orig
                ts[n] = 0
                iface[n] = iface_base
                n += 1
            else:
                skipped += 1
            pos += blen
            step = blen
    return n, pos, status, a, b, skipped
