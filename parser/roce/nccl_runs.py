"""The NCCL decoder's common case, a batch of reassembled runs at a time.

On a lossless wire every RDMA message reaches the decoder inside a ``MessageRun`` (a QP's intact
messages as columns). ``NcclDecoder.feed`` then did, per message, the same few checks and lookups
(is it a CTS post? which connection? is it a whole send?) in about 10 µs of Python, the larger
part of an LL replay's packet path. ``RunLane.take_runs`` first decides, with column operations
and no change to the decoder, that every message of the batch is plain for the decoder's state:

* the CTS layout and the immediates' byte order are already known;
* every WRITE without immediate is CTS-sized and reads as a CTS post in that layout (the rules
  below, the per-message path's too), for a buffer (rkey) of a connection already known;
* every other message is a whole send: closed with an immediate equal to its length, on a
  connection already joined by its rkeys, of one QP or of several that carry whole messages in
  turn, with no split-form pieces pending.

Then it does what the per-message path does, in the same order (CTS posts first, in arrival
order; sends by time and QP), and returns the same sends. Otherwise it returns None having changed
nothing, and the batch goes the per-message way.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.parser.roce import nccl_versions, protocols
from mirrorckpt.parser.roce.reassembly import MessageRun
from mirrorckpt.parser.roce.sends import LazySend, NcclSend, SendBlock

_CTS_FIELDS = ("idx", "addr", "size", "rkey", "nreqs", "tag")  # nccl.Cts's fields, in its order


# What makes a WRITE a CTS post, for one message (ints) or a column of them (arrays) alike: the
# per-message path (``NcclDecoder._take_cts``) and the run lane read it from here.
def cts_sized(dlen):
    """A WRITE without immediate of this length may be a CTS post: whole 32-byte entries, one slot."""
    return (dlen > 0) & (dlen % 32 == 0) & (dlen <= 512)


def cts_fits(h, dlen):
    """Its length holds whole entries of layout ``h``, at most a slot's (NET_IB_MAX_RECVS)."""
    return (dlen % h.size == 0) & (dlen <= h.size * nccl_versions.NET_IB_MAX_RECVS)


def cts_plausible(h, e, dlen):
    """Its first entry ``e`` (fields by name) reads as a post: a positive size no larger than a
    Simple slice pair, a request count matching the WRITE length, a small tag (a rank), a running
    index and a buffer address."""
    return ((e["size"] > 0) & (e["size"] <= 1 << 24) & (e["nreqs"] * h.size == dlen) & (e["tag"] < 1 << 20)
            & (e["idx"] >= 1) & (e["addr"] != 0))


def _imm_sizes(imm: np.ndarray, order: str) -> np.ndarray:
    """``nccl_versions.decode_imm_order`` of a column."""
    raw = imm.astype(np.uint32)
    return (raw if order == "big" else raw.byteswap()).astype(np.int64)


class RunLane:
    """Mixed into ``NcclDecoder`` (whose state it reads and, once it holds, changes)."""

    def take_runs(self, runs: list[MessageRun]) -> list | None:
        if self.protocol not in (None, protocols.SIMPLE):  # pinned LL or LL128: every send is read
            for r in runs:
                if not (r.read_pending and self.protocol == protocols.LL128):  # those read where they lie
                    r.fill()
        plan = self._plain(runs)
        return None if plan is None else self._apply(runs, plan)

    def _plain(self, runs: list[MessageRun]):
        h, order = self.seen_cts, self.imm_order or self.seen_imm
        if h is None or self.seen_imm is None or self.cts_header not in (None, h):
            return None  # the first CTS post or immediate still teaches the decoder the release
        plan = []
        for r in runs:
            wimm = r.imm >= 0
            cts = ~wimm & cts_sized(r.dlen)
            if (~wimm & ~cts).any():
                return None  # split-form pieces, or WRITEs that are neither
            k = np.flatnonzero(cts)
            fields, conns = None, {}
            if len(k):
                dl = r.dlen[k]
                if not cts_fits(h, dl).all():
                    return None
                r.fill()
                fields = h.read_fields(r.buf, r.base[k], _CTS_FIELDS)
                if not cts_plausible(h, fields, dl).all():
                    return None
                for rk in set(fields["rkey"].tolist()):  # the posts' connections, by the buffers they offer
                    g = self._rkey_group.get((r.qp.dst, r.qp.src, rk)) if rk else None
                    c = self.conns.get(g.key) if g is not None else None
                    if c is None:
                        return None
                    conns[rk] = c
            d = np.flatnonzero(~cts)
            c, sizes = None, None
            if len(d):
                g = self._qp_group.get(r.qp)
                if g is None:
                    return None
                if any(rk and self._rkey_group.get((r.qp.src, r.qp.dst, rk)) is not g
                       for rk in set(r.rkey[d].tolist())):
                    return None  # a buffer not yet joined to its connection: _link decides
                c = self.conns.get(g.key)
                # one QP, or several that carry whole messages in turn (2.20+ by default)
                if c is None or c.bulks.get(r.qp) or (c.qp_mode == "cut" if len(g.qps) == 1 else c.qp_mode != "whole"):
                    return None
                sizes = _imm_sizes(r.imm[d], order)
                if (sizes != r.dlen[d]).any():
                    return None  # a send cut over QPs, run together with another, or a split close
            plan.append((k, fields, conns, d, c, sizes, (g.index(r.qp), len(g.qps)) if len(d) else None))
        return plan

    def _apply(self, runs: list[MessageRun], plan: list) -> list:
        for r in runs:  # _learn_pmtu, the run's largest message a packet standing for all of them
            sel = (r.dlen > 0) & (r.npkts > 0)
            if sel.any():
                self._pmtu_seen(r.qp, int((-(-r.dlen[sel] // r.npkts[sel])).max()), bool((r.npkts[sel] >= 2).any()))
        for k, fields, conns, *_ in plan:  # CTS posts first, in arrival order
            if fields is None:
                continue
            # each on the connection of its rkey (post[3])
            self._post_all(conns, list(zip(*[fields[f].tolist() for f in _CTS_FIELDS])))
            self.cts_posts += len(k)
        # The sends, by time and QP number (stable: arrival order breaks ties), as feed sorts them.
        which = [(i, p[3]) for i, p in enumerate(plan) if len(p[3])]
        if not which:
            return []

        def col(f) -> np.ndarray:
            return np.concatenate([f(runs[i], d) for i, d in which])

        ts = col(lambda r, d: r.ts[d])
        order = np.lexsort((col(lambda r, d: np.full(len(d), r.qp.dqp, np.int64)), ts))
        # every column in that order
        cols = {"m": col(lambda r, d: d), "run": np.concatenate([np.full(len(d), i, np.int64) for i, d in which]),
                "size": np.concatenate([plan[i][5] for i, _ in which]), "ts": ts,
                "a": col(lambda r, d: r.base[d]), "b": col(lambda r, d: r.base[d + 1])}
        for f in ("psn", "npkts", "va", "ll_flag", "ll_off", "ll_n"):
            cols[f] = col(lambda r, d, f=f: getattr(r, f)[d])
        cols = {f: v[order] for f, v in cols.items()}
        # per run: it, its connection, its QP's MTU, its QP's place among the connection's QPs, and how many
        per_run = [None] * len(plan)
        for i, _ in which:
            r, c, _, (qi, nq) = runs[i], *plan[i][4:]
            per_run[i] = (r, c, self.pmtu.get(r.qp, 0), qi if nq > 1 else 0, nq)
        block = self._lazy_rows(per_run, cols) if self.blocks else None
        if block is None or not block.any():
            return self._sends(per_run, cols, slice(None))
        out = []
        cut = np.flatnonzero(np.diff(block.view(np.int8))) + 1
        for lo, hi in zip([0, *cut.tolist()], [*cut.tolist(), len(block)]):
            if block[lo]:
                out.append(self._block(per_run, cols, slice(lo, hi)))
            else:
                out += self._sends(per_run, cols, slice(lo, hi))
        return out

    def _lazy_rows(self, per_run: list, cols: dict) -> np.ndarray:
        """Which sends the per-send loop (``_sends``) would make ``LazySend``s of: LL words, or
        Simple bytes, still in the batch."""
        has = np.zeros((2, len(per_run)), bool)  # per run: its LL words wait, its Simple bytes wait
        for i, p in enumerate(per_run):
            if p is not None:
                r = p[0]
                has[:, i] = (r.ll_pending is not None, r.pending is not None and r.ll_pending is None and (
                    not r.read_pending or self.protocol == protocols.SIMPLE))
        ll = (cols["ll_flag"] != 0) & (self.protocol in (None, protocols.LL))
        return np.where(ll, has[0][cols["run"]], has[1][cols["run"]] & (cols["b"] > cols["a"]))

    def _block(self, per_run: list, cols: dict, rows: slice) -> SendBlock:
        """Sends ``rows`` (all lazy, ``_lazy_rows``) as one ``SendBlock``: what ``_sends`` does for
        each, done for the columns (a connection's protocol is its last send's; CTS posts are
        taken in order where one waits at a send's address)."""
        c = {f: v[rows] for f, v in cols.items()}
        ll = c["ll_flag"] != 0
        runs = sorted(set(c["run"].tolist()))
        last: dict = {}  # per connection: its last send here, whose protocol it keeps
        for i in runs:
            conn, k = per_run[i][1], len(ll) - 1 - int(np.flatnonzero(c["run"][::-1] == i)[0])
            if k > last.get(id(conn), (-1, None))[0]:
                last[id(conn)] = (k, conn)
        for k, conn in last.values():
            conn.protocol = protocols.LL if ll[k] else protocols.SIMPLE
        seq, cts = np.full(len(ll), -1, np.int64), {}
        if any(q for _, conn in last.values() for q in conn.by_addr.values()):  # posts wait: taken in order
            for k, (i, va) in enumerate(zip(c["run"].tolist(), c["va"].tolist())):
                conn = per_run[i][1]
                if conn.by_addr.get(va):
                    got = self._match_cts(conn, va)
                    if got is not None:
                        seq[k], cts[k] = got.idx, got
        local = np.zeros(len(per_run), np.int64)
        local[runs] = np.arange(len(runs))
        lo = np.where(ll, c["ll_off"], c["a"])
        return SendBlock(self.stream, *zip(*[(per_run[i][0], per_run[i][1].key, per_run[i][0].qp, *per_run[i][2:])
                                            for i in runs]),
                         {"run": local[c["run"]], "m": c["m"], "flag": c["ll_flag"], "seq": seq, "va": c["va"],
                          "size": c["size"], "wire": c["b"] - c["a"], "psn": c["psn"], "npkts": c["npkts"],
                          "ts": c["ts"], "lo": lo, "hi": np.where(ll, lo + c["ll_n"], c["b"])}, cts)

    def _sends(self, per_run: list, cols: dict, rows: slice) -> list:
        """Sends ``rows``, one object each."""
        want_ll = self.protocol in (None, protocols.LL)
        stream, out = self.stream, []
        names = ("m", "run", "size", "psn", "npkts", "va", "ll_flag", "ll_off", "ll_n", "a", "b", "ts")
        for m, i, size, psn, npkts, va, flag, o, n, a, b, t in zip(*[cols[f][rows].tolist() for f in names]):
            r, c, pm, qi, nq = per_run[i]
            if flag and want_ll:
                # LL words still in the batch (ll_pending): gathered if and when they are read
                fast = (protocols.LL, None if r.ll_pending is not None else r.ll_user[o:o + n], flag)
            else:
                if r.pending is not None and r.ll_pending is None and b > a \
                        and (not r.read_pending or self.protocol == protocols.SIMPLE):
                    # still in the batch, none of its messages opens like LL or LL128 (or pinned
                    # Simple): Simple, and its bytes are the send's (LazySend reads them when wanted)
                    fast = (protocols.SIMPLE, None, None)
                elif r.read_pending and self.protocol in (None, protocols.LL128) and b > a \
                        and (p := r._pieces(r.pending, m)) is not None:
                    # read where it lies, as decode_intact reads it: not LL (no new message of the
                    # run opens like LL, the reassembler looked), LL128 if every line is intact,
                    # else Simple (left in the batch) or, pinned LL128, the careful way
                    got = protocols.ll128_intact_pieces(p[0], p[1], p[3])
                    fast = (protocols.LL128, *got) if got is not None else \
                        (protocols.SIMPLE, None, None) if self.protocol is None else None
                else:
                    if (r.ll_pending is not None or r.read_pending) and b > a:
                        r.fill_range(m)  # an LL run's message read from its wire bytes, or one to read
                    fast = protocols.decode_intact(r.buf[a:b], self.protocol) if b > a else None
            if fast is None:  # lines to read the careful way, or an empty step: as the per-message path
                msg = r.message(m)
                out.append(self._make(c, msg.data, [], [msg], size, va, "empty" if b == a and not size else "normal",
                                      True))
                continue
            proto, user, flag = fast
            c.protocol = proto
            cts = self._match_cts(c, va) if c.by_addr.get(va) else None  # a post left for its address
            lazy = user is None  # still in the batch (Simple bytes, LL words): copied if and when it is read
            s = (LazySend if lazy else NcclSend)(c.key, r.qp, proto, user, [], b - a, size, va, "normal", flag,
                                                 cts.idx if cts else None, cts, t, True, stream, psn, npkts, pm, qi,
                                                 nq)
            if lazy:
                s._source = (r, o, o + n, True, m) if proto == protocols.LL else (r, a, b, False, m)
            out.append(s)
        return out
