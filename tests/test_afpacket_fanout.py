"""AF_PACKET fanout: N rings on one interface, each receiving exactly `split.worker_of == k`.

The classic BPF programs run in the kernel only, so they are tested live: frames are injected
into one end of a veth pair (the root-namespace end of a tools.netns monitor port) and the N
members capture on the other end, inside the monitor's namespace. The frames: a real RoCEv2
capture and a small mixed one from ../shared, and built ones (IPv4 with options, IPv6, VLAN
and QinQ tags, ARP/TCP, odd IHL, frames cut short inside their headers). Needs root, as CI has;
without root these tests fail and say so (marker `root`).
"""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
from common import FLOWCHECK
from mirrorckpt.capture.afpacket import AfPacketRing, fanout_members
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.capture.source import open_source
from mirrorckpt.parser.encap import split_walk
from mirrorckpt.parser.roce.split import flow_ports, worker_of
from mirrorckpt.tools.generator.encap import EncapOptions, Encapsulator
from mirrorckpt.tools.testbed.netns import FrameSender, Topology

pytestmark = pytest.mark.root

JUMBO = FLOWCHECK / "iter_40000_p2p_iter10_2.pcapng"  # real RoCEv2, 1634 frames up to 4190 bytes
SMALL = FLOWCHECK / "rdma32.pcapng"  # 175 frames, ARP/LLDP/IPv4/IPv6


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.fail("live fanout tests need root (namespaces, AF_PACKET); CI runs them as root")


@pytest.fixture(scope="module")
def port():
    """(monitor, sender): capture on monitor.ifname in monitor.netns, inject with sender."""
    if os.geteuid() != 0:
        pytest.fail("live fanout tests need root (namespaces, AF_PACKET); CI runs them as root")
    with Topology(hosts=1, monitors=1, mtu=9000) as t:
        m = t.monitors[0]
        with FrameSender(m.peer) as sender:
            yield m, sender


# -- frames -------------------------------------------------------------------------------

MACS = bytes.fromhex("02aabbccddee021122334455")


def eth(etype: int, payload: bytes, tags: tuple[int, ...] = ()) -> bytes:
    head = MACS + b"".join(struct.pack(">HH", t, 0x0064 + i) for i, t in enumerate(tags))
    return head + struct.pack(">H", etype) + payload


def ipv4(proto: int, payload: bytes, options: bytes = b"", ihl: int | None = None) -> bytes:
    ihl = 5 + len(options) // 4 if ihl is None else ihl
    head = struct.pack(">BBHHHBBH4s4s", 0x40 | ihl, 0, 20 + len(options) + len(payload), 1, 0,
                       64, proto, 0, bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    return head + options + payload


def ipv6(nxt: int, payload: bytes) -> bytes:
    return struct.pack(">IHBB16s16s", 0x60000000, len(payload), nxt, 64, b"\xfd" + bytes(15),
                       b"\xfd" + bytes(14) + b"\x02") + payload


def udp(sport: int, dport: int = 4791, body: bytes = bytes(40)) -> bytes:
    return struct.pack(">HHHH", sport, dport, 8 + len(body), 0) + body


def built_frames() -> list[bytes]:
    rng = np.random.default_rng(7)
    ports = [int(p) for p in rng.integers(0, 65536, 96)] + [0, 1, 2, 3, 4, 5, 6, 7, 65535, 49152]
    f = []
    for i, sp in enumerate(ports):
        f.append(eth(0x0800, ipv4(17, udp(sp))))  # RoCEv2 over IPv4
        f.append(eth(0x86DD, ipv6(17, udp(sp))))  # over IPv6
        opts = bytes([1]) * (4 * (1 + i % 10))  # 1..10 words of NOP options: IHL 6..15
        f.append(eth(0x0800, ipv4(17, udp(sp), options=opts)))
        tags = [(0x8100,), (0x88A8, 0x8100), (0x8100, 0x8100)][i % 3]
        f.append(eth(0x0800, ipv4(17, udp(sp)), tags))  # the kernel keeps the outer tag apart
        f.append(eth(0x86DD, ipv6(17, udp(sp)), tags[:1]))
        f.append(eth(0x0800, ipv4(17, udp(sp)), (0x8100, 0x88A8, 0x8100)))  # 3 tags: not read
        f.append(eth(0x0800, ipv4(6, udp(sp))))  # TCP (a header that looks like UDP's)
        f.append(eth(0x86DD, ipv6(6, udp(sp))))
        f.append(eth(0x0800, ipv4(17, udp(sp), ihl=4)))  # IHL below 5
        f.append(eth(0x0806, bytes(28)))  # ARP
        f.append(eth(0x88CC, bytes(30)))  # LLDP
        f.append(eth(0x0800, ipv4(17, udp(sp)))[:14 + 20 + 1])  # cut inside the source port
        f.append(eth(0x0800, ipv4(17, udp(sp)))[:14 + 10])  # cut inside the IP header
        f.append(eth(0x0800, ipv4(17, udp(sp), options=opts))[:14 + 20 + len(opts) + 1])
        f.append(eth(0x86DD, ipv6(17, udp(sp)))[:14 + 41])
        f.append(eth(0x0800, ipv4(17, udp(sp)), (0x8100,))[:18 + 21])
        f.append(MACS + b"\x08\x00")  # IPv4's ethertype, nothing after it
    return f


def encapsulated_frames() -> list[bytes]:
    """RoCE frames of the mix inside every mirror encapsulation (IPv4 and IPv6 underlay, 0-2 tags
    outside and inside), and copies cut anywhere or with a header byte changed: the BPF walk must
    reach the inner flow's port exactly where the decoder's does, and give up where it gives up."""
    rng = np.random.default_rng(11)
    plain = FrameBatch.from_frames([eth(0x0800, ipv4(17, udp(sp))) for sp in (0xC001, 0xC0DE, 0xD00F)]
                                   + [eth(0x86DD, ipv6(17, udp(sp))) for sp in (0xC002, 0xE00D)])
    out = []
    kinds = ("erspan1", "erspan2", "erspan3", "gre", "gretap", "vxlan", "vendor:0x8949:22")
    for i, kind in enumerate(kinds):
        for v6 in (False, True):
            for outer, inner in (((), ()), ((7,), (0,)), ((7, 8), (3, 4)), ((), (5,))):
                opts = EncapOptions(kind=kind, ipv6=v6, outer_vlan=outer, inner_vlan=inner, platform=i % 2 == 0)
                w = Encapsulator(opts).wrap_batch(plain)
                out += [w.frame(k) for k in range(len(w))]
    damaged = []
    for f in out:
        # (at least 20 bytes: the kernel drops a tagged frame too short for its tag and EtherType)
        cut = bytearray(f[:rng.integers(20, len(f))])
        bent = bytearray(f)
        bent[rng.integers(12, min(len(f), 110))] = int(rng.choice([0x00, 0x08, 0x10, 0x11, 0x2F, 0x45, 0x65, 0x88,
                                                                   0xBE, 0x22, 0xEB, 0xFF]))
        damaged += [bytes(cut), bytes(bent)]
    return out + damaged


@pytest.fixture(scope="module")
def mix() -> FrameBatch:
    frames = built_frames() + encapsulated_frames()
    for path in (JUMBO, SMALL):
        src = read_all(path)
        frames += [src.frame(i) for i in range(len(src))]
    b = FrameBatch.from_frames(frames)
    sp = flow_ports(b)
    assert (sp >= 0).sum() > 1000 and (sp < 0).sum() > 1000  # both kinds, plenty of each
    return b


# -- helpers ------------------------------------------------------------------------------

def member(port, workers: int, worker: int, **opts) -> AfPacketRing:
    m, _ = port
    opts.setdefault("fanout_timeout", 5.0)
    opts.setdefault("fanout_walk", split_walk())
    return open_source(f"afpacket:{m.ifname}@{m.netns}", fanout_workers=workers,
                       fanout_worker=worker, block_size=1 << 20, block_count=16,
                       poll_timeout=0.05, **opts)


def drain(ring: AfPacketRing, quiet: float = 0.3) -> list[bytes]:
    """Frames (copied) until none came for `quiet` seconds."""
    got, empty = [], 0
    while empty * ring.poll_timeout < quiet:
        b = next(ring)
        empty = 0 if len(b) else empty + 1
        got += [b.frame(i) for i in range(len(b))]
    return got


def test_encapsulated_frames_go_by_the_inner_flows_port(mix):
    """The split reads the mirrored flow's port (both directions of a pair in one worker): every
    whole encapsulated frame of the mix goes by the port it was built with, not the outer one."""
    enc = FrameBatch.from_frames(encapsulated_frames())
    whole = len(enc) // 3
    assert set(flow_ports(enc.select(slice(0, whole))).tolist()) == {0xC001, 0xC0DE, 0xD00F, 0xC002, 0xE00D}


def shares(batch: FrameBatch, workers: int) -> list[list[bytes]]:
    w = worker_of(batch, workers)
    return [[batch.frame(i) for i in np.flatnonzero(w == k)] for k in range(workers)]


def inject(port, batch: FrameBatch) -> None:
    assert port[1].send(batch) == len(batch)


def close_all(rings) -> None:
    for r in rings:
        r.close()


# -- the split ----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [2, 3])
def test_each_member_receives_exactly_its_share(port, mix, workers):
    rings = [member(port, workers, k) for k in range(workers)]
    try:
        assert rings[0].wait_fanout(1.0) and rings[0].fanout_members() == list(range(workers))
        assert rings[0].fanout_group == rings[-1].fanout_group  # default: the interface index
        inject(port, mix)
        got = [drain(r) for r in rings]
        stats = [r.stats() for r in rings]
    finally:
        close_all(rings)
    want = shares(mix, workers)
    assert all(len(w) > 100 for w in want)
    for k in range(workers):
        assert got[k] == want[k], f"worker {k}: {len(got[k])} frames, {len(want[k])} wanted"
        assert stats[k].kernel_packets == len(want[k]) and stats[k].kernel_drops == 0
    assert stats[0].vlan_restored > 0  # tagged frames came through, tags back in place


def test_members_may_open_in_any_order(port, mix):
    """Workers started together open in any order: each waits for the ones before it, so the
    kernel's member slots are the worker numbers whatever the timing."""
    rings: dict[int, AfPacketRing] = {}
    errors = []

    def open_one(k):
        try:
            rings[k] = member(port, 3, k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(k,)) for k in (2, 1)]
    for t in threads:
        t.start()
    threading.Event().wait(0.3)
    assert not rings and not errors  # 1 and 2 wait for 0
    open_one(0)
    for t in threads:
        t.join()
    try:
        assert not errors and sorted(rings) == [0, 1, 2]
        inject(port, mix)
        got = [drain(rings[k]) for k in range(3)]
    finally:
        close_all(rings.values())
    assert got == shares(mix, 3)


# -- before all have joined, and after one left -------------------------------------------

def test_until_all_joined_only_the_missing_workers_frames_are_missing(port, mix):
    """With 2 of 3 workers joined, the kernel reduces the program's worker (sport mod 3) mod
    2: worker 2's frames reach worker 0, whose socket filter drops them. Workers 0 and 1 still
    get exactly their shares (a program returning the bare port would lose some of theirs);
    once worker 2 joins, every frame is received."""
    want = shares(mix, 3)
    rings = [member(port, 3, 0), member(port, 3, 1)]
    try:
        assert rings[1].fanout_members() == [0, 1] and not rings[1].wait_fanout(0.1)
        inject(port, mix)
        got = [drain(r) for r in rings]
        assert got == want[:2]
        rings.append(member(port, 3, 2))
        assert rings[0].wait_fanout(1.0)
        inject(port, mix)
        assert [drain(r) for r in rings] == want
    finally:
        close_all(rings)


def test_worker_out_of_turn_waits_then_says_whom_it_waited_for(port):
    with pytest.raises(CaptureError, match=r"worker 2 waited 0.2 s for workers \[0, 1\]"):
        member(port, 3, 2, fanout_timeout=0.2)
    first = member(port, 3, 0)
    try:
        with pytest.raises(CaptureError, match=r"worker 2 waited 0.2 s for workers \[1\]"):
            member(port, 3, 2, fanout_timeout=0.2)
        with pytest.raises(CaptureError, match="worker 0 is already capturing"):
            member(port, 3, 0)
        with pytest.raises(CaptureError, match="has 3 workers, not 2"):
            member(port, 2, 1)
    finally:
        first.close()
    m, _ = port
    assert fanout_members(first.fanout_group, m.netns) == []  # a closed member is gone


def test_a_restarted_last_worker_takes_its_place_again(port, mix):
    """The last worker may restart (its slot is the last); another one may not: the kernel
    gave its slot to the last member, and its restart says so instead of joining wrongly."""
    rings = [member(port, 2, 0), member(port, 2, 1)]
    try:
        rings.pop().close()
        rings.append(member(port, 2, 1))
        inject(port, mix)
        assert [drain(r) for r in rings] == shares(mix, 2)
        rings.pop(0).close()
        with pytest.raises(CaptureError, match=r"workers \[1\] are still members"):
            member(port, 2, 0, fanout_timeout=0.2)
    finally:
        close_all(rings)


def test_a_full_ring_drops_and_counts_its_own_frames_only(port, mix):
    """Rollover is off: worker 1's ring, too small and not read during the injection, drops
    and counts; its frames do not move to worker 0, which receives exactly its share."""
    m, _ = port
    rings = [member(port, 2, 0)]
    small = open_source(f"afpacket:{m.ifname}@{m.netns}", fanout_workers=2, fanout_worker=1,
                        block_size=1 << 16, block_count=2, max_blocks=1, poll_timeout=0.05,
                        fanout_walk=split_walk())
    try:
        inject(port, mix)
        got0 = drain(rings[0])
        got1 = drain(small)
        s1 = small.stats()
    finally:
        close_all([*rings, small])
    want = shares(mix, 2)
    assert got0 == want[0]
    assert s1.kernel_drops > 0 and len(got1) + s1.kernel_drops == len(want[1])
    assert set(got1) <= set(want[1])


def test_frames_sent_on_the_port_are_not_captured(port, mix):
    """ignore_outgoing holds for the group too (PACKET_FANOUT_FLAG_IGNORE_OUTGOING: once the
    socket joined, the group's hook receives, not its own)."""
    m, _ = port
    rings = [member(port, 2, k) for k in range(2)]
    try:
        with FrameSender(m.ifname, netns=m.netns, qdisc_bypass=False) as out:  # seen by taps
            assert out.send(mix) == len(mix)
        assert [drain(r) for r in rings] == [[], []]
    finally:
        close_all(rings)


def test_fanout_options_are_checked(port):
    m, _ = port
    spec = f"afpacket:{m.ifname}@{m.netns}"
    for opts, msg in [({"fanout_workers": 2, "fanout_worker": 2}, "fanout_worker must be 0..1"),
                      ({"fanout_workers": 0}, "fanout_workers must be 1..256"),
                      ({"fanout_workers": True}, "fanout_workers must be an integer"),
                      ({"fanout_workers": 2, "fanout_group": 70000}, "fanout_group must be 0..65535"),
                      ({"fanout_workers": 2, "fanout_walk": None}, "fanout needs fanout_walk")]:
        with pytest.raises(ValueError, match=msg):
            open_source(spec, **opts)
