# The LL line reading shared by _place (a message in a buffer) and _fast (a packet as the
# frame walk checks its ICRC): included, so each keeps it inline.

cdef inline uint32_t _ll_one(const uint8_t *wire, Py_ssize_t nbytes, uint8_t *out, int line, int lo, int f1,
                             int hi, int f2) noexcept nogil:
    """``ll_intact`` on ``nbytes`` of wire (a multiple of ``line``, at least one line)."""
    cdef Py_ssize_t n = nbytes // line, i
    cdef uint32_t flag, a, b
    cdef const uint8_t *p
    cdef uint8_t *q
    memcpy(&flag, wire + f1, 4)
    if flag == 0:
        return 0
    for i in range(n):
        p = wire + i * line
        memcpy(&a, p + f1, 4)
        memcpy(&b, p + f2, 4)
        if a != flag or b != flag:
            return 0
        q = out + i * 8
        memcpy(q, p + lo, 4)
        memcpy(q + 4, p + hi, 4)
    return flag
