# cython: language_level=3
"""CTS posts kept for the sends that take them (``NcclDecoder._post``), compiled: an LL replay
keeps one post per send, and the per-post method call and its dict and list work were a tenth of
the NCCL decoding's time. The connection's fields are the decoder's own (``nccl._Conn``)."""


cdef inline void _keep(dict cts, dict by_addr, set tags, tuple post, Py_ssize_t addrs_kept,
                       Py_ssize_t per_addr) except *:
    cdef object idx = post[0], addr = post[1]
    cdef list q
    cts[idx] = post
    tags.add(post[5])
    q = by_addr.get(addr)
    if q is None:
        q = []
        by_addr[addr] = q
        if len(by_addr) > addrs_kept:  # the oldest address goes, with its posts
            for i in by_addr.pop(next(iter(by_addr))):
                cts.pop(i, None)
    q.append(idx)
    if len(q) > per_addr:
        cts.pop(q.pop(0), None)


def post(decoder, conn, tuple post, Py_ssize_t addrs_kept, Py_ssize_t per_addr):
    """One post (``nccl.Cts``'s fields) kept on ``conn``: the newest ``per_addr`` per address, of
    at most ``addrs_kept`` addresses, the oldest going first."""
    if not conn.nccl:
        decoder._proven(conn, "CTS posts")
    _keep(conn.cts, conn.by_addr, conn.tags, post, addrs_kept, per_addr)


def post_all(decoder, dict conns, list posts, Py_ssize_t addrs_kept, Py_ssize_t per_addr):
    """``post`` for each of ``posts`` in turn, each on ``conns[its rkey]``."""
    cdef tuple p
    for p in posts:
        conn = conns[p[3]]
        if not conn.nccl:
            decoder._proven(conn, "CTS posts")
        _keep(conn.cts, conn.by_addr, conn.tags, p, addrs_kept, per_addr)
