"""The generator's chunking against an independent table of NCCL's partition code (issue 13).

The generator and the parser share ``parser.schedule``, so they can agree with each other while both
disagree with NCCL. Here a reference written only from the pseudocode of
/work/shared/docs/nccl-ring-schedule.md (section 3.1 channels and threads; 3.2 the "loop" family,
2.12-2.19; 3.3 "CBD", 2.20-2.21; 3.4 "cells", 2.23-2.30, which 2.31 and 2.32 keep: nccl-2.31-2.32.md
section 1), importing nothing from the parser, gives each channel's chunks of a ring all-reduce. It is
anchored to the doc's worked examples (3.5), then compared with the plan the generator builds
(``schedule.allreduce_plan``, what ``tools/generator/packetize.py`` sends) over a grid of sizes, ranks,
channels, protocols and element sizes; and a generated capture's wire is checked against the worked
example's message sizes.
"""

from __future__ import annotations

import itertools

import pytest
from mirrorckpt.parser.roce import schedule

# -- the reference, from the doc alone ------------------------------------------------------------------

CHUNK_BYTES = {"LL": 32768, "LL128": 576000, "Simple": 2097152}  # doc 1.2: C * esize
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}  # doc 3.1


def div_up(a, b):
    return -(-a // b)


def round_up(a, b):
    return div_up(a, b) * b


def vt(v: str) -> tuple[int, int]:
    a, b = v.split(".")
    return int(a), int(b)


def launch(count, esize, R, comm, proto, v="2.18"):
    """Doc 3.1: (channels, threads) of one all-reduce launch. The doc puts the 3-warp floor in every
    version; 2.12 has none (v2.12.12-1:src/enqueue.cc:470-486, the floor first at
    v2.13.4-1:src/enqueue.cc:1130), which the generator follows and so does this table."""
    nbytes = count * esize
    th = {"LL": 8 * R, "LL128": 8, "Simple": 64}[proto]
    nc, nt = comm, MAX_THREADS[proto]
    while nbytes < nc * nt * th and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * th and nt % 128 == 0:
        nt //= 2
    if proto == "Simple":
        nt += 32
    return nc, (max(nt, 96) if vt(v) >= (2, 13) else nt)


def ref_loop(count, esize, R, comm, proto, v):
    """Doc 3.2 (2.12-2.19): channel -> [(offset, nelem)] of its non-empty chunks, loop by loop."""
    nc, nt = launch(count, esize, R, comm, proto, v)
    C = CHUNK_BYTES[proto] // esize
    min_chunk = nt * (8 // esize) if proto == "LL" else nt * (60 // esize) // 2
    out = {bid: [] for bid in range(nc)}
    for grid in range(0, count, nc * R * C):
        if proto == "Simple":
            real = round_up(min(C, div_up(count - grid, nc * R)), (nt - 32) * 8 // esize)
        else:
            real = min(C, div_up(count - grid, nc * R * min_chunk) * min_chunk)
        for bid in range(nc):
            for c in range(R):
                off = grid + (bid * R * real + c * real if proto == "Simple" else (c * nc + bid) * real)
                n = min(real, count - off)
                if n > 0:
                    out[bid].append((off, n))
    return out


def chunks_in_parts(parts, R, C, last):
    """Loops of R chunks of C elements in each part, the last loop's chunk ``last(partCount, rem)``."""
    out = {}
    for ch, poff, pcount in parts:
        lst = out.setdefault(ch, [])
        for elem in range(0, pcount, R * C):
            rem = pcount - elem
            chunk = C if rem >= R * C else last(pcount, rem)
            for c in range(R):
                n = min(chunk, rem - c * chunk)
                if n > 0:
                    lst.append((poff + elem + c * chunk, n))
    return out


def ref_cbd(count, esize, R, comm, proto):
    """Doc 3.3 (2.20-2.21)."""
    nc, nt = launch(count, esize, R, comm, proto)
    C = CHUNK_BYTES[proto] // esize
    max_bytes = round_up(div_up(count * esize, nc), 16)
    align = {"Simple": 4096 // esize, "LL128": (480 // esize) * (nt // 32), "LL": (8 // esize) * nt}[proto]
    parts, off, k = [], 0, 0
    while off < count:
        pc = min(round_up(div_up(min(max_bytes, (count - off) * esize), esize), align), count - off)
        parts.append((k, off, pc))
        off, k = off + pc, k + 1
    return chunks_in_parts(parts, R, C, lambda pc, rem: round_up(div_up(pc % (R * C), R), align))


def ref_cells(count, esize, R, comm, proto, v):
    """Doc 3.4 (2.23-2.30): one all-reduce starting its launch."""
    nc, _ = launch(count, esize, R, comm, proto)
    min_traffic = 32768 if vt(v) >= (2, 29) else 16384
    ll4 = proto == "LL" and vt(v) >= (2, 26)
    tb = count * esize * 2 * (4 if ll4 else 1)
    traffic = max(min_traffic, tb)
    nch = min(nc, comm)
    tpc = round_up(traffic // nch, 16) if vt(v) >= (2, 29) else max(min_traffic, traffic // nch)
    tpb = 2 * (4 if ll4 else 1)
    cell = round_up(div_up(min_traffic, tpb), 16)
    epc, cells, tpcell = cell // esize, div_up(count * esize, cell), cell * tpb
    cpc = min(cells, div_up(tpc, tpcell))
    lo = cells if comm == 1 else min(cells, div_up(tpc, tpcell))
    mid, hi = (cells - lo) // cpc, (cells - lo) % cpc
    if (1 if lo else 0) + mid + (1 if hi else 0) > comm:
        mid = comm - 2
        cpc = (cells - lo) // (mid + 1)
        hi = cpc + (cells - lo) % (mid + 1)
    if hi == 0 and mid != 0:
        hi, mid = cpc, mid - 1
    counts = [lo * epc] + [cpc * epc] * mid + ([hi * epc] if hi else [])
    counts[-1] -= cells * epc - count  # the last non-empty of (countHi, countLo)
    parts, off = [], 0
    for ch, pc in enumerate(counts):
        if pc:
            parts.append((ch, off, pc))
        off += pc
    grain = {"LL": 16, "LL128": 1920, "Simple": 512}[proto]
    C = CHUNK_BYTES[proto] // grain * (grain // esize)
    return chunks_in_parts(parts, R, C, lambda pc, rem: round_up(div_up(rem, R), max(1, 16 // esize)))


def reference(count, esize, R, comm, proto, v):
    if vt(v) <= (2, 19):
        return ref_loop(count, esize, R, comm, proto, v)
    if vt(v) <= (2, 21):
        return ref_cbd(count, esize, R, comm, proto)
    assert vt(v) >= (2, 23), "2.22's cells rules (floor, 512 B minimum) are not in the reference"
    return ref_cells(count, esize, R, comm, proto, v)


def generator(count, esize, R, comm, proto, v):
    """The chunks the generator sends: its plan's non-empty chunks per channel, loop by loop."""
    plan = schedule.allreduce_plan(count, esize, R, comm, proto, v)
    out = {ch: [(o, n) for loop in plan.loops(ch) for o, n in loop if n > 0] for ch in plan.channels}
    return {ch: c for ch, c in out.items() if c}


def nonempty(table):
    return {ch: c for ch, c in table.items() if c}


# -- the reference reproduces the doc's worked examples (3.5) -----------------------------------------

def spans(table, ch):
    return [(o, o + n) for o, n in table.get(ch, [])]


@pytest.mark.parametrize("v,split", [("2.12", 3072), ("2.18", 3072), ("2.21", 3072), ("2.23", 2500),
                                     ("2.27", 2500), ("2.30", 2500), ("2.32", 2500)])
def test_reference_ll_5000_one_channel(v, split):
    assert spans(reference(5000, 4, 2, 1, "LL", v), 0) == [(0, split), (split, 5000)]
    ten = [(0, 5120), (5120, 10000)] if vt(v) <= (2, 21) else [(0, 5000), (5000, 10000)]
    assert spans(reference(10000, 4, 2, 1, "LL", v), 0) == ten


@pytest.mark.parametrize("v,ch0,ch1", [
    ("2.18", [(0, 2048), (4096, 5000)], [(2048, 4096)]),  # channel 1's second chunk is empty
    ("2.21", [(0, 2048), (2048, 3072)], [(3072, 4096), (4096, 5000)]),
    ("2.23", [(0, 2048), (2048, 4096)], [(4096, 4548), (4548, 5000)]),
    ("2.27", [(0, 1280), (1280, 2560)], [(2560, 3780), (3780, 5000)]),
    ("2.29", [(0, 1536), (1536, 3072)], [(3072, 4036), (4036, 5000)])])
def test_reference_ll_5000_two_channels(v, ch0, ch1):
    t = reference(5000, 4, 2, 2, "LL", v)
    assert (spans(t, 0), spans(t, 1)) == (ch0, ch1)


@pytest.mark.parametrize("v,ch1", [("2.18", [(501760, 752640), (752640, 10**6)]),
                                   ("2.23", [(501760, 750880), (750880, 10**6)])])
def test_reference_simple_1e6_two_channels(v, ch1):
    t = reference(10**6, 4, 2, 2, "Simple", v)
    assert launch(10**6, 4, 2, 2, "Simple")[1] == 544
    assert spans(t, 0) == [(0, 250880), (250880, 501760)] and spans(t, 1) == ch1


# -- the generator against the reference ----------------------------------------------------------------

COUNTS = [1, 7, 100, 999, 4999, 5000, 10000, 33333, 100001, 262144, 1_000_000, 3_000_001]
VERSIONS = ["2.12", "2.18", "2.20", "2.21", "2.23", "2.26", "2.28", "2.29", "2.30", "2.31", "2.32"]


@pytest.mark.parametrize("v", VERSIONS)
@pytest.mark.parametrize("proto", ["LL", "LL128", "Simple"])
def test_generator_chunks_equal_the_reference(v, proto):
    bad = []
    for count, esize, R, comm in itertools.product(COUNTS, (4, 2), (2, 3, 4), (1, 2, 4)):
        want, got = nonempty(reference(count, esize, R, comm, proto, v)), generator(count, esize, R, comm, proto, v)
        if want != got:
            bad.append((count, esize, R, comm))
        assert sum(n for c in got.values() for _, n in c) == count  # every element in exactly one chunk
    assert not bad, f"{len(bad)} cases differ from the doc's partition, first (count, esize, R, channels): {bad[:5]}"


# -- the generated wire carries the worked example's messages -----------------------------------------------

@pytest.mark.parametrize("v,sizes", [("2.18", (15424, 24576)), ("2.23", (20000, 20000))])
def test_generated_wire_has_the_worked_example_sizes(tmp_path, v, sizes):
    """R = 2, one channel, LL, one fp32 bucket of 5000 elements: rank 0's egress carries, per iteration,
    its own chunk and its reduced chunk with the doc's wire sizes (3.5: 3072/1928 elements up to 2.21,
    2500/2500 from 2.22; LL lines of 16 bytes per 8 data bytes)."""
    from mirrorckpt.capture.pcapfile import read_all
    from mirrorckpt.parser import roce
    from mirrorckpt.parser.roce.nccl import NcclDecoder
    from mirrorckpt.parser.roce.reassembly import Reassembler
    from mirrorckpt.tools.generator.gen import GenConfig, generate

    steps = 3
    truth = generate(GenConfig(ranks=2, channels=1, protocol="LL", nccl_version=v, model="linear:5000",
                               steps=steps, seed=1, mirrors="0:egress", send_truth=False), tmp_path)
    b = read_all(tmp_path / truth["wire"]["captures"][0]["file"])
    pk, _ = roce.decode(b)
    rs, dec = Reassembler(), NcclDecoder(v)
    sends = dec.feed(rs.feed(pk, b.data) + rs.flush()) + dec.flush()
    seq = [s.wire_bytes for s in sends if s.length_known and s.flag is not None]
    pairs = sum(1 for a, c in zip(seq, seq[1:]) if (a, c) == sizes)
    assert pairs >= steps, (sizes, seq)
