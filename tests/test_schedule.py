"""Ring schedule: the doc's worked examples (3.5), the real captures' message sizes, version facts,
and properties of every plan over versions, protocols, ring sizes, channels and counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mirrorckpt.parser import headers
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import schedule as S

FAMILY_VERSIONS = {
    "loop": ["2.12", "2.15", "2.16", "2.18.6", "2.19"],
    "cbd": ["2.20", "2.21"],
    "cells": ["2.22", "2.23", "2.25", "2.26", "2.28", "2.29", "2.30", "2.31", "2.32.3"],
}
ALL_VERSIONS = [v for vs in FAMILY_VERSIONS.values() for v in vs]


def chunks(plan, ch):
    return [(o, o + n) for loop in plan.loops(ch) for o, n in loop]


# --- doc 3.5 worked examples --------------------------------------------------------------------


@pytest.mark.parametrize("v", ALL_VERSIONS)
def test_ll_5000_fp32_one_channel(v):
    p = S.allreduce_plan(5000, 4, 2, 1, "LL", v)
    split = 3072 if v <= "2.21" else 2500
    assert p.channels == [0] and chunks(p, 0) == [(0, split), (split, 5000)]
    sent = [(m.phase, m.offset, m.offset + m.nelem, m.wire_bytes) for m in p.messages(0, 0)]
    wire = (15424, 24576) if v <= "2.21" else (20000, 20000)
    assert sent == [("own", split, 5000, wire[0]), ("reduced", 0, split, wire[1])]
    ten = S.allreduce_plan(10000, 4, 2, 1, "LL", v)
    assert chunks(ten, 0) == ([(0, 5120), (5120, 10000)] if v <= "2.21" else [(0, 5000), (5000, 10000)])


TWO_CHANNELS = {
    ("2.12", "2.19"): ([(0, 2048), (4096, 5000)], [(2048, 4096), (6144, 6144)]),
    ("2.20", "2.21"): ([(0, 2048), (2048, 3072)], [(3072, 4096), (4096, 5000)]),
    ("2.22", "2.22"): ([(0, 1252), (1252, 2500)], [(2500, 3752), (3752, 5000)]),
    ("2.23", "2.25"): ([(0, 2048), (2048, 4096)], [(4096, 4548), (4548, 5000)]),
    ("2.26", "2.28"): ([(0, 1280), (1280, 2560)], [(2560, 3780), (3780, 5000)]),
    ("2.29", "2.32"): ([(0, 1536), (1536, 3072)], [(3072, 4036), (4036, 5000)]),
}


@pytest.mark.parametrize("v", ALL_VERSIONS)
def test_ll_5000_two_channels(v):
    p = S.allreduce_plan(5000, 4, 2, 2, "LL", v)
    want = next(w for (a, b), w in TWO_CHANNELS.items() if nv.NcclVersion.parse(v).between(a, b))
    assert p.channels == [0, 1] and (chunks(p, 0), chunks(p, 1)) == want


@pytest.mark.parametrize("v,ch1", [("2.12", [(501760, 752640), (752640, 10**6)]),
                                   ("2.18", [(501760, 752640), (752640, 10**6)]),
                                   ("2.23", [(501760, 750880), (750880, 10**6)])])
def test_simple_1e6_two_channels(v, ch1):
    p = S.allreduce_plan(10**6, 4, 2, 2, "Simple", v)
    assert p.nthreads == 544 and chunks(p, 0) == [(0, 250880), (250880, 501760)] and chunks(p, 1) == ch1
    msgs = p.messages(0, 0)
    assert [(m.offset, m.nelem, m.slice, m.conn_step) for m in msgs] == [
        (250880, 125440, 0, 0), (376320, 125440, 1, 2), (0, 125440, 0, 4), (125440, 125440, 1, 6)]
    assert [m.wire_bytes for m in msgs] == [501760] * 4
    assert p.conn_steps(0) == 8 == p.proxy_steps(0)


# --- real captures (nccl-roce-wire-format.md sections 4 and 6) -----------------------------------


@pytest.mark.parametrize("v", FAMILY_VERSIONS["loop"])
def test_iter_40000_rank0_allreduce(v):
    msgs = S.allreduce_plan(5000, 4, 2, 1, "LL", v).messages(0, 0)
    assert [(m.wire_bytes, m.phase, m.offset, m.nelem, m.conn_step) for m in msgs] == [
        (15424, "own", 3072, 1928, 0), (24576, "reduced", 0, 3072, 1)]


@pytest.mark.parametrize("v", FAMILY_VERSIONS["loop"])
def test_rdma32_two_channels_with_empty_step(v):
    p = S.allreduce_plan(5000, 4, 2, 2, "LL", v)
    got = {(r, ch): [(m.phase, m.offset, m.nelem, m.nbytes) for m in p.messages(r, ch)]
           for r in range(2) for ch in range(2)}
    assert got == {
        (0, 0): [("own", 4096, 904, 3616), ("reduced", 0, 2048, 8192)],
        (1, 0): [("own", 0, 2048, 8192), ("reduced", 4096, 904, 3616)],
        (0, 1): [("own", 6144, 0, 0), ("reduced", 2048, 2048, 8192)],
        (1, 1): [("own", 2048, 2048, 8192), ("reduced", 6144, 0, 0)],
    }
    assert p.missing_chunk_ranges(0, 0) == [(4096, 904)] and p.missing_chunk_ranges(0, 1) == []


@pytest.mark.parametrize("v", ALL_VERSIONS)
def test_startup_broadcast_and_allgather(v):
    b = S.broadcast_plan(5000, 4, 2, 1, "LL", v)
    assert [m.wire_bytes for m in b.messages(0, 0)] == [40000] and b.messages(1, 0) == []
    b = S.broadcast_plan(10000, 4, 2, 1, "LL", v)
    assert [(m.offset, m.nelem, m.wire_bytes, m.conn_step) for m in b.messages(0, 0)] == [
        (0, 8192, 65536, 0), (8192, 1808, 14464, 1)]
    assert b.conn_steps(0, 0) == 2 == b.proxy_steps(0, 0) and b.conn_steps(0, 1) == 0
    for comm_channels in (1, 2):
        a = S.allgather_plan(1, 8, 2, comm_channels, "LL", v)
        assert a.channels == [0]
        assert [(m.chunk, m.phase, m.nbytes, m.wire_bytes) for m in a.messages(0, 0)] == [(0, "own", 8, 16)]
        assert [(m.chunk, m.wire_bytes) for m in a.messages(1, 0)] == [(1, 16)]


def test_broadcast_positions_and_simple_steps():
    p = S.broadcast_plan(3 << 20, 1, 4, 1, "Simple", "2.18", root=2)
    assert p.messages(1, 0) == []  # upstream neighbour of the root only receives
    assert {m.phase for m in p.messages(2, 0)} == {"own"} and {m.phase for m in p.messages(3, 0)} == {"forward"}
    msgs = p.messages(0, 0)
    assert [m.conn_step for m in msgs] == list(range(len(msgs)))  # 1 step per message, no rounding
    assert sum(m.nelem for m in msgs) == 3 << 20 and max(m.nbytes for m in msgs) <= 512 << 10


# --- channel/thread selection and step accounting -----------------------------------------------


def test_select_launch():
    assert S.select_launch(20000, 2, 2, "LL", "2.18") == S.Launch(2, 512)
    assert S.select_launch(16, 2, 4, "LL", "2.18") == S.Launch(1, 96)
    assert S.select_launch(16, 2, 4, "LL", "2.12") == S.Launch(1, 64)  # no 3-warp floor in 2.12
    assert S.select_launch(16, 2, 4, "LL128", "2.30") == S.Launch(1, 320)
    assert S.select_launch(100, 2, 4, "Simple", "2.30") == S.Launch(1, 96)
    assert S.select_launch(4 * 10**6, 2, 2, "Simple", "2.23", max_threads=256) == S.Launch(2, 288)


def test_conn_steps_flags_and_slots():
    assert [S.conn_step_start(t, "Simple", "allreduce") for t in (0, 1, 4, 5, 7)] == [0, 4, 4, 8, 8]
    assert S.conn_step_start(5, "Simple", "allgather") == 8
    assert S.conn_step_start(5, "Simple", "broadcast") == 5 == S.conn_step_start(5, "LL", "allreduce")
    assert S.flag("LL", 2**32 - 1) == 0 and S.flag("LL", 6) == 7 and S.flag("LL128", 2**32 - 1) == 2**32
    assert S.flag("Simple", 3) is None and S.slot(13) == 5
    s = S.recv_slot(9, "LL", "allreduce", "2.18")
    assert (s.slot, s.offset, s.alloc_offset, s.cts_size, s.flag) == (1, 65536, 65536, 65536, 10)
    s = S.recv_slot(10, "Simple", "allreduce", "2.30")
    assert (s.slot, s.offset, s.alloc_offset, s.cts_size) == (2, 1 << 20, 5439488 + (1 << 20), 1 << 20)
    assert S.recv_slot(3, "LL128", "allreduce", "2.23").alloc_offset == 524288 + 3 * 614400
    assert S.recv_slot(1, "Simple", "broadcast", "2.23").cts_size == 524288
    assert S.message_wire_bytes("LL", 8, 0x7FFFFFF8, "2.18") == 65536
    assert S.message_wire_bytes("LL", 8, 0x7FFFFFF7, "2.18") == 16


def test_plan_argument_errors():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        S.allreduce_plan(10, 4, 1, 1, "LL", "2.18")
    with pytest.raises(ValueError, match="outside the supported range"):
        S.allreduce_plan(10, 4, 2, 1, "LL", "2.11")
    with pytest.raises(ValueError, match="root position 3"):
        S.broadcast_plan(10, 4, 3, 1, "LL", "2.18", root=3)
    with pytest.raises(ValueError, match="ring position 2"):
        S.allreduce_plan(10, 4, 2, 1, "LL", "2.18").messages(2, 0)


# --- nccl_versions ------------------------------------------------------------------------------


def test_versions_parse_and_compare():
    V = nv.NcclVersion.parse
    assert V("2.18.6") == V("v2.18.6-1") == "2.18" and str(V("2.18.6-1")) == "2.18.6"
    assert V("2.9") < V("2.12") < "2.30" and sorted([V("2.30"), V("2.4"), V("2.19")])[0] == V("2.4")
    with pytest.raises(ValueError, match="not of the form"):
        V("two.eighteen")


def test_version_facts():
    assert [nv.chunk_family(v) for v in ("2.12", "2.19", "2.20", "2.21", "2.22", "2.30")] == \
        ["loop", "loop", "cbd", "cbd", "cells", "cells"]
    assert [nv.cts_header(v) for v in ("2.12", "2.19", "2.20", "2.23", "2.24", "2.29", "2.30")] == [
        headers.CTS32, headers.CTS32, headers.CTS64_V220, headers.CTS64_V220, headers.CTS64_V224,
        headers.CTS64_V224, headers.CTS64_V230]
    assert [(nv.cts_fifo_slots(v), nv.cts_fifo_stride(v)) for v in ("2.18", "2.19", "2.20")] == [
        (64, 256), (256, 256), (256, 512)]
    assert nv.cts_fifo_offset(65, "2.18") == 0 and nv.cts_fifo_offset(65, "2.19") == 64 * 256
    assert [nv.recv_buffer_offset(p) for p in nv.PROTOCOLS] == [0, 524288, 5439488]
    assert [nv.step_bytes(p, "2.18") for p in nv.PROTOCOLS] == [65536, 614400, 524288]
    assert nv.buffer_bytes("Simple", "2.18", arm=True) == 1 << 20
    assert nv.buffer_bytes("Simple", "2.19", arm=True) == 4 << 20
    assert [nv.cells_rules(v).min_traffic for v in ("2.22", "2.23", "2.28", "2.29")] == [512, 16384, 16384, 32768]
    assert nv.cells_rules("2.25").ll_traffic_factor == 1 and nv.cells_rules("2.26").ll_traffic_factor == 4
    assert [nv.max_threads(p) for p in nv.PROTOCOLS] == [512, 640, 512]


def test_split_write_and_immediate():
    assert nv.uses_split_write("2.15", 8193) and not nv.uses_split_write("2.15", 8192)
    assert not nv.uses_split_write("2.16", 10**6, "RoCE") and nv.uses_split_write("2.16", 10**6, "IB")
    assert nv.uses_split_write("2.18", 10**6, "RoCE", adaptive_routing=True)
    assert not nv.uses_split_write("2.30", 10**6, "IB", ooo_rq=True)
    assert nv.uses_split_write("2.29", 10**6, "IB", ooo_rq=True)
    assert nv.uses_split_write("2.20", 16, nreqs=2)
    assert nv.imm_byte_order("2.28") == "little" and nv.imm_byte_order("2.29") == "big"
    raw_le = int.from_bytes((24576).to_bytes(4, "little"), "big")  # ImmDt read big-endian
    assert nv.decode_imm(raw_le, "2.18") == 24576 and nv.decode_imm(24576, "2.29") == 24576
    assert np.array_equal(nv.decode_imm(np.array([raw_le, 0], np.uint32), "2.12"), [24576, 0])
    assert nv.encode_imm(24576, "2.18") == raw_le
    assert nv.split_data_on_qps_default("2.19") and not nv.split_data_on_qps_default("2.20")
    assert nv.imm_is_request_id("2.29.7", True) and not nv.imm_is_request_id("2.29.3", True)
    assert not nv.imm_is_request_id("2.30", False) and [nv.recv_post_depth(n) for n in (1, 2, 4)] == [8, 8, 4]


# --- properties over all plans ----------------------------------------------------------------


@st.composite
def cases(draw):
    v = draw(st.sampled_from(ALL_VERSIONS))
    proto = draw(st.sampled_from(nv.PROTOCOLS))
    R = draw(st.integers(2, 16))
    nc = draw(st.integers(1, 4))
    esize = draw(st.sampled_from([2, 4]))
    count = draw(st.one_of(st.integers(0, 80), st.integers(81, 300_000),
                           st.sampled_from([1024, 4096, 65536, 524288, 576000, 2**20]),
                           st.integers(300_001, 2_500_000)))
    return v, proto, R, nc, esize, count


def coverage(count, ranges):
    """How many times each element is covered by [(offset, nelem)] (difference array)."""
    d = np.zeros(count + 1, np.int64)
    for off, n in ranges:
        if n:
            d[off] += 1
            d[off + n] -= 1
    return np.cumsum(d[:-1])


@settings(max_examples=80, deadline=None)
@given(cases())
def test_allreduce_plan_properties(case):
    check_allreduce_plan(case)


@pytest.mark.parametrize("case", [  # several loops of full Simple / LL128 chunks, non-multiple tails
    ("2.18", "Simple", 2, 1, 2, 3_000_001), ("2.21", "Simple", 3, 2, 4, 4_000_003),
    ("2.23", "Simple", 2, 2, 4, 5_000_000), ("2.30", "Simple", 4, 1, 2, 9_000_017),
    ("2.12", "LL128", 5, 2, 4, 2_000_000), ("2.29", "LL", 16, 4, 2, 2_500_001)])
def test_allreduce_plan_properties_large(case):
    check_allreduce_plan(case)


def check_allreduce_plan(case):
    v, proto, R, nc, esize, count = case
    p = S.allreduce_plan(count, esize, R, nc, proto, v)
    if count == 0:
        assert p.channels == []
        return
    assert set(p.channels) <= set(range(nc))
    assert (coverage(count, [(o, n) for ch in p.channels for _, o, n in p.chunk_ranges(ch)]) == 1).all()
    per_channel = set()
    reduced = {}
    for ch in p.channels:
        ops = {}  # (loop, chunk) -> step -> (rank, slices)
        for r in range(R):
            msgs = p.messages(r, ch)
            # message count = NCCL's proxy step formula; the counter advances by exactly that much
            assert len(msgs) * nv.slice_steps(proto, "allreduce") == p.proxy_steps(ch) == p.conn_steps(ch, r)
            assert [m.conn_step for m in msgs] == sorted({m.conn_step for m in msgs})
            for m in msgs:
                assert m.nbytes == m.nelem * esize and m.wire_bytes == S.wire_bytes(proto, m.nbytes)
                ops.setdefault((m.loop, m.chunk), {}).setdefault(m.step, (r, []))[1].append((m.offset, m.nelem))
            reduced.setdefault(r, []).extend((m.offset, m.nelem) for m in msgs if m.phase == "reduced")
        per_channel.add(len(p.messages(0, ch)))
        for (_loop, c), steps in ops.items():  # every piece of a chunk lines up along the ring
            assert sorted(steps) == list(range(2 * R - 2))
            assert all(rank == (c + s + 1) % R for s, (rank, _) in steps.items())
            assert len({tuple(sl) for _, sl in steps.values()}) == 1
    if nv.chunk_family(v) == "loop":  # every channel runs the same loops, empty steps included
        assert len(per_channel) == 1 and p.channels == list(range(p.nchannels))
    for r in range(R):
        # rank r's reduced messages: everything but chunk (r+1) mod R, each element once
        missing = coverage(count, [rg for ch in p.channels for rg in p.missing_chunk_ranges(r, ch)])
        got = coverage(count, reduced[r])
        assert (got <= 1).all() and ((got == 1) == (missing == 0)).all()
        assert (got + coverage(count, reduced[(r + 1) % R]) >= 1).all()  # two neighbours: everything


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(["broadcast", "allgather"]), st.data())
def test_byte_plan_properties(case, kind, data):
    v, proto, R, nc, esize, count = case
    count = min(count, 600_000)
    if kind == "broadcast":
        root = data.draw(st.integers(0, R - 1))
        p = S.broadcast_plan(count, esize, R, nc, proto, v, root=root)
    else:
        root = None
        p = S.allgather_plan(count, esize, R, nc, proto, v)
    for ch in p.channels:
        for r in range(R):
            msgs = p.messages(r, ch)
            assert len(msgs) * nv.slice_steps(proto, kind) == p.proxy_steps(ch, r) == p.conn_steps(ch, r)
            if kind == "broadcast" and (r - root) % R == R - 1:
                assert msgs == []
    for r in range(R):
        if kind == "broadcast" and (r - root) % R == R - 1:
            continue
        msgs = [m for ch in p.channels for m in p.messages(r, ch)]
        origins = {m.chunk for m in msgs if m.nelem}
        for origin in ({root} if kind == "broadcast" else {(r - s) % R for s in range(R - 1)}):
            cov = coverage(count, [(m.offset, m.nelem) for m in msgs if m.chunk == origin])
            assert (cov == 1).all()
        assert origins <= ({root} if kind == "broadcast" else set(range(R)) - {(r + 1) % R})


def test_simple_pci_thread_rule_ends_at_2_30():
    """2.31 doc section 1's example: R = 2, fp32, 10 000 elements, a 2-channel PCI-limited ring. Up to
    2.30 Simple runs 256 threads there, on 2 channels; from 2.31 512, on one (20 000 B + 0 B)."""
    assert nv.pci_thread_rule("2.30") and not nv.pci_thread_rule("2.31") and not nv.pci_thread_rule("2.32")
    old = S.allreduce_plan(10000, 4, 2, 2, "Simple", "2.30", nthreads=nv.max_threads("Simple", pci_limited=True))
    new = S.allreduce_plan(10000, 4, 2, 2, "Simple", "2.31",
                           nthreads=nv.max_threads("Simple", pci_limited=nv.pci_thread_rule("2.31")))
    assert old.channels == [0, 1] and new.channels == [0]
    assert [m.wire_bytes for m in old.messages(0, 0)][:2] == [16384, 0]
    assert [m.wire_bytes for m in old.messages(0, 1)][:2] == [3616, 0]
    assert [m.wire_bytes for m in new.messages(0, 0)][:2] == [20000, 0]


def test_2_31_and_2_32_write_2_30_s_cts_entry():
    for v in ("2.31", "2.32"):
        assert nv.cts_header(v) is headers.CTS64_V230 and nv.cts_fifo_stride(v) == 512
        assert nv.imm_byte_order(v) == "big" and nv.chunk_family(v) == nv.CELLS
        assert nv.cells_rules(v) == nv.cells_rules("2.30")
    fam = nv.WireFamily(headers.CTS64_V230, "big")
    assert fam.describe() == "NCCL 2.30-2.32" and fam.candidates() == ["2.30", "2.32"]
    with pytest.raises(ValueError, match="outside the supported range"):
        nv.version("2.33")
