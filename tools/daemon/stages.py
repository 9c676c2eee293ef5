"""The main process's pipeline threads: the parser (send stream -> job stream -> items) and the
updater (items -> the replica), with the bounded queue between them."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.roce.nccl_versions import AUTO
from mirrorckpt.parser.streams import WIRE_IDLE
from mirrorckpt.tools.daemon.streams import Prefixed

log = logging.getLogger("mirrorckpt.serve")

INFER_WINDOW = 2000  # sends read before what the job file leaves to NCCL is decided from the wire


class UpdaterQueue:
    """The parser thread's sink: items go to the updater thread over a bounded queue (a full
    queue blocks the parser: back-pressure)."""

    def __init__(self, q: queue.Queue, metrics, run: int = 0):
        self.q, self.metrics, self.run = q, metrics, run  # run: which start of the job this stream follows

    def initial_weights(self, w) -> None:
        self.q.put(w)

    def bucket(self, b) -> None:
        self.q.put(b)

    def weights(self, g) -> None:
        self.q.put(g)

    def apply(self, it) -> None:
        it.run = self.run
        self.metrics.iterations.labels("complete" if it.complete else "incomplete").inc()
        self.metrics.wire_iteration.set(it.index)
        self.q.put(it)
        self.metrics.queue_depth.labels("iterations").set(self.q.qsize())


class ParserStage:
    """The parser thread: one pass per run of the job (a re-arm starts the next pass on the new
    connections). ``model()`` gives the job's collective sequence (None: stopped before it was
    known); ``ring()`` the ring the pass follows; ``run()`` which start of the job this is."""

    def __init__(self, streams, sink_queue: queue.Queue, metrics, stopping: threading.Event, *, model, ring, run,
                 grad_dtype: str, p2p_fill: bool = False):
        self.streams, self.sink_queue, self.metrics, self.stopping = streams, sink_queue, metrics, stopping
        self.model, self.ring, self.run = model, ring, run
        self.grad_dtype, self.p2p_fill = grad_dtype, p2p_fill
        self.error: BaseException | None = None
        self.job = None  # the pass's job stream

    def __call__(self) -> None:
        from mirrorckpt.updater.drive import drive

        try:
            while not self.stopping.is_set():
                js = self._pass()
                if js is not None:
                    drive(js, UpdaterQueue(self.sink_queue, self.metrics, self.run()))
                if not self.streams.restart.is_set():
                    return  # every capture source ended (or the daemon stops)
                early = self.streams.next_pass()
                log.info("parser restarted for the job's new communicator",
                         extra={"run": self.run() + 1, "sends_before_rearm": early})
        except BaseException as e:  # a parser failure stops the daemon with the reason logged
            self.error = e
            log.exception("parser stopped")
        finally:
            self.streams.parser_cpu_ns = time.thread_time_ns()
            self.sink_queue.put(None)

    def _pass(self):
        """This pass's job stream, or None when the wire ended (or re-armed) before it could start."""
        from mirrorckpt.parser.roce.jobstream import JobStream

        model = self.model()
        if model is None:
            return None
        ring = self.ring()
        source = self.streams
        if model.ring.nccl_version is None or model.ring.protocol == AUTO:
            model, source = self._from_wire(model, ring)
            if model is None:
                return None
        js = JobStream(source, model=model, ranks=ring.ranks_by_address(), nccl_version=model.ring.nccl_version,
                       infer_after=INFER_WINDOW, p2p_fill=self.p2p_fill)
        self.job = js
        self.streams.watch.follow(js)
        return js

    def _from_wire(self, model, ring):
        """The job model with what its configuration left open (the NCCL release, the protocol of
        each collective shape) read from the first INFER_WINDOW sends, and a stream that hands those
        sends on first. (None, None) when the wire ended or the job re-armed before any send."""
        from mirrorckpt.parser.roce.infer import infer

        it = iter(self.streams)
        pending: list = []
        for sends in it:
            if sends is WIRE_IDLE:
                if pending:
                    break
                continue
            pending.append(([s.keep() for s in sends], set(self.streams.ended)))  # held until inference ends
            if sum(len(b) for b, _ in pending) >= INFER_WINDOW:
                break
        if not pending:
            return None, None
        got = infer([s for b, _ in pending for s in b], self.streams.decoders, self.grad_dtype,
                    model.ring.nccl_version, model, ring)
        log.info("NCCL release and protocols read from the wire", extra={"nccl_version": got.model.ring.nccl_version,
                                                                          "notes": got.notes})
        return got.model, Prefixed(self.streams, pending, it)  # the configured sequence, completed


class Latencies:
    """Seconds from an iteration's last captured packet to its replica step ("step") or its
    committed checkpoint ("commit"). Live captures only: a file's timestamps are the recording's,
    and a NIC clock (DPDK device timestamps) is not this host's; an implausible difference is not
    recorded."""

    def __init__(self, metrics, live: bool):
        self.metrics, self.live = metrics, live
        self._wire_ts: dict[int, int] = {}  # checkpoint step -> its iteration's last capture timestamp
        self._lock = threading.Lock()  # the updater thread adds, the persister's thread takes
        self.seen: collections.deque = collections.deque(maxlen=4096)  # (what, seconds, wire ts), newest last

    def stepped(self, it: ReducedIteration) -> None:
        if not self.live:
            return
        with self._lock:
            self._wire_ts[it.index + 1] = it.last_ts  # the checkpoint of this step is named index + 1
            while len(self._wire_ts) > 4096:
                self._wire_ts.pop(next(iter(self._wire_ts)))
        self._observe("step", it.last_ts)

    def committed(self, step: int) -> None:
        if not self.live:
            return
        with self._lock:
            ts = self._wire_ts.pop(step, 0)
        self._observe("commit", ts)

    def _observe(self, what: str, ts: int) -> None:
        seconds = (time.time_ns() - ts) / 1e9
        if ts > 0 and 0 <= seconds < 3600:
            (self.metrics.step_latency if what == "step" else self.metrics.commit_latency).observe(seconds)
            self.seen.append((what, seconds, ts))
