# cython: language_level=3
"""Compiled byte movers of the capture stage: record packing for the writers, bulk range copies.

The writers build every record header with numpy; this kernel lays out, per record, its header
row, its frame bytes, zero padding and an optional trailer row (pcapng's trailing length).
"""

from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy, memset


# The bytes from which a copy lets go of the GIL (see parser/_place.pyx)
cdef int64_t GIL_FREE_BYTES = 1 << 18


def pack_records(const uint8_t[:, ::1] head, const uint8_t[::1] src, const int64_t[::1] src_off,
                 const int64_t[::1] length, int64_t align, const uint8_t[:, ::1] tail,
                 uint8_t[::1] out):
    """Writes head[i] + src[src_off[i] : +length[i]] + zeros to a multiple of `align` (counting
    from the record start) + tail[i] for every i into out; returns the bytes written."""
    cdef Py_ssize_t n = head.shape[0], i
    cdef int64_t hl = head.shape[1], tl = tail.shape[1], ns = src.shape[0], pos = 0, body, pad
    if src_off.shape[0] != n or length.shape[0] != n or tail.shape[0] != n:
        raise ValueError(f"pack_records: {n} headers but {src_off.shape[0]} offsets, "
                         f"{length.shape[0]} lengths, {tail.shape[0]} trailers")
    if align < 1:
        raise ValueError(f"pack_records: align {align} must be at least 1")
    for i in range(n):
        if length[i] < 0 or src_off[i] < 0 or src_off[i] + length[i] > ns:
            raise ValueError(f"pack_records: frame {i} at {src_off[i]} with length {length[i]} "
                             f"lies outside the {ns}-byte data buffer")
        body = hl + length[i]
        pos += body + (align - body % align) % align + tl
    if pos > out.shape[0]:
        raise ValueError(f"pack_records: needs {pos} bytes, output has {out.shape[0]}")
    pos = 0
    with nogil:
        for i in range(n):
            if hl:
                memcpy(&out[pos], &head[i, 0], hl)
                pos += hl
            if length[i]:
                memcpy(&out[pos], &src[src_off[i]], length[i])
                pos += length[i]
            pad = (align - (hl + length[i]) % align) % align
            if pad:
                memset(&out[pos], 0, pad)
                pos += pad
            if tl:
                memcpy(&out[pos], &tail[i, 0], tl)
                pos += tl
    return pos


def copy_ranges(const uint8_t[::1] src, const int64_t[::1] src_off, uint8_t[::1] dst,
                const int64_t[::1] dst_off, const int64_t[::1] length):
    """dst[dst_off[k] : +length[k]] = src[src_off[k] : +length[k]] for every k (bounds checked)."""
    cdef Py_ssize_t n = src_off.shape[0], k
    cdef int64_t ns = src.shape[0], nd = dst.shape[0], total = 0
    for k in range(n):
        if length[k] < 0 or src_off[k] < 0 or dst_off[k] < 0 or \
                src_off[k] + length[k] > ns or dst_off[k] + length[k] > nd:
            raise IndexError(f"range {k}: src {src_off[k]}+{length[k]} of {ns}, dst {dst_off[k]} of {nd}")
        total += length[k]
    if total == 0:
        return
    if total >= GIL_FREE_BYTES:  # a short copy keeps the GIL: its hand-over would cost more (_place.pyx)
        with nogil:
            _copy(&src[0], &src_off[0], &dst[0], &dst_off[0], &length[0], n)
    else:
        _copy(&src[0], &src_off[0], &dst[0], &dst_off[0], &length[0], n)


cdef void _copy(const uint8_t *src, const int64_t *src_off, uint8_t *dst, const int64_t *dst_off,
                const int64_t *length, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(n):
        if length[k] > 0:
            memcpy(dst + dst_off[k], src + src_off[k], length[k])
