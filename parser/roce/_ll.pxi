# The LL line reading shared by _place (a message in a buffer) and _fast (a packet as the
# frame walk checks its ICRC): included, so each keeps it inline.

cdef extern from * nogil:
    """
    #include <string.h>
    #ifdef __SSE2__
    #include <emmintrin.h>
    #endif
    /* ll_intact of n lines: every line's two flag words equal flag, its data words to out (8 bytes
       a line). In NCCL's layout (data flag data flag) four lines, 64 bytes, a step: each line's words
       reordered to data data flag flag, two lines' flags compared at once and their data stored as
       16 bytes (a word at a time cost the decode of cold LL frames with ICRC 0.18 CPU-s/GB, not 0.16). */
    static inline uint32_t mck_ll_lines(const uint8_t *wire, int64_t n, uint8_t *out, uint32_t flag,
                                        int line, int lo, int f1, int hi, int f2) {
        int64_t i = 0;
    #ifdef __SSE2__
        if (line == 16 && lo == 0 && f1 == 4 && hi == 8 && f2 == 12) {
            const __m128i want = _mm_set1_epi32((int)flag);
            for (; i + 4 <= n; i += 4) {
                const uint8_t *p = wire + i * 16;
                __m128i a = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)p), _MM_SHUFFLE(3, 1, 2, 0));
                __m128i b = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(p + 16)), _MM_SHUFFLE(3, 1, 2, 0));
                __m128i c = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(p + 32)), _MM_SHUFFLE(3, 1, 2, 0));
                __m128i d = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(p + 48)), _MM_SHUFFLE(3, 1, 2, 0));
                __m128i same = _mm_and_si128(_mm_cmpeq_epi32(_mm_unpackhi_epi64(a, b), want),
                                             _mm_cmpeq_epi32(_mm_unpackhi_epi64(c, d), want));
                if (_mm_movemask_epi8(same) != 0xFFFF)
                    return 0;
                _mm_storeu_si128((__m128i *)(out + i * 8), _mm_unpacklo_epi64(a, b));
                _mm_storeu_si128((__m128i *)(out + i * 8 + 16), _mm_unpacklo_epi64(c, d));
            }
        }
    #endif
        for (; i < n; i++) {
            const uint8_t *p = wire + i * line;
            uint32_t x, y;
            memcpy(&x, p + f1, 4);
            memcpy(&y, p + f2, 4);
            if (x != flag || y != flag)
                return 0;
            memcpy(out + i * 8, p + lo, 4);
            memcpy(out + i * 8 + 4, p + hi, 4);
        }
        return flag;
    }
    """
    uint32_t mck_ll_lines(const uint8_t *wire, int64_t n, uint8_t *out, uint32_t flag, int line, int lo, int f1,
                          int hi, int f2)


cdef inline uint32_t _ll_one(const uint8_t *wire, Py_ssize_t nbytes, uint8_t *out, int line, int lo, int f1,
                             int hi, int f2) noexcept nogil:
    """``ll_intact`` on ``nbytes`` of wire (a multiple of ``line``, at least one line)."""
    cdef uint32_t flag, second
    memcpy(&flag, wire + f1, 4)
    memcpy(&second, wire + f2, 4)
    if flag == 0 or second != flag:  # not LL (Simple, LL128 data): most often known here
        return 0
    return mck_ll_lines(wire, nbytes // line, out, flag, line, lo, f1, hi, f2)
