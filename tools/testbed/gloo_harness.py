"""Runs the gloo DDP trainer (``tools.ddp_gloo_job``) in network namespaces with mirrored ports.

The topology is ``tools.netns.Topology`` (one host namespace per rank on a bridge, monitor
namespaces); the mirrors are set here because one port hook may feed several monitors: the
first u32 filter that matches ends classification, so all monitors of a hook get one filter
with one ``mirred`` action each. Directions are the appliance's (``MirrorSpec``): "egress" is
what the rank sends (the bridge port's ingress hook), "ingress" what it receives.

Segmentation offloads stay on by default, as on a real host: mirrored frames are TSO/GSO
super-frames with partial checksums. Test tooling: root, iproute2, tc and tcpdump are needed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mirrorckpt.capture.afpacket import open_ring
from mirrorckpt.tools.testbed import harness
from mirrorckpt.tools.testbed.netns import Host, Monitor, Topology, TopologyError

MASTER_PORT = 29500
_HOOK = {"egress": ("ingress",), "ingress": ("egress",), "both": ("ingress", "egress")}


def gloo_topology(nranks: int, mirrors: dict[int, list[tuple[int, str]]], offloads: bool = True,
                  prefix: str | None = None) -> Topology:
    """A set-up topology with ``mirrors``: monitor index -> [(rank, direction)]."""
    prefix = prefix or f"mck8{os.getpid() % 10000}"  # names start with the prefix
    topo = Topology(hosts=nranks, monitors=max(mirrors, default=-1) + 1, prefix=prefix, offloads=offloads)
    topo.setup()
    try:
        hooks: dict[tuple[str, str], list[str]] = {}
        for j, streams in mirrors.items():
            for rank, direction in streams:
                for hook in _HOOK[direction]:
                    hooks.setdefault((topo.hosts[rank].port, hook), []).append(topo.monitors[j].peer)
        for dev in sorted({d for d, _ in hooks}):
            topo.run(None, "tc", "qdisc", "add", "dev", dev, "clsact")
        for (dev, hook), peers in hooks.items():
            acts = []
            for p in peers:
                acts += ["action", "mirred", "egress", "mirror", "dev", p]
            topo.run(None, "tc", "filter", "add", "dev", dev, hook, "protocol", "all", "prio", "1",
                     "u32", "match", "u32", "0", "0", *acts)
    except BaseException:
        topo.teardown()
        raise
    return topo


class Tcpdump:
    """tcpdump on a monitor (or a host's own interface), writing a pcap; ``stop`` flushes and
    waits for it. ``direction``: "in" or "out" captures only frames the interface receives or
    sends (tcpdump -Q); None both."""

    def __init__(self, topo: Topology, mon: Monitor | Host, path: Path, direction: str | None = None):
        self.path = Path(path)
        self.proc = topo.popen(mon, "tcpdump", "-i", mon.ifname, "-w", str(self.path), "-s", "0",
                               "-B", "65536", "-n", "--immediate-mode", *(["-Q", direction] if direction else []),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log = ""
        self._wait_listening()

    def _wait_listening(self) -> None:
        # tcpdump says "listening on ..." once its socket is bound; frames before are not seen.
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.log += os.read(fd, 4096).decode(errors="replace")
            except BlockingIOError:
                pass
            if "listening on" in self.log:
                return
            if self.proc.poll() is not None:
                raise TopologyError(f"tcpdump exited: {self.log.strip()}")
            time.sleep(0.02)
        raise TopologyError(f"tcpdump did not start: {self.log.strip()}")

    def stop(self) -> str:
        """Stops tcpdump; returns its output (with the kernel drop count)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.set_blocking(self.proc.stderr.fileno(), True)
        self.log += self.proc.stderr.read().decode(errors="replace")
        return self.log

    def dropped(self) -> int | None:
        """Frames the kernel dropped, from tcpdump's report at stop (None before it)."""
        m = re.search(r"(\d+) packets? dropped by kernel", self.log)
        return int(m.group(1)) if m else None


class LiveSource:
    """Batches from an AF_PACKET ring on a monitor until ``stop``; then the ring is drained
    (until a poll finds nothing) and iteration ends. Iterate it from the consuming thread."""

    def __init__(self, mon: Monitor, block_count: int = 256):
        self.ring = open_ring(mon.ifname, netns=mon.netns, block_count=block_count,
                              poll_timeout=0.2)
        self.name = self.ring.name
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def __iter__(self):
        try:
            for b in self.ring:
                if len(b):
                    yield b
                elif self._stop.is_set():
                    return
        finally:
            self.stats = self.ring.stats()
            self.ring.close()


class Consumer(threading.Thread):
    """Runs ``fn()`` (e.g. iterating a GlooJobStream over a LiveSource) in a thread; ``result()``
    returns its value or raises what it raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the caller
            self.error = e

    def result(self, timeout: float = 120):
        self.join(timeout)
        if self.is_alive():
            raise TimeoutError("the live consumer did not finish")
        if self.error is not None:
            raise self.error
        return self.value


def start_ranks(topo: Topology, out: Path, steps: int = 8, extra: list[str] | None = None,
                port: int = MASTER_PORT) -> list[subprocess.Popen]:
    """One trainer process per rank in its namespace; rank 0 hosts the TCPStore."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for r, h in enumerate(topo.hosts):
        env["GLOO_SOCKET_IFNAME"] = h.ifname
        log = open(out / f"rank{r}.log", "w")
        procs.append(topo.popen(h, sys.executable, "-m", "mirrorckpt.tools.testbed.ddp_gloo_job", "--rank", r,
                                "--world", len(topo.hosts), "--master", topo.hosts[0].ip, "--port", port,
                                "--out", out, "--steps", steps, *(extra or []),
                                env=dict(env), stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_ranks(procs: list[subprocess.Popen], out: Path, timeout: float = 180) -> None:
    harness.wait_ranks(procs, out, timeout, error=TopologyError)


def wait_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TopologyError(f"{path} did not appear in {timeout} s")
        time.sleep(0.01)
