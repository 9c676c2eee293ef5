"""A remote mirror in network namespaces: a switch that wraps what arrives on a port into a tunnel,
and the appliance's port at the tunnel's far end, on an underlay link.

    root namespace           namespace P_sw                                namespace P_col
    Phin ═══ veth ═══ Phinx ──tc mirred──► Pvx (vxlan) ─┐
                       (raw IP protocol 47 socket) ──────┴─► Pu0 ═══ veth (underlay) ═══ Pu1
                                                            10.S.1.1 / fdS::1           10.S.1.2 / fdS::2

Frames injected into ``Phin`` (``netns.FrameSender``) arrive on the switch's port ``Phinx``, whose
tc ingress hook copies them into a Linux ``vxlan`` netdev (``vxlan()``): the kernel writes the
VXLAN, UDP, IP and Ethernet headers. Kernels without gre/gretap/erspan netdevs still have raw IP
sockets: ``send_gre`` sends GRE/ERSPAN packets whose GRE and ERSPAN headers the caller wrote
(tools.generator.encap, Linux include/net/erspan.h's layout) from the switch's namespace, the
kernel writing the outer IP and Ethernet headers. ``record`` captures the underlay's far end
with the project's AF_PACKET ring; ``lossy`` drops a share of the underlay's packets at random
(netem, or on a kernel without netem a classic BPF ``ld rand`` classifier whose matches tc
redirects into a dead link). The collector namespace holds a raw GRE socket and a UDP socket on
the VXLAN port, so it answers the tunnel with no ICMP. Static neighbours: no ARP or ND on the
underlay. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import zlib

from mirrorckpt.capture.afpacket import in_netns
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.source import open_source
from mirrorckpt.parser.headers import IPPROTO_GRE, VXLAN_PORT
from mirrorckpt.tools.testbed.netns import TopologyError, _mac, _run, require_root

_SKF_AD_RANDOM = 0xFFFFF000 + 56  # classic BPF: `ld rand`
_RET_MATCH, _RET_NONE = 0xFFFFFFFF, 0


class TunnelRig:
    def __init__(self, underlay: str = "ipv4", prefix: str | None = None, mtu: int = 9000):
        if underlay not in ("ipv4", "ipv6"):
            raise ValueError(f"underlay must be ipv4 or ipv6, not {underlay!r}")
        self.v6 = underlay == "ipv6"
        self.prefix = prefix or f"mt{os.getpid()}"
        self.mtu = mtu
        p = self.prefix
        self.sw, self.col = f"{p}_sw", f"{p}_col"
        self.inject, self.port, self.u0, self.u1 = f"{p}hin", f"{p}hinx", f"{p}u0", f"{p}u1"
        net = 16 + zlib.crc32(p.encode()) % 200
        self.switch_ip = f"fd{net:02x}::1" if self.v6 else f"10.{net}.1.1"
        self.collector_ip = f"fd{net:02x}::2" if self.v6 else f"10.{net}.1.2"
        self.loss_kind: str | None = None
        self._absorb: list[socket.socket] = []
        self._up = False

    def __enter__(self) -> TunnelRig:
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def ns(self, where: str, *argv: str, check: bool = True):
        return _run(["ip", "netns", "exec", where, *map(str, argv)], check=check)

    def setup(self) -> TunnelRig:
        require_root()
        _cleanup_stale()
        self.teardown()
        self._up = True
        try:
            for ns in (self.sw, self.col):
                _run(["ip", "netns", "add", ns])
                self.ns(ns, "ip", "link", "set", "lo", "up")
            _run(["ip", "link", "add", self.inject, "mtu", str(self.mtu), "type", "veth", "peer", "name", self.port,
                  "mtu", str(self.mtu), "netns", self.sw])
            _run(["ip", "link", "add", self.u0, "mtu", str(self.mtu), "netns", self.sw, "type", "veth", "peer",
                  "name", self.u1, "mtu", str(self.mtu), "netns", self.col])
            self._quiet(None, self.inject)
            self._quiet(self.sw, self.port)
            macs = {self.u0: _mac(self.prefix, 2, 0), self.u1: _mac(self.prefix, 2, 1)}
            for ns, dev, mine, peer, peer_dev in ((self.sw, self.u0, self.switch_ip, self.collector_ip, self.u1),
                                                  (self.col, self.u1, self.collector_ip, self.switch_ip, self.u0)):
                self._quiet(ns, dev)
                self.ns(ns, "ip", "link", "set", dev, "address", macs[dev])
                if self.v6:
                    self.ns(ns, "ip", "-6", "addr", "add", f"{mine}/64", "dev", dev, "nodad")
                else:
                    self.ns(ns, "ip", "addr", "add", f"{mine}/24", "dev", dev)
                self.ns(ns, "ip", "link", "set", dev, "up")
                self.ns(ns, "ip", "neigh", "replace", peer, "lladdr", macs[peer_dev], "dev", dev, "nud", "permanent")
            _run(["ip", "link", "set", self.inject, "up"])
            self.ns(self.sw, "ip", "link", "set", self.port, "up")
            fam = socket.AF_INET6 if self.v6 else socket.AF_INET
            with in_netns(self.col):  # the tunnel's end takes what arrives: no ICMP back
                raw = socket.socket(fam, socket.SOCK_RAW, IPPROTO_GRE)
                udp = socket.socket(fam, socket.SOCK_DGRAM)
                udp.bind(("::" if self.v6 else "0.0.0.0", VXLAN_PORT))
            self._absorb = [raw, udp]
        except BaseException:
            self.teardown()
            raise
        return self

    def _quiet(self, ns: str | None, dev: str) -> None:
        """No IPv6 chatter on an IPv4 rig and no router solicitations on either; no offloads."""
        run = (lambda *a, **k: self.ns(ns, *a, **k)) if ns else (lambda *a, **k: _run(list(a), **k))
        if not self.v6 or dev in (self.inject, self.port) or dev.endswith("vx"):
            run("sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1")
        else:
            run("sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.router_solicitations=0", check=False)
        run("ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off", check=False)

    def teardown(self) -> None:
        for s in self._absorb:
            s.close()
        self._absorb = []
        for ns in (self.sw, self.col):
            _run(["ip", "netns", "del", ns], check=False)
        _run(["ip", "link", "del", self.inject], check=False)
        self._up = False

    # -- the switch's mirrors ---------------------------------------------------------------

    def vxlan(self, vni: int = 42, port: int = VXLAN_PORT) -> str:
        """A vxlan netdev on the underlay, and the port's arriving frames copied into it."""
        dev = f"{self.prefix}vx"
        self.ns(self.sw, "ip", "link", "add", dev, "type", "vxlan", "id", vni, "local", self.switch_ip, "remote",
                self.collector_ip, "dstport", port, "dev", self.u0, "nolearning")
        self._quiet(self.sw, dev)
        self.ns(self.sw, "ip", "link", "set", dev, "up")
        self.ns(self.sw, "tc", "qdisc", "add", "dev", self.port, "clsact")
        self.ns(self.sw, "tc", "filter", "add", "dev", self.port, "ingress", "protocol", "all", "prio", "1", "u32",
                "match", "u32", "0", "0", "action", "mirred", "egress", "mirror", "dev", dev)
        return dev

    def send_gre(self, payloads: FrameBatch, pause_every: int = 256, pause_s: float = 0.002) -> int:
        """Sends each payload (a GRE header and what follows) from the switch's namespace to the
        collector through a raw IP protocol 47 socket; a short pause every ``pause_every`` packets
        keeps the veth's backlog from overflowing. Returns the packets sent."""
        fam = socket.AF_INET6 if self.v6 else socket.AF_INET
        with in_netns(self.sw):
            s = socket.socket(fam, socket.SOCK_RAW, IPPROTO_GRE)
        try:
            dst = (self.collector_ip, 0)
            for i in range(len(payloads)):
                s.sendto(payloads.frame(i), dst)
                if pause_every and (i + 1) % pause_every == 0:
                    time.sleep(pause_s)
        finally:
            s.close()
        return len(payloads)

    def lossy(self, percent: float) -> str:
        """Drops ``percent`` % of what leaves the switch on the underlay, at random: netem where the
        kernel has it, else a classic BPF classifier (``ld rand``) on the underlay's egress whose
        matches tc redirects into a veth whose peer is down. Returns which ("netem", "bpf")."""
        r = self.ns(self.sw, "tc", "qdisc", "add", "dev", self.u0, "root", "netem", "loss", f"{percent}%",
                    check=False)
        if r.returncode == 0:
            self.loss_kind = "netem"
            return self.loss_kind
        if "unknown" not in (r.stderr or "").lower():
            raise TopologyError(f"tc netem: {r.stderr.strip()}")
        dead, peer = f"{self.prefix}bh0", f"{self.prefix}bh1"
        self.ns(self.sw, "ip", "link", "add", dead, "type", "veth", "peer", "name", peer)
        self._quiet(self.sw, dead)
        self.ns(self.sw, "ip", "link", "set", dead, "up")  # its peer stays down: whatever goes in is lost
        threshold = int((1 << 32) * (1 - percent / 100.0))
        code = [(0x20, 0, 0, _SKF_AD_RANDOM), (0x35, 0, 1, threshold), (0x06, 0, 0, _RET_MATCH),
                (0x06, 0, 0, _RET_NONE)]
        bytecode = f"{len(code)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in code)
        self.ns(self.sw, "tc", "qdisc", "add", "dev", self.u0, "clsact")
        self.ns(self.sw, "tc", "filter", "add", "dev", self.u0, "egress", "protocol", "all", "prio", "1", "bpf",
                "bytecode", bytecode, "action", "mirred", "egress", "redirect", "dev", dead)
        self.loss_kind = "bpf"
        return self.loss_kind

    # -- the appliance's port -------------------------------------------------------------------

    @property
    def source(self) -> str:
        """The underlay's far end as a capture source spec (AF_PACKET, in the collector's namespace)."""
        return f"afpacket:{self.u1}@{self.col}"

    @contextlib.contextmanager
    def record(self, idle_s: float = 1.0):
        """Captures the underlay's far end while the block runs, and until it went quiet for
        ``idle_s`` after: ``frames`` (a list, filled once the block is left) of bytes."""
        frames: list[bytes] = []
        ts: list[int] = []
        ring = open_source(self.source, idle_timeout=idle_s, block_size=1 << 20, block_count=64, poll_timeout=0.05)
        stop = threading.Event()
        errors: list[BaseException] = []

        def drain():
            try:
                for b in ring:
                    frames.extend(b.frame(i) for i in range(len(b)))
                    ts.extend(b.ts_ns.tolist())
                    if stop.is_set() and not len(b):
                        break
            except BaseException as e:  # noqa: BLE001 - said where the recording is read
                errors.append(e)

        t = threading.Thread(target=drain, name="tunnel-record", daemon=True)
        t.start()
        rec = _Recording(frames, ts)
        try:
            yield rec
        finally:
            time.sleep(idle_s)
            stop.set()
            t.join(timeout=30)
            ring.close()
        if errors:
            raise errors[0]


class _Recording:
    def __init__(self, frames: list[bytes], ts: list[int]):
        self.frames, self.ts = frames, ts

    def batch(self) -> FrameBatch:
        """The frames recorded, with the kernel's receive times."""
        return FrameBatch.from_frames(self.frames, "tunnel", ts_ns=self.ts)


def _cleanup_stale() -> None:
    """Rigs of processes that are gone (a killed test run)."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return
    for ns in names:
        head = ns.partition("_")[0]
        if head.startswith("mt") and head[2:].isdigit() and not os.path.exists(f"/proc/{head[2:]}"):
            _run(["ip", "netns", "del", ns], check=False)
            _run(["ip", "link", "del", f"{head}hin"], check=False)
