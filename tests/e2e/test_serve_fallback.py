"""Issue 7 back-pressure, end to end: `serve` (tools.serve.Daemon) behind a real port mirror, with
the control plane, following a live 2-process CPU DDP job; a deliberately slow updater makes the
capture edge drop frames, the replica goes stale, the appliance asks the trainer for a GoCkpt
fallback, resyncs, and follows the rest of the run bit-exactly once the updater keeps up.

The ranks (tools.testbed.harness) send the RoCEv2 frames of their ring all-reduce over the harness's
frame stream; a relay injects each rank's frames from that rank's namespace (harness.relayed_mirror),
tc mirrors both ranks' ports to the monitor interface, and the daemon's AF_PACKET worker captures it
there ("afpacket:IFACE@NETNS") while its control plane listens on 127.0.0.1 for the trainers.
Needs root, as CI has.
"""

from __future__ import annotations

import functools
import os
import threading

import common
import pytest
from mirrorckpt.config.jobfile import JobConfig
from mirrorckpt.config.layout import MirrorSpec
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.tools.metrics import Metrics
from mirrorckpt.tools.serve import Daemon
from mirrorckpt.tools.testbed import harness

pytestmark = pytest.mark.root

SECRET = "serve-fallback-secret-0123456789abcdef"
WORLD, STEPS = 2, 100
DEADLINE = 240  # seconds for any one wait on a loaded machine (never a timing assertion)


wait_for = functools.partial(common.wait_for, timeout=DEADLINE)


def dropped_at_capture(metrics: Metrics) -> float:
    return sum(s.value for fam in metrics.registry.collect() for s in fam.samples
               if s.name == "mirrorckpt_frames_dropped_total" and s.labels.get("where") == "capture")


def test_slow_updater_drops_then_recovers_by_fallback(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root (namespaces, tc, AF_PACKET); CI runs it as root")
    ring, _ = harness.ring_for(WORLD)
    plane = AppliancePlane(SECRET, parts=3, fingerprint_every=2, fallback_timeout=60).start()
    frames = harness.FrameStreamServer(WORLD)
    daemon = procs = None
    with harness.relayed_mirror(frames, WORLD) as topo:  # each rank's egress reaches the monitor
        try:
            procs = harness.spawn_ranks(WORLD, tmp_path, SECRET, control_port=plane.port, frames_port=frames.port,
                                        steps=STEPS, extra=["--step-delay", "0.15", "--parts", "3",
                                                            "--dims", "64,128,32"])
            assert plane.registered.wait(DEADLINE), "no trainer registered"
            m = topo.monitors[0]
            job = JobConfig(ring=ring, startup=False, layout=plane.layout,
                            mirrors=[MirrorSpec(rank=0, source=f"afpacket:{m.ifname}@{m.netns}")],
                            capture={"queue_bytes": 2_000_000})  # ~20 iterations of this job's traffic
            metrics = Metrics()
            daemon = Daemon(job, plane.training, PersistSpec(str(tmp_path / "ckpt")), metrics, iteration_queue=1,
                            sends_queue=1, updater_delay=0.5, control=plane)
            runner = threading.Thread(target=daemon.run, name="serve", daemon=True)
            runner.start()
            # the updater is slow until the capture edge has dropped; then the queues have room to spare
            assert wait_for(lambda: dropped_at_capture(metrics) > 0)
            daemon.updater_delay = 0.0
            harness.wait_ranks(procs, tmp_path, timeout=DEADLINE)
            assert wait_for(lambda: plane.replica is not None and plane.replica.iterations_done == STEPS), (
                plane.stats, plane.app.summary if plane.app else None)
        finally:
            if daemon is not None:
                daemon.request_stop()
                runner.join(60)
            plane.stop()
    summary, st = plane.app.summary, plane.stats
    assert summary.iterations_incomplete > 0 and summary.stale_events >= 1
    assert st.fallbacks_done >= 1 and st.fallbacks_failed == 0, st
    # once resynced, mirror mode followed the rest of the run: the last state is the trainer's
    trainer = harness.read_digests(tmp_path)
    params, optim = plane.replica.state_sha256()
    assert (params, optim) == (trainer[STEPS]["params"], trainer[STEPS]["optim"])
    last_resync = max(d["step"] for kind, d in st.events if kind == "resynced")
    assert last_resync < STEPS and summary.iterations_applied >= STEPS - last_resync
