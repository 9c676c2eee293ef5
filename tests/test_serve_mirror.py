"""serve's capture worker says what a remote mirror's encapsulation showed: the frames each mirror
session lost (a message to the main process, a metric per port and session), the frames the switch
cut (a counter, a metric, and one warning with the setting to change)."""

from __future__ import annotations

import ctypes
import json
import queue
import threading
import time

from mirrorckpt.tools.daemon.ports import PortMonitor
from mirrorckpt.tools.daemon.streams import QueueStreams
from mirrorckpt.tools.daemon.worker import COUNTERS, Ended, MirrorLoss, Note, WorkerSpec, worker_main
from mirrorckpt.tools.generator.encap import EncapOptions
from mirrorckpt.tools.generator.faults import FaultOptions
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.metrics import Metrics


def samples(metrics: Metrics, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for fam in metrics.registry.collect() for s in fam.samples
            if s.name == name}


def test_a_workers_mirror_loss_and_truncation_reach_the_metrics_and_the_log(tmp_path, monkeypatch):
    generate(GenConfig(ranks=2, model="linear:3000", steps=3, mirrors="0:egress",
                       encap=EncapOptions(kind="erspan2", mirror_mtu=700),
                       faults=FaultOptions(loss=0.03, seed=4)), tmp_path)
    truth = json.loads((tmp_path / "truth.json").read_text())
    lost = sum(f["kind"] == "loss" for f in truth["wire"]["faults"])
    assert lost > 0
    out: queue.Queue = queue.Queue()
    shared = (ctypes.c_int64 * len(COUNTERS))()
    spec = WorkerSpec(port=0, source=str(tmp_path / "rank0_egress.pcapng"), batch_frames=32)
    monkeypatch.setattr("signal.signal", lambda *a: None)  # worker_main in a thread, not its process
    t = threading.Thread(target=worker_main, args=(spec, out, threading.Event(), shared), daemon=True)
    t.start()
    msgs = []
    deadline = time.monotonic() + 60
    while not msgs or not isinstance(msgs[-1], Ended):
        assert time.monotonic() < deadline, msgs[-3:]
        msgs.append(out.get(timeout=60))
    t.join(timeout=10)
    warned = [m for m in msgs if isinstance(m, Note) and "the mirror truncates" in m.text]
    assert len(warned) == 1 and "can never be followed" in warned[0].text  # once, with what to change
    counts = dict(zip(COUNTERS, shared))
    assert counts["mirror_lost"] == lost and counts["mirror_truncated"] > 0
    sessions = [m.sessions for m in msgs if isinstance(m, MirrorLoss)]
    assert sessions and sum(sessions[-1].values()) == lost
    assert list(sessions[-1]) == ["erspan2 10.99.0.1>10.99.0.2 session 1"]

    # the main process: counters into metrics, the sessions' running counts into their metric
    q: queue.Queue = queue.Queue()
    for m in msgs:
        if isinstance(m, (MirrorLoss, Ended)):
            q.put(m)
    ports = PortMonitor(Metrics(), ["0"], shared=[shared])
    streams = QueueStreams(q, ports)
    ports.sync()
    assert list(streams) == []
    assert samples(ports.metrics, "mirrorckpt_truncated_frames_total") == {(("port", "0"),):
                                                                          counts["mirror_truncated"]}
    assert samples(ports.metrics, "mirrorckpt_mirror_lost_frames_total") == {
        (("port", "0"), ("session", "erspan2 10.99.0.1>10.99.0.2 session 1")): lost}
