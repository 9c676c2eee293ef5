"""From an iteration's last packet to the replica's step and to its committed checkpoint (issue 16).

A live job as `serve` follows one: two trainer processes (tools.testbed.harness, gloo DDP on
CPU) send the RoCEv2 frames of each step's ring all-reduce; a relay injects each rank's frames
from that rank's namespace, tc mirrors the ranks' ports to a monitor interface, and the daemon
(tools.serve.Daemon, with the control plane) captures there with AF_PACKET. The capture's kernel
timestamps are this host's clock, so the daemon times every applied iteration from its last
captured packet to the replica's step, and every checkpoint to its commit (the
``mirrorckpt_step_latency_seconds`` / ``mirrorckpt_commit_latency_seconds`` metrics). A checkpoint
is committed after every iteration. The trainers pause between steps, so these are the pipeline's
own times for one iteration, not a backlog. Needs root (namespaces, tc, AF_PACKET).

    python -m mirrorckpt.benchmarks.bench_latency
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import numpy as np

SECRET = "bench-latency-secret-0123456789abcdef"


def _quantiles(xs: list[float]) -> dict:
    a = np.sort(np.asarray(xs, float))
    if not a.size:
        return {"n": 0}
    return {"n": int(a.size), "p50_ms": float(np.quantile(a, 0.5) * 1e3), "p90_ms": float(np.quantile(a, 0.9) * 1e3),
            "max_ms": float(a[-1] * 1e3)}


def measure(dims: str, steps: int = 30, step_delay: float = 0.5, deadline: float = 300.0) -> dict:
    """One job of ``dims`` (harness --dims) for ``steps`` steps, ``step_delay`` s between them."""
    from mirrorckpt.config.jobfile import JobConfig
    from mirrorckpt.config.layout import MirrorSpec
    from mirrorckpt.config.training import PersistSpec
    from mirrorckpt.control.appliance_side import AppliancePlane
    from mirrorckpt.tools.metrics import Metrics
    from mirrorckpt.tools.serve import Daemon
    from mirrorckpt.tools.testbed import harness

    world = 2
    ring, _ = harness.ring_for(world)
    tmp = tempfile.mkdtemp(prefix="bench-latency-")
    persist = PersistSpec(os.path.join(tmp, "ckpt"), every_iterations=1, keep_last=2)
    plane = AppliancePlane(SECRET, parts=2, persist=persist).start()
    frames = harness.FrameStreamServer(world)
    daemon = runner = None
    with harness.relayed_mirror(frames, world) as topo:
        try:
            m = topo.monitors[0]
            # capturing before the job starts (the layout comes with the trainer's REGISTER)
            job = JobConfig(ring=ring, startup=False,
                            mirrors=[MirrorSpec(rank=0, source=f"afpacket:{m.ifname}@{m.netns}")])
            daemon = Daemon(job, None, persist, Metrics(), control=plane)
            runner = threading.Thread(target=daemon.run, name="serve", daemon=True)
            runner.start()
            time.sleep(1.0)  # the capture worker opens its ring
            procs = harness.spawn_ranks(world, tmp, SECRET, control_port=plane.port, frames_port=frames.port,
                                        steps=steps, extra=["--step-delay", str(step_delay), "--dims", dims])
            harness.wait_ranks(procs, tmp, timeout=deadline)
            end = time.monotonic() + 60
            while time.monotonic() < end and not (plane.replica is not None
                                                  and plane.replica.iterations_done == steps):
                time.sleep(0.2)
            time.sleep(2.0)  # the last commits land
        finally:
            if daemon is not None:
                daemon.request_stop()
                runner.join(60)
            plane.stop()
    lat = list(daemon.latencies) if daemon is not None else []
    # the job's iteration period on the wire: between consecutive iterations' last packets
    ts = np.sort([t for w, _, t in lat if w == "step"])
    period = float(np.median(np.diff(ts))) / 1e9 if ts.size > 1 else 0.0
    layout = plane.layout
    grad_bytes = layout.total_numel * 4 if layout is not None else 0
    return {"dims": dims, "params": layout.total_numel if layout is not None else 0, "grad_MB": grad_bytes / 1e6,
            "steps": steps, "step_delay_s": step_delay,
            "applied": plane.app.summary.iterations_applied if plane.app is not None else 0,
            "incomplete": plane.app.summary.iterations_incomplete if plane.app is not None else 0,
            "capture": dict(daemon.streams.counters.get(0, {})) if daemon is not None and daemon.streams else {},
            "wire_period_ms": period * 1e3,
            "to_step": _quantiles([s for w, s, _ in lat if w == "step"]),
            "to_commit": _quantiles([s for w, s, _ in lat if w == "commit"])}


def run(sizes: tuple[str, ...] = ("64,128,32", "512,1024,512", "1024,2048,1024"), steps: int = 30) -> dict:
    if os.geteuid() != 0:
        return {"error": "needs root (network namespaces, tc, AF_PACKET)"}
    return {"jobs": [measure(d, steps=steps) for d in sizes]}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
