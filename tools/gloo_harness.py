"""Runs the gloo DDP trainer (``tools.ddp_gloo_job``) in network namespaces with mirrored ports.

Topology: one namespace per rank (``<p>r<k>``, interface ``eth0``, 10.208.<n>.<k+1>/24), their
veth peers on a bridge in the root namespace, and a monitor namespace whose veth ends receive
``tc mirred`` copies of chosen rank ports (clsact: the port's ingress hook sees what the rank
sends, its egress hook what the rank receives; u32 match-all, since this kernel has no matchall).
All names start with a unique prefix and ``down()`` removes everything it made.

This is test tooling: root, iproute2, tc and tcpdump are required; it raises with the failing
command's output otherwise.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MASTER_PORT = 29500


class HarnessError(RuntimeError):
    pass


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HarnessError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
    return p


@dataclass
class Mirror:
    """A monitor interface and the (rank, direction) streams copied to it."""

    name: str  # interface inside the monitor namespace
    streams: list[tuple[int, str]]  # direction: "egress" (what the rank sends), "ingress", "both"


@dataclass
class Topology:
    nranks: int
    mirrors: list[Mirror] = field(default_factory=list)
    prefix: str = ""
    subnet: int = 0

    def __post_init__(self):
        self.prefix = self.prefix or "mck8" + secrets.token_hex(2)
        self.subnet = self.subnet or 100 + secrets.randbelow(100)
        self.made_ns: list[str] = []
        self.made_links: list[str] = []

    # names ---------------------------------------------------------------------------------
    def ns(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    @property
    def mon_ns(self) -> str:
        return f"{self.prefix}mon"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def port(self, rank: int) -> str:
        return f"{self.prefix}p{rank}"

    def addr(self, rank: int) -> str:
        return f"10.208.{self.subnet}.{rank + 1}"

    def mon_iface(self, k: int) -> str:
        return self.mirrors[k].name

    # lifecycle -------------------------------------------------------------------------------
    def up(self) -> "Topology":
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made_links.append(self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for r in range(self.nranks):
            ns, port, inner = self.ns(r), self.port(r), f"{self.prefix}e{r}"
            sh("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            sh("ip", "link", "add", port, "type", "veth", "peer", "name", inner)
            self.made_links.append(port)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "set", port, "master", self.bridge)
            sh("ip", "link", "set", port, "up")
        if self.mirrors:
            sh("ip", "netns", "add", self.mon_ns)
            self.made_ns.append(self.mon_ns)
        hooks: dict[tuple[int, str], list[str]] = {}
        for k, m in enumerate(self.mirrors):
            tgt = f"{self.prefix}q{k}"
            sh("ip", "link", "add", tgt, "type", "veth", "peer", "name", m.name)
            self.made_links.append(tgt)
            sh("ip", "link", "set", m.name, "netns", self.mon_ns)
            sh("ip", "-n", self.mon_ns, "link", "set", m.name, "up")
            sh("ip", "link", "set", tgt, "up")
            for rank, direction in m.streams:
                if direction in ("egress", "both"):
                    hooks.setdefault((rank, "ingress"), []).append(tgt)
                if direction in ("ingress", "both"):
                    hooks.setdefault((rank, "egress"), []).append(tgt)
        for rank in sorted({r for r, _ in hooks}):
            sh("tc", "qdisc", "add", "dev", self.port(rank), "clsact")
        for (rank, hook), targets in hooks.items():
            # One filter with one mirred action per target: the first matching filter ends
            # classification, so two filters would feed only one monitor.
            acts = []
            for t in targets:
                acts += ["action", "mirred", "egress", "mirror", "dev", t]
            sh("tc", "filter", "add", "dev", self.port(rank), hook, "protocol", "all", "prio", "1",
               "u32", "match", "u32", "0", "0", *acts)

    def down(self) -> None:
        for link in reversed(self.made_links):
            sh("ip", "link", "del", link, check=False)
        for ns in reversed(self.made_ns):
            sh("ip", "netns", "del", ns, check=False)
        self.made_links, self.made_ns = [], []

    def __enter__(self) -> "Topology":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


class Tcpdump:
    """tcpdump on a monitor interface, writing a pcap; ``stop`` flushes and waits for it."""

    def __init__(self, topo: Topology, iface: str, path: Path):
        self.path = Path(path)
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", topo.mon_ns, "tcpdump", "-i", iface, "-w", str(self.path), "-s", "0",
             "-B", "65536", "-n", "--immediate-mode"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.banner = ""
        self._wait_listening()

    def _wait_listening(self) -> None:
        # tcpdump prints "listening on ..." once the socket is bound; frames before that are lost.
        deadline = time.monotonic() + 10
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        line = ""
        while time.monotonic() < deadline:
            try:
                line += os.read(fd, 4096).decode(errors="replace")
            except BlockingIOError:
                pass
            if "listening on" in line:
                self.banner = line
                return
            if self.proc.poll() is not None:
                raise HarnessError(f"tcpdump exited: {line.strip()}")
            time.sleep(0.02)
        raise HarnessError(f"tcpdump did not start: {line.strip()}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.set_blocking(self.proc.stderr.fileno(), True)
        return self.banner + self.proc.stderr.read().decode(errors="replace")


def start_ranks(topo: Topology, out: Path, steps: int = 8, extra: list[str] | None = None,
                port: int = MASTER_PORT) -> list[subprocess.Popen]:
    """One trainer process per rank in its namespace; rank 0 hosts the TCPStore."""
    procs = []
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for r in range(topo.nranks):
        cmd = ["ip", "netns", "exec", topo.ns(r), sys.executable, "-m", "mirrorckpt.tools.ddp_gloo_job",
               "--rank", str(r), "--world", str(topo.nranks), "--master", topo.addr(0), "--port", str(port),
               "--out", str(out), "--steps", str(steps)] + list(extra or [])
        log = open(out / f"rank{r}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_ranks(procs: list[subprocess.Popen], out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            left = max(0.1, deadline - time.monotonic())
            rc = p.wait(timeout=left)
            if rc != 0:
                raise HarnessError(f"rank {r} exited {rc}: {(out / f'rank{r}.log').read_text()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
