"""The compiled common case of PSN reassembly (Reassembler._fast) decides exactly what the careful
path decides: the same messages, bytes, holes, counters and held packets, on intact traffic and on
traffic with lost, duplicated, reordered and damaged packets, whatever the batch cuts."""

from __future__ import annotations

import random

import numpy as np
import pytest
from common import FLOWCHECK, flowcheck_captures
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser import roce
from mirrorckpt.parser.roce.reassembly import _MAX_GROUPS, Reassembler
from mirrorckpt.parser.roce.streams import _split

FIELDS = ("psn", "npkts", "holes", "va", "rkey", "dlen", "imm_raw", "with_imm", "ts_ns", "length_known", "sport")


def batches(batch: FrameBatch, size: int):
    while len(batch) > size:
        part, batch = _split(batch, size)
        yield part
    yield batch


def run(batch: FrameBatch, size: int, fast: bool):
    r = Reassembler(fast=fast)
    out = []
    for b in batches(batch, size):
        pk, _ = roce.decode(b)
        out += [(m, m.data.tobytes()) for m in r.feed(pk, b.data)]
    out += [(m, m.data.tobytes()) for m in r.flush()]
    return out, r


def same(batch: FrameBatch, size: int) -> int:
    """Both paths over ``batch`` cut every ``size`` frames; returns the tables the fast path placed."""
    taken = []
    orig = Reassembler._fast

    def counting(self, *a):
        got = orig(self, *a)
        taken.append(got is not None)
        return got

    Reassembler._fast = counting
    try:
        fast, rf = run(batch, size, True)
    finally:
        Reassembler._fast = orig
    slow, rs = run(batch, size, False)
    assert len(fast) == len(slow)
    for (a, da), (b, db) in zip(fast, slow):
        assert a.qp == b.qp and da == db
        for f in FIELDS:
            assert getattr(a, f) == getattr(b, f), f
    assert rf.qps.keys() == rs.qps.keys()
    for k, q in rf.qps.items():
        s = rs.qps[k]
        assert q.stats == s.stats and q.cursor == s.cursor and q.ref == s.ref and q.pmtu == s.pmtu
    return sum(taken)


def damaged(batch: FrameBatch, seed: int, what: str) -> FrameBatch:
    rng = random.Random(seed)
    frames = [batch.frame(i) for i in range(len(batch))]
    out = []
    for f in frames:
        r = rng.random()
        if what == "loss" and r < 0.01:
            continue
        if what == "dup" and r < 0.01:
            out.append(f)
        if what == "flip" and r < 0.01:  # fails its ICRC: a lost packet, seen
            f = bytearray(f)
            f[-9] ^= 0x40
            f = bytes(f)
        out.append(f)
        if what == "swap" and r < 0.01 and len(out) > 1:
            out[-1], out[-2] = out[-2], out[-1]
    return FrameBatch.from_frames(out, f"{what}-{seed}", ts_ns=list(range(len(out))))


@pytest.fixture(scope="module", params=flowcheck_captures())
def real(request):
    return read_all(FLOWCHECK / request.param)


@pytest.mark.parametrize("size", [7, 333, 10**9])
def test_intact_capture_same(real, size):
    n = same(real, size)
    if size < 1000 and len(real) > 10 * size:
        assert n > 0  # the common case did go the compiled way


@pytest.mark.parametrize("what", ["loss", "dup", "swap", "flip"])
@pytest.mark.parametrize("size", [61, 2500])
def test_damaged_capture_same(real, what, size):
    same(damaged(real, 7, what), size)


def test_generated_protocols_same(tmp_path):
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    for proto, pmtu in (("Simple", 4096), ("LL128", 1024), ("LL", 1024)):
        d = tmp_path / proto
        generate(GenConfig(ranks=2, channels=2, protocol=proto, model="linear:200000", steps=1, seed=3,
                           mirrors="0:egress", wire=WireOptions(pmtu=pmtu, initial_psn="wrap"), send_truth=False), d)
        b = read_all(next(d.glob("*.pcap*")))
        assert same(b, 13) > 0
        for size in (13, 500):
            same(damaged(b, 11, "loss"), size)
            same(damaged(b, 12, "swap"), size)


@pytest.mark.parametrize("size", [700, 2000])
def test_whole_messages_of_a_batch_are_read_as_ll_behind_a_held_one(tmp_path, size):
    """A batch's first message of a QP often began in the batch before (its packets held); the
    messages behind it, all of this batch, are still read as LL while in cache (RdmaMessage.ll),
    and that reading is the message's own."""
    from mirrorckpt.parser.roce import protocols
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol="LL", model="linear:200000", steps=2, seed=5,
                       mirrors="0:egress", wire=WireOptions(pmtu=1024), send_truth=False), tmp_path)
    b = read_all(next(tmp_path.glob("*.pcap*")))
    msgs, r = run(b, size, True)
    cuts = -(-len(b) // size) - 1
    ll_msgs = [m for m, _ in msgs if m.with_imm and m.complete and protocols.ll_intact(m.data)]
    assert len(ll_msgs) > 4 * cuts  # many whole messages in each batch
    for m in ll_msgs:
        if m.ll is not None:
            user, flag = protocols.ll_intact(m.data)
            assert m.ll[1] == flag and m.ll[0].tobytes() == user.tobytes()
    # only a message cut by a batch boundary (one per QP per cut at most) is left to be read again
    assert sum(m.ll is None for m in ll_msgs) <= cuts * len(r.qps)


def _packets(n: int, qps: list[tuple[int, int, int]], rng: random.Random) -> roce.RocePackets:
    """``n`` rows over ``qps`` (source, destination, QP number), in random order."""
    pick = [rng.randrange(len(qps)) for _ in range(n)]
    addr = lambda v: np.frombuffer(bytes(12) + v.to_bytes(4, "big"), np.uint8)  # noqa: E731
    cols = {f: np.zeros(n, np.int64) for f in roce.RocePackets.__dataclass_fields__}
    cols["src"] = np.array([addr(qps[p][0]) for p in pick], np.uint8).reshape(n, 16)
    cols["dst"] = np.array([addr(qps[p][1]) for p in pick], np.uint8).reshape(n, 16)
    cols["dqp"] = np.array([qps[p][2] for p in pick], np.int64)
    return roce.RocePackets(**cols)


@pytest.mark.parametrize("nqps", [1, 3, 40, 400])
def test_qp_groups_compiled_same_as_sorted(nqps):
    """The one-pass grouping gives the rows and keys, in the order, of the numpy one; QP numbers
    shared by several address pairs included, and more QPs than the compiled pass takes."""
    rng = random.Random(nqps)
    qps = [(rng.randrange(1, 5), rng.randrange(1, 5), 0x10000 + k if k % 4 else rng.choice([7, 9, 0x1234]))
           for k in range(nqps)]
    qps = list(dict.fromkeys(qps))
    pk = _packets(5000, qps, rng)
    sel = np.array(sorted(rng.sample(range(5000), 4000)), np.int64)
    fast = [(rows.tolist(), key) for rows, key in Reassembler._groups(pk, sel)]
    slow = [(rows.tolist(), key) for rows, key in Reassembler._groups_sorted(pk, sel)]
    assert fast == slow
    assert sum(len(r) for r, _ in fast) == len(sel)
    assert (len(fast) > _MAX_GROUPS) == (nqps > _MAX_GROUPS)  # both ways of grouping are tried


def test_line_table_follows_the_psn_line_across_the_24_bit_wrap():
    """The fast path's table: held rows, then the batch's rows while their 24-bit PSNs continue the
    line (through the wrap), unwrapped; any other PSN refuses the whole table."""
    from mirrorckpt.parser.roce import _reasm
    from mirrorckpt.parser.roce.reassembly import _COLS, _IS_FIRST, _IS_LAST

    cursor = (1 << 24) - 2  # unwrapped, the line goes 2^24 - 2, 2^24 - 1, 2^24, ...
    held = np.array([[cursor], [6], [1], [2], [3], [-1], [5], [6], [0]], np.int64)  # one held MIDDLE
    nb = 6
    psn24 = np.array([(cursor + 1 + i) % (1 << 24) for i in range(nb)], np.int64)  # 2^24 - 1, 0, 1, ...
    op = np.full(nb, 7, np.int64)  # MIDDLE
    va, rkey, dlen, imm, ts, plen, off = (np.arange(nb, dtype=np.int64) + 100 * (c + 1) for c in range(7))
    has_imm = np.zeros(nb, np.uint8)
    has_imm[2] = 1
    out = np.empty((9, 1 + nb), np.int64)
    rows = np.arange(nb, dtype=np.int64)
    args = (va.astype(np.uint64), rkey, dlen, imm, has_imm, ts, plen, off, held, cursor, _IS_FIRST, _IS_LAST, 7, out)
    ok, full = _reasm.line_table(rows, psn24, op, *args)
    assert ok and full == plen.max()
    assert out[_COLS.index("psn")].tolist() == list(range(cursor, cursor + 1 + nb))
    assert out[:, 0].tolist() == held[:, 0].tolist()
    assert out[_COLS.index("imm"), 1:].tolist() == [-1, -1, int(imm[2]), -1, -1, -1]
    assert out[_COLS.index("src_off"), 1:].tolist() == off.tolist()
    psn24[3] += 1  # a gap
    assert _reasm.line_table(rows, psn24, op, *args) == (False, -1)


def test_a_run_is_read_as_ll_only_where_a_message_opens_like_ll():
    """The fast path reads a run as LL while it copies it (and takes a buffer for that reading)
    only when one of its messages opens with an LL line: two equal, non-zero flag words."""
    from mirrorckpt.parser.roce.protocols import LL_INTACT_ARGS
    from mirrorckpt.parser.roce.reassembly import _looks_ll

    line, _, f1, _, f2 = LL_INTACT_ARGS
    data = np.zeros(4 * line, np.uint8)
    first, length = np.array([0, line, 2 * line]), np.array([line, line, line])
    assert not _looks_ll(data, first, length)  # zero flags: not LL (NCCL's flags start at 1)
    data[line + f1], data[line + f2 + 1] = 5, 5  # equal words? no: 5 vs 5 << 8
    assert not _looks_ll(data, first, length)
    data[line + f2], data[line + f2 + 1] = 5, 0
    assert _looks_ll(data, first, length)
    assert not _looks_ll(data, first, np.array([line, line - 1, line]))  # too short for a line
    assert not _looks_ll(data, first[:0], length[:0])


@pytest.mark.parametrize("proto", ["Simple", "LL"])
def test_only_ll_runs_take_a_buffer_for_their_ll_reading(tmp_path, proto):
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol=proto, model="linear:200000", steps=2, seed=5,
                       mirrors="0:egress", wire=WireOptions(pmtu=4096 if proto == "Simple" else 1024),
                       send_truth=False), tmp_path)
    b = read_all(next(tmp_path.glob("*.pcap*")))
    r = Reassembler(runs=True)
    pk, _ = roce.decode(b)
    runs = [x for x in r.feed(pk, b.data) if hasattr(x, "ll_user")]
    assert len(runs) >= 2 and sum(len(x) for x in runs) > 10
    if proto == "Simple":
        assert all(x.ll_user is None and not x.ll_flag.any() for x in runs)
    else:
        # every message that is intact LL was read so (one batch: no packet held from before)
        from mirrorckpt.parser.roce import protocols

        read = [(protocols.ll_intact(x.buf[x.base[k]:x.base[k + 1]]) is not None, bool(x.ll_flag[k]))
                for x in runs for k in range(len(x))]
        assert all(a == b for a, b in read) and sum(a for a, _ in read) > 10
        assert any(x.ll_user is None for x in runs)  # runs whose messages open with no LL line


def test_the_compiled_opening_checks_are_the_column_ones():
    """``_looks_ll`` and ``_may_be_ll128`` (asked for every run a batch places, compiled) say what
    the numpy column expressions they replaced say, on lines that are LL, LL128, Simple and
    damaged, short first packets and messages not of whole groups included."""
    from mirrorckpt.parser.headers import LL128_FLAG_OFFSET, LL128_GROUP_WIRE, LL128_LINE_BYTES
    from mirrorckpt.parser.roce import reassembly as ra

    f1, f2 = ra._LL_ARGS[2], ra._LL_ARGS[4]
    flag_bytes = np.concatenate([np.arange(4) + f1, np.arange(4) + f2])
    ll128_at = LL128_FLAG_OFFSET + np.concatenate([np.arange(8), LL128_LINE_BYTES + np.arange(8)])

    def looks_ll(data, first, length):
        first = first[length >= ra.LL_LINE_BYTES]
        if not len(first):
            return False
        w = np.ascontiguousarray(data[first[:, None] + flag_bytes]).view(np.uint32)
        return bool(np.any((w[:, 0] != 0) & (w[:, 0] == w[:, 1])))

    def may_be_ll128(data, first, length, dlen):
        whole = (dlen > 0) & (dlen % LL128_GROUP_WIRE == 0)
        if not whole.any():
            return False
        if (length[whole] < 2 * LL128_LINE_BYTES).any():
            return True
        f = np.ascontiguousarray(data[first[whole][:, None] + ll128_at]).view(np.int64)
        return bool(((f[:, 0] > 0) & (f[:, 0] == f[:, 1])).any())

    rng = np.random.default_rng(5)
    seen = {True: 0, False: 0}
    for _ in range(400):
        data = rng.integers(0, 256, 4096, dtype=np.uint8)
        k = int(rng.integers(0, 6))
        first = rng.integers(0, 4096 - 2 * LL128_LINE_BYTES, k).astype(np.int64)
        length = rng.choice([8, 16, 100, 2 * LL128_LINE_BYTES - 1, 2 * LL128_LINE_BYTES, 1024], k).astype(np.int64)
        dlen = rng.choice([0, LL128_GROUP_WIRE, 3 * LL128_GROUP_WIRE, 1000, 4096], k).astype(np.int64)
        for a in first.tolist():  # some open like LL, some like LL128, some with one flag off
            kind = rng.integers(0, 4)
            if kind == 1:
                v = rng.integers(0, 3, dtype=np.uint32).astype(np.uint32).tobytes()  # 0 is no flag
                data[a + f1:a + f1 + 4] = np.frombuffer(v, np.uint8)
                data[a + f2:a + f2 + 4] = np.frombuffer(v, np.uint8)
            elif kind == 2:
                v = np.int64(rng.integers(-2, 3)).tobytes()
                data[a + LL128_FLAG_OFFSET:a + LL128_FLAG_OFFSET + 8] = np.frombuffer(v, np.uint8)
                b = a + LL128_LINE_BYTES + LL128_FLAG_OFFSET
                data[b:b + 8] = np.frombuffer(v, np.uint8)
        got = ra._looks_ll(data, first, length)
        assert got == looks_ll(data, first, length)
        seen[got] += 1
        assert ra._may_be_ll128(data, first, length, dlen) == may_be_ll128(data, first, length, dlen)
        assert ra._looks_ll(data, first[::-1], length[::-1]) == looks_ll(data, first[::-1], length[::-1])
    assert seen[True] > 20 and seen[False] > 20
    with pytest.raises(IndexError):
        ra._looks_ll(np.zeros(10, np.uint8), np.array([5], np.int64), np.array([16], np.int64))


def _runs(batch: FrameBatch, size: int, fast: bool, defer: bool):
    r = Reassembler(runs=True, fast=fast)
    r.defer = defer
    out = []
    for b in batches(batch, size):
        pk, _ = roce.decode(b, ll=defer)
        out += r.feed(pk, b.data)
    return out + r.flush(), r


RUN_COLUMNS = ("psn", "npkts", "base", "va", "rkey", "dlen", "imm", "ts", "ll_off", "ll_n", "ll_flag")


def _same_run(a, b) -> None:
    assert type(a) is type(b)
    if not hasattr(a, "ll_user"):  # a message of the careful path
        assert a.qp == b.qp and a.data.tobytes() == b.data.tobytes()
        assert all(getattr(a, f) == getattr(b, f) for f in FIELDS)
        return
    assert (a.qp, a.sport, a.read_pending, a.pend_from) == (b.qp, b.sport, b.read_pending, b.pend_from)
    for f in RUN_COLUMNS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert (a.buf is None) == (b.buf is None) and (a.ll_user is None) == (b.ll_user is None)
    if a.buf is not None:  # the messages copied at once (begun in held packets), or all of them
        n = int(a.base[a.pend_from]) if a.pending is not None else int(a.base[-1])
        assert len(a.buf) == len(b.buf) and a.buf[:n].tobytes() == b.buf[:n].tobytes()
    if a.ll_user is not None:
        assert a.ll_user.tobytes() == b.ll_user.tobytes()
    for p, q in ((a.pending, b.pending), (a.ll_pending, b.ll_pending)):
        assert (p is None) == (q is None)
        if p is not None:  # the same pieces of the same bytes (LL words: each decode's buffer of them)
            assert all(np.array_equal(x, y) for x, y in zip(p[1:], q[1:]))
            assert all(p[0][o:o + n].tobytes() == q[0][o:o + n].tobytes() for o, n in zip(p[1].tolist(), p[3].tolist()))


@pytest.mark.parametrize("proto,pmtu", [("Simple", 4096), ("LL", 1024), ("LL128", 4096)])
def test_fast_runs_are_the_careful_paths_runs(tmp_path, proto, pmtu):
    """The runs ``_fast`` places (its table from ``line_table``, held packets first) are the ones
    the careful path places (its table sorted by PSN, held packets marked): every column, buffer,
    pending piece and LL reading, whatever the batch cuts, with and without deferred copies, intact
    and with loss; and the messages they hold are the same bytes."""
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol=proto, model="linear:200000", steps=2, seed=9,
                       mirrors="0:egress", wire=WireOptions(pmtu=pmtu, initial_psn="wrap"), send_truth=False),
             tmp_path)
    whole = read_all(next(tmp_path.glob("*.pcap*")))
    taken = []
    orig = Reassembler._run

    def counting(self, *a):
        got = orig(self, *a)
        taken.extend((r.ll_pending is not None, r.pend_from) for r in got[0])  # before messages() fills them
        return got

    Reassembler._run = counting
    try:
        for b, size in ((whole, 13), (whole, 700), (whole, 1 << 20), (damaged(whole, 4, "loss"), 500)):
            for defer in (False, True):
                got, rc = _runs(b, size, True, defer)
                want, rp = _runs(b, size, False, defer)
                assert len(got) == len(want)
                # LL read by the decode (deferred copies): only the fast path has that reading, the
                # careful path reads the same messages from their wire bytes
                read_by_decode = defer and proto == "LL"
                for a, c in zip(got, want):
                    if read_by_decode and hasattr(a, "ll_user"):
                        assert a.qp == c.qp
                        assert all(np.array_equal(getattr(a, f), getattr(c, f)) for f in RUN_COLUMNS[:8])
                    else:
                        _same_run(a, c)
                for k, q in rc.qps.items():
                    s = rp.qps[k]
                    assert (q.stats, q.cursor, q.ref, q.pmtu) == (s.stats, s.cursor, s.ref, s.pmtu)
                    assert q.pend.keys() == s.pend.keys() and all(np.array_equal(q.pend[c], s.pend[c]) for c in q.pend)
                for a, c in zip(got, want):  # the same bytes, and the same LL reading of each message
                    if hasattr(a, "ll_user"):
                        ma, mc = a.messages(), c.messages()
                        assert [m.data.tobytes() for m in ma] == [m.data.tobytes() for m in mc]
                        assert [m.ll and (m.ll[0].tobytes(), m.ll[1]) for m in ma] == \
                            [m.ll and (m.ll[0].tobytes(), m.ll[1]) for m in mc]
    finally:
        Reassembler._run = orig
    assert len(taken) > 20  # the compiled pass laid out runs
    if proto == "LL":  # LL words left in the decode's buffer, and runs begun in held packets
        assert any(ll for ll, _ in taken) and any(first for _, first in taken)
