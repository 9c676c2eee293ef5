"""Test topologies in Linux network namespaces: hosts on a bridge, monitor ports, tc mirroring.

A `Topology` stands in for a switch with SPAN ports, built from root-only kernel pieces:

    root namespace                         namespace P_h0          namespace P_mon0
    bridge Pbr ── Ph0p ═══ veth ═══════════ Ph0 (10.R.0.1)
               ── Ph1p ═══ veth ═══ Ph1 (namespace P_h1, 10.R.0.2)
    (not on the bridge) Pm0p ═══ veth ════════════════════════════ Pm0 (promiscuous sink)

`mirror(port, direction)` copies a bridge port's traffic to a monitor with tc (clsact qdisc,
u32 match-all, `mirred egress mirror`; this kernel has neither the matchall classifier nor
the prio qdisc). Directions use the tc hook names on the bridge port ``Ph<i>p``:
"ingress" is what host i sends, "egress" what it receives, "both" is both.

    with Topology(hosts=2, mtu=9000) as topo:       # torn down on exit, also on error
        topo.mirror(0, "both")
        mon = topo.monitors[0]
        ring = open_ring(mon.ifname, netns=mon.netns)
        server = topo.popen(topo.hosts[1], sys.executable, "-m", "http.server", "-b",
                            topo.hosts[1].ip)
        topo.run(topo.hosts[0], "curl", f"http://{topo.hosts[1].ip}:8000/")
        with in_netns(mon.netns): ...                # sockets made here live in P_mon0

Hosts get fixed MACs and static ARP (and, with ``ipv6=True``, static ND) entries, so no
resolution traffic appears on the mirrors; with ``ipv6=False`` IPv6 is disabled on every
interface for the same reason. Segmentation/checksum offloads are off by default so mirrored
TCP frames look like wire frames (no 64 KiB GSO super-frames, no partial checksums).

`FrameSender` / `send_frames` inject frames through a raw AF_PACKET socket with ``sendmmsg``
(no per-frame Python call), from any namespace. Everything needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import time
import zlib
from dataclasses import dataclass

import numpy as np
from mirrorckpt.capture.afpacket import in_netns  # re-exported: enter a namespace (thread)
from mirrorckpt.capture.batch import FrameBatch

__all__ = ["FrameSender", "Host", "Monitor", "Topology", "TopologyError", "cleanup_prefix",
           "cleanup_stale", "in_netns", "send_frames", "unique_prefix"]

_SOL_PACKET = 263
_PACKET_QDISC_BYPASS = 20
_SENDMMSG_MAX = 1024  # UIO_MAXIOV: the kernel's cap on messages per sendmmsg call


class TopologyError(RuntimeError):
    """A topology command failed; the message holds the command and its stderr."""


@dataclass
class Host:
    index: int
    netns: str  # namespace holding the host
    ifname: str  # the host's interface (inside netns)
    port: str  # its bridge port (root namespace): where mirrors attach
    mac: str
    ip: str
    ip6: str | None = None


@dataclass
class Monitor:
    index: int
    netns: str
    ifname: str  # capture here (inside netns)
    peer: str  # root-namespace end that mirrors write into


class Topology:
    """Hosts h0..hN-1 on a bridge plus monitor ports; see the module docstring.

    `prefix` names everything (namespaces ``P_h<i>``/``P_mon<j>``, interfaces ``P...``) and
    has at most 10 characters; by default it is "mk" + this process's pid. Leftovers of an
    earlier run with the same prefix, or of default-prefix runs whose process is gone, are
    removed first."""

    def __init__(self, hosts: int = 2, monitors: int = 1, prefix: str | None = None,
                 mtu: int = 1500, ipv6: bool = False, offloads: bool = False, subnet: int | None = None):
        self.hosts_count, self.monitors_count = int(hosts), int(monitors)
        self.prefix = prefix or unique_prefix()
        if not (self.prefix.isalnum() and len(self.prefix) <= 10):
            raise ValueError(f"prefix {self.prefix!r}: up to 10 letters/digits (interface names "
                             "are limited to 15 characters)")
        if not 1 <= self.hosts_count <= 99 or not 0 <= self.monitors_count <= 9:
            raise ValueError("hosts must be 1..99 and monitors 0..9")
        self.mtu, self.ipv6, self.offloads = int(mtu), bool(ipv6), bool(offloads)
        # hosts in 10.SUBNET.0.0/24; by default one the prefix picks
        self.subnet = 16 + zlib.crc32(self.prefix.encode()) % 200 if subnet is None else int(subnet)
        if not 0 <= self.subnet <= 255:
            raise ValueError(f"subnet {subnet}: hosts are in 10.SUBNET.0.0/24, SUBNET 0..255")
        self.hosts: list[Host] = []
        self.monitors: list[Monitor] = []
        self._mirrors: set[tuple[str, str, str]] = set()  # (port, hook, monitor peer)
        self._clsact: set[str] = set()
        self._up = False

    # -- life cycle ---------------------------------------------------------------------

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def __enter__(self) -> Topology:
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> Topology:
        """Creates namespaces, bridge, veths, addresses and neighbour entries."""
        require_root()
        cleanup_stale()
        cleanup_prefix(self.prefix)
        self._up = True
        try:
            p = self.prefix
            # Without snooping the bridge sends no IGMP of its own: a live capture saw one of its
            # reports (all-snoopers, 224.0.0.106) on a mirrored port, a frame no host sent.
            _ip("link", "add", self.bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("link", "set", self.bridge, "mtu", str(self.mtu), "up")
            self._quiet(None, self.bridge)
            for i in range(self.hosts_count):
                h = Host(i, f"{p}_h{i}", f"{p}h{i}", f"{p}h{i}p", _mac(p, 0, i),
                         f"10.{self.subnet}.0.{i + 1}",
                         f"fd00:{self.subnet:x}::{i + 1:x}" if self.ipv6 else None)
                self._add_end(h.netns, h.ifname, h.port, h.mac)
                _ip("link", "set", h.port, "master", self.bridge)
                _ip("link", "set", h.port, "up")
                self.run(h, "ip", "addr", "add", f"{h.ip}/24", "dev", h.ifname)
                if h.ip6:
                    self.run(h, "ip", "-6", "addr", "add", f"{h.ip6}/64", "dev", h.ifname, "nodad")
                self.hosts.append(h)
            for h in self.hosts:
                for o in self.hosts:
                    if o is not h:
                        self.run(h, "ip", "neigh", "replace", o.ip, "lladdr", o.mac, "dev",
                                 h.ifname, "nud", "permanent")
                        if o.ip6:
                            self.run(h, "ip", "-6", "neigh", "replace", o.ip6, "lladdr", o.mac,
                                     "dev", h.ifname, "nud", "permanent")
            for j in range(self.monitors_count):
                m = Monitor(j, f"{p}_mon{j}", f"{p}m{j}", f"{p}m{j}p")
                self._add_end(m.netns, m.ifname, m.peer, _mac(p, 1, j))
                self.run(m.netns, "ip", "link", "set", m.ifname, "promisc", "on")
                _ip("link", "set", m.peer, "up")
                self.monitors.append(m)
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Removes everything this topology made; safe to call twice and after a failure."""
        if self._up:
            cleanup_prefix(self.prefix)
        self._up = False
        self.hosts, self.monitors = [], []
        self._mirrors, self._clsact = set(), set()

    def _add_end(self, netns: str, inner: str, outer: str, mac: str) -> None:
        """A namespace holding `inner`, veth-paired with `outer` in the root namespace."""
        _run(["ip", "netns", "add", netns])
        self.run(netns, "ip", "link", "set", "lo", "up")
        _ip("link", "add", outer, "mtu", str(self.mtu), "type", "veth", "peer", "name", inner,
            "mtu", str(self.mtu), "netns", netns)
        self.run(netns, "ip", "link", "set", inner, "address", mac)
        self._quiet(netns, inner)
        self._quiet(None, outer)
        self.run(netns, "ip", "link", "set", inner, "up")

    def _quiet(self, netns: str | None, ifname: str) -> None:
        """No IPv6 chatter (unless wanted) and, unless wanted, no offloads on an interface."""
        if not self.ipv6:
            self.run(netns, "sysctl", "-q", "-w", f"net.ipv6.conf.{ifname}.disable_ipv6=1")
        if not self.offloads and not ifname.endswith("br"):
            self.run(netns, "ethtool", "-K", ifname, "tso", "off", "gso", "off", "gro", "off",
                     "tx", "off", check=False)

    # -- mirroring ----------------------------------------------------------------------

    def mirror(self, port: int | str | Host, direction: str = "both", monitor: int = 0) -> None:
        """Copies bridge port traffic to monitor `monitor`: a host index, a Host, or any
        root-namespace interface name; direction "ingress" (sent by the host), "egress"
        (received by the host) or "both"."""
        dev = self._port(port)
        hooks = {"ingress": ("ingress",), "egress": ("egress",),
                 "both": ("ingress", "egress")}.get(direction)
        if hooks is None:
            raise ValueError(f"direction must be ingress, egress or both, not {direction!r}")
        dst = self.monitors[monitor].peer
        if dev not in self._clsact:
            _run(["tc", "qdisc", "add", "dev", dev, "clsact"])
            self._clsact.add(dev)
        for hook in hooks:
            key = (dev, hook, dst)
            if key in self._mirrors:
                continue
            _run(["tc", "filter", "add", "dev", dev, hook, "protocol", "all", "prio",
                  str(1 + len(self._mirrors)), "u32", "match", "u32", "0", "0",
                  "action", "mirred", "egress", "mirror", "dev", dst])
            self._mirrors.add(key)

    def _port(self, port) -> str:
        if isinstance(port, Host):
            return port.port
        if isinstance(port, int):
            return self.hosts[port].port
        return str(port)

    # -- running things -----------------------------------------------------------------

    def run(self, where: Host | Monitor | str | None, *argv: str, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """Runs a command in a host's/monitor's namespace (None: the root namespace)."""
        return _run(self._wrap(where, argv), check=check, **kw)

    def popen(self, where: Host | Monitor | str | None, *argv: str, **kw) -> subprocess.Popen:
        """Starts a command in a namespace; the caller waits for or kills it."""
        return subprocess.Popen(self._wrap(where, argv), **kw)

    @staticmethod
    def _wrap(where, argv) -> list[str]:
        ns = where.netns if isinstance(where, (Host, Monitor)) else where
        return (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in argv]


def unique_prefix() -> str:
    """A prefix no other process is using: 'mk' and this process id."""
    return f"mk{os.getpid()}"


def require_root() -> None:
    if os.geteuid() != 0:
        raise TopologyError("network namespaces, veths and tc need root (CI runs as root)")


def cleanup_stale() -> None:
    """Removes topologies with default prefixes ("mk" + pid) of processes that are gone
    (a test run that was killed before its teardown)."""
    for ns in _netns_list():
        head = ns.partition("_")[0]
        if head.startswith("mk") and head[2:].isdigit() and not os.path.exists(f"/proc/{head[2:]}"):
            cleanup_prefix(head)


def cleanup_prefix(prefix: str) -> None:
    """Deletes namespaces ``PREFIX_*`` and root-namespace links ``PREFIX*`` (leftovers of a
    crashed run). Deleting a namespace also deletes its veths and their root-side peers."""
    for ns in _netns_list():
        if ns.startswith(prefix + "_"):
            _run(["ip", "netns", "del", ns], check=False)
    for name in os.listdir("/sys/class/net"):
        if name.startswith(prefix) and name[len(prefix):len(prefix) + 1] in ("h", "m", "b"):
            _run(["ip", "link", "del", name], check=False)


def _netns_list() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []


def _mac(prefix: str, kind: int, i: int) -> str:
    """A locally administered unicast MAC, unique per prefix, kind and index."""
    h = zlib.crc32(prefix.encode()).to_bytes(4, "big")
    return ":".join(f"{b:02x}" for b in (0x02, h[0], h[1], h[2], kind, i))


def _ip(*argv: str) -> None:
    _run(["ip", *argv])


def _run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    r = subprocess.run(argv, check=False, **kw)
    if check and r.returncode != 0:
        raise TopologyError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stderr or '').strip()}")
    return r


# -- frame injection ----------------------------------------------------------------------

# struct mmsghdr on x86-64 (msghdr with one iovec, plus the kernel's msg_len).
_MMSG = np.dtype({"names": ["name", "namelen", "iov", "iovlen", "control", "controllen",
                            "flags", "len"],
                  "formats": ["<u8", "<u4", "<u8", "<u8", "<u8", "<u8", "<i4", "<u4"],
                  "offsets": [0, 8, 16, 24, 32, 40, 48, 56], "itemsize": 64})
_IOVEC = np.dtype({"names": ["base", "len"], "formats": ["<u8", "<u8"], "offsets": [0, 8],
                   "itemsize": 16})
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_libc.sendmmsg.restype = ctypes.c_int


class FrameSender:
    """A raw AF_PACKET socket on `ifname` (in `netns`) sending `FrameBatch`es as they are,
    `chunk` frames per sendmmsg call. Keep one for repeated sends: closing a packet socket
    waits for an RCU grace period (milliseconds). With `qdisc_bypass` frames skip the qdisc
    (faster, never queued). Frames above the interface MTU + 14 fail with EMSGSIZE."""

    def __init__(self, ifname: str, netns: str | None = None, qdisc_bypass: bool = True,
                 chunk: int = 256):
        self.chunk = max(1, min(int(chunk), _SENDMMSG_MAX))
        # A socket belongs to the namespace it was made in; bind resolves the name there.
        with in_netns(netns) if netns else contextlib.nullcontext():
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            if qdisc_bypass:
                self.sock.setsockopt(_SOL_PACKET, _PACKET_QDISC_BYPASS, 1)
            self.sock.bind((ifname, 0))  # protocol 0: this socket receives nothing
        except BaseException:
            self.sock.close()
            raise

    def send(self, batch: FrameBatch) -> int:
        """Sends every frame of `batch`; returns the number sent."""
        return _sendmmsg(self.sock, batch, self.chunk)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FrameSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def send_frames(ifname: str, batch: FrameBatch, netns: str | None = None,
                qdisc_bypass: bool = True, chunk: int = 256) -> int:
    """Sends every frame of `batch` out of `ifname` once (see `FrameSender`)."""
    with FrameSender(ifname, netns, qdisc_bypass, chunk) as sender:
        return sender.send(batch)


def _sendmmsg(s: socket.socket, batch: FrameBatch, chunk: int) -> int:
    n = len(batch)
    data = np.ascontiguousarray(batch.data)
    iov = np.zeros(n, _IOVEC)
    iov["base"] = data.ctypes.data + batch.offset.astype(np.uint64)
    iov["len"] = batch.caplen
    msgs = np.zeros(n, _MMSG)
    msgs["iov"] = iov.ctypes.data + 16 * np.arange(n, dtype=np.uint64)
    msgs["iovlen"] = 1
    sent = 0
    while sent < n:
        k = min(chunk, n - sent)
        r = _libc.sendmmsg(s.fileno(), msgs.ctypes.data + 64 * sent, k, 0)
        if r < 0:
            err = ctypes.get_errno()
            if err in (11, 105, 4):  # EAGAIN, ENOBUFS, EINTR: the device queue is full; retry
                time.sleep(50e-6)
                continue
            raise OSError(err, f"sendmmsg on {s.getsockname()[0]}: {os.strerror(err)} "
                               f"(frame {sent}, {int(batch.caplen[sent])} bytes)")
        sent += r
    return sent
