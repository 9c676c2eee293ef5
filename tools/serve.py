"""The appliance daemon, wired: capture workers, parser, updater and persister as pipeline stages,
the control plane, and the protection verdict.

    port 0: [capture worker process: capture -> decode] -+
    port 1: [capture worker process: capture -> decode] -+-> sends queue (typed messages, bytes in shared rings)
    main process:  [parser thread] -> iterations queue -> [updater thread: replica] -> [persister thread]
                   [monitor thread: port counters -> metrics; protection verdict -> metrics, degraded fallbacks]

Every queue is bounded. When a stage falls behind, its input queue fills, the stage before it
blocks, and in the end the capture edge drops whole batches (counted and warned): the affected
iterations come out incomplete (and ask for a fallback), never corrupt. When the wire goes quiet,
collectives already complete are handed on at once. The daemon ends only when told to
(SIGTERM/SIGINT: capture stops, queued data drains, the last complete iteration is applied and
committed, exit 0), when every capture file has been read, or on a fatal error (logged, exit 1). A
job restart (re-arm) starts the parser's next pass; it never ends the daemon.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time

import numpy as np
from mirrorckpt.control.protection import PROTECTED, VERDICTS, Facts, Guard, Limits, Verdict
from mirrorckpt.parser import memory
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.tools.daemon.logs import RING_SEP, JsonLogFormatter, setup_logging  # noqa: F401 - re-exported
from mirrorckpt.tools.daemon.ports import PortMonitor, stream_label, warn_uneven
from mirrorckpt.tools.daemon.stages import Latencies, ParserStage
from mirrorckpt.tools.daemon.streams import JobWatch, QueueStreams
from mirrorckpt.tools.daemon.worker import COUNTERS, WorkerSpec, worker_main  # noqa: F401 - re-exported
from mirrorckpt.tools.sendring import SendRing

log = logging.getLogger("mirrorckpt.serve")

MONITOR_S = 0.2  # port counters to the metrics
META_WAIT_S = 10.0  # capture files read to their end: how long iterations may wait for their step metadata
JUDGE_S = 1.0  # the protection verdict


class Daemon:
    """`mirrorckpt serve`: owns the workers, the pipeline threads and the endpoints. ``control``: the
    trainer's control plane (``control.appliance_side.AppliancePlane``); ``limits``: protection
    (``control.protection.Limits``); ``control_only``: no mirror at all, fallbacks every
    ``limits.fallback_every`` steps."""

    def __init__(self, job, training, persist, metrics, iteration_queue: int = 4, sends_queue: int = 64,
                 pace=None, updater_delay: float = 0.0, control=None, pipelined: bool = False,
                 limits: Limits | None = None, control_only: bool = False, ring: str = ""):
        self.job, self.training, self.persist, self.metrics = job, training, persist, metrics
        self.ring = ring  # one ring of a sharded job (tools.daemon.rings): its threads and logs carry the name
        self.pipelined = pipelined  # buckets stepped ahead of their iteration (Appliance; not with a control plane)
        self.pace = pace
        self.updater_delay = updater_delay  # tests: a deliberately slow updater
        self.control = control
        self.control_only = control_only
        self.guard = Guard(limits or Limits(), control.request_fallback if control is not None else None)
        self.ctx = mp.get_context("spawn")
        self.sends_q = self.ctx.Queue(maxsize=sends_queue)
        self.iters_q: queue.Queue = queue.Queue(maxsize=iteration_queue)
        self.stop_capture = self.ctx.Event()
        self.stopping = threading.Event()
        self.workers: list = []
        # one stream per capture worker: (mirror index, worker k, workers N)
        self.stream_of = [] if control_only else \
            [(i, k, m.workers) for i, m in enumerate(job.mirrors) for k in range(m.workers)]
        self.shared = [self.ctx.Array("q", len(COUNTERS), lock=False) for _ in self.stream_of]
        ring_bytes = job.capture.get("transfer_bytes", 128 << 20)
        self.rings = [SendRing(self.ctx, ring_bytes) for _ in self.stream_of] if ring_bytes else None
        # capture timestamps are this host's clock: wire-to-step and wire-to-commit times are measured
        self.live = bool(self.stream_of) and all(m.live for m in job.mirrors)
        self.latency = Latencies(metrics, self.live)
        self.ports = PortMonitor(metrics, [stream_label(*x) for x in self.stream_of],
                                 [job.mirrors[i].source for i, _, _ in self.stream_of], self.shared,
                                 [self._drop_hint(job.mirrors[i]) for i, _, _ in self.stream_of],
                                 [[s for s, (j, _, _) in enumerate(self.stream_of) if j == i]
                                  for i, m in enumerate(job.mirrors) if m.live])
        self.streams = QueueStreams(self.sends_q, self.ports, JobWatch(any(w > 1 for _, _, w in self.stream_of)),
                                    replay_bytes=job.capture.get("queue_bytes", 256 << 20), rings=self.rings)
        self.parser = ParserStage(self.streams, self.iters_q, metrics, self.stopping, model=self._job_model,
                                  ring=self._ring, run=self._run, grad_dtype=job.grad_dtype, p2p_fill=job.p2p_fill)
        self.updater_cpu_ns = 0
        self._cpu_seen = {"parser": 0, "updater": 0}
        self._seen = {"fallbacks": 0, "degraded": 0}
        self._appliance = None

    # -- the stages' inputs ---------------------------------------------------------------------
    @property
    def appliance(self):
        return self.control.app if self.control is not None else self._appliance

    @property
    def error(self) -> BaseException | None:
        return self.parser.error

    def _run(self) -> int:
        return self.control.run if self.control is not None else 0

    def _ring(self):
        return self.control.ring if self.control is not None and self.control.ring else self.job.ring

    def _job_model(self):
        """The job's collective sequence: from the configuration, or once the trainer registered its
        layout (frames wait in the capture queues meanwhile). None if stopped before that."""
        from mirrorckpt.parser.roce.collectives import NcclJobModel

        if self.job.kind != "ddp" or self.job.layout is not None:
            return NcclJobModel.from_job(self.job)
        if not self._wait_registered():
            return None
        return NcclJobModel.ddp(self._ring(), self.control.layout, with_startup=self.job.startup)

    def _wait_registered(self) -> bool:
        """Waits until the trainer registered its layout; False if stopped before that."""
        if not self.control.registered.is_set():
            log.info("waiting for the trainer to register the job's layout")
            while not self.control.registered.wait(0.2):
                if self.stopping.is_set():
                    return False
            log.info("layout registered: following the mirror", extra={"params": len(self.control.layout.params)})
        return True

    def _drop_hint(self, m) -> str:
        if not m.live and self.pace is None:
            return ("a capture file served without --pace is offered as fast as it can be read, as a port at "
                    "line rate would be: raise [capture] queue_bytes above its size to process every frame")
        return ("capture edge: a stage behind it is slower than the port ([capture] queue_bytes full; the "
                "'stage CPU seconds' line at stop says which); kernel: the capture ring or NIC queue was full")

    def _file_split(self, m):
        """The worker of each UDP source port of mirror ``m``'s capture file split over its workers: a
        connection's QP pairs together, dealt out by bytes (parser.split), unless ``[capture]
        file_split = "port"``; None for live sources (the kernel splits by port) and one worker."""
        from mirrorckpt.capture.batch import CaptureError
        from mirrorckpt.capture.source import open_source
        from mirrorckpt.parser.roce import split

        if m.workers == 1 or m.live:
            return None
        by_port = self.job.capture.get("file_split", "connection") == "port"
        try:
            with open_source(m.source, batch_frames=self.job.capture.get("batch_frames", 65536)) as start:
                lut, found = split.plan(start, m.workers, by_port=by_port, encapsulation=self.job.encap)
        except (CaptureError, OSError):
            return None  # each worker meets the same error opening it, and reports it as its port's
        log.info("capture file split over its workers", extra={"source": str(m.source), **found})
        warn_uneven([str(m.source)], found["share_of_bytes"])
        return None if by_port else lut.astype(np.int32)

    def start_workers(self) -> None:
        cap = self.job.capture
        luts = {i: self._file_split(m) for i, m in enumerate(self.job.mirrors)} if self.stream_of else {}
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
        if self.workers:
            log.info("capture workers started", extra={"ports": [m.source for m in self.job.mirrors]})

    def request_stop(self, *_):
        if not self.stopping.is_set():
            log.info("stop requested: draining, then committing a last checkpoint")
        self.stopping.set()
        self.stop_capture.set()

    def _on_rearm(self, run: int) -> None:
        """The job restarted (control plane thread): the parser starts over on the new connections."""
        self.metrics.rearms.inc()
        self.streams.rearm()

    # -- the updater thread ---------------------------------------------------------------------
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
        r = self.appliance.replica if self.appliance is not None else None
        if r is not None:
            self._replica_metrics(r)
            self.metrics.lag.set(max(0, it.index - r.iteration))
            if it.complete and r.iteration == it.index and r.stale is None:
                self.latency.stepped(it)

    def _on_stale(self, exc) -> None:
        """No control plane: nothing can bring the replica back but a restart of the job's capture."""
        if self.stopping.is_set():
            log.info("iteration %d incomplete at stop (its traffic was cut by the stop)", exc.iteration)
            return
        log.warning("replica stale: iteration %d could not be reassembled; without [control] no fallback can be "
                    "asked, so the replica stays at step %d", exc.iteration, exc.step)

    def _on_commit(self, path) -> None:
        from mirrorckpt.updater import ckptdir

        per = getattr(self.appliance, "persister", None)
        if per is not None:
            self.metrics.persist_seconds.observe(per.stats.last_commit_seconds)
        self.latency.committed(ckptdir.parse_step(path.name))
        log.info("checkpoint committed", extra={"path": str(path)})

    # -- the monitor thread ---------------------------------------------------------------------
    def _monitor(self, done: threading.Event) -> None:
        judged = 0.0
        while not done.wait(MONITOR_S):
            self._sync_once()
            if time.monotonic() - judged >= JUDGE_S:
                judged = time.monotonic()
                self.judge()
        self._sync_once()
        self.judge()

    def _sync_once(self) -> None:
        self.ports.sync(self.streams.stats)
        for stage, ns in self._main_cpu().items():
            self.metrics.stage_cpu.labels(stage, "").inc(max(0, ns - self._cpu_seen[stage]) / 1e9)
            self._cpu_seen[stage] = max(ns, self._cpu_seen[stage])

    def facts(self) -> Facts:
        """Everything the protection verdict compares: the plane's view of the trainer and replica
        (or the replica alone), the persister's commits, the mirror's faults."""
        if self.control is not None:
            f = self.control.facts()
        else:
            r = self.appliance.replica if self.appliance is not None else None
            stale = f"replica stale since step {r.iterations_done}: an iteration could not be reassembled" \
                if r is not None and r.stale is not None else None
            f = Facts(control=False, replica_step=r.iterations_done if r is not None and stale is None else None,
                      replica_stale=stale)
        per = getattr(self.appliance, "persister", None)
        if per is not None:
            st = per.stats
            f.committed_step, f.committed_unix, f.verified_step = st.committed_step, st.committed_unix, st.verified_step
            f.persist_error = st.failing
        if not self.control_only:
            f.wire = self.ports.silent(self.guard.limits.silent_seconds, f.trainer_step)
            if self.streams.watch.unplaced:
                f.wire.append(self.streams.watch.unplaced)
        return f

    def judge(self) -> Verdict:
        v = self.guard.check(self.facts())
        m = self.metrics
        for state in VERDICTS:
            m.protection.labels(state).set(1 if v.state == state else 0)
        m.protection_reason.info({"verdict": v.state, "reason": v.reason[:500]})
        m.trainer_step.set(-1 if v.trainer_step is None else v.trainer_step)
        m.protected_step.set(-1 if v.protected_step is None else v.protected_step)
        m.lag_steps.set(-1 if v.lag is None else v.lag)
        per = getattr(self.appliance, "persister", None)
        st = per.stats if per is not None else None
        m.verified_step.set(-1 if st is None or st.verified_step is None else st.verified_step)
        m.last_commit_time.set(0 if st is None or st.committed_unix is None else st.committed_unix)
        if st is not None and st.committed_step is not None:
            m.last_committed.set(st.committed_step)
        if self.control is not None:
            ps = self.control.stats
            m.fallback_given_up.set(1 if ps.fallback_error else 0)
            m.fallbacks.inc(max(0, ps.fallbacks_requested - self._seen["fallbacks"]))
            self._seen["fallbacks"] = max(self._seen["fallbacks"], ps.fallbacks_requested)
        m.degraded_fallbacks.inc(self.guard.degraded_fallbacks - self._seen["degraded"])
        self._seen["degraded"] = self.guard.degraded_fallbacks
        r = self.appliance.replica if self.appliance is not None else None
        if r is not None:
            self._replica_metrics(r)
        return v

    def _replica_metrics(self, r) -> None:
        m = self.metrics
        m.replica_step.set(r.step)
        m.replica_iteration.set(r.iteration)
        m.stale.set(1 if r.stale is not None else 0)

    def _main_cpu(self) -> dict[str, int]:
        return {"parser": self.streams.parser_cpu_ns, "updater": self.updater_cpu_ns}

    def stage_cpu(self) -> dict:
        """CPU seconds of each stage's thread so far: capture and decode per capture stream, the
        parser, the updater (its own thread; torch's pool threads, when it has more than one, are
        in ``daemon_process``), and this process's whole CPU time (start-up included)."""
        import resource

        per = {"capture": {}, "decode": {}}
        for port, c in sorted(self.ports.counters.items()):
            for stage in per:
                per[stage][self.ports.labels[port]] = round(c.get(f"cpu_{stage}_ns", 0) / 1e9, 4)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {**per, **{k: round(v / 1e9, 4) for k, v in self._main_cpu().items()},
                "daemon_process": round(ru.ru_utime + ru.ru_stime, 4)}

    # -- run ------------------------------------------------------------------------------------
    def _start_sink(self) -> None:
        from mirrorckpt.updater.appliance import Appliance

        if self.control is not None:
            # the plane owns the appliance (created when the layout is known; resyncs replace its
            # replica); it tells the parser when the job restarted on a new communicator
            self.control.listen(on_commit=self._on_commit, on_rearm=self._on_rearm)
            self.control.start()
            log.info("control plane listening", extra={"port": self.control.port})
        else:
            self._appliance = Appliance(self.job.layout, self.training, self.persist, on_stale=self._on_stale,
                                        pipelined=self.pipelined)
            self._appliance.on_commit = self._on_commit

    def run(self) -> int:
        self._start_sink()
        memory.freeze_startup_heap()  # torch and the job are loaded: the threads below never collect them
        self.start_workers()
        done = threading.Event()
        at = f"{RING_SEP}{self.ring}" if self.ring else ""  # a sharded job's ring: its threads carry the name
        monitor = threading.Thread(target=self._monitor, args=(done,), name=f"monitor{at}", daemon=True)
        monitor.start()
        if self.control_only:
            log.info("control-only: no mirror; a fallback checkpoint every %s steps",
                     self.guard.limits.fallback_every)
            self.stopping.wait()
        else:
            threads = [threading.Thread(target=self.parser, name=f"parser{at}", daemon=True),
                       threading.Thread(target=self._updater, name=f"updater{at}", daemon=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if self.control is not None and not self.live and not self.stopping.is_set() and \
                    not self.control.wait_metadata(META_WAIT_S):
                log.warning("capture files ended with iterations still waiting for the trainer's step metadata "
                            "(%g s): they are not applied", META_WAIT_S)
        for w in self.workers:
            w.join(timeout=10)
        done.set()
        monitor.join()
        return self._stopped()

    def _stopped(self) -> int:
        log.info("stage CPU seconds", extra=self.stage_cpu())
        drops = self.ports.drops()
        if drops:
            log.warning("frames dropped while serving", extra={"ports": drops})
        if self.control is not None:
            self.control.server.stop()
        self._close_sink()
        failed = self.streams.finished and all(d is not None for d in self.streams.finished.values())
        if failed:
            log.error("every capture source failed", extra={"sources": self.streams.finished})
        unmatched = None if failed or self.stopping.is_set() else self.matched_nothing()
        if unmatched:
            log.error(unmatched)
        v = self.guard.verdict
        (log.info if v.state == PROTECTED else log.warning)("at stop the job was %s: %s", v.state, v.reason)
        return 1 if self.error is not None or failed or unmatched else 0

    def _close_sink(self) -> None:
        if self.appliance is not None:
            summary = self.appliance.close()
            log.info("appliance stopped", extra=summary.to_dict())
        else:
            log.warning("appliance stopped before any trainer registered the job: no replica, nothing committed")

    def matched_nothing(self) -> str | None:
        """Capture files read to their end with no iteration applied: what the wire showed against
        what the job file names (None when something was followed)."""
        if self.live or self.control_only or not self.stream_of or self.streams.restart.is_set():
            return None
        if self.appliance is None:
            return "no trainer registered the job before the capture files ended: nothing was followed"
        s = self.appliance.summary
        if s.iterations_applied:
            return None
        if s.iterations_incomplete or s.iterations_skipped:
            return (f"the capture files gave {s.iterations_incomplete} incomplete iteration(s) and none was applied "
                    f"({s.iterations_skipped} complete one(s) skipped behind them): nothing was followed; the "
                    "warnings above say why")
        ring = self._ring()
        names = f"{ring.nranks} ranks at {', '.join(list(ring.addresses.values())[:4])}, {ring.nchannels} " \
                f"channel(s), protocol {ring.protocol}"
        seen = "; ".join(f"port {self.ports.labels[p]}: {self.ports.sees(p)}" for p in range(self.ports.nports))
        why = self.streams.watch.unplaced or "no NCCL send was placed in a collective"
        return (f"the capture files matched nothing, so nothing was followed: the job file names {names}; the wire "
                f"shows {seen}; {why}")
