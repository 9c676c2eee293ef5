"""Capture receive rate per backend, against a numpy copy of the same bytes and tcpdump.

Every function returns a dict of measurements from this run (no files are kept):
- `bench_file`: the pcap/pcapng reader over a large file made of real frames (page cache warm).
- `bench_dpdk_pcap`: DPDK net_pcap with infinite_rx=1 over a real capture (the driver copies
  each frame from its stored copy into a fresh mbuf; we build zero-copy batches).
- `bench_live`: a namespace topology; a separate injector process sends real frames as fast as
  it can (sendmmsg, qdisc bypass) into the monitor port, and in turn AF_PACKET (TPACKET_V3),
  DPDK net_af_packet and `tcpdump -w /dev/null` read that same interface for the same time.
  Also "drain": frames queued in a big ring first (AF_PACKET, and DPDK net_af_packet's own
  ring), then read, which measures the consumer alone (the injector on this VM is slower
  than the readers).
- `bench_memcpy`: `np.copyto` of the same bytes, the ceiling for anything that touches them.

Rates: Mpps (frames/s / 1e6) and Gbit/s of captured frame bytes (no preamble, no gap).
The consumer runs on the last CPU, the injector (and the kernel's softirq work) on the first.

    python -m mirrorckpt.benchmarks.bench_capture       # prints the dict as JSON
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mirrorckpt.capture.bench import build_bench_capture
from mirrorckpt.capture.pcapfile import open_capture, read_all

SHARED = Path(__file__).resolve().parents[2] / "shared" / "captures" / "flowcheck"
FRAMES = SHARED / "iter_40000_p2p_iter10.pcapng"  # RoCEv2 LL traffic, 82..1118-byte frames


def _rates(frames: int, nbytes: int, seconds: float) -> dict:
    return {"frames": frames, "bytes": nbytes, "seconds": round(seconds, 4),
            "mpps": frames / seconds / 1e6, "gbit_s": nbytes * 8 / seconds / 1e9}


@contextlib.contextmanager
def _pinned(cpu: int | None):
    """Runs the block with this thread on one CPU (then restores the affinity)."""
    saved = os.sched_getaffinity(0)
    if cpu is not None and len(saved) > 1:
        os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _cpus() -> tuple[int | None, int | None]:
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[-1]) if len(cpus) > 1 else (None, None)


def bench_memcpy(nbytes: int = 256 << 20, repeat: int = 3) -> dict:
    """Best of `repeat` np.copyto between two resident arrays of `nbytes`."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    return {"bytes": nbytes, "seconds": best, "gbit_s": nbytes * 8 / best / 1e9}


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _memcpy_equiv(rates: dict, mem: dict) -> dict:
    """The same frames at memcpy speed, and how far the backend is from it."""
    per_frame = rates["bytes"] / max(1, rates["frames"])
    return {"memcpy_gbit_s": mem["gbit_s"], "memcpy_mpps": mem["gbit_s"] * 1e9 / 8 / per_frame / 1e6,
            "vs_memcpy": rates["gbit_s"] / mem["gbit_s"]}


def bench_file(target_bytes: int = 256 << 20) -> dict:
    """The file reader over a pcapng of real frames (one warm pass, one timed pass)."""
    _, consumer = _cpus()
    with tempfile.TemporaryDirectory(prefix="mck-bench-") as tmp:
        path = Path(tmp) / "bench.pcapng"
        build_bench_capture(path, [FRAMES], target_bytes)
        with _pinned(consumer):
            for _ in range(2):
                t0 = time.perf_counter()
                with open_capture(path) as reader:
                    for _batch in reader:
                        pass
                    frames, nbytes = reader.stats.frames, reader.stats.bytes
                seconds = time.perf_counter() - t0
    return _rates(frames, nbytes, seconds)


def bench_dpdk_pcap(seconds: float = 3.0, burst: int = 64) -> dict:
    """DPDK net_pcap,infinite_rx=1 over a real capture: batches only (no byte touched)."""
    from mirrorckpt.capture.dpdk import open_port

    _, consumer = _cpus()
    with _pinned(consumer):
        port = open_port(f"net_pcap0,rx_pcap={FRAMES},infinite_rx=1", burst=burst)
        try:
            frames = nbytes = 0
            next(port)  # warm-up
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                b = next(port)
                frames += len(b)
                nbytes += b.nbytes
            elapsed = time.perf_counter() - t0
            stats = port.stats()
        finally:
            port.close()
    out = _rates(frames, nbytes, elapsed)
    out.update(burst=burst, imissed=stats["imissed"], rx_nombuf=stats["rx_nombuf"])
    return out


# -- live ---------------------------------------------------------------------------------

def _injector(topo, seconds: float | None = None, frames: int | None = None) -> subprocess.Popen:
    """A separate process on the first CPU sending FRAMES over and over into the monitor's
    root-side peer (so they arrive on the monitor interface). It prints the count sent."""
    inject_cpu, _ = _cpus()
    argv = [sys.executable, "-m", "mirrorckpt.benchmarks.bench_capture", "inject",
            topo.monitors[0].peer, str(seconds or 0), str(frames or 0)]
    if inject_cpu is not None:
        argv = ["taskset", "-c", str(inject_cpu), *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"injector failed: {err.strip()}")
    sent, seconds = out.split()
    return {"sent": int(sent), "inject_seconds": float(seconds),
            "offered_mpps": int(sent) / float(seconds) / 1e6}


def _consume(source, proc, tail: float = 0.3) -> tuple[int, int, float]:
    """Reads until the injector has exited and the source was quiet for `tail` s; returns
    frames, bytes and the time from the first to the last frame."""
    frames = nbytes = 0
    first = last = None
    quiet_since = None
    for b in source:
        now = time.perf_counter()
        if len(b):
            frames += len(b)
            nbytes += b.nbytes
            first = first or now
            last = now
            quiet_since = None
        elif proc.poll() is not None:
            quiet_since = quiet_since or now
            if now - quiet_since >= tail:
                break
    return frames, nbytes, (last - first) if first and last and last > first else float("nan")


def _live_afpacket(topo, seconds: float) -> dict:
    from mirrorckpt.capture.afpacket import open_ring

    _, consumer = _cpus()
    m = topo.monitors[0]
    with _pinned(consumer):
        ring = open_ring(m.ifname, netns=m.netns, block_size=1 << 20, block_count=64,
                         poll_timeout=0.05)
        try:
            proc = _injector(topo, seconds=seconds)
            frames, nbytes, _ = _consume(ring, proc)
            stats = ring.stats()
        finally:
            ring.close()
    inj = _finish(proc)
    out = _rates(frames, nbytes, inj["inject_seconds"])
    out.update(inj, kernel_drops=stats.kernel_drops)
    return out


def _drain(source, expect: int) -> tuple[int, int, float]:
    """Reads `expect` queued frames (or until an empty batch says the rest was lost)."""
    n = nbytes = 0
    t0 = time.perf_counter()
    for b in source:
        if not len(b):
            break
        n += len(b)
        nbytes += b.nbytes
        if n >= expect:
            break
    return n, nbytes, time.perf_counter() - t0


def _drain_afpacket(topo, frames: int = 200_000) -> dict:
    """Frames queued in a 512 MiB ring with nobody reading, then read: the consumer alone."""
    from mirrorckpt.capture.afpacket import open_ring

    _, consumer = _cpus()
    m = topo.monitors[0]
    ring = open_ring(m.ifname, netns=m.netns, block_size=1 << 20, block_count=512,
                     max_blocks=32, poll_timeout=0.05, idle_timeout=0.2)
    try:
        inj = _finish(_injector(topo, frames=frames))
        time.sleep(0.1)  # let the last block retire
        with _pinned(consumer):
            n, nbytes, elapsed = _drain(ring, inj["sent"])
        stats = ring.stats()
    finally:
        ring.close()
    out = _rates(n, nbytes, elapsed)
    out.update(sent=inj["sent"], kernel_drops=stats.kernel_drops)
    return out


def _live_dpdk_af_packet(topo, seconds: float) -> dict:
    from mirrorckpt.capture.dpdk import open_port

    _, consumer = _cpus()
    m = topo.monitors[0]
    with _pinned(consumer):
        port = open_port(f"net_af_packet0,iface={m.ifname},framecnt=32768,framesz=2048,"
                         "blocksz=65536", netns=m.netns, poll_timeout=0.05, mbufs=16383)
        try:
            proc = _injector(topo, seconds=seconds)
            frames, nbytes, _ = _consume(port, proc)
            stats = port.stats()
        finally:
            port.close()
    inj = _finish(proc)
    out = _rates(frames, nbytes, inj["inject_seconds"])
    out.update(inj, lost=inj["sent"] - frames, imissed=stats["imissed"])
    return out


def _drain_dpdk_af_packet(topo, frames: int = 60_000) -> dict:
    """The same for DPDK net_af_packet: frames queued in its ring (65536 frames), then read."""
    from mirrorckpt.capture.dpdk import open_port

    _, consumer = _cpus()
    m = topo.monitors[0]
    port = open_port(f"net_af_packet0,iface={m.ifname},framecnt=65536,framesz=2048,"
                     "blocksz=65536", netns=m.netns, poll_timeout=0.05, idle_timeout=0.2,
                     mbufs=16383)
    try:
        inj = _finish(_injector(topo, frames=frames))
        with _pinned(consumer):
            n, nbytes, elapsed = _drain(port, inj["sent"])
    finally:
        port.close()
    out = _rates(n, nbytes, elapsed)
    out.update(sent=inj["sent"], lost=inj["sent"] - n)
    return out


def _live_tcpdump(topo, seconds: float) -> dict:
    _, consumer = _cpus()
    m = topo.monitors[0]
    argv = ["ip", "netns", "exec", m.netns, "tcpdump", "-i", m.ifname, "-w", "/dev/null",
            "-B", str(64 << 10), "-s", "0", "-n"]
    if consumer is not None:
        argv = ["taskset", "-c", str(consumer), *argv]
    dump = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        line = dump.stderr.readline()  # "listening on ...": the ring is in place
        if "listening" not in line:
            raise RuntimeError(f"tcpdump did not start: {line.strip()}")
        inj = _finish(_injector(topo, seconds=seconds))
        time.sleep(0.3)
    finally:
        dump.send_signal(signal.SIGINT)
    err = dump.communicate(timeout=30)[1]
    counts = {}
    for line in err.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit():
            counts[" ".join(parts[1:])] = int(parts[0])
    captured = counts.get("packets captured", 0)
    per_frame = _frame_mean()
    out = _rates(captured, int(captured * per_frame), inj["inject_seconds"])
    out.update(inj, received_by_filter=counts.get("packets received by filter"),
               kernel_drops=counts.get("packets dropped by kernel"))
    return out


def _frame_mean() -> float:
    b = read_all(FRAMES)
    return b.nbytes / len(b)


def bench_live(seconds: float = 3.0) -> dict:
    """AF_PACKET, DPDK net_af_packet and tcpdump on one monitor interface, same injector."""
    from mirrorckpt.tools.testbed.netns import Topology

    with Topology(hosts=1, mtu=9000) as topo:
        return {"afpacket": _live_afpacket(topo, seconds),
                "dpdk_af_packet": _live_dpdk_af_packet(topo, seconds),
                "tcpdump": _live_tcpdump(topo, seconds),
                "afpacket_drain": _drain_afpacket(topo),
                "afpacket_drain_60k": _drain_afpacket(topo, 60_000),
                "dpdk_af_packet_drain_60k": _drain_dpdk_af_packet(topo)}


def run_all(seconds: float = 3.0) -> dict:
    mem = bench_memcpy()
    out = {"memcpy": mem, "file": bench_file(), "dpdk_pcap_infinite": bench_dpdk_pcap(seconds)}
    out.update(bench_live(seconds))
    for k, v in out.items():
        if k != "memcpy" and v.get("frames"):
            v.update(_memcpy_equiv(v, mem))
    return out


def _inject(ifname: str, seconds: float, frames: int) -> None:
    """Injector process body: sends FRAMES repeatedly for `seconds` or `frames` frames."""
    from mirrorckpt.capture.batch import FrameBatch
    from mirrorckpt.tools.testbed.netns import FrameSender

    src = read_all(FRAMES)
    batch = FrameBatch.from_frames([src.frame(i) for i in range(len(src))])
    sent = 0
    with FrameSender(ifname) as sender:
        t0 = time.perf_counter()
        while True:
            if frames:
                left = frames - sent
                if left <= 0:
                    break
                part = batch if left >= len(batch) else FrameBatch.from_frames(
                    [batch.frame(i) for i in range(left)])
            else:
                if time.perf_counter() - t0 >= seconds:
                    break
                part = batch
            sent += sender.send(part)
        elapsed = time.perf_counter() - t0
    print(sent, elapsed)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "inject":
        _inject(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        import json

        print(json.dumps(run_all(), indent=1))
