# cython: language_level=3
"""Compiled placement of a piece's values into a collective's buffer, for the common case: copy
where nothing is placed yet, compare where something is (a disagreeing copy writes nothing and
returns -1: the caller reports the conflict). Transport-neutral: the concatenator and the packet
paths of every wire use it.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cdef extern from * nogil:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    /* The same with whole-line stores where the CPU has AVX-512 (4 KB pieces, cold: 7.4-8.1 GB/s
       against 6.3-7.0 with 16-byte stores, in one run); chosen once, at import. */
    __attribute__((target("avx512f"))) static void mck_copy_stream512(uint8_t *d, const uint8_t *s, size_t m) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        if (head > m) head = m;
        memcpy(d, s, head);
        d += head; s += head; m -= head;
        for (; m >= 64; m -= 64, d += 64, s += 64)
            _mm512_stream_si512((__m512i *)d, _mm512_loadu_si512((const void *)s));
        memcpy(d, s, m);
    }
    static int mck_wide = 0;
    static void mck_merge_init(void) { __builtin_cpu_init(); mck_wide = __builtin_cpu_supports("avx512f"); }
    #else
    static const int mck_wide = 0;
    static void mck_copy_stream512(uint8_t *d, const uint8_t *s, size_t m) { memcpy(d, s, m); }
    static void mck_merge_init(void) {}
    #endif
    /* Copies with non-temporal stores: a collective's buffer is not read again while it is being
       placed, and streaming stores skip reading each destination line first (cold 512-byte pieces
       of a 192 MB copy: 7.0-7.6 GB/s against memcpy's 4.1-4.2 on the shared VM). */
    static inline void mck_copy_stream(uint8_t *d, const uint8_t *s, size_t m) {
        if (mck_wide && m >= 256) {
            mck_copy_stream512(d, s, m);
            return;
        }
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        if (head > m) head = m;
        memcpy(d, s, head);
        d += head; s += head; m -= head;
        for (; m >= 64; m -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        for (; m >= 16; m -= 16, d += 16, s += 16)
            _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
        memcpy(d, s, m);
    }
    /* the streamed stores ordered before anything after the kernel (another thread's reads too) */
    static inline void mck_store_fence(void) { _mm_sfence(); }
    #else
    static inline void mck_copy_stream(uint8_t *d, const uint8_t *s, size_t m) { memcpy(d, s, m); }
    static inline void mck_store_fence(void) {}
    static void mck_merge_init(void) {}
    #endif
    """
    void mck_copy_stream(uint8_t *d, const uint8_t *s, size_t m)
    void mck_store_fence()
    void mck_merge_init()

mck_merge_init()


# A kernel lets go of the GIL only for this many bytes or more. Below, the hand-over costs more
# than it frees: a 22-step LL replay places 5,000 sends of 35 KB from the consumer's thread, and
# each release let the packet path's thread take the GIL first. Warm passes, interleaved, best of
# 8: LL 0.49-0.53 s vs 0.50-0.55 always released, LL128 0.18-0.19 vs 0.19-0.20, Simple (its
# sends larger) the same, 0.115-0.12; never released, Simple was 15 % slower.
cdef Py_ssize_t GIL_FREE_BYTES = 1 << 18


cdef inline Py_ssize_t _run_end(const uint8_t *c, Py_ssize_t i, Py_ssize_t n, uint8_t v) noexcept nogil:
    """First index at or after ``i`` whose flag is not ``v`` (flags are 0 or 1), 64 then eight at a
    time: a send's flags are most often all 0 (with the one-pass copy below, gathering 512 KB
    messages went from 3.75 to 4.23 GB/s)."""
    cdef uint64_t w, want = 0x0101010101010101 if v else 0
    cdef uint64_t w8[8]
    cdef uint64_t a, o
    while i + 64 <= n:
        memcpy(w8, c + i, 64)
        a = w8[0] & w8[1] & w8[2] & w8[3] & w8[4] & w8[5] & w8[6] & w8[7]
        o = w8[0] | w8[1] | w8[2] | w8[3] | w8[4] | w8[5] | w8[6] | w8[7]
        if (a if v else o) != want:  # 0/1 flags: all ones AND to the pattern, all zeros OR to 0
            break
        i += 64
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
    cdef bint seen = False
    while i < n:  # runs of covered elements: compare
        j = _run_end(c, i, n, 1)
        if j > i:
            if memcmp(d + i * es, s + i * es, (j - i) * es) != 0:
                return -1
            seen = True
        i = _run_end(c, j, n, 0)
    if not seen and n:  # nothing placed there yet (the common case): one copy, no second scan
        mck_copy_stream(d, s, n * es)
        memset(c, 1, n)
        mck_store_fence()
        return n
    i = 0
    while i < n:  # runs of uncovered elements: copy
        i = _run_end(c, i, n, 1)
        j = _run_end(c, i, n, 0)
        if j > i:
            mck_copy_stream(d + i * es, s + i * es, (j - i) * es)
            memset(c + i, 1, j - i)
            added += j - i
        i = j
    mck_store_fence()
    return added


cdef inline bint _gathered(uint8_t *d, const uint8_t *src, const int64_t *soff, const int64_t *moff,
                           const int64_t *ln, Py_ssize_t nrows, Py_ssize_t *k, int64_t x, int64_t y,
                           bint compare, int64_t mbase) noexcept nogil:
    """Bytes [x, y) of a message whose packet r holds its bytes [moff[r] - mbase, moff[r] - mbase + ln[r])
    at src[soff[r]:]: compared with (False when they differ) or copied to d[x:y]. Ranges come in
    increasing order; ``k`` keeps the row the last one ended in."""
    cdef int64_t m, a
    cdef Py_ssize_t r
    while k[0] < nrows and moff[k[0]] - mbase + ln[k[0]] <= x:
        k[0] += 1
    r = k[0]
    while x < y:
        a = x - (moff[r] - mbase)
        m = moff[r] - mbase + ln[r] - x
        if m > y - x:
            m = y - x
        if compare:
            if memcmp(d + x, src + soff[r] + a, m) != 0:
                return False
        else:
            mck_copy_stream(d + x, src + soff[r] + a, m)
        x += m
        r += 1
    return True


def place_agreeing_gather(uint8_t[::1] dst, uint8_t[::1] covered, Py_ssize_t start, const uint8_t[::1] src,
                          const int64_t[::1] src_off, const int64_t[::1] msg_off, const int64_t[::1] length,
                          Py_ssize_t n, Py_ssize_t es, Py_ssize_t first=0, Py_ssize_t last=-1):
    """``place_agreeing`` from a message still in its packets: packet r (rows ``first`` up to
    ``last``, -1: all) carries the message's bytes [msg_off[r], msg_off[r] + length[r]) at
    src[src_off[r]:], the packets tiling the message from byte msg_off[first] in order (so a run's
    columns serve each of its messages without a slice of them). One pass from the capture to the
    collective's buffer."""
    cdef Py_ssize_t r, nr, added
    cdef int64_t mbase
    cdef uint8_t *d
    cdef uint8_t *c
    if last < 0:
        last = src_off.shape[0]
    if start < 0 or n < 0 or (start + n) > covered.shape[0] or (start + n) * es > dst.shape[0] \
            or msg_off.shape[0] != src_off.shape[0] or length.shape[0] != src_off.shape[0] \
            or first < 0 or first > last or last > src_off.shape[0]:
        raise ValueError("place_agreeing_gather: range outside the buffers")
    nr = last - first
    mbase = msg_off[first] if nr else 0
    for r in range(first, last):
        if msg_off[r] != (msg_off[r - 1] + length[r - 1] if r > first else mbase) or length[r] < 0 \
                or src_off[r] < 0 or src_off[r] + length[r] > src.shape[0]:
            raise ValueError(f"place_agreeing_gather: packet {r - first} does not follow the one before in the message")
    if nr == 0 or msg_off[last - 1] + length[last - 1] - mbase < n * es:
        raise ValueError("place_agreeing_gather: the packets hold fewer bytes than the elements placed")
    if n == 0:
        return 0
    d = &dst[start * es]
    c = &covered[start]
    if n * es >= GIL_FREE_BYTES:
        with nogil:
            added = _gather_place(d, c, &src[0], &src_off[first], &msg_off[first], &length[first], nr, n, es, mbase)
    else:
        added = _gather_place(d, c, &src[0], &src_off[first], &msg_off[first], &length[first], nr, n, es, mbase)
    return added


cdef Py_ssize_t _gather_place(uint8_t *d, uint8_t *c, const uint8_t *src, const int64_t *src_off,
                              const int64_t *msg_off, const int64_t *length, Py_ssize_t nr, Py_ssize_t n,
                              Py_ssize_t es, int64_t mbase) noexcept nogil:
    cdef Py_ssize_t i = 0, j, k = 0, added = 0
    cdef bint seen = False
    while i < n:  # runs of covered elements: compare
        j = _run_end(c, i, n, 1)
        if j > i:
            if not _gathered(d, src, src_off, msg_off, length, nr, &k, i * es, j * es, True, mbase):
                return -1
            seen = True
        i = _run_end(c, j, n, 0)
    k = 0
    if not seen and n:  # nothing placed there yet (the common case): one gather, no second scan
        _gathered(d, src, src_off, msg_off, length, nr, &k, 0, n * es, False, mbase)
        memset(c, 1, n)
        mck_store_fence()
        return n
    i = 0
    while i < n:  # runs of uncovered elements: copy
        i = _run_end(c, i, n, 1)
        j = _run_end(c, i, n, 0)
        if j > i:
            _gathered(d, src, src_off, msg_off, length, nr, &k, i * es, j * es, False, mbase)
            memset(c + i, 1, j - i)
            added += j - i
        i = j
    mck_store_fence()
    return added
