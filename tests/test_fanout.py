"""capture.fanout, parser.split: one port's frames split over workers by QP pair (the mirrored
flow's UDP source port, as the packet decoder walks the frame)."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest
from common import SHARED
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser import roce
from mirrorckpt.parser.headers import (
    ETH,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ETHERTYPE_VLAN,
    IPPROTO_UDP,
    IPV4,
    IPV4_FRAGMENT,
    IPV6,
    UDP,
    VLAN,
)
from mirrorckpt.parser.roce import split
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.noise import NoiseOptions


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    d = tmp_path_factory.mktemp("fanout")
    generate(GenConfig(ranks=3, channels=2, model="linear:3000", steps=2, seed=5, mirrors="0:both,1:both",
                       noise=NoiseOptions(frozenset({"probes", "tcp"}))), d)
    return d


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_every_frame_of_a_qp_pair_both_ways_goes_to_one_worker(generated, workers):
    """Data, ACKs and the CTS posted back on a QP pair (truth: the generator's ring QP pairs) all
    land in one worker; every frame in exactly one share; the pairs spread over the workers."""
    t = json.loads((generated / "truth.json").read_text())
    pairs = t["wire"]["topology"]["ring"]
    used = set()
    for f in sorted(generated.glob("*.pcap*")):
        b = read_all(f)
        w = split.worker_of(b, workers)
        parts = [split.share(b, k, workers) for k in range(workers)]
        assert sum(len(p) for p in parts) == len(b)
        assert np.array_equal(np.sort(np.concatenate([p.offset for p in parts])), np.sort(b.offset))
        pk, _ = roce.decode(b, icrc=False)
        for p in pairs:
            rows = pk.frame[np.isin(pk.dqp, [p["send_qpn"], p["recv_qpn"]]) & (pk.sport == p["sport"])]
            if len(rows):
                assert len(set(w[rows].tolist())) == 1, p
                used.add(int(w[rows][0]))
    assert len(used) > 1


def test_source_ports_agree_with_the_packet_decoder_on_every_real_capture():
    for f in sorted(glob.glob(str(SHARED / "captures" / "flowcheck" / "*.pcap*"))):
        b = read_all(f)
        pk, _ = roce.decode(b, icrc=False)
        sp = split.flow_ports(b)
        assert np.array_equal(sp[pk.frame], pk.sport), f
        assert split.worker_of(b, 3).max() <= 2


def batch(frames: list[bytes]) -> FrameBatch:
    caplen = np.array([len(f) for f in frames], np.int64)
    offset = np.concatenate([[0], np.cumsum(caplen)[:-1]]).astype(np.int64)
    n = len(frames)
    return FrameBatch(np.frombuffer(b"".join(frames), np.uint8), offset, caplen, caplen, np.zeros(n, np.int64),
                      np.zeros(n, np.int32))


def frame(eth: bytes) -> FrameBatch:
    return batch([eth])


def test_header_forms_and_foreign_frames():
    mac = b"\x02" * 12
    udp = (0xC123).to_bytes(2, "big") + (4791).to_bytes(2, "big") + b"\x00" * 4
    v4 = b"\x45" + b"\x00" * 8 + b"\x11" + b"\x00" * 10
    v4_opts = b"\x46" + b"\x00" * 8 + b"\x11" + b"\x00" * 14  # IHL 6: one option word
    v6 = b"\x60" + b"\x00" * 5 + b"\x11" + b"\x00" * 33
    tag = (0x8100).to_bytes(2, "big") + b"\x00\x05"
    cases = {
        mac + b"\x08\x00" + v4 + udp: 0xC123,
        mac + b"\x08\x00" + v4_opts + udp: 0xC123,
        mac + b"\x86\xdd" + v6 + udp: 0xC123,
        mac + tag + b"\x86\xdd" + v6 + udp: 0xC123,
        mac + tag + tag + b"\x08\x00" + v4 + udp: 0xC123,
        mac + b"\x08\x00" + v4.replace(b"\x11", b"\x06", 1) + udp: -1,  # TCP
        mac + b"\x08\x06" + b"\x00" * 28: -1,  # ARP
        mac + b"\x08\x00" + v4: -1,  # cut before the UDP header
        mac[:10]: -1,
    }
    for eth, want in cases.items():
        assert split.flow_ports(frame(eth)).tolist() == [want], eth.hex()
        assert split.worker_of(frame(eth), 5).tolist() == [want % 5 if want >= 0 else 0]


def _sport_by_hand(eth: bytes) -> int:
    """The split's rule read field by field (the compiled walk and the BPF program must agree):
    up to two tags, IPv4 (version 4, IHL >= 5, no fragment) or IPv6, a whole UDP header."""
    if len(eth) < ETH.size:
        return -1
    pos, etype = ETH.size, int.from_bytes(eth[12:14], "big")
    for _ in range(2):
        if etype not in ETHERTYPE_VLAN:
            break
        if pos + VLAN.size > len(eth):
            return -1
        etype = int.from_bytes(eth[pos + 2:pos + 4], "big")
        pos += VLAN.size
    if etype == ETHERTYPE_IPV4 and pos + IPV4.size <= len(eth):
        ihl = (eth[pos] & 0x0F) * 4
        frag = int.from_bytes(eth[pos + 6:pos + 8], "big") & IPV4_FRAGMENT
        if eth[pos] >> 4 == 4 and ihl >= 20 and not frag and eth[pos + 9] == IPPROTO_UDP \
                and pos + ihl + UDP.size <= len(eth):
            return int.from_bytes(eth[pos + ihl:pos + ihl + 2], "big")
    elif etype == ETHERTYPE_IPV6 and pos + IPV6.size + UDP.size <= len(eth) and eth[pos + 6] == IPPROTO_UDP:
        return int.from_bytes(eth[pos + 40:pos + 42], "big")
    return -1


def test_mutated_and_cut_frames_follow_the_rule_field_by_field():
    rng = np.random.default_rng(3)
    mac = b"\x02" * 12
    tag = (0x8100).to_bytes(2, "big") + b"\x00\x05"
    qinq = (0x88A8).to_bytes(2, "big") + b"\x00\x05"
    v4 = b"\x45" + b"\x00" * 8 + b"\x11" + b"\x00" * 10
    v6 = b"\x60" + b"\x00" * 5 + b"\x11" + b"\x00" * 33
    udp = (0xC0DE).to_bytes(2, "big") + (4791).to_bytes(2, "big") + b"\x00" * 4
    bases = [mac + b"\x08\x00" + v4 + udp, mac + tag + b"\x86\xdd" + v6 + udp,
             mac + qinq + tag + b"\x08\x00" + v4 + udp, mac + b"\x86\xdd" + v6 + udp]
    frames = []
    for _ in range(4000):
        f = bytearray(bases[rng.integers(len(bases))])
        for _ in range(rng.integers(0, 3)):  # a byte of the headers changed (EtherType, IHL, protocol...)
            f[rng.integers(12, len(f))] = rng.choice([0x00, 0x06, 0x08, 0x11, 0x45, 0x4F, 0x81, 0x86, 0x88,
                                                      0xA8, 0xDD, int(rng.integers(256))])
        frames.append(bytes(f[:rng.integers(0, len(f) + 1)]))  # cut anywhere, to nothing
    b = batch(frames)
    n = len(frames)
    want = [_sport_by_hand(f) for f in frames]
    assert split.flow_ports(b).tolist() == want
    assert 0 < sum(w >= 0 for w in want) < n  # both kinds were made
    # a frame said to lie outside the buffer is an error, not a read past it
    with pytest.raises(IndexError):
        split.flow_ports(FrameBatch(b.data, b.offset + 1, b.caplen, b.caplen, b.ts_ns, b.iface))


def _udp_frames(sports_sizes: list[tuple[int, int]]) -> FrameBatch:
    mac = b"\x02" * 12
    v4 = b"\x45" + b"\x00" * 8 + b"\x11" + b"\x00" * 10
    return batch([mac + b"\x08\x00" + v4 + sp.to_bytes(2, "big") + (4791).to_bytes(2, "big") + b"\x00" * (4 + size)
                  for sp, size in sports_sizes])


@pytest.mark.parametrize("workers", [2, 3])
def test_a_file_is_split_by_its_pairs_bytes_where_port_numbers_would_pile_up(workers):
    """Four QP pairs whose ports are all multiples of 6: port mod N gives them all to worker 0;
    the plan deals them out by bytes (the largest first, each to the least loaded worker), the same
    table from every worker's read of the file, each pair whole in one worker."""
    rng = np.random.default_rng(1)
    sizes = {0xC000: 1000, 0xC006: 900, 0xC00C: 300, 0xC012: 250}
    rows = [(int(sp), int(rng.integers(sizes[sp] - 40, sizes[sp]))) for sp in rng.choice(list(sizes), 4000)]
    b = _udp_frames(rows)
    assert set(split.worker_of(b, workers).tolist()) == {0}
    halves = [b.select(slice(0, 2000)), b.select(slice(2000, 4000))]
    lut, found = split.plan(iter(halves), workers)
    assert np.array_equal(lut, split.plan(iter(halves), workers)[0])
    assert found["qp_pairs"] == 4 and found["connections_of_several_qps"] == 0
    w = split.worker_of(b, workers, lut)
    sport = split.flow_ports(b)
    for sp in sizes:
        assert len(set(w[sport == sp].tolist())) == 1  # a pair whole in one worker
    pair_bytes = [b.caplen[sport == sp].sum() for sp in sizes]
    load = np.bincount(w, weights=b.caplen, minlength=workers)
    assert (load > 0).all()
    assert load.max() <= b.caplen.sum() / workers + max(pair_bytes)  # dealt largest first
    if workers == 2:
        assert load.max() / load.min() < 1.2
    parts = [split.share(b, k, workers, lut) for k in range(workers)]
    assert sorted(np.concatenate([p.offset for p in parts]).tolist()) == b.offset.tolist()
    # the plan reads batches until ``limit`` bytes: ports first seen after them keep port mod N
    first = _udp_frames([(0xC000, 500), (0xC006, 400)])
    part = split.plan(iter([first, b]), workers, limit=1)[0]
    assert part[0xC000] != part[0xC006]
    assert part[0xC00C] == 0xC00C % workers and part[0xC012] == 0xC012 % workers


def test_a_connections_qps_are_one_unit_by_the_buffer_they_write(tmp_path):
    """NCCL_IB_QPS_PER_CONNECTION = 3 (2.23, whole messages in turn): every connection's three QP
    pairs (truth: the generator's ring, its first QP's port and ``more_qps``) are one group, found
    from the rkeys their WRITEs name, and the split keeps each group in one worker."""
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=3, channels=2, model="mlp:64,96,8", steps=2, seed=9, nccl_version="2.23",
                       protocol="Simple", mirrors="0:both", wire=WireOptions(qps_per_connection=3)), tmp_path)
    ring = json.loads((tmp_path / "truth.json").read_text())["wire"]["topology"]["ring"]
    want = {frozenset([c["sport"], *(q[2] for q in c["more_qps"])]) for c in ring}
    b = read_all(next(tmp_path.glob("*.pcap*")))
    weight, groups = split.connection_ports(iter([b]))
    seen = {frozenset(g) for g in groups}
    assert seen and seen <= want and all(len(g) == 3 for g in seen)
    on_port = {g for g in want if g & set(np.flatnonzero(weight).tolist())}
    assert seen == on_port  # every connection the port shows, each whole
    lut, found = split.plan(iter([b]), 2)
    assert found["connections_of_several_qps"] == len(seen) and min(found["share_of_bytes"]) > 0.3
    assert all(len({int(lut[p]) for p in g}) == 1 for g in seen)
    assert len({int(lut[p]) for g in seen for p in g}) == 2  # and the connections spread over both


def test_a_workers_share_in_compact_pieces_decodes_to_the_same_sends(generated):
    """What a file-fed worker's compact thread hands its decode (serve.COMPACT_BYTES): the share cut
    into copies of at most the given bytes, frames in order; the packet path makes the same sends of
    them as of the share itself, whose frames sit among the other workers' in the file's pages."""
    from mirrorckpt.parser.roce.packet_path import PacketPath

    def sends(batches):
        pp = PacketPath(icrc=True, nccl_version=None, stream=0, messages=False)
        out = [s for b in batches for s in pp.feed(b)[1]] + pp.flush()[1]
        return [(s.connection, s.qp, s.psn, s.size, s.holes, s.data.tobytes()) for s in out]

    f = sorted(generated.glob("*.pcap*"))[0]
    b = read_all(f)
    for k in range(2):
        share = split.share(b, k, 2)
        for limit in (1, 3000, 1 << 16, 1 << 30):
            pieces = share.pieces(limit)
            assert sum(len(p) for p in pieces) == len(share)
            assert np.array_equal(np.concatenate([p.offset for p in pieces]), share.offset)
            assert all(p.nbytes <= limit or len(p) == 1 for p in pieces)
            if limit >= share.nbytes:
                assert len(pieces) == 1
            if limit == 1:
                assert len(pieces) == len(share)
            compact = [p.copy() for p in pieces]
            assert sends(compact) == sends([share]), (k, limit)
    assert sends([split.share(b, 0, 2)]) != sends([split.share(b, 1, 2)])
    assert FrameBatch.from_frames([]).pieces(100) == []
