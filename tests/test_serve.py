"""tools.daemon.streams.QueueStreams across a re-arm: the pass after it starts with the sends of the new
connections that reached the wire before the restarted job's REGISTER (the ended pass did not
follow them), and the old connections' sends captured before the re-arm are dropped."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.reassembly import QpKey
from mirrorckpt.tools.daemon.ports import PortMonitor
from mirrorckpt.tools.daemon.streams import JobWatch, QueueStreams
from mirrorckpt.tools.daemon.worker import COUNTERS, Ended, Sends, WorkerSpec, worker_main
from mirrorckpt.tools.metrics import Metrics

OLD = ConnKey(b"\x01" * 16, b"\x02" * 16, 0xC001)  # the killed run's ring connection
NEW = ConnKey(b"\x03" * 16, b"\x04" * 16, 0xC002)  # the resumed run's


def send(conn: ConnKey, ts_ns: int, nbytes: int = 64) -> NcclSend:
    return NcclSend(conn, QpKey(conn.sender, conn.receiver, 1), "LL", np.zeros(nbytes, np.uint8), [], nbytes,
                    nbytes, 0, "normal", ts_ns=ts_ns)


class Job:
    """A job stream's public view, as the JobWatch reads it."""

    def __init__(self, mapped=None, counts=None):
        self.mapped, self.counts = mapped if mapped is not None else {}, counts

    def ring_connections(self):
        return self.mapped

    def placement_counts(self):
        return self.counts

    def channel_notes(self):
        return []


def streams_of(q, mapped=None, nports: int = 1, shared=None, **kw) -> QueueStreams:
    s = QueueStreams(q, PortMonitor(Metrics(), [str(k) for k in range(nports)], shared=shared), **kw)
    s.watch.follow(Job(mapped))
    return s


def passes(q: queue.Queue, streams: QueueStreams, rearm_after: int) -> tuple[list, list]:
    """Sends of the first pass (ended by a re-arm after ``rearm_after`` batches) and the second."""
    first, second = [], []
    for k, sends in enumerate(streams):
        first += sends
        if k + 1 == rearm_after:
            streams.rearm()
    streams.next_pass()
    streams.watch.follow(Job({}))
    for sends in streams:
        second += sends
    return first, second


def test_rearm_hands_the_new_runs_early_sends_to_the_next_pass():
    q: queue.Queue = queue.Queue()
    streams = streams_of(q, {OLD: 0})  # what the first pass's resolver mapped
    t0 = time.time_ns()
    early = [send(NEW, t0 + 1), send(NEW, t0 + 2)]
    q.put(Sends(0, [send(OLD, t0)], None, None))
    q.put(Sends(0, [send(OLD, t0 + 1), *early], None, None))  # the restarted job's first collective
    tail, late = send(OLD, t0 + 3), send(OLD, time.time_ns() + 10**9)  # captured before / after the re-arm
    q.put(Sends(0, [tail, late, send(NEW, t0 + 4)], None, None))
    q.put(Ended(0, None))
    first, second = passes(q, streams, rearm_after=2)
    assert len(first) == 4  # the re-arm ended the first pass after its second batch
    # the early sends first, then the batch after the re-arm without the old tail captured before it
    assert len(second) == 4 and all(a is b for a, b in zip(second, [*early, late]))
    assert second[3].connection == NEW and not any(s is tail for s in second)
    assert streams.replayed == 2 and streams.dropped_old == 1


def test_replayed_sends_are_bounded():
    q: queue.Queue = queue.Queue()
    streams = streams_of(q, {OLD: 0}, replay_bytes=1000)
    t0 = time.time_ns()
    for k in range(5):
        q.put(Sends(0, [send(NEW, t0 + k, nbytes=400)], None, None))
    q.put(Ended(0, None))
    first, second = passes(q, streams, rearm_after=5)
    assert len(first) == 5 and [s.ts_ns - t0 for s in second] == [3, 4]  # the newest that fit


def test_sends_of_connections_the_pass_maps_are_not_kept():
    q: queue.Queue = queue.Queue()
    mapped: dict = {}
    streams = streams_of(q, mapped)
    q.put(Sends(0, [send(OLD, 1, nbytes=1000)], None, None))  # before the resolver placed its connection
    q.put(Sends(0, [send(OLD, 2, nbytes=1000)], None, None))
    q.put(Ended(0, None))
    held = []
    for _ in streams:
        held.append(streams.held_bytes)
        mapped[OLD] = 0
    assert held == [1000, 0]  # the pass's own start is not held for a replay


def test_drop_counters_move_while_the_sends_queue_is_full(monkeypatch):
    """A worker whose sends wait behind a full queue (nobody reads it) still publishes its
    counters: the capture edge's drops show in the metrics while the pipeline is backed up."""
    import ctypes
    import pathlib

    pcap = pathlib.Path(__file__).parent / "pcaps" / "demo" / "rank0_egress.pcapng"
    out: queue.Queue = queue.Queue(maxsize=1)  # fills with the first sends; never read
    shared = (ctypes.c_int64 * len(COUNTERS))()
    stop = threading.Event()
    spec = WorkerSpec(port=0, source=str(pcap), batch_frames=16, local_bytes=32 << 10)
    t = threading.Thread(target=worker_main, args=(spec, out, stop, shared), daemon=True)
    # worker_main ignores SIGINT in its process; in a thread here only the main thread may
    monkeypatch.setattr("signal.signal", lambda *a: None)
    try:
        t.start()
        ports = PortMonitor(Metrics(), ["0"], shared=[shared])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and ports.counters.get(0, {}).get("dropped_capture", 0) == 0:
            time.sleep(0.05)
            ports.sync()
    finally:
        stop.set()
    c = ports.counters[0]
    assert c["dropped_capture"] > 0 and c["frames"] > c["dropped_capture"]
    # the worker's two threads say their CPU time, and the metrics follow
    assert c["cpu_capture_ns"] > 0 and c["cpu_decode_ns"] > 0
    cpu = {s.labels["stage"]: s.value for fam in ports.metrics.registry.collect() for s in fam.samples
           if s.name == "mirrorckpt_stage_cpu_seconds_total" and s.labels.get("port") == "0"}
    assert cpu == {"capture": c["cpu_capture_ns"] / 1e9, "decode": c["cpu_decode_ns"] / 1e9}
    dropped = sum(s.value for fam in ports.metrics.registry.collect() for s in fam.samples
                  if s.name == "mirrorckpt_frames_dropped_total" and s.labels.get("where") == "capture")
    assert dropped == c["dropped_capture"]
    while t.is_alive():  # let the worker end: drain what it still puts
        try:
            out.get(timeout=0.1)
        except queue.Empty:
            pass


def test_a_file_fed_worker_whose_compact_thread_fails_still_ends(monkeypatch):
    """A worker of two on a capture file hands its frames to the decode through a compact thread
    (worker.COMPACT_BYTES). If a copy there fails, the decode must not wait for it forever: the worker
    ends and says so to the daemon ("end"), its later frames dropped at the capture edge as counted."""
    import ctypes
    import pathlib

    from mirrorckpt.capture.batch import FrameBatch

    def broken(self):
        raise MemoryError("compact copy")

    pcap = pathlib.Path(__file__).parent / "pcaps" / "demo" / "rank0_egress.pcapng"
    out: queue.Queue = queue.Queue()
    shared = (ctypes.c_int64 * len(COUNTERS))()
    spec = WorkerSpec(port=0, source=str(pcap), batch_frames=64, local_bytes=1, share=(0, 2))
    monkeypatch.setattr("signal.signal", lambda *a: None)
    monkeypatch.setattr(FrameBatch, "copy", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the compact thread's, expected
    t = threading.Thread(target=worker_main, args=(spec, out, threading.Event(), shared), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the worker waits on a compact thread that failed"
    kinds = []
    while not out.empty():
        kinds.append(type(out.get()))
    assert kinds[-1] is Ended and Sends not in kinds
    c = dict(zip(COUNTERS, shared))
    assert c["frames"] > 0 and c["dropped_capture"] > 0


def _daemon_that_dies(pid_file: str) -> None:
    """A stand-in for `serve` killed outright: starts a capture worker, then vanishes."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    shared = ctx.Array("q", len(COUNTERS), lock=False)
    shared[0] = -1  # the worker's first published counters overwrite it: then it is capturing
    out, stop = ctx.Queue(2), ctx.Event()  # referenced until the end: the child unpickles them late
    w = ctx.Process(target=worker_main, args=(WorkerSpec(port=0, source="afpacket:lo"), out, stop, shared),
                    daemon=False)
    w.start()
    deadline = time.monotonic() + 60
    while shared[0] == -1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(pid_file, "w") as f:
        f.write(str(w.pid) if shared[0] != -1 else "never started")
    os._exit(0)


def test_a_capture_worker_ends_when_its_daemon_is_killed(tmp_path):
    """SIGKILL of `serve` used to leave its capture processes polling their ports forever."""
    import multiprocessing as mp
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.fail("needs root (AF_PACKET); CI runs it as root")
    pid_file = tmp_path / "worker.pid"
    p = mp.get_context("spawn").Process(target=_daemon_that_dies, args=(str(pid_file),))
    p.start()
    p.join(60)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail(f"capture worker {pid} still running 20 s after its daemon died")


def test_many_sends_and_none_placed_is_said_once(caplog):
    """Sends keep coming and the state machine places none (a job file that does not match, or a
    port's workers splitting connections of several QPs): one warning naming the reasons; none while
    the job stream is not set up, and none once sends are placed."""
    from mirrorckpt.tools.daemon import streams as streams_mod

    def warned():
        return [r.getMessage() for r in caplog.records if "none placed in a collective" in r.getMessage()]

    n = streams_mod.UNPLACED_WARN_SENDS
    w = JobWatch()
    caplog.set_level("WARNING", logger="mirrorckpt.serve")
    w.check_placed(2 * n)  # no job stream yet: not counted
    counts = {"not_ring": 0}
    w.follow(Job(counts=counts))
    for _ in range(n // 100 - 1):
        counts["not_ring"] += 100
        w.check_placed(100)
    assert not warned() and w.unplaced is None
    counts["not_ring"] += 100
    w.check_placed(100)
    w.check_placed(100)
    want = (f"{n} sends captured and none placed in a collective (why: not_ring {n}): the job file may not match "
            "the traffic, or a port's workers split connections that use several QPs (`mirrorckpt doctor CAPTURE` "
            "tells both)")
    assert warned() == [want] and w.unplaced == want
    ok = JobWatch()
    ok.follow(Job(counts={"placed": 1, "not_ring": 5 * n}))
    ok.check_placed(5 * n)
    assert len(warned()) == 1 and ok.unplaced is None


def test_a_port_is_reported_only_once_it_captures():
    """A worker still opening its source (DPDK's EAL, a fanout group not yet whole) sees no frame:
    the port shows in the metrics (and `status`) only once it captures, so nobody takes it for ready."""
    import ctypes

    arr = (ctypes.c_int64 * len(COUNTERS))()
    s = PortMonitor(Metrics(), ["0"], shared=[arr])

    def ports():
        return {x.labels["port"] for fam in s.metrics.registry.collect() for x in fam.samples
                if x.name == "mirrorckpt_frames_received_total"}

    s.sync()
    assert ports() == set()
    arr[COUNTERS.index("capturing")] = 1
    s.sync()
    assert ports() == {"0"}
