"""The capture workers' sends as one send stream (``parser.streams.SendStream``), as
``MirrorStreams`` is for files in one process.

Re-arm (the job restarted on a new communicator): ``rearm`` ends the parser's pass. The restarted
job's first collectives reach the wire before its REGISTER does, so the ended pass saw them on
connections it does not follow (the pass's ring connections, from the job stream it follows); the
sends of such connections are kept (newest ``replay_bytes``) and the next pass starts with them. It
drops what the old connections still deliver from before the re-arm (the killed run's tail).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from mirrorckpt.parser.streams import WIRE_IDLE, StreamStats
from mirrorckpt.tools.daemon.worker import Ended, Fatal, MirrorLoss, Note, Seen, Sends

log = logging.getLogger("mirrorckpt.serve")

UNPLACED_WARN_SENDS = 2000  # sends seen with none placed before the parser says so


class WireSeen:
    """A capture worker's view of the NCCL release, as ``parser.infer.wire_family`` reads decoders."""

    conns: dict = {}

    def __init__(self):
        self.seen_cts = self.seen_imm = None

    def saw(self, cts: str | None, imm: str | None) -> None:
        from mirrorckpt.parser.roce.nccl_versions import CTS_LAYOUTS

        if cts is not None and (self.seen_cts is None or self.seen_cts.name != cts):
            self.seen_cts = next(h for h, _, _ in CTS_LAYOUTS if h.name == cts)
        self.seen_imm = imm or self.seen_imm


class JobWatch:
    """What the job stream a pass follows makes of the sends, said where it matters: many sends and
    none placed (a job file that does not match, or a port's workers splitting connections of several
    QPs), and each channel decision (a connection left unplaced is a warning: its collectives stay
    incomplete). Reads only the job stream's public view (``parser.pipeline.JobStream``)."""

    def __init__(self, split_ports: bool = False):
        self.split_ports = split_ports  # some port has several workers
        self.job = None
        self.sends_seen = 0
        self.unplaced: str | None = None  # said once: why nothing is placed
        self._placement_checked = False
        self._notes_logged = 0

    def follow(self, job) -> None:
        """A new pass: its job stream (None between passes)."""
        self.job = job
        self._notes_logged = 0

    def ring_connections(self):
        return self.job.ring_connections() if self.job is not None else {}

    def after(self, n: int) -> None:
        self.check_placed(n)
        self.log_notes()

    def check_placed(self, n: int) -> None:
        if self._placement_checked:
            return
        counts = self.job.placement_counts() if self.job is not None else None
        if counts is None:
            return  # the job stream is not set up yet (its release read from the first sends)
        self.sends_seen += n
        if counts.get("placed", 0):
            self._placement_checked = True  # placing: nothing to say, and nothing more to check
        elif self.sends_seen >= UNPLACED_WARN_SENDS:
            self._placement_checked = True
            why = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
            self.unplaced = (f"{self.sends_seen} sends captured and none placed in a collective (why: {why}): the "
                             "job file may not match the traffic, or a port's workers split connections that use "
                             "several QPs (`mirrorckpt doctor CAPTURE` tells both)")
            log.warning(self.unplaced)

    def log_notes(self) -> None:
        notes = self.job.channel_notes() if self.job is not None else []
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


class QueueStreams:
    """Sends from the capture workers' queue as a send stream. ``ports`` (``ports.PortMonitor``)
    takes what the workers say of their ports; ``watch`` (``JobWatch``) what the parser makes of it."""

    def __init__(self, q, ports, watch: JobWatch | None = None, stall_seconds: float = 10.0,
                 idle_seconds: float = 2.0, replay_bytes: int = 256 << 20, rings: list | None = None):
        self.q, self.ports = q, ports
        self.watch = watch or JobWatch()
        self.nports = self.nstreams = ports.nports
        self.labels = ports.labels
        self.rings = rings  # per port: the worker's sendring.SendRing (None: bytes come pickled)
        self.stats = [StreamStats(f"port {lab}") for lab in self.labels]
        self.finished: dict[int, str | None] = {}  # port -> damage (None: clean end)
        self.last_seen: dict[int, float] = {}
        self.stall_seconds = stall_seconds
        # WIRE_IDLE is yielded once no port delivered a send for `idle_seconds` after some did:
        # the wire went quiet (end of the job, a pause).
        self.idle_seconds = idle_seconds
        self.stalled: set[int] = set()
        self.restart = threading.Event()
        self.rearmed_ns = 0
        self.replay_bytes = replay_bytes
        self._outside: collections.deque[list] = collections.deque()
        self._outside_bytes = 0
        self._ring_seen = 0
        self._old: frozenset = frozenset()
        self._replay: list[list] = []
        self.replayed = 0  # sends handed to a new pass from before its re-arm
        self.dropped_old = 0  # sends of the ended run's connections captured before the re-arm
        # What each port's decoder saw of the NCCL release (CTS tags stay in the workers: serve
        # takes ranks from the config)
        self.decoders = [WireSeen() for _ in range(self.nports)]
        self.parser_cpu_ns = 0  # CPU time of the thread that iterates this stream (the parser)
        self.started = time.monotonic()

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

    @property
    def all_ended(self) -> bool:
        return len(self.finished) == self.nports

    @property
    def held_bytes(self) -> int:
        """Bytes of sends kept for the next pass (connections the current pass does not follow)."""
        return self._outside_bytes

    def rearm(self) -> None:
        """The job restarted on new connections: end this pass (any thread)."""
        self.rearmed_ns = time.time_ns()
        self.restart.set()

    def next_pass(self) -> int:
        """Prepares the pass after a re-arm (the parser thread, once the ended pass is flushed);
        returns the sends it will start with."""
        self._old = frozenset(self.watch.ring_connections())
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
        ring = self.watch.ring_connections()
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
        unsettled = None  # time of the newest send since the wire last went quiet
        replay, self._replay = self._replay, []
        for sends in replay:
            self.replayed += len(sends)
            unsettled = time.monotonic()
            yield sends
        while not self.all_ended and not self.restart.is_set():
            if unsettled is not None and time.monotonic() - unsettled >= self.idle_seconds:
                unsettled = None
                yield WIRE_IDLE
            self.parser_cpu_ns = time.thread_time_ns()  # the parser thread's work until this item
            try:
                msg = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(msg, Sends):
                self.last_seen[msg.port] = unsettled = time.monotonic()
                self.stalled.discard(msg.port)
                sends = self.rings[msg.port].unpack(msg.sends, msg.span) if msg.span is not None else msg.sends
                self.decoders[msg.port].saw(msg.cts, msg.imm_order)
                sends = self._admit(sends)
                if sends:
                    yield sends
                    self.watch.after(len(sends))
            else:
                self._message(msg)

    def _message(self, msg) -> None:
        if isinstance(msg, Fatal):
            from mirrorckpt.parser.errors import VersionMismatch

            raise VersionMismatch(f"port {msg.port}: {msg.text}")
        if isinstance(msg, Note):
            log.warning("%s", msg.text, extra={"port": self.labels[msg.port]})
        elif isinstance(msg, Seen):
            self.ports.seen(msg.port, msg.classes)
        elif isinstance(msg, MirrorLoss):
            self.ports.mirror_lost(msg.port, msg.sessions)
        elif isinstance(msg, Ended):
            self.ports.sync(self.stats)
            self.finished[msg.port] = msg.damage
            self.stats[msg.port].damage = msg.damage
            self.ports.ended(msg.port, msg.damage)
            if msg.damage:
                log.error("capture source failed", extra={"port": msg.port, "error": msg.damage})


class Prefixed:
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
