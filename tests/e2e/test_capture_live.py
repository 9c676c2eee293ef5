"""Live capture backends on real frames: AF_PACKET TPACKET_V3 behind a tc mirror, DPDK net_pcap
on real capture files, DPDK net_af_packet on a veth, and the DPDK start-up failure paths.

Frames come from the real captures in ../shared, read with capture.pcapfile and injected with
a raw AF_PACKET socket from a host namespace (tools.netns). Everything needs root, as CI has;
without root these tests fail and say so (marker `root`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from common import FLOWCHECK
from mirrorckpt.capture import _dpdk_abi, _dpdk_lib
from mirrorckpt.capture.afpacket import AfPacketRing
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.capture.dpdk import DpdkAbiError, DpdkMissingError, DpdkPort
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.capture.source import open_source
from mirrorckpt.tools.testbed.netns import Topology, send_frames

pytestmark = pytest.mark.root

JUMBO = FLOWCHECK / "iter_40000_p2p_iter10_2.pcapng"  # 1634 frames, 66..4190 bytes
SMALL = FLOWCHECK / "rdma32.pcapng"  # 175 frames, ARP/LLDP/IPv4/IPv6


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.fail("live capture tests need root (namespaces, tc, AF_PACKET, DPDK EAL); "
                    "CI runs them as root")


@pytest.fixture
def topo():
    with Topology(hosts=2, mtu=9000) as t:
        yield t


def frames_of(batch: FrameBatch) -> list[bytes]:
    return [batch.frame(i) for i in range(len(batch))]


def drain(source, limit: int) -> tuple[list[bytes], list[np.ndarray]]:
    """Frames (copied: batches are valid until the next one) and timestamps until the
    source goes idle or `limit` frames arrived."""
    got, ts = [], []
    for b in source:
        got += frames_of(b)
        ts.append(b.ts_ns.copy())
        if len(got) >= limit:
            break
    return got, ts


def monitor_ring(topo, **opts) -> AfPacketRing:
    m = topo.monitors[0]
    opts.setdefault("idle_timeout", 0.5)
    return open_source(f"afpacket:{m.ifname}", netns=m.netns, **opts)


# -- AF_PACKET ----------------------------------------------------------------------------

def test_afpacket_receives_every_mirrored_frame_byte_identical(topo):
    src = read_all(JUMBO)
    topo.mirror(0, "both")
    ring = monitor_ring(topo, block_size=1 << 20, block_count=16)
    assert isinstance(ring, AfPacketRing)
    try:
        h = topo.hosts[0]
        assert send_frames(h.ifname, src, netns=h.netns) == len(src)
        got, ts = drain(ring, len(src))
        stats = ring.stats()
    finally:
        ring.close()
    assert got == frames_of(src)
    ts = np.concatenate(ts)
    assert (np.diff(ts) >= 0).all() and abs(int(ts[0]) / 1e9 - __import__("time").time()) < 60
    assert stats.frames == len(src) and stats.bytes == src.nbytes
    assert stats.kernel_packets == len(src) and stats.kernel_drops == 0
    assert stats.truncated == 0 and stats.vlan_restored == 0


def test_afpacket_spec_names_the_namespace(topo):
    """"afpacket:IFACE@NETNS" (what a [[mirror]] source can say) captures in that namespace."""
    src = read_all(JUMBO)
    topo.mirror(0, "both")
    m = topo.monitors[0]
    ring = open_source(f"afpacket:{m.ifname}@{m.netns}", idle_timeout=0.5)
    try:
        assert ring.name == f"afpacket:{m.ifname}@{m.netns}"
        h = topo.hosts[0]
        assert send_frames(h.ifname, src, netns=h.netns) == len(src)
        got, _ = drain(ring, len(src))
    finally:
        ring.close()
    assert got == frames_of(src)
    for bad in ("afpacket:@" + m.netns, "afpacket:" + m.ifname + "@"):
        with pytest.raises(CaptureError, match="expected IFACE@NETNS"):
            open_source(bad)


def test_afpacket_puts_vlan_tags_back(topo):
    """The kernel strips the outer tag into the packet header; the walk restores it."""
    base = frames_of(read_all(SMALL))
    tags = [bytes.fromhex("8100a07b"), bytes.fromhex("88a800648100a07b"), bytes.fromhex("81000000")]
    tagged = [f[:12] + tags[i % 3] + f[12:] for i, f in enumerate(base)]
    topo.mirror(0, "ingress")
    ring = monitor_ring(topo, block_size=1 << 16, block_count=8)
    try:
        h = topo.hosts[0]
        send_frames(h.ifname, FrameBatch.from_frames(tagged), netns=h.netns)
        got, _ = drain(ring, len(tagged))
        stats = ring.stats()
    finally:
        ring.close()
    assert got == tagged
    assert stats.vlan_restored == len(tagged) and stats.vlan_left_out == 0


def test_afpacket_counts_kernel_drops_when_the_ring_is_full(topo):
    """A 4 x 64 KiB ring not read during a 2 MB injection: what does not fit is dropped and
    counted; delivered + dropped is everything the socket saw."""
    src = read_all(JUMBO)
    topo.mirror(0, "ingress")
    ring = monitor_ring(topo, block_size=1 << 16, block_count=4, max_blocks=3)
    try:
        h = topo.hosts[0]
        send_frames(h.ifname, src, netns=h.netns)
        got, _ = drain(ring, len(src))
        stats = ring.stats()
    finally:
        ring.close()
    assert stats.kernel_drops > 0 and stats.kernel_freezes > 0
    assert stats.kernel_packets == len(src)
    assert len(got) + stats.kernel_drops == len(src)
    # Whatever arrived is intact and in order: a subsequence of the injected frames.
    want = iter(frames_of(src))
    assert all(any(g == w for w in want) for g in got)


def test_afpacket_idle_batches_and_batch_lifetime(topo):
    ring = monitor_ring(topo, block_size=1 << 16, block_count=4, poll_timeout=0.05,
                        idle_timeout=0.3)
    try:
        first = next(ring)
        assert len(first) == 0  # nothing sent: an empty batch after poll_timeout
        assert sum(1 for _ in ring) >= 1  # then more empty ones until idle_timeout
        with pytest.raises(StopIteration):
            next(ring)
    finally:
        ring.close()


def test_afpacket_names_a_missing_interface():
    with pytest.raises(CaptureError, match="no network interface named 'mck_nope0'"):
        open_source("afpacket:mck_nope0")
    with pytest.raises(ValueError, match="block_size"):
        AfPacketRing("lo", block_size=1000)


# -- DPDK ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [JUMBO, SMALL], ids=["jumbo", "small"])
def test_dpdk_net_pcap_frames_match_the_file_reader(path):
    src = read_all(path)
    affinity = os.sched_getaffinity(0)
    port = open_source(f"dpdk:net_pcap0,rx_pcap={path}", idle_timeout=0.3, batch_frames=512)
    assert isinstance(port, DpdkPort)
    try:
        full = port.pool_free()
        got, ts = drain(port, len(src))
        next(port, None)  # hands the last batch back
        stats = port.stats()
        assert port.pool_free() == full  # every mbuf came back
    finally:
        port.close()
    assert os.sched_getaffinity(0) == affinity  # the EAL's pinning was undone
    assert got == frames_of(src)
    # net_pcap fills the RX timestamp field from the file, in microseconds.
    assert (np.concatenate(ts) == src.ts_ns // 1000 * 1000).all()
    assert stats["frames"] == stats["ipackets"] == len(src)
    assert stats["ibytes"] == src.nbytes and stats["multiseg"] == 0
    assert stats["imissed"] == 0 and stats["ierrors"] == 0


def test_dpdk_chained_frames_are_marked_truncated():
    """With a 2048-byte data room the 4190-byte frames span several mbufs: the batch holds
    the first segment and says so (caplen < wirelen)."""
    src = read_all(JUMBO)
    port = open_source(f"dpdk:net_pcap0,rx_pcap={JUMBO}", idle_timeout=0.3, data_room=2048)
    try:
        rows = []
        for b in port:
            rows += [(b.frame(i), int(b.wirelen[i])) for i in range(len(b))]
        stats = port.stats()
    finally:
        port.close()
    long = src.caplen > 2048
    assert [w for _, w in rows] == src.caplen.tolist()
    assert [len(f) for f, _ in rows] == np.minimum(src.caplen, 2048).tolist()
    assert all(f == s[:len(f)] for (f, _), s in zip(rows, frames_of(src)))
    assert stats["multiseg"] == int(long.sum()) > 0


def test_dpdk_net_af_packet_receives_injected_frames(topo):
    src = read_all(JUMBO)
    topo.mirror(0, "ingress")
    m, h = topo.monitors[0], topo.hosts[0]
    port = open_source(f"dpdk:net_af_packet0,iface={m.ifname},framecnt=4096,framesz=8192,"
                       "blocksz=65536", netns=m.netns, idle_timeout=0.5)
    try:
        assert port.driver == "net_af_packet"
        send_frames(h.ifname, src, netns=h.netns)
        got, _ = drain(port, len(src))
        stats = port.stats()
    finally:
        port.close()
    assert got == frames_of(src)
    assert stats["ipackets"] == len(src) and stats["frames"] == len(src)


def test_dpdk_eal_arguments_vdev_and_pinning():
    """In a fresh process: a device made by --vdev in the EAL arguments is found by name,
    `-l 0` without restore_affinity leaves the thread pinned to CPU 0 (the EAL's doing), and
    a second init with other arguments is refused."""
    script = f"""
import os
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.dpdk import DEFAULT_EAL_ARGS, eal_init, open_port
args = [*DEFAULT_EAL_ARGS, f"--file-prefix=mckvdev{{os.getpid()}}", "-l", "0",
        "--vdev=net_pcap7,rx_pcap={SMALL}"]
port = open_port("net_pcap7", eal_args=args, idle_timeout=0.3, restore_affinity=False)
frames = sum(len(b) for b in port)
pinned = sorted(os.sched_getaffinity(0))
try:
    eal_init(["--no-huge"])
    again = "accepted"
except CaptureError:
    again = "refused"
port.close()
print(frames, pinned, again)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == f"{len(read_all(SMALL))} [0] refused"


def test_dpdk_names_a_missing_interface_and_file():
    with pytest.raises(CaptureError, match="no network interface named 'mck_nope1'"):
        open_source("dpdk:net_af_packet0,iface=mck_nope1")
    with pytest.raises(CaptureError, match="does not exist"):
        open_source("dpdk:net_pcap0,rx_pcap=/nonexistent/x.pcap")


def test_dpdk_abi_mismatch_fails_at_start_up(monkeypatch):
    expr, right = _dpdk_abi.EXPECTED["mbuf.data_off"]
    assert _dpdk_abi.check()["mbuf.data_off"] == right  # the real layout passes
    monkeypatch.setitem(_dpdk_abi.EXPECTED, "mbuf.data_off", (expr, right + 2))
    with pytest.raises(DpdkAbiError, match=rf"mbuf.data_off: the code expects {right + 2}, "
                                           rf"the installed headers say {right}"):
        open_source(f"dpdk:net_pcap0,rx_pcap={SMALL}")


def test_dpdk_abi_check_compiles_the_probe_and_caches_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MIRRORCKPT_CACHE_DIR", str(tmp_path))
    found = _dpdk_abi.check(library_version=_dpdk_lib.load().version)
    assert len(list(tmp_path.rglob("dpdk-abi-*.json"))) == 1
    which = _dpdk_abi.shutil.which
    monkeypatch.setattr(_dpdk_abi.shutil, "which",  # no compiler from now on
                        lambda name: None if name in ("gcc", "cc") else which(name))
    assert _dpdk_abi.check() == found  # answered from the cache
    with pytest.raises(DpdkAbiError, match="running DPDK library is 'DPDK 23.11.0'"):
        _dpdk_abi.check(library_version="DPDK 23.11.0")
    monkeypatch.setenv("MIRRORCKPT_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(DpdkAbiError, match="needs gcc"):
        _dpdk_abi.check()


def test_dpdk_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_dpdk_lib, "LIBRARIES", ("librte_mck_missing.so.23",))
    with pytest.raises(DpdkMissingError, match=r"cannot load librte_mck_missing\.so\.23.*"
                                               r"apt-get install librte-eal23"):
        open_source(f"dpdk:net_pcap0,rx_pcap={SMALL}")
