"""LL, LL128 and Simple payload codecs: layouts, round trips, damaged lines -> holes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mirrorckpt.parser.headers import LL_LINE
from mirrorckpt.parser.roce import protocols as P

payload = st.binary(min_size=0, max_size=9000).map(lambda b: np.frombuffer(b, np.uint8))


# --- LL ----------------------------------------------------------------------------------------


def test_ll_line_layout_matches_header_table():
    data = np.arange(1, 13, dtype=np.uint8)  # 12 bytes: one full line, one half line
    wire = P.ll_encode(data, flag=0x01020304)
    assert wire.size == 32
    l0, l1 = LL_LINE.unpack(wire.tobytes(), 0), LL_LINE.unpack(wire.tobytes(), 16)
    assert l0 == {"data_lo": 0x04030201, "flag1": 0x01020304, "data_hi": 0x08070605, "flag2": 0x01020304}
    assert l1["data_lo"] == 0x0C0B0A09 and l1["data_hi"] == 0  # bytes past n are zero
    assert l1["flag1"] == l1["flag2"] == 0x01020304


@settings(max_examples=60, deadline=None)
@given(payload, st.integers(0, 2**32 - 1))
def test_ll_round_trip(data, flag):
    wire = P.ll_encode(data, flag)
    assert wire.size == P.wire_bytes("LL", data.size)
    assert P.data_bytes("LL", wire.size) >= data.size
    dec = P.ll_decode(wire, data.size, expect_flag=flag)
    assert np.array_equal(dec.data, data) and dec.line_ok.all() and dec.holes == []
    assert P.ll_decode(wire, data.size).flag == (flag if data.size else None)


def test_ll_bad_lines_become_holes():
    data = np.arange(100, dtype=np.uint8)  # 13 lines, last holds 4 bytes
    wire = P.ll_encode(data, 7).copy()
    wire[16 * 2 + 12] ^= 1  # line 2: second flag differs from the first
    wire[16 * 12 + 4: 16 * 12 + 8] = 0  # line 12: both flags stale... first flag only
    wire[16 * 12 + 12: 16 * 12 + 16] = 0  # ...and the second: self-consistent but not the flag
    dec = P.ll_decode(wire, 100)
    assert dec.flag == 7
    assert np.flatnonzero(~dec.line_ok).tolist() == [2, 12]
    assert dec.holes == [(16, 8), (96, 4)]
    assert P.ll_decode(wire, 100, expect_flag=8).holes == [(0, 100)]


def test_ll_intact_agrees_with_ll_decode_on_every_line_count_and_damaged_word():
    """ll_intact (compiled: four lines a step, then one at a time) says intact exactly when
    ll_decode finds every line good under the first line's flag, and then returns its data: for 1
    to 13 lines, each line's flag words and data words changed in turn."""
    rng = np.random.default_rng(5)
    for nlines in range(1, 14):
        data = rng.integers(0, 256, nlines * 8, dtype=np.uint8)
        wire = P.ll_encode(data, 0x5A5A0001)
        got = P.ll_intact(wire)
        assert got is not None and got[1] == 0x5A5A0001 and np.array_equal(got[0], data)
        for line in range(nlines):
            for byte, breaks in ((4, True), (12, True), (0, False), (8, False)):  # flag1, flag2, data
                bad = wire.copy()
                bad[line * 16 + byte] ^= 0x40
                dec = P.ll_decode(bad, expect_flag=0x5A5A0001 if line == 0 and byte == 4 else None)
                got = P.ll_intact(bad)
                assert (got is None) == breaks == (not dec.line_ok.all()), (nlines, line, byte)
                if got is not None:
                    assert np.array_equal(got[0], dec.data)
    assert P.ll_intact(np.zeros(64, np.uint8)) is None  # flag 0: never intact


def test_ll_intact_reads_another_line_layout_word_by_word():
    """The compiled reading follows the layout it is given (LL_INTACT_ARGS is one of them)."""
    from mirrorckpt.parser.roce import _place

    words = np.arange(1, 4 * 9 + 1, dtype=np.uint32).reshape(9, 4)  # layout: flag data flag data
    words[:, 0] = words[:, 2] = 77
    out = np.zeros(9 * 8, np.uint8)
    assert _place.ll_intact(words.view(np.uint8).reshape(-1), out, 16, 4, 0, 12, 8) == 77
    assert np.array_equal(out.view(np.uint32).reshape(9, 2), words[:, [1, 3]])
    words[8, 2] = 78
    assert _place.ll_intact(words.view(np.uint8).reshape(-1), out, 16, 4, 0, 12, 8) == 0


def test_ll_decode_rejects_bad_sizes():
    with pytest.raises(ValueError, match="16-byte lines"):
        P.ll_decode(np.zeros(20, np.uint8))
    with pytest.raises(ValueError, match="at most 16 bytes"):
        P.ll_decode(np.zeros(32, np.uint8), nbytes=17)


# --- LL128 -------------------------------------------------------------------------------------


def test_ll128_permutation_follows_the_doc_table():
    pos = P.LL128_DATA_POS
    assert np.array_equal(pos[:120], np.arange(120))  # line 0 words 0-14
    assert pos[120] == 4 * 128 + 112  # tail of line 0 in word 14 of line 4
    assert pos[512] == 4 * 128 and pos[623] == 4 * 128 + 111  # line 4 words 0-13
    assert pos[960] == 1024 and pos[960 + 120] == 12 * 128 + 112 and pos[1472] == 12 * 128
    assert sorted(set(range(2048)) - set(pos.tolist())) == [128 * L + b for L in range(16) for b in range(120, 128)]


@settings(max_examples=60, deadline=None)
@given(payload, st.integers(0, 2**64 - 1))
def test_ll128_round_trip(data, flag):
    wire = P.ll128_encode(data, flag)
    assert wire.size == P.wire_bytes("LL128", data.size)
    flags = wire.view("<u8").reshape(-1, 16)[:, 15]
    assert (flags == np.uint64(flag)).all()
    dec = P.ll128_decode(wire, data.size, expect_flag=flag)
    assert np.array_equal(dec.data, data) and dec.line_ok.all() and dec.holes == []


def test_ll128_bad_line_maps_to_scattered_data_bytes():
    data = np.arange(875, dtype=np.uint32).view(np.uint8)  # 3500 bytes, 2 groups
    wire = P.ll128_encode(data, 5).copy()
    wire[4 * 128 + 120] ^= 0xFF  # flag of line 4 of group 0
    wire[2048 + 13 * 128 + 127] ^= 0x01  # flag of line 13 of group 1
    dec = P.ll128_decode(wire, 3500)
    assert dec.flag == 5 and np.flatnonzero(~dec.line_ok).tolist() == [4, 16 + 13]
    # line 4: data [512,624) and the tail [120,128) of line 0; group 1 line 13 (q=1, second half):
    # data 1920+[1584,1696) and 1920+[960+128+120, +8)
    assert dec.holes == [(120, 8), (512, 112), (1920 + 1208, 8)]  # 1920+1584 = 3504: past the end
    assert np.array_equal(np.delete(dec.data, np.r_[120:128, 512:624, 3128:3136]),
                          np.delete(data, np.r_[120:128, 512:624, 3128:3136]))


def test_ll128_rejects_partial_groups():
    with pytest.raises(ValueError, match="2048-byte groups"):
        P.ll128_decode(np.zeros(1024, np.uint8))


# --- Simple and sizes ----------------------------------------------------------------------------


@given(payload)
def test_simple_is_identity(data):
    assert np.array_equal(P.simple_decode(P.encode("Simple", data)), data)
    assert P.wire_bytes("Simple", data.size) == data.size == P.data_bytes("Simple", data.size)


def test_wire_sizes():
    assert [P.wire_bytes("LL", n) for n in (0, 1, 8, 9, 7712, 12288)] == [0, 16, 16, 32, 15424, 24576]
    assert [P.wire_bytes("ll128", n) for n in (0, 1, 1920, 1921)] == [0, 2048, 2048, 4096]
    assert np.array_equal(P.wire_bytes("LL", np.array([20000, 7232])), [40000, 14464])
    with pytest.raises(ValueError, match="not a multiple of 2048"):
        P.data_bytes("LL128", 100)
    with pytest.raises(ValueError, match="protocol 'LL256'"):
        P.wire_bytes("LL256", 1)


# --- the compiled one-pass decode of intact sends (protocols.decode_intact) ----------------------


def _careful(wire):
    """What the numpy path makes of a send with no lost bytes: detection, then decode."""
    from mirrorckpt.parser.roce import nccl

    proto, flag = nccl._detect(wire, [])
    user, holes, flag = nccl.decode(proto, wire, [], flag)
    return proto, user, holes, flag


@pytest.mark.parametrize("proto", ["LL", "LL128", "Simple"])
@pytest.mark.parametrize("n", [1, 8, 1920, 5000, 70_000])
def test_decode_intact_equals_the_careful_path(proto, n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, np.uint8)
    wire = P.encode(proto, data, flag=0x1234 + n)
    got = P.decode_intact(wire, None)
    want = _careful(wire)
    assert got is not None and want[2] == []
    assert got[0] == want[0] == proto
    assert np.array_equal(got[1], want[1]) and got[2] == want[3]
    assert np.array_equal(got[1][:n], data)
    stated = P.decode_intact(wire, proto)
    assert stated[0] == proto and np.array_equal(stated[1], got[1])


@pytest.mark.parametrize("proto", ["LL", "LL128"])
def test_decode_intact_refuses_a_damaged_line(proto):
    """A line whose flag differs anywhere is never decoded here: the careful path marks it a hole."""
    data = np.arange(20_000, dtype=np.uint32).view(np.uint8)
    for where in (0, 1, 7, -1):
        wire = P.encode(proto, data, flag=77).copy()
        line = P.LL_LINE_BYTES if proto == "LL" else P.LL128_LINE_BYTES
        off = (where % (wire.size // line)) * line + (4 if proto == "LL" else P.LL128_FLAG_OFFSET)
        wire[off] ^= 0x40
        assert P.decode_intact(wire, proto) is None
        got = P.decode_intact(wire, None)
        # undetected as LL/LL128, it would be Simple: exactly what detection says of the same bytes
        assert got is None or got[0] == _careful(wire)[0]


def test_decode_intact_flag_zero_and_partial_lines():
    data = np.arange(4096, dtype=np.uint8)
    assert P.decode_intact(P.encode("LL", data, flag=0), "LL") is None
    assert P.decode_intact(P.encode("LL128", data, flag=0), "LL128") is None
    assert P.decode_intact(P.encode("LL", data, flag=5)[:-8], "LL") is None
    assert P.decode_intact(P.encode("LL128", data, flag=5)[:-128], "LL128") is None
    assert P.decode_intact(P.encode("LL128", data, flag=1 << 63), None)[0] == "Simple"


def test_place_agreeing_copies_compares_and_refuses_without_writing():
    from mirrorckpt.parser import _merge

    dst = np.zeros(40, np.uint8)
    covered = np.zeros(10, bool)
    src = np.arange(40, dtype=np.uint8)
    assert _merge.place_agreeing(dst, covered.view(np.uint8), 2, src[:16], 4, 4) == 4  # newly covered
    assert covered.tolist() == [False, False, True, True, True, True, False, False, False, False]
    assert np.array_equal(dst[8:24], src[:16]) and not dst[:8].any() and not dst[24:].any()
    # a second copy over [4, 8): the covered part agrees, the rest is new
    src2 = np.concatenate([src[8:16], np.full(8, 9, np.uint8)])
    assert _merge.place_agreeing(dst, covered.view(np.uint8), 4, src2, 4, 4) == 2
    assert _merge.place_agreeing(dst, covered.view(np.uint8), 4, src2, 4, 4) == 0  # all there, agreeing
    assert covered[2:8].all() and np.array_equal(dst[24:32], np.full(8, 9, np.uint8))
    before, cov = dst.copy(), covered.copy()
    bad = src2.copy()
    bad[0] ^= 1
    assert _merge.place_agreeing(dst, covered.view(np.uint8), 4, bad, 4, 4) == -1
    assert np.array_equal(dst, before) and np.array_equal(covered, cov)
    with pytest.raises(ValueError):
        _merge.place_agreeing(dst, covered.view(np.uint8), 8, src, 4, 4)


@pytest.mark.parametrize("gather", [False, True])
def test_one_covered_element_anywhere_in_long_uncovered_runs_is_compared(gather):
    """The flags are scanned 64, then eight, then one at a time, and a send none of whose elements
    is covered yet is copied whole without a second scan: a single covered element at any place
    around those steps is still found, compared (a disagreement refused, nothing written) and
    kept, and every other element copied."""
    from mirrorckpt.parser import _merge

    rng = np.random.default_rng(7)
    n, es = 700, 4
    src = rng.integers(0, 256, n * es, dtype=np.uint8)
    pieces = np.array([0, 333, 1024, 2048, n * es])  # a message in packets, for the gather
    lengths = np.diff(pieces)

    def place(dst, covered, data):
        if not gather:
            return _merge.place_agreeing(dst, covered.view(np.uint8), 0, data, n, es)
        return _merge.place_agreeing_gather(dst, covered.view(np.uint8), 0, data, pieces[:-1].copy(),
                                            pieces[:-1].copy(), lengths, n, es)

    for at in (0, 1, 7, 8, 63, 64, 65, 127, 128, 500, n - 65, n - 64, n - 9, n - 1):
        dst = rng.integers(0, 256, n * es, dtype=np.uint8)
        covered = np.zeros(n, bool)
        covered[at] = True
        dst[at * es:(at + 1) * es] = src[at * es:(at + 1) * es]
        got_dst, got_cov = dst.copy(), covered.copy()
        assert place(got_dst, got_cov, src) == n - 1
        assert np.array_equal(got_dst, src) and got_cov.all()
        bad = src.copy()
        bad[at * es] ^= 1
        got_dst, got_cov = dst.copy(), covered.copy()
        assert place(got_dst, got_cov, bad) == -1
        assert np.array_equal(got_dst, dst) and np.array_equal(got_cov, covered)
    got_dst, got_cov = np.zeros(n * es, np.uint8), np.zeros(n, bool)  # none covered: all of it, once
    assert place(got_dst, got_cov, src) == n and np.array_equal(got_dst, src) and got_cov.all()


@pytest.mark.parametrize("es", [1, 2, 4, 8])
def test_place_agreeing_long_runs_match_numpy(es):
    """Covered runs of every length around the kernel's eight-flag steps, at every alignment:
    the same bytes and flags as a numpy reference, and a disagreement anywhere refused."""
    from mirrorckpt.parser import _merge

    rng = np.random.default_rng(es)
    n = 3000
    runs = rng.integers(1, 40, 400)
    covered = np.repeat(np.arange(len(runs)) % 2 == 1, runs)[:n]
    dst = rng.integers(0, 256, n * es, dtype=np.uint8)
    src = rng.integers(0, 256, n * es, dtype=np.uint8)
    rows = lambda a: a.reshape(n, es)  # noqa: E731
    rows(src)[covered] = rows(dst)[covered]  # where covered, the copies agree
    for start in (0, 1, 7, 13):
        m = n - start
        want_dst, want_cov = dst.copy(), covered.copy()
        sl = slice(start, start + m)
        rows(want_dst)[sl][~covered[sl]] = rows(src)[:m][~covered[sl]]
        want_cov[sl] = True
        got_dst, got_cov = dst.copy(), covered.copy()
        got = _merge.place_agreeing(got_dst, got_cov.view(np.uint8), start, src, m, es)
        assert got == (int((~covered).sum()) if start == 0 else -1)
        if start == 0:
            assert np.array_equal(got_dst, want_dst) and got_cov.all()
        else:  # shifted, the covered elements no longer agree: refused, nothing written
            assert np.array_equal(got_dst, dst) and np.array_equal(got_cov, covered)
    i = int(np.flatnonzero(covered)[-1])  # the last covered element differs: refused, nothing written
    bad = src.copy()
    bad[i * es] ^= 1
    got_dst, got_cov = dst.copy(), covered.copy()
    assert _merge.place_agreeing(got_dst, got_cov.view(np.uint8), 0, bad, n, es) == -1
    assert np.array_equal(got_dst, dst) and np.array_equal(got_cov, covered)


def test_place_agreeing_copies_exactly_at_every_alignment_and_length():
    """The copy (streaming stores in 16-byte blocks between unaligned head and tail bytes) against
    numpy's, for every destination alignment and lengths around the block sizes, with a covered
    run (whose copy agrees) splitting the copy in two."""
    from mirrorckpt.parser import _merge

    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 400, dtype=np.uint8)
    for start in range(18):
        for n in (0, 1, 15, 16, 17, 63, 64, 65, 130, 300):
            dst = rng.integers(0, 256, 400, dtype=np.uint8)
            covered = np.zeros(400, bool)
            if n >= 8:
                covered[start + n // 2:start + n // 2 + 3] = True
                dst[start + n // 2:start + n // 2 + 3] = src[n // 2:n // 2 + 3]
            want = dst.copy()
            want[start:start + n] = src[:n]
            got = _merge.place_agreeing(dst, covered.view(np.uint8), start, src, n, 1)
            assert got == n - (3 if n >= 8 else 0)
            assert np.array_equal(dst, want) and covered[start:start + n].all()


@pytest.mark.parametrize("es", [1, 2, 4, 8])
def test_place_agreeing_gather_from_packets_is_place_agreeing_of_the_message(es):
    """The message still in its packets (random lengths, not element-aligned, scattered in a batch
    with header bytes between them): the same result, flags and refusals as placing the message
    itself, for every covered pattern and start."""
    from mirrorckpt.parser import _merge

    rng = np.random.default_rng(10 + es)
    n = 2000
    msg = rng.integers(0, 256, n * es + 5, dtype=np.uint8)  # a few bytes more than placed
    cuts = np.sort(rng.choice(np.arange(1, len(msg)), 60, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [len(msg)]]))
    gaps = rng.integers(0, 70, len(lengths))  # headers between payloads
    src_off = np.cumsum(gaps + np.concatenate([[0], lengths[:-1]]))
    batch = rng.integers(0, 256, int(src_off[-1] + lengths[-1]), dtype=np.uint8)
    msg_off = np.concatenate([[0], np.cumsum(lengths[:-1])])
    for so, mo, ln in zip(src_off, msg_off, lengths):
        batch[so:so + ln] = msg[mo:mo + ln]
    for start, seed in ((0, 1), (3, 2), (0, 3)):
        covered = np.repeat(np.random.default_rng(seed).integers(0, 2, 300).astype(bool),
                            np.random.default_rng(seed).integers(1, 30, 300))[:start + n + 10]
        covered = np.concatenate([covered, np.zeros(start + n + 10 - len(covered), bool)])
        dst = rng.integers(0, 256, len(covered) * es, dtype=np.uint8)
        if seed == 3:  # every covered element agrees: placed
            dst.reshape(-1, es)[start:start + n][covered[start:start + n]] = \
                msg[:n * es].reshape(n, es)[covered[start:start + n]]
        want_dst, want_cov = dst.copy(), covered.copy()
        want = _merge.place_agreeing(want_dst, want_cov.view(np.uint8), start, msg, n, es)
        got_dst, got_cov = dst.copy(), covered.copy()
        got = _merge.place_agreeing_gather(got_dst, got_cov.view(np.uint8), start, batch, src_off, msg_off, lengths,
                                           n, es)
        assert got == want and (got >= 0) == (seed == 3)
        assert np.array_equal(got_dst, want_dst) and np.array_equal(got_cov, want_cov)
        # the same message as rows 2.. of a run's columns, its offsets those in the run's buffer
        run_src, run_msg, run_len = (np.concatenate([[0, 9], a]) for a in (src_off, msg_off + 100, lengths))
        run_msg[:2] = [80, 89]
        got_dst, got_cov = dst.copy(), covered.copy()
        got = _merge.place_agreeing_gather(got_dst, got_cov.view(np.uint8), start, batch, run_src, run_msg, run_len,
                                           n, es, 2, len(run_src))
        assert got == want and np.array_equal(got_dst, want_dst) and np.array_equal(got_cov, want_cov)
    with pytest.raises(ValueError, match="fewer bytes"):
        _merge.place_agreeing_gather(dst, covered.view(np.uint8), 0, batch, src_off[:3], msg_off[:3], lengths[:3],
                                     n, es)
    with pytest.raises(ValueError, match="does not follow"):
        _merge.place_agreeing_gather(dst, covered.view(np.uint8), 0, batch, src_off[::-1].copy(),
                                     msg_off[::-1].copy(), lengths[::-1].copy(), n, es)


def test_gather_ll_copies_each_message_and_reads_it_as_ll_intact_would():
    """Messages of random packets, end to end: the copy is copy_ranges', and each message's flag and
    user bytes are ll_intact's of its wire (LL, LL with one bad line, Simple, a length that is not
    whole lines, an empty message); bounds that do not add up are refused before anything is copied."""
    from mirrorckpt.capture._pack import copy_ranges
    from mirrorckpt.parser.roce import _place

    rng = np.random.default_rng(3)
    wires = [P.encode("LL", rng.integers(0, 256, 4096, dtype=np.uint8), flag=9),
             P.encode("LL", rng.integers(0, 256, 800, dtype=np.uint8), flag=3).copy(),
             rng.integers(0, 256, 3000, dtype=np.uint8),
             P.encode("LL", rng.integers(0, 256, 512, dtype=np.uint8), flag=4)[:-8],
             np.zeros(0, np.uint8),
             P.encode("LL", rng.integers(0, 256, 64, dtype=np.uint8), flag=1)]
    wires[1][16 * 7 + 4] ^= 1  # line 7's first flag word
    # packets of each message in a shuffled source buffer
    rows, src_parts, pos = [], [], 0
    msg_rows = [0]
    for w in wires:
        cuts = sorted({0, len(w), *rng.integers(0, len(w) + 1, 3).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            pad = int(rng.integers(0, 40))
            src_parts.append(np.zeros(pad, np.uint8))
            rows.append((pos + pad, b - a))
            src_parts.append(w[a:b])
            pos += pad + b - a
        msg_rows.append(len(rows))
    src = np.concatenate(src_parts)
    src_off = np.array([r[0] for r in rows], np.int64)
    length = np.array([r[1] for r in rows], np.int64)
    sizes = np.array([len(w) for w in wires], np.int64)
    msg_bytes = np.concatenate([[0], np.cumsum(sizes)])
    nb = sizes // 16 * 8
    out_off = np.concatenate([[0], np.cumsum(nb[:-1])])
    buf = np.zeros(int(msg_bytes[-1]), np.uint8)
    out = np.zeros(int(nb.sum()), np.uint8)
    flags = np.zeros(len(wires), np.uint32)
    _place.gather_ll(src, src_off, length, np.array(msg_rows, np.int64), msg_bytes, buf, out_off, out, flags,
                     *P.LL_INTACT_ARGS)
    want = np.zeros_like(buf)
    copy_ranges(src, src_off, want, np.concatenate([[0], np.cumsum(length[:-1])]), length)
    assert np.array_equal(buf, want) and np.array_equal(buf, np.concatenate(wires))
    for k, w in enumerate(wires):
        got = P.ll_intact(w) if len(w) and len(w) % 16 == 0 else None
        if got is None:
            assert flags[k] == 0
        else:
            assert flags[k] == got[1] and np.array_equal(out[out_off[k]:out_off[k] + nb[k]], got[0])
    assert flags.tolist() == [9, 0, 0, 0, 0, 1]
    bad = msg_bytes.copy()
    bad[2] += 16  # message 1's packets no longer add up to its bytes
    buf[:] = 0
    with pytest.raises(ValueError):
        _place.gather_ll(src, src_off, length, np.array(msg_rows, np.int64), bad, buf, out_off, out, flags,
                         *P.LL_INTACT_ARGS)
    assert not buf.any()


@pytest.mark.parametrize("mtu", [256, 1000, 1024, 3000, 4096])
def test_ll128_read_from_its_packets_is_the_whole_messages_reading(mtu):
    """``ll128_intact_pieces``: a message cut into packets at any MTU (groups cut by a packet's end
    too), scattered in a batch, reads as ``ll128_intact`` of the whole message; one flag off: None."""
    rng = np.random.default_rng(mtu)
    for ng in (1, 2, 7, 40):
        data = rng.integers(0, 256, ng * P.LL128_GROUP_DATA, dtype=np.uint8)
        wire = P.ll128_encode(data, 5 + ng)
        src, offs, lens = bytearray(), [], []
        for a in range(0, wire.size, mtu):
            src += bytes(int(rng.integers(0, 64)))  # other frames' bytes between the packets
            offs.append(len(src))
            lens.append(min(mtu, wire.size - a))
            src += wire[a:a + mtu].tobytes()
        src = np.frombuffer(bytes(src), np.uint8).copy()
        got = P.ll128_intact_pieces(src, np.array(offs), np.array(lens))
        assert got is not None and got[1] == 5 + ng and np.array_equal(got[0], data)
        byte = int(rng.integers(0, wire.size // 128)) * 128 + 120  # a line's flag, its lowest byte
        k = byte // mtu
        src[offs[k] + byte - k * mtu] ^= 1
        assert P.ll128_intact_pieces(src, np.array(offs), np.array(lens)) is None
        assert P.ll128_intact_pieces(src, np.array(offs[:1]), np.array([lens[0] - 8])) is None  # not whole
