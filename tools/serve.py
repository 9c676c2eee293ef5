"""The appliance daemon: capture workers, parser, updater and persister as pipeline stages.

    port 0: [capture thread] -> drop-if-full queue -> [packet path thread] -+
    port 1: [capture thread] -> drop-if-full queue -> [packet path thread] -+-> sends queue
                      (one process per mirror port: the GIL does not bind)  |
    main process:  [parser thread: state machine, concatenator] -> iterations queue
                   -> [updater thread: replica] -> [persister thread: DCP commits]

Every queue is bounded. When a stage falls behind, its input queue fills, the stage before it
blocks, and in the end the capture thread finds its queue full and drops the batch, counting its
frames: the affected iterations come out incomplete (and ask for a fallback), never corrupt.
When the wire goes quiet (no send from any port for `QueueStreams.idle_seconds`), collectives
that are already complete are handed on at once instead of waiting for traffic to move the
concatenator's window past them: at the end of a job (or a pause) the replica catches up with
the wire. SIGTERM/SIGINT: capture stops, queued data is drained, the last complete iteration is
applied and committed, and the daemon exits 0.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
from mirrorckpt.config.layout import live_source
from mirrorckpt.parser import memory
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.nccl_versions import AUTO
from mirrorckpt.parser.streams import WIRE_IDLE, StreamStats
from mirrorckpt.tools.sendring import SendRing

log = logging.getLogger("mirrorckpt.serve")

# A port that keeps dropping frames is warned about at most this often (the count goes on in the
# metrics); the first drop is always said.
DROP_WARN_S = 10.0
# A live port split over workers has its shares of the bytes looked at once it has captured this
# much (a file's, from its plan); a worker above UNEVEN_SHARE / N of them is said.
SPLIT_CHECK_BYTES = 256 << 20
UNEVEN_SHARE = 1.5


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra` fields."""

    skip = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, r: logging.LogRecord) -> str:
        d = {"ts": round(r.created, 6), "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
        d.update({k: v for k, v in vars(r).items() if k not in self.skip})
        if r.exc_info:
            d["exc"] = self.formatException(r.exc_info)
        return json.dumps(d, default=str)


def setup_logging(level=logging.INFO) -> None:
    h = logging.StreamHandler()
    h.setFormatter(JsonLogFormatter())
    root = logging.getLogger("mirrorckpt")
    root.handlers[:] = [h]
    root.setLevel(level)
    root.propagate = False


# -- capture worker (one process per mirror port) ---------------------------------------------


# Frames per DPDK batch at most: half of DpdkPort's default pool (8191 mbufs); the driver and
# the per-lcore cache hold the rest.
DPDK_MAX_BATCH = 4096


@dataclass
class WorkerSpec:
    port: int
    source: str
    batch_frames: int = 65536
    local_bytes: int = 256 << 20  # captured bytes held between capture and decode before dropping
    icrc: bool = True
    nccl_version: str | None = None  # None: the decoder reads the release's wire facts from the traffic
    pace: str | float | None = None  # file replay: None (as fast as possible), "recorded", Gbit/s
    # a capture file's share: the worker of each UDP source port (parser.split's plan, made once by
    # the daemon so every worker of the port holds the same); None: port mod N, as a live port's kernel
    lut: object = None
    share: tuple[int, int] = (0, 1)  # worker k of N on this port: the frames of its QP pairs (capture.fanout)
    encap: object = None  # config.encap.EncapSpec: the mirror encapsulations taken off (None: any)


# A file-fed worker's frames interleave with its siblings' in the file's pages: walking every other
# ~1 KB frame costs the decode what walking them all does (the prefetchers pull the skipped lines in).
# A third thread copies the worker's frames into compact pieces of about COMPACT_BYTES first, at most
# COMPACT_AHEAD pieces ahead of the decode (the memory this costs stays small).
COMPACT_BYTES = 16 << 20
COMPACT_AHEAD = 2
FANOUT_WAIT_S = 60.0  # for the other workers of a port to join its AF_PACKET fanout group
UNPLACED_WARN_SENDS = 2000  # sends seen with none placed before the parser says so


def split_connection(decoder) -> str | None:
    """What to tell the operator when a connection seems to cut its messages over several QPs
    (NCCL_IB_QPS_PER_CONNECTION > 1): a port's workers are split by QP pair, so each message's
    pieces land in different workers and come out incomplete (never wrong). A message that lost a
    whole piece looks the same, hence a warning, not a stop. A connection whose QPs are all in the
    worker proves them with its first message's pieces (``nq``); one missing some never does."""
    cut = [c.key for c in decoder.conns.values() if c.qp_mode == "cut" and not c.nq and len(c.cut) >= 2]
    if not cut:
        return None
    return (f"connection {cut[0]} cuts messages over several QPs (NCCL_IB_QPS_PER_CONNECTION > 1, or a "
            "lost piece): [[mirror]] workers > 1 splits a port by QP pair, so the pieces of such messages "
            "land in different workers and no iteration they carry can be reassembled; use workers = 1 for "
            "this port if it persists (`mirrorckpt doctor` shows the QPs per connection)")

# A worker's counters, in the shared array the main process reads: they must not wait behind
# the sends in the bounded queue, or the drop counters freeze exactly while the pipeline backs up.
# "capturing": 1 once the source is open (and a port's fanout group whole): frames sent before
# then are not seen, so a port is reported only from then on. "cpu_*_ns": the CPU time of the
# worker's capture thread (with its compact thread, when it has one) and decode thread so far (which of
# its stages limits the port). "mirror_*": frames the mirror lost on its way (GRE sequence gaps) and
# frames the switch cut (parser.encap.MirrorHealth).
COUNTERS = ("frames", "bytes", "dropped_capture", "dropped_kernel", "icrc", "capturing", "cpu_capture_ns",
            "cpu_decode_ns", "mirror_lost", "mirror_truncated")


def worker_main(spec: WorkerSpec, out: mp.Queue, stop: mp.Event, shared=None, ring=None) -> None:
    """Capture thread + packet-path thread; sends go to the main process through ``out`` (their
    bytes through ``ring``, a sendring.SendRing, when given), counters through ``shared`` (an
    int64 array laid out as COUNTERS)."""
    from mirrorckpt.capture.batch import CaptureError
    from mirrorckpt.capture.source import open_source, paced
    from mirrorckpt.parser import encap, split
    from mirrorckpt.parser.packet_path import PacketPath

    memory.freeze_startup_heap()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    parent = os.getppid()  # a daemon killed outright (SIGKILL) must not leave its workers capturing
    local: queue.Queue = queue.Queue()
    held = {"bytes": 0}  # bytes waiting in `local`; the capture edge drops beyond spec.local_bytes
    lock = threading.Lock()
    counters = dict.fromkeys(COUNTERS, 0)

    def publish():
        if shared is not None:
            shared[:] = [int(counters[k]) for k in COUNTERS]
    pp = PacketPath(icrc=spec.icrc, nccl_version=spec.nccl_version, stream=spec.port, messages=False,
                    encapsulation=spec.encap)
    if ring is not None:
        # Every batch the decode thread gets stays valid (a file's mapping, or a live batch's own
        # copy): a Simple send's bytes, or an LL send's words as the decode read them, go from the
        # batch straight into the ring (SendRing.pack), not through its run's buffer first.
        pp.defer_copies()
    damage = None

    def given_up() -> bool:  # while the ring is full
        return stop.is_set() or os.getppid() != parent

    def put(sends):
        # what the decoder has seen of the release goes with its sends: the parser decides it
        fam = pp.nccl.family
        cts = fam.cts.name if fam.cts else None
        for bare, span in ring.pack(sends, given_up) if ring is not None else [(sends, None)]:
            out.put(("sends", spec.port, (bare, cts, fam.imm_order, span)))

    k, n = spec.share
    # a capture file's port split over workers: every worker reads the file and keeps its QP pairs'
    # frames, which reach its decode through `compact`
    file_split = n > 1 and not live_source(spec.source)
    ready: queue.Queue = queue.Queue(COMPACT_AHEAD) if file_split else local
    cpu_compact = {"ns": 0}

    def taken(b):  # a batch leaves `local`: the capture edge may hold more
        if b is not None:
            with lock:
                held["bytes"] -= b.nbytes
        return b

    def hand_over(c) -> bool:
        while threads[0].is_alive():  # a decode thread that died takes nothing more
            try:
                ready.put(c, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def compact():
        try:
            while (b := taken(local.get())) is not None:
                for piece in b.pieces(COMPACT_BYTES):
                    if not hand_over(piece.copy()):  # copy_ranges drops the GIL
                        return
                    cpu_compact["ns"] = time.thread_time_ns()
        finally:  # however it ends (a copy that failed too), the decode waits for nothing more
            hand_over(None)

    def next_batch():
        return ready.get() if file_split else taken(local.get())

    def decode():
        from mirrorckpt.parser.errors import VersionMismatch

        warned = None
        try:
            while True:
                b = next_batch()
                if b is None:
                    break
                _, sends = pp.feed(b)
                counters["icrc"] = pp.counters.icrc_failed
                counters["cpu_decode_ns"] = time.thread_time_ns()
                mirror = pp.counters.mirror
                if mirror.lost != counters["mirror_lost"]:
                    out.put(("mirror", spec.port, {s["session"]: s["lost"] for s in mirror.sessions()}))
                if mirror.truncated and not counters["mirror_truncated"]:  # said once
                    out.put(("warn", spec.port, encap.truncation_advice(mirror)))
                counters["mirror_lost"], counters["mirror_truncated"] = mirror.lost, mirror.truncated
                publish()
                if spec.share[1] > 1 and not warned:
                    warned = split_connection(pp.nccl)
                    if warned:
                        out.put(("warn", spec.port, warned))
                if sends:
                    put(sends)
            _, sends = pp.flush()
            if sends:
                put(sends)
            counters["cpu_decode_ns"] = time.thread_time_ns()
        except VersionMismatch as e:  # the stated release (or the port's own earlier traffic) is contradicted
            out.put(("fatal", spec.port, str(e)))
            stop.set()
            while next_batch() is not None:  # let the capture thread finish
                pass

    threads = [threading.Thread(target=decode, name="decode", daemon=True)]
    if file_split:
        threads.append(threading.Thread(target=compact, name="compact", daemon=True))
    for t in threads:
        t.start()
    try:
        # AF_PACKET hands over whole ring blocks; files and DPDK take a frame count per batch
        # (DPDK's at most DPDK_MAX_BATCH: a batch must fit in the port's mbuf pool)
        opts = {} if spec.source.startswith("afpacket:") else {"batch_frames": spec.batch_frames}
        if n > 1 and spec.source.startswith("afpacket:"):  # the kernel splits the port (capture.fanout)
            opts.update(fanout_workers=n, fanout_worker=k, fanout_walk=encap.split_walk(spec.encap))
        if spec.source.startswith("dpdk:"):
            opts["batch_frames"] = min(spec.batch_frames, DPDK_MAX_BATCH)
        src = open_source(spec.source, **opts)
        it = paced(src, spec.pace) if spec.pace is not None else src
        # a live source reuses its buffers once we move on; a file's batches are views of a
        # read-only mapping that stays valid
        keep = getattr(src, "stable_batches", False)
        if file_split:
            it = (split.share(b, k, n, spec.lut, spec.encap) for b in it)
        elif n > 1 and not (hasattr(src, "wait_fanout") and src.wait_fanout(FANOUT_WAIT_S)):
            raise CaptureError(f"{spec.source}: worker {k} of {n}: not every worker joined the port's fanout "
                               f"group within {FANOUT_WAIT_S:g} s (their frames would be captured by nobody)")
        counters["capturing"] = 1
        publish()
        for batch in it:
            counters["frames"] += len(batch)
            counters["bytes"] += batch.nbytes
            with lock:
                room = held["bytes"] == 0 or held["bytes"] + batch.nbytes <= spec.local_bytes
                if room:
                    held["bytes"] += batch.nbytes
            if room:
                local.put(batch if keep else batch.copy())
            else:
                counters["dropped_capture"] += len(batch)
            kstats = getattr(src, "kernel_drops", None)
            if kstats is not None:
                counters["dropped_kernel"] = int(kstats() if callable(kstats) else kstats)
            counters["cpu_capture_ns"] = time.thread_time_ns() + cpu_compact["ns"]
            publish()
            if stop.is_set():
                break
            if os.getppid() != parent:  # orphaned (sources yield at least every poll): nobody reads
                os._exit(1)  # the queue, and a put or the decode thread could wait on it forever
    except CaptureError as e:
        damage = str(e)
    except Exception as e:  # noqa: BLE001  (any other failure must not look like a clean end of the source)
        damage = f"{type(e).__name__}: {e}"
    finally:
        cpu = time.thread_time_ns()
        local.put(None)
        for t in threads[::-1]:
            t.join()
        counters["cpu_capture_ns"] = cpu + cpu_compact["ns"]
        publish()
        out.put(("end", spec.port, damage))


# -- main process ------------------------------------------------------------------------------


class WireSeen:
    """A capture worker's view of the NCCL release, as ``parser.infer.wire_family`` reads decoders."""

    conns: dict = {}

    def __init__(self):
        self.seen_cts = self.seen_imm = None

    def saw(self, cts: str | None, imm: str | None) -> None:
        from mirrorckpt.parser.nccl_versions import CTS_LAYOUTS

        if cts is not None and (self.seen_cts is None or self.seen_cts.name != cts):
            self.seen_cts = next(h for h, _, _ in CTS_LAYOUTS if h.name == cts)
        self.seen_imm = imm or self.seen_imm


class QueueStreams:
    """Sends from the capture workers as a ``parser.streams.SendStream`` (what MirrorStreams is
    for files in one process)."""

    def __init__(self, q: mp.Queue, nports: int, metrics, stop: threading.Event, stall_seconds: float = 10.0,
                 idle_seconds: float = 2.0, replay_bytes: int = 256 << 20, shared: list | None = None,
                 rings: list | None = None, labels: list[str] | None = None, drop_hints: list[str] | None = None,
                 split_groups: list[list[int]] | None = None):
        self.q, self.nports, self.metrics, self.stop = q, nports, metrics, stop
        self.labels = labels or [str(k) for k in range(nports)]  # the metrics' port label per stream
        # per stream: what to do about drops at its capture edge, said with the warning
        self.drop_hints = drop_hints or [""] * nports
        # the streams of each port split over several workers, until its shares were looked at
        self.split_unchecked = [g for g in (split_groups or []) if len(g) > 1]
        self._drop_warned: dict[int, tuple[float, int]] = {}  # stream -> (time, drops) of its last warning
        self.rings = rings  # per port: the worker's sendring.SendRing (None: bytes come pickled)
        self.shared = shared  # per port: the worker's counters (COUNTERS), read by sync_counters
        self.nstreams = nports
        self.stats = [StreamStats(f"port {lab}") for lab in self.labels]
        self.finished: dict[int, str | None] = {}  # port -> damage (None: clean end)
        self.last_seen: dict[int, float] = {}
        self.stall_seconds = stall_seconds
        # WIRE_IDLE is yielded once no port delivered a send for `idle_seconds` after some did:
        # the wire went quiet (end of the job, a pause).
        self.idle_seconds = idle_seconds
        self.stalled: set[int] = set()
        # Re-arm (the job restarted on a new communicator): ``rearm`` ends the parser's pass. The
        # restarted job's first collectives reach the wire before its REGISTER does, so the ended
        # pass saw them on connections it does not follow (``ring_connections``: the pass's ring
        # connections, set by the daemon); the sends of such connections are kept (newest
        # ``replay_bytes``) and the next pass starts with them. It drops what the old connections
        # still deliver from before the re-arm (the killed run's tail).
        self.restart = threading.Event()
        self.rearmed_ns = 0
        self.ring_connections = dict  # () -> the current pass's ring connections (a container)
        self.placement = lambda: None  # () -> the pass's placement counts (RingStateMachine.counts)
        self.notes = list  # () -> the pass's channel notes so far (ChannelResolver.notes), logged as they come
        self.split_ports = False  # some port has several workers
        self._notes_logged = 0
        self.sends_seen = 0
        self._placement_checked = False
        self.replay_bytes = replay_bytes
        self._outside: collections.deque[list] = collections.deque()
        self._outside_bytes = 0
        self._ring_seen = 0
        self._old: frozenset = frozenset()
        self._replay: list[list] = []
        self.replayed = 0  # sends handed to a new pass from before its re-arm
        self.dropped_old = 0  # sends of the ended run's connections captured before the re-arm
        self.counters: dict[int, dict] = {}
        self._counters_lock = threading.Lock()
        # What each port's decoder saw of the NCCL release (CTS tags stay in the workers: serve
        # takes ranks from the config)
        self.decoders = [WireSeen() for _ in range(nports)]
        self.parser_cpu_ns = 0  # CPU time of the thread that iterates this stream (the parser)

    @property
    def ended(self) -> set[int]:
        """Ports that finished, or went silent for ``stall_seconds`` while another one delivered:
        collectives are not held back for them (their late data can only make things complete)."""
        now = time.monotonic()
        newest = max(self.last_seen.values(), default=now)
        for k in range(self.nports):
            if k not in self.finished and k not in self.stalled and \
                    newest - self.last_seen.get(k, self.started) > self.stall_seconds:
                self.stalled.add(k)
                log.warning("mirror port silent: collectives no longer wait for it", extra={"port": k})
        return set(self.finished) | self.stalled

    def rearm(self) -> None:
        """The job restarted on new connections: end this pass (any thread)."""
        self.rearmed_ns = time.time_ns()
        self.restart.set()

    def next_pass(self) -> int:
        """Prepares the pass after a re-arm (the parser thread, once the ended pass is flushed);
        returns the sends it will start with."""
        self._old = frozenset(self.ring_connections())
        self._replay = [kept for sends in self._outside
                        if (kept := [x for x in sends if x.connection not in self._old])]
        self._outside.clear()
        self._outside_bytes = self._ring_seen = 0
        self.restart.clear()
        return sum(map(len, self._replay))

    def _admit(self, sends: list) -> list:
        if self._old:
            keep = [x for x in sends if x.connection not in self._old or x.ts_ns >= self.rearmed_ns]
            self.dropped_old += len(sends) - len(keep)
            sends = keep
        ring = self.ring_connections()
        if len(ring) != self._ring_seen:  # connections were mapped: what they sent is the pass's own
            self._ring_seen = len(ring)
            self._outside = collections.deque(kept for sends in self._outside
                                              if (kept := [x for x in sends if x.connection not in ring]))
            self._outside_bytes = sum(x.data.nbytes for sends in self._outside for x in sends)
        outside = [x for x in sends if x.connection not in ring]
        for x in outside:  # kept: their own bytes, not a view that holds a whole ring chunk
            x.keep()
        if outside:
            self._outside.append(outside)
            self._outside_bytes += sum(x.data.nbytes for x in outside)
            while self._outside_bytes > self.replay_bytes and len(self._outside) > 1:
                self._outside_bytes -= sum(x.data.nbytes for x in self._outside.popleft())
        return sends

    def __iter__(self):
        self.started = time.monotonic()
        unsettled = None  # time of the newest send since the wire last went quiet
        replay, self._replay = self._replay, []
        for sends in replay:
            self.replayed += len(sends)
            unsettled = time.monotonic()
            yield sends
        while len(self.finished) < self.nports and not self.restart.is_set():
            if unsettled is not None and time.monotonic() - unsettled >= self.idle_seconds:
                unsettled = None
                yield WIRE_IDLE
            self.parser_cpu_ns = time.thread_time_ns()  # the parser thread's work until this item
            try:
                kind, port, payload = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "sends":
                self.last_seen[port] = unsettled = time.monotonic()
                self.stalled.discard(port)
                payload, cts, imm, *span = payload
                if span and span[0] is not None:
                    payload = self.rings[port].unpack(payload, span[0])
                self.decoders[port].saw(cts, imm)
                payload = self._admit(payload)
                if payload:
                    yield payload
                    self._check_placed(len(payload))
                    self._log_notes()
            elif kind == "fatal":
                from mirrorckpt.parser.errors import VersionMismatch

                raise VersionMismatch(f"port {port}: {payload}")
            elif kind == "warn":
                log.warning("%s", payload, extra={"port": self.labels[port]})
            elif kind == "mirror":  # frames lost per mirror session so far
                self.metrics.mirror_lost_sessions(self.labels[port], payload)
            elif kind == "end":
                self.sync_counters()
                self.finished[port] = payload
                self.stats[port].damage = payload
                if payload:
                    log.error("capture source failed", extra={"port": port, "error": payload})

    def _check_placed(self, n: int) -> None:
        """Says once when many sends came and none was placed in a collective: the traffic does
        not match the job file, or a port's workers split connections of several QPs."""
        if self._placement_checked:
            return
        counts = self.placement()
        if counts is None:
            return  # the job stream is not set up yet (its release read from the first sends)
        self.sends_seen += n
        if counts.get("placed", 0):
            self._placement_checked = True  # placing: nothing to say, and nothing more to check
        elif self.sends_seen >= UNPLACED_WARN_SENDS:
            self._placement_checked = True
            why = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
            log.warning(f"{self.sends_seen} sends captured and none placed in a collective (why: {why}): the "
                        "job file may not match the traffic, or a port's workers split connections that use "
                        "several QPs (`mirrorckpt doctor CAPTURE` tells both)")

    def _log_notes(self) -> None:
        """Says each channel decision as the parser makes it; a connection left unplaced is a
        warning (its collectives stay incomplete), with the likely cause when workers split ports."""
        notes = self.notes()
        for n in notes[self._notes_logged:]:
            if "not placed" not in n:
                log.info("%s", n)
            elif self.split_ports:
                log.warning("%s; with [[mirror]] workers > 1 a port is split by QP pair, so the QPs of a connection "
                            "that uses several (NCCL_IB_QPS_PER_CONNECTION > 1) land in different workers: use "
                            "workers = 1 for this port if it persists", n)
            else:
                log.warning("%s", n)
        self._notes_logged = len(notes)

    def sync_counters(self) -> None:
        """Brings the metrics up to the workers' shared counters (any thread; the daemon calls it
        every 0.2 s, so the drop counters move while the queues are full)."""
        if self.shared is None:
            return
        with self._counters_lock:
            for port, arr in enumerate(self.shared):
                self._stats(port, dict(zip(COUNTERS, arr[:])))

    def _stats(self, port: int, c: dict) -> None:
        if not c.get("capturing") and not c.get("frames"):
            return  # not capturing yet: the port is not reported (status, metrics) before it can see frames
        old = self.counters.get(port, {})
        m, lp = self.metrics, self.labels[port]
        m.frames.labels(lp).inc(max(0, c["frames"] - old.get("frames", 0)))
        m.bytes.labels(lp).inc(max(0, c["bytes"] - old.get("bytes", 0)))
        m.dropped.labels(lp, "capture").inc(max(0, c["dropped_capture"] - old.get("dropped_capture", 0)))
        m.dropped.labels(lp, "kernel").inc(max(0, c["dropped_kernel"] - old.get("dropped_kernel", 0)))
        m.icrc.labels(lp).inc(max(0, c["icrc"] - old.get("icrc", 0)))
        m.truncated.labels(lp).inc(max(0, c["mirror_truncated"] - old.get("mirror_truncated", 0)))
        for stage in ("capture", "decode"):
            k = f"cpu_{stage}_ns"
            m.stage_cpu.labels(stage, lp).inc(max(0, c[k] - old.get(k, 0)) / 1e9)
        self.counters[port] = c
        self.stats[port].frames, self.stats[port].bytes = c["frames"], c["bytes"]
        self._warn_drops(port, c)
        self._check_split()

    def _check_split(self) -> None:
        """Says once per live port when its workers' shares of the bytes are uneven (a capture
        file's are known from its plan, and its workers read it at their own pace)."""
        for g in list(self.split_unchecked):
            got = [self.counters.get(p, {}).get("bytes", 0) for p in g]
            if sum(got) < SPLIT_CHECK_BYTES:
                continue
            self.split_unchecked.remove(g)
            warn_uneven([self.labels[p] for p in g], [round(x / sum(got), 3) for x in got])

    def _warn_drops(self, port: int, c: dict) -> None:
        """Drops make iterations incomplete (a fallback each): the log says so where it happens,
        not only the metrics."""
        n = c["dropped_capture"] + c["dropped_kernel"]
        when, said = self._drop_warned.get(port, (0.0, 0))
        now = time.monotonic()
        if n > said and (not said or now - when >= DROP_WARN_S):
            self._drop_warned[port] = (now, n)
            log.warning("frames dropped: the iterations they carried are incomplete",
                        extra={"port": self.labels[port], "dropped_capture": c["dropped_capture"],
                               "dropped_kernel": c["dropped_kernel"], "frames": c["frames"],
                               "hint": self.drop_hints[port]})

    def drops(self) -> dict:
        """Per stream with any: frames dropped at its capture edge and by the kernel (or NIC)."""
        return {self.labels[p]: {"capture": c["dropped_capture"], "kernel": c["dropped_kernel"]}
                for p, c in sorted(self.counters.items()) if c["dropped_capture"] or c["dropped_kernel"]}


class _Prefixed:
    """A send stream that yields sends already taken from it, each with the streams that had
    ended when it was taken (later ends must not finalize collectives before their data), then
    goes on with its iterator."""

    def __init__(self, streams, first: list[tuple[list, set]], it):
        self.streams, self.first, self.it = streams, first, it
        self._ended: set | None = None

    def __getattr__(self, name):
        return getattr(self.streams, name)

    @property
    def ended(self) -> set[int]:
        return self._ended if self._ended is not None else self.streams.ended

    def __iter__(self):
        for sends, ended in self.first:
            self._ended = ended
            yield sends
        self.first, self._ended = [], None
        yield from self.it


class _UpdaterQueue:
    """The parser thread's sink: items go to the updater thread over a bounded queue (a full
    queue blocks the parser: back-pressure)."""

    def __init__(self, q: queue.Queue, metrics, run: int = 0):
        self.q, self.metrics, self.run = q, metrics, run  # run: which start of the job this stream follows

    def initial_weights(self, w) -> None:
        self.q.put(w)

    def bucket(self, b) -> None:
        self.q.put(b)

    def apply(self, it) -> None:
        it.run = self.run
        self.metrics.iterations.labels("complete" if it.complete else "incomplete").inc()
        self.metrics.wire_iteration.set(it.index)
        self.q.put(it)
        self.metrics.queue_depth.labels("iterations").set(self.q.qsize())


def _placement(js) -> dict | None:
    """The placement counts of a job stream's state machine so far (None before its set-up)."""
    a = js.assembler
    return dict(a.sm.counts) if a is not None else None


def _channel_notes(js) -> list[str]:
    """What the job stream's channel resolver noted so far (decisions, connections not placed)."""
    a = js.assembler
    return a.resolver.notes if a is not None and a.resolver is not None else []


def _ring_connections(js) -> dict:
    """The ring connections a job stream follows (mapped to channels so far)."""
    a = js.assembler
    return a.resolver.mapped if a is not None and a.resolver is not None else {}


def warn_uneven(ports: list[str], share: list[float]) -> None:
    """A port is split by whole QP pairs: a few pairs (or one carrying most bytes) leave the extra
    workers idle, which the operator should hear of."""
    if max(share) > UNEVEN_SHARE / len(share):
        log.warning("a port's workers are unevenly loaded: it is split by whole QP pairs, and its pairs do not "
                    "spread (few of them, or one carrying most bytes; a live port's kernel splits by UDP source "
                    "port mod N): workers beyond the busiest add little",
                    extra={"ports": ports, "share_of_bytes": share})


def stream_label(mirror: int, worker: int, workers: int) -> str:
    """A capture stream's name in metrics and logs: the port, and the worker when it has several."""
    return str(mirror) if workers == 1 else f"{mirror}.{worker}"


class Daemon:
    """`mirrorckpt serve`: owns the workers, the parser and updater threads and the endpoints."""

    def __init__(self, job, training, persist, metrics, iteration_queue: int = 4, sends_queue: int = 64,
                 pace=None, updater_delay: float = 0.0, control=None, pipelined: bool = False):
        self.job, self.training, self.persist, self.metrics = job, training, persist, metrics
        self.pipelined = pipelined  # buckets stepped ahead of their iteration (Appliance; not with a control plane)
        self.pace = pace
        self.updater_delay = updater_delay  # tests: a deliberately slow updater
        self.control = control  # control.appliance_side.AppliancePlane: fallbacks, drift checks, restore
        self.ctx = mp.get_context("spawn")
        self.sends_q = self.ctx.Queue(maxsize=sends_queue)
        self.iters_q: queue.Queue = queue.Queue(maxsize=iteration_queue)
        self.stop_capture = self.ctx.Event()
        self.stopping = threading.Event()
        self.workers: list = []
        # one stream per capture worker: (mirror index, worker k, workers N)
        self.stream_of = [(i, k, m.workers) for i, m in enumerate(job.mirrors) for k in range(m.workers)]
        self.shared = [self.ctx.Array("q", len(COUNTERS), lock=False) for _ in self.stream_of]
        ring_bytes = job.capture.get("transfer_bytes", 128 << 20)
        self.rings = [SendRing(self.ctx, ring_bytes) for _ in self.stream_of] if ring_bytes else None
        # capture timestamps are this host's clock: wire-to-step and wire-to-commit times are measured
        self.live = bool(job.mirrors) and all(m.live for m in job.mirrors)
        self._wire_ts: dict[int, int] = {}  # checkpoint step -> its iteration's last capture timestamp
        self._lat_lock = threading.Lock()
        self.latencies: collections.deque = collections.deque(maxlen=4096)  # (what, seconds, wire ts), newest last
        self.updater_cpu_ns = 0
        self._cpu_seen = {"parser": 0, "updater": 0}
        self._appliance = None
        self.streams = None
        self.error: BaseException | None = None

    def _file_split(self, m):
        """The worker of each UDP source port of mirror ``m``'s capture file split over its workers: a
        connection's QP pairs together, dealt out by bytes (parser.split), unless ``[capture]
        file_split = "port"``; None for live sources (the kernel splits by port) and one worker."""
        from mirrorckpt.capture.batch import CaptureError
        from mirrorckpt.capture.source import open_source
        from mirrorckpt.parser import split

        source, workers = m.source, m.workers
        if workers == 1 or m.live:
            return None
        by_port = self.job.capture.get("file_split", "connection") == "port"
        try:
            with open_source(source, batch_frames=self.job.capture.get("batch_frames", 65536)) as start:
                lut, found = split.plan(start, workers, by_port=by_port, encapsulation=self.job.encap)
        except (CaptureError, OSError):
            return None  # each worker meets the same error opening it, and reports it as its port's
        log.info("capture file split over its workers", extra={"source": str(source), **found})
        warn_uneven([str(source)], found["share_of_bytes"])
        return None if by_port else lut.astype(np.int32)

    def start_workers(self) -> None:
        cap = self.job.capture
        luts = {i: self._file_split(m) for i, m in enumerate(self.job.mirrors)}
        for s, (i, k, n) in enumerate(self.stream_of):
            m = self.job.mirrors[i]
            spec = WorkerSpec(port=s, source=m.source, batch_frames=cap.get("batch_frames", 65536),
                              local_bytes=cap.get("queue_bytes", 256 << 20), nccl_version=self.job.ring.nccl_version,
                              pace=self.pace, share=(k, n), lut=luts[i], encap=self.job.encap)
            ring = self.rings[s] if self.rings else None
            p = self.ctx.Process(target=worker_main, args=(spec, self.sends_q, self.stop_capture, self.shared[s], ring),
                                 name=f"mirrorckpt-capture-{stream_label(i, k, n)}", daemon=True)
            p.start()
            self.workers.append(p)
        log.info("capture workers started", extra={"ports": [m.source for m in self.job.mirrors]})

    def request_stop(self, *_):
        if not self.stopping.is_set():
            log.info("stop requested: draining, then committing a last checkpoint")
        self.stopping.set()
        self.stop_capture.set()

    @property
    def appliance(self):
        return self.control.app if self.control is not None else self._appliance

    def _on_rearm(self, run: int) -> None:
        """The job restarted (control plane thread): the parser starts over on the new connections."""
        self.metrics.rearms.inc()
        if self.streams is not None:
            self.streams.rearm()

    def _drop_hint(self, m) -> str:
        if not m.live and self.pace is None:
            return ("a capture file served without --pace is offered as fast as it can be read, as a port at "
                    "line rate would be: raise [capture] queue_bytes above its size to process every frame")
        return ("capture edge: a stage behind it is slower than the port ([capture] queue_bytes full; the "
                "'stage CPU seconds' line at stop says which); kernel: the capture ring or NIC queue was full")

    def _parser(self) -> None:
        from mirrorckpt.parser.pipeline import JobStream
        from mirrorckpt.updater.drive import drive

        streams = QueueStreams(self.sends_q, len(self.stream_of), self.metrics, self.stopping,
                               replay_bytes=self.job.capture.get("queue_bytes", 256 << 20), shared=self.shared,
                               rings=self.rings, labels=[stream_label(*x) for x in self.stream_of],
                               drop_hints=[self._drop_hint(self.job.mirrors[i]) for i, _, _ in self.stream_of],
                               split_groups=[[s for s, (j, _, _) in enumerate(self.stream_of) if j == i]
                                             for i, m in enumerate(self.job.mirrors) if m.live])
        self.streams = streams
        try:
            while not self.stopping.is_set():
                run = self.control.run if self.control is not None else 0
                model = self._job_model()
                if model is None:
                    return
                ring = self.control.ring if self.control is not None and self.control.ring else self.job.ring
                source = streams
                if model.ring.nccl_version is None or model.ring.protocol == AUTO:
                    model, source = self._from_wire(streams, model, ring)
                    if model is None:
                        return
                js = JobStream(source, model=model, ranks=ring.ranks_by_address(),
                               nccl_version=model.ring.nccl_version, infer_after=2000, p2p_fill=self.job.p2p_fill)
                self.jobstream = js
                streams.ring_connections = functools.partial(_ring_connections, js)
                streams.placement = functools.partial(_placement, js)
                streams.notes = functools.partial(_channel_notes, js)
                streams.split_ports, streams._notes_logged = any(w > 1 for _, _, w in self.stream_of), 0
                drive(js, _UpdaterQueue(self.iters_q, self.metrics, run))
                if not streams.restart.is_set():
                    return  # every capture source ended
                early = streams.next_pass()
                log.info("parser restarted for the job's new communicator",
                         extra={"run": run + 1, "sends_before_rearm": early})
        except BaseException as e:  # a parser failure stops the daemon with the reason logged
            self.error = e
            log.exception("parser stopped")
        finally:
            streams.parser_cpu_ns = time.thread_time_ns()
            self.iters_q.put(None)

    def _from_wire(self, streams, model, ring, window: int = 2000):
        """The job model with what its configuration left open (the NCCL release, the protocol of
        each collective shape) read from the first ``window`` sends, and a stream that hands those
        sends on first. (None, None) when the wire ended before any send."""
        from mirrorckpt.parser.infer import infer

        it = iter(streams)
        pending: list = []
        for sends in it:
            if sends is WIRE_IDLE:
                if pending:
                    break
                continue
            pending.append(([s.keep() for s in sends], set(streams.ended)))  # held until inference ends
            if sum(len(b) for b, _ in pending) >= window:
                break
        if not pending:
            return None, None
        got = infer([s for b, _ in pending for s in b], streams.decoders, self.job.grad_dtype, model.ring.nccl_version,
                    model, ring)
        log.info("NCCL release and protocols read from the wire", extra={"nccl_version": got.model.ring.nccl_version,
                                                                          "notes": got.notes})
        return got.model, _Prefixed(streams, pending, it)  # the configured sequence, completed

    def _job_model(self):
        """The job's collective sequence: from the configuration, or once the trainer registered its
        layout (frames wait in the capture queues meanwhile). None if stopped before that."""
        from mirrorckpt.parser.collectives import JobModel

        if self.job.kind != "ddp" or self.job.layout is not None:
            return JobModel.from_job(self.job)
        if not self.control.registered.is_set():
            log.info("waiting for the trainer to register the job's layout")
            while not self.control.registered.wait(0.2):
                if self.stopping.is_set():
                    return None
            log.info("layout registered: following the mirror", extra={"params": len(self.control.layout.params)})
        return JobModel.ddp(self.job.ring, self.control.layout, with_startup=self.job.startup)

    def _updater(self) -> None:
        from mirrorckpt.updater.drive import drive

        sink = self.control if self.control is not None else self.appliance  # the plane: fallbacks, replays
        drive(iter(self._next_update, None), sink, self._updated)  # metrics after each step

    def _next_update(self):
        self.updater_cpu_ns = time.thread_time_ns()  # the updater thread's work until this item
        item = self.iters_q.get()
        self.metrics.queue_depth.labels("iterations").set(self.iters_q.qsize())
        if item is not None and self.updater_delay:
            time.sleep(self.updater_delay)
        return item

    def _updated(self, it) -> None:
        if not isinstance(it, ReducedIteration):
            return
        m = self.metrics
        if self.control is not None:
            m.fallbacks.inc(self.control.stats.fallbacks_requested - self._fallbacks_seen)
            self._fallbacks_seen = self.control.stats.fallbacks_requested
        r = self.appliance.replica if self.appliance is not None else None
        if r is not None:
            m.replica_step.set(r.step)
            m.replica_iteration.set(r.iteration)
            m.stale.set(1 if r.stale is not None else 0)
            m.lag.set(max(0, it.index - r.iteration))
            if it.complete and r.iteration == it.index and r.stale is None:
                self._landed(it, "step")

    def _landed(self, it, what: str) -> None:
        """Seconds from the iteration's last captured packet to its replica step (``what`` "step")
        or its committed checkpoint ("commit"). Live captures only: a file's timestamps are the
        recording's, and a NIC clock (DPDK device timestamps) is not this host's; an implausible
        difference is not recorded."""
        if not self.live:
            return
        with self._lat_lock:  # the updater thread adds, the persister's thread takes
            if what == "step":
                self._wire_ts[it.index + 1] = it.last_ts  # the checkpoint of this step is named index + 1
                while len(self._wire_ts) > 4096:
                    self._wire_ts.pop(next(iter(self._wire_ts)))
                ts = it.last_ts
            else:
                ts = self._wire_ts.pop(it, 0)
        seconds = (time.time_ns() - ts) / 1e9
        if ts > 0 and 0 <= seconds < 3600:
            (self.metrics.step_latency if what == "step" else self.metrics.commit_latency).observe(seconds)
            self.latencies.append((what, seconds, ts))

    def _sync_counters(self, done: threading.Event) -> None:
        while not done.wait(0.2):
            self._sync_once()
        self._sync_once()

    def _sync_once(self) -> None:
        if self.streams is not None:
            self.streams.sync_counters()
        for stage, ns in self._main_cpu().items():
            self.metrics.stage_cpu.labels(stage, "").inc(max(0, ns - self._cpu_seen[stage]) / 1e9)
            self._cpu_seen[stage] = max(ns, self._cpu_seen[stage])

    def _main_cpu(self) -> dict[str, int]:
        return {"parser": self.streams.parser_cpu_ns if self.streams is not None else 0,
                "updater": self.updater_cpu_ns}

    def stage_cpu(self) -> dict:
        """CPU seconds of each stage's thread so far: capture and decode per capture stream, the
        parser, the updater (its own thread; torch's pool threads, when it has more than one, are
        in ``daemon_process``), and this process's whole CPU time (start-up included)."""
        import resource

        per = {"capture": {}, "decode": {}}
        if self.streams is not None:
            for port, c in sorted(self.streams.counters.items()):
                for stage in per:
                    per[stage][self.streams.labels[port]] = round(c.get(f"cpu_{stage}_ns", 0) / 1e9, 4)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {**per, **{k: round(v / 1e9, 4) for k, v in self._main_cpu().items()},
                "daemon_process": round(ru.ru_utime + ru.ru_stime, 4)}

    def _on_stale(self, exc) -> None:
        self.metrics.fallbacks.inc()
        log.warning("replica stale: fallback checkpoint requested",
                    extra={"iteration": exc.iteration, "step": exc.step})
        if self.control is not None:
            self.control.on_stale(exc)

    def _on_commit(self, path) -> None:
        from mirrorckpt.updater import ckptdir

        step = ckptdir.parse_step(path.name)
        self.metrics.last_committed.set(step)
        per = getattr(self.appliance, "persister", None)
        if per is not None:
            self.metrics.persist_seconds.observe(per.stats.last_commit_seconds)
        self._landed(step, "commit")
        log.info("checkpoint committed", extra={"path": str(path)})

    def run(self) -> int:
        from mirrorckpt.updater.appliance import Appliance

        self._fallbacks_seen = 0
        if self.control is not None:
            # the plane owns the appliance (created when the layout is known; resyncs replace its
            # replica); it tells the parser when the job restarted on a new communicator
            self.control.on_commit = self._on_commit
            self.control.on_rearm = self._on_rearm
            if self.control.app is not None:
                self.control.app.on_commit = self._on_commit
            self.control.start()
            log.info("control plane listening", extra={"port": self.control.port})
        else:
            self._appliance = Appliance(self.job.layout, self.training, self.persist, on_stale=self._on_stale,
                                        pipelined=self.pipelined)
            self._appliance.on_commit = self._on_commit
        memory.freeze_startup_heap()  # torch and the job are loaded: the threads below never collect them
        self.start_workers()
        parser = threading.Thread(target=self._parser, name="parser", daemon=True)
        updater = threading.Thread(target=self._updater, name="updater", daemon=True)
        done = threading.Event()
        counters = threading.Thread(target=self._sync_counters, args=(done,), name="counters", daemon=True)
        parser.start()
        updater.start()
        counters.start()
        parser.join()
        updater.join()
        for w in self.workers:
            w.join(timeout=10)
        done.set()
        counters.join()
        log.info("stage CPU seconds", extra=self.stage_cpu())
        drops = self.streams.drops() if self.streams is not None else {}
        if drops:
            log.warning("frames dropped while serving", extra={"ports": drops})
        if self.control is not None:
            self.control.server.stop()
        if self.appliance is not None:
            summary = self.appliance.close()
            log.info("appliance stopped", extra=summary.to_dict())
        else:
            log.warning("appliance stopped before any trainer registered the job: no replica, nothing committed")
        failed = self.streams is not None and self.streams.finished and all(
            d is not None for d in self.streams.finished.values())
        if failed:
            log.error("every capture source failed", extra={"sources": self.streams.finished})
        return 1 if self.error is not None or failed else 0
