"""`serve` of a sharded job: the rings of one job file ([[ring]] tables) in one appliance process.

    ring sh0: [capture workers] -> [parser] -> [updater: ShardSink -> Appliance (replica shard 0)] -+
    ring sh1: [capture workers] -> [parser] -> [updater: ShardSink -> Appliance (replica shard 1)] -+-> [joint]
    ring weights-0: [capture workers] -> [parser] -> [updater: WeightsFollower -> weight snapshots]
    [job verdict: every ring's, combined]

Each ring is a ``Daemon`` of its own (tools.serve: capture workers, queues, parser and updater
threads, metrics, verdict), its job model the framework's sequence for that ring
(``config.shard_steps``) and its sink the ring's (``updater.shard_sink``, ``updater.weights``).
The replicas' shards meet in the joint persister (``updater.joint``, a process group of this
process alone): a round commits the newest step every shard holds as one DCP checkpoint of the
whole model; a ring that is behind delays it, never tears it. With global-norm clipping the rings'
updaters meet once per iteration in a ``NormExchange``.

With [joint] this process is one appliance of several, each following its own groups' rings
(``DpGroup.appliance``) from its own job file: they join one gloo process group (``[joint]
address``, rank = the appliance's place in the layout's list) before following; the joint rounds
are collective over it (each appliance writes its own slices into the one checkpoint, committed
only when every appliance holds the step), the norms meet in its store
(``shard_clip.StoreNormExchange``), and the rounds go on until every appliance is ending, so the
last commit is the newest step all reached. A peer that never joins, or leaves, makes the job NOT
PROTECTED in words; no partial checkpoint is ever committed.

The job's verdict is its worst ring's; the endpoint serves the job's metrics and every ring's
under a ``ring`` label (``metrics.with_rings``).

With ``[control]`` every gradient ring's group has a control plane of its own (``[[ring]]
listen``, one ``AppliancePlane`` per group, as ``control.sharded_appliance`` has them): the
trainer's sharded REGISTER brings the layout (every plane the same, every group followed here, or
with [joint] every group of this appliance), the initial state or a fallback, and each step's
metadata with the clipping coefficient it applied; the ring's sink hands the plane the group's
slices, and the joint persister opens once every plane is registered (with [joint]: every
appliance's).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from mirrorckpt.config import shard_steps
from mirrorckpt.control.protection import LAGGING, NOT_PROTECTED, PROTECTED, VERDICTS, Limits, Verdict
from mirrorckpt.tools.daemon.logs import RING_SEP
from mirrorckpt.tools.metrics import Metrics
from mirrorckpt.tools.serve import Daemon

log = logging.getLogger("mirrorckpt.serve")

JOINT_S = 0.2  # how often the joint persister looks for a step every shard holds
JUDGE_S = 1.0
GROUP_TIMEOUT_S = 120.0  # [joint] timeout_seconds: how long appliances wait for each other
HOLD = 8  # due steps each shard's snapshots are held for the others to reach


class RingDaemon(Daemon):
    """One [[ring]] of a sharded job: its updater drives ``sink``; ``appliance`` (None for a
    weights-only ring) is the replica the verdict reads; ``committed()`` gives the job's newest
    checkpoint as (step, unix time, error)."""

    def __init__(self, rc, job, steps: shard_steps.RingSteps | None, sink, appliance, committed, training,
                 metrics, **kw):
        """With ``control`` (the group's plane) ``steps`` and ``sink`` come with its registration."""
        self.rc, self.steps, self.sink, self._ring_app, self._committed = rc, steps, sink, appliance, committed
        super().__init__(dataclasses.replace(job, ring=rc.ring, mirrors=rc.mirrors, rings=[]), training, None,
                         metrics, ring=rc.name, **kw)

    def _job_model(self):
        from mirrorckpt.parser.roce.collectives import NcclJobModel

        if self.control is not None:
            if not self._wait_registered():
                return None
            self.steps = shard_steps.gradient_ring(self.control.shards, self.rc.group)
        return NcclJobModel.sharded(self._ring(), self.steps)

    def _start_sink(self) -> None:
        if self.control is not None:
            super()._start_sink()
        else:
            self._appliance = self._ring_app

    def _updater(self) -> None:
        import itertools

        from mirrorckpt.updater.drive import drive
        from mirrorckpt.updater.shard_sink import ShardSink

        items = iter(self._next_update, None)
        try:
            if self.control is not None:  # the first item comes once the layout is registered
                first = next(items, None)
                if first is None:
                    return
                self.sink = ShardSink(self.control.shards, self.rc.group, self.control, None, self.job.grad_dtype)
                items = itertools.chain([first], items)
            drive(items, self.sink, self._updated)
        finally:
            if self.sink is not None:
                self.sink.ended()

    def facts(self):
        f = super().facts()
        f.committed_step, f.committed_unix, f.persist_error = self._committed()
        if self.rc.weights_only:
            s = self.sink.summary
            f.replica_stale = ("weights only: this job's optimizer state never crosses the wire, so its all-gathers "
                               "give weight snapshots, not a training state" +
                               (f" (newest: step {s.last_step})" if s.last_step is not None else ""))
            f.committed_step = None  # a weight snapshot restores no training state
        return f

    def _close_sink(self) -> None:
        if self.rc.weights_only:
            log.info("weights-only ring stopped", extra=self.sink.close().to_dict())
        else:
            super()._close_sink()

    def matched_nothing(self) -> str | None:
        if self.rc.weights_only and not (self.live or self.streams.restart.is_set()):
            if self.sink.summary.snapshots:
                return None
            return (f"ring {self.ring}: the capture files gave no complete parameter all-gather, so no weight "
                    "snapshot was made; the warnings above say why")
        why = super().matched_nothing()
        return f"ring {self.ring}: {why}" if why else None


class ShardedDaemon:
    """`mirrorckpt serve` of a job of [[ring]] tables (see the module text)."""

    def __init__(self, job, training, persist, metrics: Metrics, limits: Limits | None = None, pace=None,
                 pipelined: bool = False, control: dict | None = None):
        """``control``: the job file's [control] for every gradient ring's plane (secret, parts,
        fingerprint_every, server_options); None: the layout and recipe come from the job file."""
        from mirrorckpt.updater.shard_clip import NormExchange, StoreNormExchange

        layout = job.shards
        self.job, self.training, self.persist, self.metrics = job, training, persist, metrics
        self.limits = limits or Limits()
        self.control = control
        self.joint_cfg = job.joint or None  # [joint]: one appliance of several
        self.group_error: str | None = None  # the appliances' group never formed, or lost a member
        self.ring_metrics = {rc.name: Metrics() for rc in job.rings}
        grad = [rc for rc in job.rings if not rc.weights_only]
        if layout is not None:
            grad.sort(key=lambda rc: layout.group(rc.group).shard_index)
        clip = training.clip if training is not None else None
        self.clip = None  # with a control plane the trainer sends the coefficient it applied
        if clip and grad and control is None and self.joint_cfg:  # the norms of every appliance's rings
            groups = [g.name for g in sorted(layout.groups, key=lambda g: g.shard_index)]
            self.clip = StoreNormExchange(groups, [rc.group for rc in grad], clip.max_norm, clip.norm_type,
                                          timeout=self._timeout())
        elif clip and grad and control is None:
            self.clip = NormExchange([rc.group for rc in grad], clip.max_norm, clip.norm_type)
        self.registered = None  # with [control]: the layout every plane was registered with
        self._lock = threading.Lock()
        self._rings_done = threading.Event()
        self.joint = None  # opened once the appliances' group is joined (run) or the planes registered
        self.joint_error: str | None = None
        self.committed: tuple[int | None, float | None] = (None, None)
        self.verdict = Verdict(NOT_PROTECTED, "starting")
        self.rings = [self._ring(rc, pace, pipelined) for rc in job.rings]
        self.codes: dict[str, int] = {}

    def _timeout(self) -> float:
        return float(self.joint_cfg.get("timeout_seconds", GROUP_TIMEOUT_S))

    def _open_joint(self, layout, persist):
        from mirrorckpt.updater.joint import JointPersister, init_local_group

        if self.joint_cfg is None:
            init_local_group()
        mine = [self.joint_cfg["appliance"]] if self.joint_cfg else layout.appliances
        return JointPersister(layout, mine, persist.directory, every=persist.every_iterations or 1,
                              hold=HOLD, keep_last=persist.keep_last, job=persist.job_name)

    def _join(self) -> bool:
        """With [joint]: join the appliances' process group (every appliance's serve meets there);
        False, said as NOT PROTECTED, when it is not complete within timeout_seconds."""
        from mirrorckpt.updater.joint import join_group

        j = self.joint_cfg
        log.info("joining the appliances' group", extra={"address": j["address"], "appliance": j["appliance"],
                                                         "rank": j["rank"], "world": j["world"]})
        try:
            store = join_group(j["address"], j["rank"], j["world"], self._timeout())
        except RuntimeError as e:
            self.group_error = f"{e} (every appliance's serve joins it before following its rings)"
            return False
        self.group_error = self._disagreement()
        if self.group_error is not None:
            return False
        if self.clip is not None:
            self.clip.connect(store)
        return True

    def _disagreement(self) -> str | None:
        """With [joint], once joined: why the appliances cannot pair their rounds and norms (their job
        files differ where those pair up, or one does not see rank 0's [persist] directory), or None."""
        import uuid
        from pathlib import Path

        import torch.distributed as dist

        rank, world, persist = self.joint_cfg["rank"], self.joint_cfg["world"], self.persist
        probe = None
        if persist is not None and rank == 0:  # a file only a shared directory shows the others
            probe = Path(persist.directory) / f".mirrorckpt-joint-{uuid.uuid4().hex[:12]}"
            probe.touch()
        job = self.job
        mine = {"[job] shards": job.shards.digest() if job.shards is not None else None, "[job] name": job.name,
                "[training]": job.training, "[control]": self.control is not None,
                "[persist]": persist.every_iterations or 1 if persist is not None else None}
        every = [None] * world
        dist.all_gather_object(every, (mine, probe.name if probe else None))
        seen = [None] * world
        shared = every[0][1] is None or persist is None or (Path(persist.directory) / every[0][1]).exists()
        dist.all_gather_object(seen, shared)
        if probe is not None:
            probe.unlink()
        for key, value in mine.items():
            if any(other[key] != value for other, _ in every):
                return (f"the appliances' job files differ in {key} (" +
                        "; ".join(f"rank {r}: {str(other[key])[:60]}" for r, (other, _) in enumerate(every)) + ")")
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            return (f"[persist] directory: appliance rank(s) {blind} do not see the directory of rank 0's (every "
                    "appliance writes its slices into one directory: a shared filesystem)")
        return None

    def _ring(self, rc, pace, pipelined) -> RingDaemon:
        from mirrorckpt.updater.appliance import Appliance
        from mirrorckpt.updater.shard_sink import ShardSink, seed_weights
        from mirrorckpt.updater.weights import WeightsFollower, WeightsPersister

        layout, job = self.job.shards, self.job
        kw = dict(training=self.training, metrics=self.ring_metrics[rc.name], pace=pace, limits=self.limits)
        if rc.weights_only:
            training = self.training.to_dict() if self.training is not None else {}
            steps = shard_steps.shard_group_ring(layout, rc.replica, clip=training.get("clip") is not None)
            follower = WeightsFollower(layout, steps, lambda _s, _p: None)
            if self.persist is not None:
                follower.on_snapshot = WeightsPersister(self.persist, layout, training, follower.summary)
            return RingDaemon(rc, job, steps, follower, None, lambda: (None, None, None), **kw)
        if self.control is not None:
            return RingDaemon(rc, job, None, None, None, self._newest, control=self._plane(rc), **kw)
        steps = shard_steps.gradient_ring(layout, rc.group)
        app = Appliance(layout.group(rc.group).job_layout(job.grad_dtype), self.training, None,
                        pipelined=pipelined and self.clip is None)
        app.on_iteration = lambda _i, replica, group=rc.group: self._offer(group, replica)
        sink = ShardSink(layout, rc.group, app, self.clip, job.grad_dtype)
        if job.initial:
            sink.initial_weights(seed_weights(job.initial, layout, rc.group, job.grad_dtype))
        d = RingDaemon(rc, job, steps, sink, app, self._newest, **kw)
        app.on_stale = d._on_stale
        return d

    def _plane(self, rc):
        from mirrorckpt.control.appliance_side import AppliancePlane

        c = self.control
        host, _, port = rc.listen.rpartition(":")
        return AppliancePlane(c["secret"], host=host or "127.0.0.1", port=int(port), training=self.training,
                              ring=rc.ring, parts=c.get("fallback_parts", 7),
                              fingerprint_every=c.get("fingerprint_every", 10), max_lag_steps=self.limits.max_lag_steps,
                              group=rc.group, shards=self.job.shards, on_shards=self._on_shards,
                              on_iteration=lambda _i, replica, group=rc.group: self._offer(group, replica),
                              server_options=c.get("server_options"))

    def _on_shards(self, layout, group: str) -> None:
        """A plane's sharded registration (its thread): one layout for every ring, every group followed
        here with a ring of its size, nothing only weights can follow."""
        from mirrorckpt.control.endpoint import Refused

        with self._lock:
            if self.registered is not None and layout.digest() != self.registered.digest():
                raise Refused(f"group {group}: its sharded layout differs from the one this appliance's other rings "
                              "registered (one job per serve)")
            if layout.refusal is not None:
                raise Refused(f"group {group}: {layout.refusal}")
            rings = {rc.group: rc for rc in self.job.rings if not rc.weights_only}
            mine = layout.groups
            if self.joint_cfg is not None:
                me, rank, world = self.joint_cfg["appliance"], self.joint_cfg["rank"], self.joint_cfg["world"]
                if layout.appliances[rank:rank + 1] != [me] or len(layout.appliances) != world:
                    raise Refused(f"the trainer's layout lists appliances {layout.appliances}; this serve's [joint] "
                                  f"is {me!r}, rank {rank} of {world}")
                follower = layout.group(group).appliance
                if follower != me:
                    raise Refused(f"the trainer's layout has group {group} followed by appliance {follower!r}; this "
                                  f"serve is {me!r}")
                mine = layout.groups_of(me)
            unfollowed = sorted({g.name for g in mine} - set(rings))
            if unfollowed:
                raise Refused(f"the trainer's layout has group(s) {', '.join(unfollowed)}, which no [[ring]] of this "
                              "serve follows (one serve follows every ring of the job, or with [joint] every ring "
                              "of its appliance)")
            size = len(layout.group(group).ranks)
            if size != rings[group].ring.nranks:
                raise Refused(f"group {group}: its ring has {size} ranks, its [[ring]] nranks = "
                              f"{rings[group].ring.nranks}")
            self.registered = layout

    # -- the joint checkpoint -----------------------------------------------------------------------
    def _offer(self, group: str, replica) -> None:
        if self.joint is not None:
            self.joint.offer(group, replica)

    def _open_registered(self, ending: bool) -> str:
        """With [control]: the joint persister, once every gradient ring's plane is registered (with
        [joint]: every appliance's, agreed in one collective, so that all open in the same tick and
        their rounds pair up); the replicas already held are offered at once. "open", "wait", or
        "stop" (ending with nothing to open)."""
        planes = [d.control for d in self.rings if d.control is not None]
        if self.persist is None or not planes:
            return "stop" if ending else "wait"
        ready = all(p.registered.is_set() for p in planes)
        if self.joint_cfg is not None:
            import torch.distributed as dist

            every = [None] * self.joint_cfg["world"]
            try:
                dist.all_gather_object(every, (ready, ending))
            except RuntimeError as e:
                self.group_error = f"the appliances' group lost a member before every trainer registered: {e}"
                return "stop"
            ready, ending = all(r for r, _ in every), all(e for _, e in every)
        if not ready:
            return "stop" if ending else "wait"
        self.joint = self._open_joint(self.registered, self.persist)
        for p in planes:
            with p.lock:
                if p.replica is not None and p.replica.stale is None:
                    self.joint.offer(p.group, p.replica)
        return "open"

    def _newest(self) -> tuple[int | None, float | None, str | None]:
        step, unix = self.committed
        return step, unix, self.joint_error

    def _round(self, ending: bool = False) -> None:
        from mirrorckpt.updater import ckptdir
        from mirrorckpt.updater.joint import JointSaveError

        try:
            path = self.joint.save_round(ending)
        except JointSaveError as e:
            self.joint_error = str(e)
            if self.joint.stats.broken is not None and self.joint_cfg is not None:
                self.group_error = (f"the appliances' group lost a member ({self.joint.stats.broken}); nothing "
                                    "partial was committed, and no joint checkpoint commits until every appliance's "
                                    "serve restarts")
                if self.clip is not None:
                    self.clip.stop()
            return
        if path is None:
            return
        self.joint_error = None
        self.committed = (ckptdir.parse_step(path.name), time.time())
        self.metrics.persist_seconds.observe(self.joint.stats.last_seconds)
        log.info("joint checkpoint committed", extra={"path": str(path), "rings": [d.ring for d in self.rings]})

    def _joint_loop(self) -> None:
        """Rounds until every appliance is ending (its rings stopped): the last one commits the
        newest step all of them reached. Alone in its group, that is this process's last round."""
        said = False
        while True:
            ending = self._rings_done.is_set()
            if self.joint is None and self._open_registered(ending) == "stop":
                return
            if self.joint is not None:
                self._round(ending)
                if self.joint.stats.broken is not None or (ending and self.joint.all_ending):
                    return
                if ending and not said:
                    said = True
                    log.info("this appliance's rings stopped; its joint rounds go on until every appliance's have "
                             "(stopping it alone would break the others' joint checkpoints)")
            self._rings_done.wait(JOINT_S)

    # -- the verdict ------------------------------------------------------------------------------------
    def judge(self) -> Verdict:
        """The job's verdict from every ring's newest: its worst state, each troubled ring's reason;
        NOT PROTECTED whatever they say while the appliances' group is incomplete."""
        by = {d.ring: d.guard.verdict for d in self.rings}
        if self.clip is not None and getattr(self.clip, "error", None) and self.group_error is None:
            self.group_error = f"the appliances' norm exchange failed: {self.clip.error}"
        worst = next(s for s in (NOT_PROTECTED, LAGGING, PROTECTED) if any(v.state == s for v in by.values()))
        steps = [v.protected_step for v in by.values()]
        protected = None if any(s is None for s in steps) else min(steps)
        step, _ = self.committed
        if worst == PROTECTED:
            whose = f" of appliance {self.joint_cfg['appliance']}" if self.joint_cfg else ""
            reason = f"every ring's replica shard follows its mirror ({len(by)} rings{whose})" + \
                (f"; joint checkpoint of step {step}" if step is not None else "")
        else:
            reason = "; ".join(f"ring {n}: {v.reason}" for n, v in by.items() if v.state != PROTECTED)
        if self.group_error is not None:
            worst, reason = NOT_PROTECTED, self.group_error
        v = Verdict(worst, reason, None, protected)
        if v.state != self.verdict.state:
            (log.info if v.state == PROTECTED else log.warning)("job %s: %s", v.state.upper(), v.reason)
        self.verdict = v
        m = self.metrics
        for state in VERDICTS:
            m.protection.labels(state).set(1 if v.state == state else 0)
        m.protection_reason.info({"verdict": v.state, "reason": v.reason[:500]})
        m.protected_step.set(-1 if protected is None else protected)
        if step is not None:
            m.last_committed.set(step)
            m.last_commit_time.set(self.committed[1] or 0)
        return v

    def _judge_loop(self, done: threading.Event) -> None:
        while not done.wait(JUDGE_S):
            self.judge()

    # -- run ------------------------------------------------------------------------------------------
    def request_stop(self, *_) -> None:
        for d in self.rings:
            d.request_stop()

    def _run_ring(self, d: RingDaemon) -> None:
        try:
            self.codes[d.ring] = d.run()
        except BaseException:  # a ring's failure stops the job's serve with the reason logged
            log.exception("ring %s stopped", d.ring)
            self.codes[d.ring] = 1
            self.request_stop()

    def run(self) -> int:
        if self.joint_cfg is not None and not self._join():
            log.error("job NOT PROTECTED: %s", self.group_error)
            self.judge()
            return 1
        if self.persist is not None and self.control is None and any(not rc.weights_only for rc in self.job.rings):
            self.joint = self._open_joint(self.job.shards, self.persist)
            self.committed = (self.joint.last_step, None)
        done = threading.Event()
        aside = [threading.Thread(target=self._judge_loop, args=(done,), name="job-verdict", daemon=True)]
        joint = threading.Thread(target=self._joint_loop, name="joint", daemon=True) \
            if self.joint is not None or self.control is not None else None
        rings = [threading.Thread(target=self._run_ring, args=(d,), name=f"ring{RING_SEP}{d.ring}", daemon=True)
                 for d in self.rings]
        for t in aside + rings + ([joint] if joint else []):
            t.start()
        log.info("following %d rings of one job", len(rings), extra={"rings": [d.ring for d in self.rings]})
        for t in rings:
            t.join()
        self._rings_done.set()
        if joint is not None:
            joint.join()  # its last rounds, with the other appliances' (see _joint_loop)
        done.set()
        for t in aside:
            t.join()
        if self.clip is not None:
            self.clip.stop()
        self._leave()
        failed = self.group_error is not None
        if self.joint is not None:
            failed = failed or self.joint_error is not None
            if self.joint_error is not None:
                log.error("joint checkpoint at stop failed: %s", self.joint_error)
            self.joint.close()
            log.info("joint checkpoints", extra={k: v for k, v in self.joint.stats.__dict__.items()})
        v = self.judge()
        (log.info if v.state == PROTECTED else log.warning)("at stop the job was %s: %s", v.state, v.reason)
        return 1 if failed or any(self.codes.get(d.ring, 1) for d in self.rings) else 0

    def _leave(self) -> None:
        """With [joint]: wait for every appliance before leaving, so the store (rank 0's) outlives
        every peer's last norm."""
        import torch.distributed as dist
        from mirrorckpt.updater.joint import said

        if self.joint_cfg is None or self.group_error is not None or not dist.is_initialized():
            return
        try:
            dist.barrier()
        except RuntimeError as e:
            self.group_error = f"an appliance left the group before the others stopped: {said(e)}"
