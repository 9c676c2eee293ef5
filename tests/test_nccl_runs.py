"""The NCCL decoder's run lane (parser/nccl_runs) gives exactly the sends of the per-message path,
leaves the decoder in the same state, and does take the common case: real captures, generated jobs
of every protocol and wire form, and traffic with lost, duplicated and reordered packets, cut into
batches of several sizes."""

from __future__ import annotations

import numpy as np
import pytest
from common import FLOWCHECK, flowcheck_captures
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser.roce import nccl
from mirrorckpt.parser.roce.packet_path import PacketPath
from mirrorckpt.parser.roce.reassembly import Key, QpKey
from test_reassembly_fast import batches, damaged

SCALARS = ("connection", "qp", "protocol", "holes", "wire_bytes", "size", "va", "form", "flag", "seq", "cts", "ts_ns",
           "length_known", "stream", "psn", "npkts", "pmtu", "qp_index", "nqps", "cut", "pieces", "lone_piece")


def views(parts):
    """Batches as a capture file's reader hands them on: each a slice of one buffer holding its own
    frames' bytes only, its offsets from the slice's start (the reassembler then names payloads by
    their place in that buffer, and leaves held packets where they lie)."""
    for b in parts:
        lo, hi = int(b.offset.min()), int((b.offset + b.caplen).max())
        yield FrameBatch(b.data[lo:hi], b.offset - lo, b.caplen, b.wirelen, b.ts_ns, b.iface, b.source,
                         b.first_index, b.linktypes)


def sends(batch, size: int, runs: bool, version: str | None = "2.18", defer: bool = False,
          protocol: str | None = None, sliced: bool = False):
    """Sends of the packet path over ``batch`` cut every ``size`` frames, with runs (the lane) or
    one message object each; and how many batches the lane took. ``defer``: copies left in the
    batches (as from capture files: ``defer_copies``); ``sliced``: the batches as ``views``."""
    pp = PacketPath(icrc=False, nccl_version=version, protocol=protocol, messages=not runs)
    if defer:
        pp.defer_copies()
    taken = []
    orig = pp.nccl.take_runs

    def counting(rs):
        got = orig(rs)
        taken.append(got is not None)
        return got

    pp.nccl.take_runs = counting
    out = []
    for b in (views if sliced else iter)(batches(batch, size)):
        out += pp.feed(b)[1]
    out += pp.flush()[1]
    return out, pp.nccl, sum(taken)


def same(batch, size: int, version: str | None = "2.18", defer: bool = False, protocol: str | None = None,
         sliced: bool = False) -> int:
    lane, dl, n = sends(batch, size, True, version, defer, protocol, sliced)
    each, de, _ = sends(batch, size, False, version, protocol=protocol)
    assert len(lane) == len(each)
    for a, b in zip(lane, each):
        for f in SCALARS:
            assert getattr(a, f) == getattr(b, f), f
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    assert dl.cts_posts == de.cts_posts and dl.pmtu == de.pmtu and dl.pmtu_exact == de.pmtu_exact
    assert dl.seen_cts is de.seen_cts and dl.seen_imm == de.seen_imm
    assert dl.conns.keys() == de.conns.keys()
    for k, c in dl.conns.items():
        e = de.conns[k]
        assert c.cts == e.cts and c.by_addr == e.by_addr and c.protocol == e.protocol and c.qp_mode == e.qp_mode
        assert c.tags == e.tags
    return n


@pytest.fixture(scope="module", params=flowcheck_captures())
def real(request):
    return read_all(FLOWCHECK / request.param)


@pytest.mark.parametrize("size", [61, 2500, 10**9])
def test_real_capture_same(real, size):
    same(real, size, None)


@pytest.mark.parametrize("what", ["loss", "dup", "swap"])
def test_damaged_real_capture_same(real, what):
    same(damaged(real, 5, what), 700, None)


@pytest.mark.parametrize("proto,pmtu,version,qps", [("LL", 1024, "2.18", 1), ("Simple", 4096, "2.18", 1),
                                                    ("LL128", 4096, "2.18", 1), ("LL", 1024, "2.24", 2),
                                                    ("Simple", 4096, "2.30", 2), ("Simple", 1024, "2.27", 1),
                                                    ("LL128", 4096, "2.29", 3), ("LL", 1024, "2.18", 2)])
def test_generated_same_and_taken(tmp_path, proto, pmtu, version, qps):
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol=proto, nccl_version=version, model="linear:200000", steps=3,
                       seed=3, mirrors="0:egress", wire=WireOptions(pmtu=pmtu, qps_per_connection=qps),
                       send_truth=False), tmp_path)
    b = read_all(next(tmp_path.glob("*.pcap*")))
    n = same(b, 500, version)
    if qps == 1 or version >= "2.20":
        assert n > 0  # lossless, whole messages on one QP or in turn on several: the lane takes batches
    for what in ("loss", "swap"):
        same(damaged(b, 9, what), 300, version)


@pytest.mark.parametrize("proto,pmtu", [("LL128", 4096), ("LL128", 1024), ("Simple", 4096), ("LL", 1024)])
def test_deferred_runs_read_where_they_lie_give_the_same_sends(tmp_path, monkeypatch, proto, pmtu):
    """With copies left in the batches, a run that may be LL128 is not copied whole: each of its
    sends is read from its packets (``protocols.ll128_intact_pieces``, groups cut by a packet's end
    put together first at PMTU 1024), and the sends are the per-message path's, intact and damaged."""
    from mirrorckpt.parser.roce import protocols
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol=proto, model="linear:200000", steps=3, seed=4,
                       mirrors="0:egress", wire=WireOptions(pmtu=pmtu), send_truth=False), tmp_path)
    b = read_all(next(tmp_path.glob("*.pcap*")))
    read = []
    orig = protocols.ll128_intact_pieces
    monkeypatch.setattr(protocols, "ll128_intact_pieces", lambda *a: read.append(orig(*a)) or read[-1])
    assert same(b, 500, "2.18", defer=True) > 0
    if proto == "LL128":
        assert read and all(r is not None for r in read)  # sends read so, each intact LL128
    for what in ("loss", "swap", "dup"):
        same(damaged(b, 9, what), 300, "2.18", defer=True)
    same(b, 500, "2.18", defer=True, protocol=proto)  # pinned as the job file pins it
    same(damaged(b, 9, "loss"), 300, "2.18", defer=True, protocol=proto)
    # batches as a capture file's reader cuts them: messages begun in the batch before read where
    # they lie, in the intact and the damaged wire alike
    assert same(b, 500, "2.18", defer=True, sliced=True) > 0
    for what in ("loss", "swap", "dup"):
        same(damaged(b, 9, what), 300, "2.18", defer=True, sliced=True)
    same(damaged(b, 9, "loss"), 300, "2.18", defer=True, protocol=proto, sliced=True)


@pytest.mark.parametrize("size", [700, 10**9])
def test_deferred_real_capture_same(real, size):
    same(real, size, None, defer=True)
    same(real, size, None, defer=True, sliced=True)


@pytest.mark.parametrize("mirrors", ["0:egress", "0:both"])
def test_cts_posts_kept_bounded(tmp_path, monkeypatch, mirrors):
    """A long job keeps a bounded number of CTS posts: an egress-only mirror shows posts whose data
    goes the other way (never taken), one port in both directions has each taken by its send.
    (The bound per receive address is lowered so that 12 steps reach it.)"""
    from mirrorckpt.parser.roce.nccl_versions import NCCL_STEPS
    from mirrorckpt.tools.generator.gen import GenConfig, generate

    monkeypatch.setattr(nccl, "CTS_KEPT_PER_ADDR", 4)

    generate(GenConfig(ranks=2, channels=2, protocol="LL", nccl_version="2.18", model="linear:100000", steps=12,
                       seed=3, mirrors=mirrors, send_truth=False), tmp_path)
    out, dec, _ = sends(read_all(next(tmp_path.glob("*.pcap*"))), 500, True)
    posting = [c for c in dec.conns.values() if c.tags]
    kept = sum(len(c.cts) for c in posting)
    assert kept == sum(len(q) for c in posting for q in c.by_addr.values())
    if mirrors == "0:both":  # posts and data on one port: each post taken by its send
        assert sum(s.cts is not None for s in out) > 0.9 * len(out) and kept <= len(posting) * NCCL_STEPS
    else:  # a few kept per receive slot
        assert kept <= len(posting) * NCCL_STEPS * nccl.CTS_KEPT_PER_ADDR
    assert dec.cts_posts > 150 and kept < dec.cts_posts / 2
    # the data senders' ranks, for ring inference: rank 0's posts name rank 1, rank 1's rank 0
    assert {t for c in posting for t in c.tags} == ({1} if mirrors == "0:egress" else {0, 1})


def test_keys_hash_in_c_and_differ_by_class():
    import pickle

    a, b = QpKey(b"a" * 16, b"b" * 16, 7), QpKey(src=b"a" * 16, dst=b"b" * 16, dqp=7)
    c = nccl.ConnKey(b"a" * 16, b"b" * 16, 7)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != c and c not in {a: 1} and a != (b"a" * 16, b"b" * 16, 7)
    assert pickle.loads(pickle.dumps(c)) == c and type(pickle.loads(pickle.dumps(a))) is QpKey
    assert type(a).__hash__ is tuple.__hash__ and isinstance(a, Key) and a.dqp == 7
