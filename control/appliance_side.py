"""The appliance's control-plane handlers.

``AppliancePlane`` owns the replica (through ``updater.appliance.Appliance``) and serialises every
change of it under one lock: mirror iterations (``apply``, from the parser's driver) and control
messages (handlers, from connection threads). Content is validated before anything changes:

* REGISTER: layout, ring and training spec must match what the appliance was configured with or
  what an earlier registration (and so the traffic being parsed) fixed; a plane that follows one
  DP group of a sharded job (``group``) takes only that group's sharded registration, with the
  same sharded layout every time (``on_shards`` may refuse it too); the initial state must
  hold exactly the layout's parameters as float32 of the layout's shapes. A registration without
  state (reconnection, appliance restart) when there is no consistent replica asks for a fallback.
* STEP_META: per step RNG states and data position, joined to the mirror iteration of that step;
  an iteration waits for its metadata (at most ``max_meta_lag`` iterations) so a state served for
  a restore always has them.
* FINGERPRINT: compared with the replica at that step under its numeric policy
  (updater.numeric): bit-exact where the trainer runs the replica's arithmetic, else within the
  measured tolerance; beyond it (drift) the replica turns stale and a fallback is asked. A match
  marks the checkpoint of that step verified, with its measured distance.
* GOCKPT_PART / GOCKPT_DONE: the rebuild (``control.gockpt.Rebuild``), verified against the
  trainer's fingerprints of S_{N+k} before it replaces the replica; mirror iterations that
  arrived meanwhile are replayed from N+k on.
* RESTORE_REQUEST: the replica's state from memory, else the latest committed checkpoint on disk.
  The state served from memory is held until the next REGISTER (``restore_hold``): the other ranks
  of the resuming job get the same step, and its re-arm goes on from it.

Each trigger (incomplete iteration, drift, no state) asks for exactly one fallback; a fallback
not finished within ``fallback_timeout`` or whose rebuild does not verify is asked again, at most
``max_attempts`` times in all. Then the plane gives up: ``stats.fallback_error`` says why (the
error state: logged once, counted in ``fallbacks_abandoned``), the replica stays stale and nothing
is asked again until the trainer registers anew (a new trainer session may answer).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from mirrorckpt.config.layout import JobLayout, RingSpec
from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.config.training import PersistSpec, TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.endpoint import ControlServer
from mirrorckpt.parser.iteration import InitialWeights, ReducedIteration
from mirrorckpt.updater import ckptdir, numeric
from mirrorckpt.updater.appliance import Appliance
from mirrorckpt.updater.dcp_keys import ReplicaState, dumps, loads
from mirrorckpt.updater.numeric import Digest
from mirrorckpt.updater.optim import build_optimizer, plateau_state
from mirrorckpt.updater.replica import Replica, ReplicaStale

log = logging.getLogger("mirrorckpt.control.appliance")


class Refused(ValueError):
    """A message whose content does not fit the appliance's state; nothing was changed."""


@dataclass
class Fallback:
    reason: str
    requested: float
    attempt: int = 1
    rebuild: gockpt.Rebuild | None = None


@dataclass
class PlaneStats:
    fallbacks_requested: int = 0
    fallbacks_done: int = 0
    fallbacks_failed: int = 0  # attempts whose rebuild did not verify, or timed out
    fallbacks_abandoned: int = 0  # fallbacks given up after max_attempts
    rearms: int = 0  # the job restarted (a new run id registered)
    dropped_other_run: int = 0  # iterations of a run that had ended
    fallback_error: str | None = None  # set while given up: why there is no consistent replica
    drift_events: int = 0
    fingerprints_checked: int = 0
    fingerprints_exact: int = 0  # of those checked, bit-equal
    last_distance: float | None = None  # the largest per-tensor distance at the last check
    max_distance: float = 0.0  # the largest seen since the last resync
    fingerprints_missed: int = 0  # arrived for a step the replica had already passed
    replayed: int = 0  # mirror iterations applied after a resync from the buffer
    applied_without_meta: int = 0
    restores: dict = field(default_factory=lambda: {"memory": 0, "disk": 0})
    events: list = field(default_factory=list)  # (kind, detail) in order, for logs and tests


class AppliancePlane:
    def __init__(self, secret, *, host: str = "127.0.0.1", port: int = 0, training: TrainingSpec | None = None,
                 layout: JobLayout | None = None, ring: RingSpec | None = None, persist: PersistSpec | None = None,
                 parts: int = 7, fingerprint_every: int = 10, fallback_timeout: float = 60.0,
                 max_attempts: int = 3, max_meta_lag: int = 8, max_buffered: int = 256, on_iteration=None,
                 server_options: dict | None = None, lambda_modules: tuple[str, ...] = (),
                 replica_impl: str = "mirror", group: str | None = None, shards: ShardedLayout | None = None,
                 on_shards=None):
        self.training, self.layout, self.ring = training, layout, ring
        # a sharded job: the DP group this plane follows, the job's layout, and a check of both
        # (``on_shards(layout, group)``, raising Refused) before a registration is taken
        self.group, self.shards, self.on_shards = group, shards, on_shards
        self.replica_impl = replica_impl  # updater.numeric: the optimizer implementation the replica runs
        self.persist = persist
        self.parts = parts
        self.fingerprint_every = fingerprint_every
        self.fallback_timeout, self.max_attempts = fallback_timeout, max_attempts
        self.max_meta_lag = max_meta_lag
        self.on_iteration = on_iteration
        # modules a registered schedule may name functions from (resolving one imports and calls it)
        self.lambda_modules = tuple(lambda_modules)
        self.lock = threading.RLock()
        self.app: Appliance | None = None
        self.stats = PlaneStats()
        self.registered = threading.Event()  # layout and training known (a trainer registered)
        self.fallback: Fallback | None = None
        self.trainer_attached = False
        self._metas: dict[int, dict] = {}  # step -> {"rng", "data_position"}
        self._waiting: collections.deque[ReducedIteration] = collections.deque()  # for their metadata
        self._buffer: collections.deque[ReducedIteration] = collections.deque(maxlen=max_buffered)
        self._trainer_fps: dict[int, dict] = {}
        self._own_fps: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._meta_missing_at: int | None = None
        # Re-arm: a REGISTER with a new run id is the job restarted (new communicator). Its
        # iterations are counted on the wire from 0 again: ``wire_base`` is the step it resumed
        # from, ``run`` counts the restarts (iterations of an older run are dropped) and
        # ``on_rearm(run)`` tells the parser's driver to start over on the new connections.
        self.run_id: str | None = None
        self.run = 0
        self.wire_base = 0
        self.on_rearm = None
        self.on_commit = None  # handed to the appliance (committed checkpoint paths)
        # The state last served for a restore from memory, held until the next REGISTER (at most
        # ``restore_hold`` seconds): a job resuming from it goes on from it although the replica
        # applied the killed run's last iterations meanwhile, and every rank restores the same step.
        self.restore_hold = 300.0
        self._restored: tuple[float, ReplicaState] | None = None
        if layout is not None and training is not None:
            self._make_app()
        handlers = {m.REGISTER: self._on_register, m.STEP_META: self._on_step_meta,
                    m.FINGERPRINT: self._on_fingerprint, m.GOCKPT_PART: self._on_part,
                    m.GOCKPT_DONE: self._on_done, m.RESTORE_REQUEST: self._on_restore}
        self.server = ControlServer(host, port, secret, handlers, **(server_options or {}))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AppliancePlane:
        self.server.start()
        # torch imports its compiler stack on the first optimizer built (seconds): do it now, not
        # in the handler of the first registration.
        threading.Thread(target=_warm_up, name="optimizer-warm-up", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.server.stop()
        with self.lock:
            if self.app is not None:
                self.app.close()

    @property
    def replica(self) -> Replica | None:
        return self.app.replica if self.app is not None else None

    def _event(self, kind: str, detail) -> None:
        self.stats.events.append((kind, detail))

    def _make_app(self, replica: Replica | None = None) -> None:
        self.app = Appliance(self.layout, self.training, self.persist, replica=replica,
                             on_stale=self._on_stale, on_iteration=self.on_iteration, impl=self.replica_impl)
        self.app.on_commit = self.on_commit
        self.registered.set()

    # ------------------------------------------------------------------ fallback trigger
    def _on_stale(self, e: ReplicaStale) -> None:
        self.request_fallback(f"iteration {e.iteration} could not be reassembled")

    def request_fallback(self, reason: str, renew: bool = False) -> bool:
        """Ask the trainer for a GoCkpt checkpoint; False if one is already under way, or if the
        plane gave up and ``renew`` (a new registration) does not lift that."""
        with self.lock:
            if self.fallback is not None:
                return False
            if self.stats.fallback_error is not None:
                if not renew:
                    return False
                log.warning("retrying after the abandoned fallback (%s): the trainer registered again",
                            self.stats.fallback_error)
                self.stats.fallback_error = None
            self.fallback = Fallback(reason, time.monotonic())
            self.stats.fallbacks_requested += 1
            self._event("fallback_requested", reason)
            self._push_request()
            return True

    def _push_request(self) -> None:
        r = self.replica
        msg = m.make(m.FALLBACK_REQUEST, reason=self.fallback.reason[:m.MAX_STR],
                     step=r.iterations_done if r is not None else 0, parts=self.parts)
        sent = self.server.push(msg)
        log.warning("fallback requested (%s), attempt %d, %s", self.fallback.reason, self.fallback.attempt,
                    f"sent to {sent} trainer connection(s)" if sent else "no trainer connected yet")

    def poll(self) -> None:
        """Re-ask a fallback that did not finish in time (called from apply and the handlers)."""
        with self.lock:
            f = self.fallback
            if f is None or time.monotonic() - f.requested < self.fallback_timeout:
                return
            self.stats.fallbacks_failed += 1
            self._retry(f, f"no complete checkpoint within {self.fallback_timeout:g} s")

    def _retry(self, f: Fallback, why: str) -> None:
        """Ask again, or give up after ``max_attempts`` (the lock is held)."""
        if f.attempt >= self.max_attempts:
            self.fallback = None
            self.stats.fallbacks_abandoned += 1
            self.stats.fallback_error = (f"fallback ({f.reason}) abandoned after {f.attempt} attempt(s); "
                                         f"last: {why}")
            self._event("fallback_abandoned", {"reason": f.reason, "attempts": f.attempt, "last": why})
            log.error("%s; the replica stays stale and no fallback is asked until the trainer registers "
                      "again", self.stats.fallback_error)
            return
        f.attempt += 1
        f.requested, f.rebuild = time.monotonic(), None
        log.warning("fallback attempt %d failed (%s); asking again", f.attempt - 1, why)
        self._push_request()

    # ------------------------------------------------------------------ mirror iterations
    def initial_weights(self, w: InitialWeights) -> None:
        """DDP's start-up weights from the wire: the replica's step 0 when nobody registered one."""
        with self.lock:
            if self.app is not None and self.app.replica is None and self.fallback is None:
                self.app.initial_weights(w)

    def bucket(self, b) -> None:
        """Buckets are not stepped ahead here: an iteration waits for its step metadata."""

    def apply(self, it: ReducedIteration) -> None:
        """One iteration from the parser (any thread)."""
        with self.lock:
            if it.run != self.run:
                self.stats.dropped_other_run += 1
                return  # the wire of a run that ended (its tail, flushed after the restart)
            if self.wire_base:  # a restarted job: its DDP counts (and lays out buckets) from 0 again
                it = dataclasses.replace(it, index=it.index + self.wire_base, wire_index=it.index)
            self.poll()
            r = self.replica
            if self.app is None:
                return
            if r is None or r.stale is not None or self.fallback is not None:
                s = self.app.summary
                if not it.complete:
                    s.iterations_incomplete += 1
                    if r is not None and r.stale is None and it.index >= r.iterations_done:
                        self.app.apply(it)  # turns the replica stale and asks for the fallback
                    elif r is None and self.fallback is None and self.trainer_attached:
                        self.request_fallback("no consistent replica")
                    return
                self._buffer.append(it)  # replayed after the resync if it is newer than the state
                s.iterations_skipped += 1
                return
            if it.index < r.iterations_done + len(self._waiting):
                return  # already part of the state (e.g. arrived during a fallback)
            self._waiting.append(it)
            self._drain()

    def _drain(self) -> None:
        while self._waiting:
            r = self.replica
            if r is None or r.stale is not None:
                self._buffer.extend(self._waiting)
                self._waiting.clear()
                return
            it = self._waiting[0]
            meta = self._metas.get(it.index + 1)
            if meta is None and self.trainer_attached and len(self._waiting) <= self.max_meta_lag:
                return  # wait for the trainer's STEP_META of this step
            self._waiting.popleft()
            if it.index != r.iterations_done:
                if it.index < r.iterations_done:
                    continue
            if meta is not None:
                it.meta.update(meta)
            elif self.trainer_attached:
                self.stats.applied_without_meta += 1
                self._meta_missing_at = it.index + 1
                log.warning("iteration %d applied without the trainer's step metadata", it.index)
            self.app.apply(it)
            r = self.replica
            if r is not None and r.stale is None:
                self._metas = {k: v for k, v in self._metas.items() if k > r.iterations_done}
                self._after_step(r)

    # ------------------------------------------------------------------ drift
    def _after_step(self, r: Replica) -> None:
        t = r.iterations_done
        want = self._trainer_fps.pop(t, None)
        if want is not None:
            self._compare(r, t, want)
        elif self.fingerprint_every and t % self.fingerprint_every == 0:
            self._own_fps[t] = r.digest()
            while len(self._own_fps) > 4:
                self._own_fps.popitem(last=False)
        if self.fingerprint_every and t % self.fingerprint_every == 0 and self.app.persister is not None:
            self.app.persister.submit(r, force=True)  # a checkpoint at each step that can be proven

    def _compare(self, r: Replica, step: int, want: Digest, have: Digest | None = None) -> None:
        """The trainer's digest at ``step`` against the replica's (``have``: taken at that step)."""
        have = have if have is not None else r.digest()
        v = numeric.compare(want, have, r.policy, step, r.step - r.synced_at)
        st = self.stats
        st.fingerprints_checked += 1
        st.fingerprints_exact += v.match == "exact"
        st.last_distance = v.distance
        if v.ok:
            st.max_distance = max(st.max_distance, v.distance)
            if self.app.persister is not None:
                self.app.persister.mark_verified(step, want.words, numeric=v.record())
            return
        if self.app.persister is not None:  # what was committed after the last proven step is not served
            self.app.persister.quarantine_after(reason=f"drift at step {step}")
        diff = v.differing
        st.drift_events += 1
        log.warning("drift at step %d: replica differs from the trainer in %d tensor(s), first %s (distance %.3g, "
                    "tolerance %.3g: %s)", step, len(diff), diff[0], v.distance, v.tolerance, v.why)
        self._event("drift", {"step": step, "tensors": diff[:8], "distance": v.distance, "tolerance": v.tolerance})
        r.stale = ReplicaStale(r.step, r.iterations_done, {}, state_good=False)
        self._buffer.extend(self._waiting)
        self._waiting.clear()
        self.request_fallback(f"drift at step {step} in {diff[0]}")

    # ------------------------------------------------------------------ handlers
    def _on_register(self, msg: m.Message, peer) -> m.Message:
        b = msg.body
        layout = JobLayout.from_dict(b["layout"])  # the schema already checked it parses
        training = TrainingSpec.from_dict(b["training"])
        ring = RingSpec.from_dict(b["ring"]) if b.get("ring") is not None else None
        with self.lock:
            shards = self._check_shards(b)
            if self.layout is not None and layout.to_dict() != self.layout.to_dict():
                raise Refused(_differs("layout", self.layout.to_dict(), layout.to_dict()))
            if self.training is not None and training.recipe() != self.training.recipe():
                raise Refused(_differs("training", self.training.recipe(), training.recipe()))
            if self.training is None:
                foreign = [p for p in training.lr_schedule.callable_paths()
                           if p.partition(":")[0] not in self.lambda_modules]
                if foreign:
                    allowed = ", ".join(self.lambda_modules) or "none"
                    raise Refused(f"the schedule names function {foreign[0]!r}; this appliance imports scheduler "
                                  f"functions only from its lambda_modules ({allowed})")
            if self.ring is not None and ring is not None and not _same_ring(self.ring, ring):
                raise Refused("ring does not match the configured ring "
                              f"({self.ring.nranks} ranks, {self.ring.protocol}, {self.ring.nchannels} channels)")
            state = None
            if msg.tensors:
                if b["step"] != 0:
                    raise Refused("REGISTER carries an initial state only at step 0")
                state = _initial_state(layout, training, msg.tensors, b.get("state_meta"))
            self.layout, self.training = layout, training
            if shards is not None:
                self.shards, self.group = shards, b["group"]
            self.ring = ring or self.ring  # a restarted job may run on other addresses
            self.trainer_attached = True
            if self.app is None:
                self._make_app()
            run_id = b.get("run")
            if run_id is not None and self.run_id is not None and run_id != self.run_id:
                self._rearm(b["step"], state is not None)
            self.run_id = run_id if run_id is not None else self.run_id
            self._restored = None
            r = self.replica
            if r is not None and state is not None and r.iterations_done != 0:
                r = self.app.replica = None  # the job started over from its initial state
            if r is None and state is not None:
                self.app.replica = Replica(layout, training, state, self.replica_impl)
                self._event("registered", {"step": 0, "state": True})
                log.info("job %r registered at step 0 with its initial state (%d parameters)", b["job"],
                         len(layout.params))
                return m.make(m.ACK, info={"step": 0})
            self._event("registered", {"step": b["step"], "state": False})
            if r is None or r.stale is not None:
                if self.fallback is None:
                    self.request_fallback("no consistent replica for this job (appliance start or restart)",
                                          renew=True)
                else:
                    self._push_request()  # the trainer may not have heard it
            return m.make(m.ACK, info={"step": r.iterations_done if r is not None else None})

    def _check_shards(self, b: dict) -> ShardedLayout | None:
        """The sharded layout of a REGISTER (None for an unsharded job), checked against this plane's
        DP group and the layout registered before (the schema checked that it is valid and that the
        registered ring is that group's)."""
        if b.get("shards") is None:
            if self.group is not None or self.shards is not None:
                raise Refused(f"this control plane follows DP group {self.group!r} of a sharded job; the REGISTER "
                              "carries no sharded layout (a TP/PP job attaches with control.sharded.attach_sharded)")
            return None
        sl = ShardedLayout.from_dict(b["shards"])
        if self.group is not None and b["group"] != self.group:
            raise Refused(f"this control plane follows DP group {self.group!r}, the trainer registered group "
                          f"{b['group']!r} (one control link per DP group: check the trainer's appliances map)")
        if self.shards is not None and sl.digest() != self.shards.digest():
            raise Refused(_differs("sharded layout", self.shards.to_dict(), sl.to_dict()))
        if self.on_shards is not None:
            self.on_shards(sl, b["group"])
        return sl

    def _rearm(self, step: int, with_state: bool) -> None:
        """The job restarted from ``step`` (lock held): forget the old run's wire and metadata, go
        on from the replica when it holds that very step, else from the state registered with it,
        else ask for a fallback (the REGISTER handler does)."""
        self.run += 1
        self.wire_base = step
        self.fallback = None
        self._waiting.clear()
        self._buffer.clear()
        self._metas.clear()
        self._trainer_fps.clear()
        self._own_fps.clear()
        self._meta_missing_at = None
        r = self.replica
        kept = r is not None and r.committable and r.iterations_done == step and not with_state
        held = self._held_restore()
        if not kept and not with_state and held is not None and held.iterations_done == step:
            # the job resumed from the state served it; the replica had moved on with the old run
            self.app.replica = r = Replica(self.layout, self.training, _cloned(held))
            kept = True
        if kept:
            r.stale = None
        elif r is not None and not with_state:
            r.stale = ReplicaStale(r.step, r.iterations_done, {}, state_good=r.committable)
        self.stats.rearms += 1
        self._event("rearmed", {"step": step, "run": self.run, "replica": "kept" if kept else "needs a resync"})
        log.warning("the job restarted from step %d (run %d): following its new communicator%s", step, self.run,
                    ", from the replica as it is" if kept else "; the replica needs a resync")
        newest = ckptdir.latest(self.persist.directory) if self.persist is not None else None
        if newest is not None and ckptdir.parse_step(newest.name) > step:
            log.warning("the job resumed before the newest checkpoint %s of the run that ended: a diverged "
                        "history is never written into the same root, so checkpoints resume after that step",
                        newest.name)
        if self.on_rearm is not None:
            self.on_rearm(self.run)

    def _on_step_meta(self, msg: m.Message, peer) -> None:
        step = msg.body["step"]
        rng = {}
        for k, v in msg.tensors.items():
            if not k.startswith("rng:") or v.dim() != 1 or len(k) < 5:
                raise Refused(f"STEP_META tensor {k!r} is not an RNG state (rng:<name>, uint8 vector)")
            rng[k[4:]] = v.clone()
        if step < 1:
            raise Refused("STEP_META step must be >= 1")
        with self.lock:
            self.poll()
            r = self.replica
            meta = {"rng": rng, "data_position": msg.body.get("data_position")}
            for k in ("clip", "skipped"):  # what the trainer decided: the replica takes it as given
                if msg.body.get(k) is not None:
                    meta[k] = msg.body[k]
            if "lr_scheduler" in msg.body and self.training is not None and self.training.lr_schedule.needs_metrics:
                try:
                    groups = len(self.training.groups([p.name for p in self.layout.params]))
                    meta["lr_scheduler"] = plateau_state(loads(msg.body["lr_scheduler"]), groups)
                except Exception as e:  # noqa: BLE001 - whatever hostile text provokes
                    raise Refused(f"STEP_META lr_scheduler: {type(e).__name__}: {str(e)[:120]}") from None
            if r is not None and step <= r.iterations_done:
                if step == r.iterations_done and r.stale is None and not self._waiting:
                    r.rng = {k: v for k, v in rng.items()}  # late metadata of the current step
                    r.data_position = meta["data_position"]
                return
            if len(self._metas) > 4 * self.max_meta_lag + 64:
                self._metas.pop(min(self._metas))
            self._metas[step] = meta
            self._drain()
        return

    def _on_fingerprint(self, msg: m.Message, peer) -> None:
        step = msg.body["step"]
        try:
            fps = gockpt.digest_of(msg.body["fingerprints"], msg.tensors)
        except gockpt.PartError as e:
            raise Refused(f"FINGERPRINT: {e}") from None
        with self.lock:
            r = self.replica
            if r is None or r.stale is not None or self.fallback is not None:
                return
            if step in self._own_fps:
                self._compare(r, step, fps, self._own_fps.pop(step))
            elif step == r.iterations_done:
                self._compare(r, step, fps)
            elif step > r.iterations_done:
                self._trainer_fps[step] = fps
                while len(self._trainer_fps) > 16:
                    self._trainer_fps.pop(min(self._trainer_fps))
            else:
                self.stats.fingerprints_missed += 1
        return

    def _on_part(self, msg: m.Message, peer) -> None:
        b = msg.body
        with self.lock:
            f = self.fallback
            if f is None or self.layout is None:
                raise Refused("GOCKPT_PART without a fallback in progress")
            if b["index"] == 0:
                if not 1 <= b["parts"] <= gockpt.MAX_PARTS:
                    raise Refused(f"parts must be in 1..{gockpt.MAX_PARTS}")
                rb = gockpt.Rebuild(self.layout, self.training, b["parts"], impl=self.replica_impl)
                rb.add_part(b["step"], 0, b["parts"], b.get("slices", {}), msg.tensors, own=True)
                f.rebuild = rb
            else:
                if f.rebuild is None:
                    raise Refused(f"part {b['index']} before part 0")
                f.rebuild.add_part(b["step"], b["index"], b["parts"], b.get("slices", {}), msg.tensors, own=True)

    def _on_done(self, msg: m.Message, peer) -> None:
        b = msg.body
        with self.lock:
            f = self.fallback
            rb = f.rebuild if f is not None else None
            if rb is None or not rb.complete:
                raise Refused("GOCKPT_DONE before every part arrived")
            if b["step"] != rb.final_step or b["parts"] != rb.parts:
                raise Refused(f"GOCKPT_DONE for step {b['step']} ({b['parts']} parts), the rebuild is at "
                              f"{rb.final_step} ({rb.parts} parts)")
            if not b.get("fingerprints"):
                raise Refused("GOCKPT_DONE without fingerprints: the rebuilt state cannot be verified")
            try:
                want = gockpt.digest_of(b["fingerprints"], msg.tensors)
            except gockpt.PartError as e:
                raise Refused(f"GOCKPT_DONE: {e}") from None
            # the rebuild's tensors become the replica's (no copy)
            rep = Replica(self.layout, self.training, rb.state(), self.replica_impl, adopt=True)
            rep.synced_at = max(0, rep.step - rb.parts)  # each part took up to k steps of our own arithmetic
            v = rep.check(want)
            diff = v.differing
            if not v.ok:
                self.stats.fallbacks_failed += 1
                f.rebuild = None
                log.error("GoCkpt rebuild to step %d does not match the trainer's fingerprints (%d tensors, "
                          "first %s)", rb.final_step, len(diff), diff[0])
                self._event("fallback_unverified", {"step": rb.final_step, "tensors": diff[:8]})
                self._retry(f, f"rebuild to step {rb.final_step} differs from the trainer in {diff[0]}")
                return
            self._install(rep, rb)
            if self.app.persister is not None:
                self.app.persister.mark_verified(rep.iterations_done, want.words, source="gockpt", numeric=v.record())
        return

    def _install(self, rep: Replica, rb: gockpt.Rebuild) -> None:
        self.app.replica = rep
        self.fallback = None
        self.stats.max_distance = 0.0
        self._meta_missing_at = None
        self._own_fps.clear()
        self._trainer_fps = {k: v for k, v in self._trainer_fps.items() if k > rep.iterations_done}
        self.stats.fallbacks_done += 1
        self._event("resynced", {"step": rep.iterations_done, "parts": rb.parts, "start": rb.start})
        log.warning("replica resynced at step %d by a GoCkpt checkpoint (%d parts from step %d); "
                    "mirror mode resumes", rep.iterations_done, rb.parts, rb.start)
        if self.on_iteration is not None:
            self.on_iteration(rep.iterations_done - 1, rep)
        if self.app.persister is not None:
            self.app.persister.submit(rep, force=True)
        backlog = sorted((it for it in self._buffer if it.index >= rep.iterations_done), key=lambda it: it.index)
        self._buffer.clear()
        for it in backlog:
            if it.index == rep.iterations_done + len(self._waiting):
                self._waiting.append(it)
                self.stats.replayed += 1
        self._drain()

    def _held_restore(self) -> ReplicaState | None:
        if self._restored is not None and time.monotonic() - self._restored[0] > self.restore_hold:
            self._restored = None
        return self._restored[1] if self._restored is not None else None

    def _on_restore(self, msg: m.Message, peer) -> m.Message:
        want = msg.body.get("step")
        with self.lock:
            r = self.replica
            source, state = None, None
            held = self._held_restore()
            if held is not None and (want is None or want == held.iterations_done):
                source, state = "memory", held  # the other ranks of the resuming job: the same step
            elif r is not None and r.committable and self._meta_missing_at != r.iterations_done and \
                    (want is None or want == r.iterations_done):
                st = r.state()
                source = "memory"
                if _state_bytes(st) > self._copy_budget():
                    # no room for a copy: sent from the replica itself while the plane waits
                    reply = restore_message(st, source)
                    reply.re = msg.rid
                    peer.send(reply)
                    self.stats.restores[source] += 1
                    log.info("restore: state of step %d sent from memory, uncopied", st.iterations_done)
                    return None
                state = _cloned(st)
                self._restored = (time.monotonic(), state)
        if state is None and self.persist is not None:
            from mirrorckpt.updater.restore import read_state

            try:
                state = read_state(self.persist.directory)
                source = "disk"
            except Exception as e:  # noqa: BLE001 - no committed checkpoint, or one that fails verification
                raise Refused(f"no consistent state in memory and none on disk: {type(e).__name__}: {e}") from None
            if want is not None and state.iterations_done != want:
                raise Refused(f"step {want} is neither in memory nor the latest on disk ({state.iterations_done})")
        if state is None:
            raise Refused("no consistent state in memory (replica stale or never started) and no checkpoint root")
        self.stats.restores[source] += 1
        log.info("restore: state of step %d sent from %s", state.iterations_done, source)
        return restore_message(state, source)


    def _copy_budget(self) -> int:
        """Bytes a restore may copy the state into: the persist memory budget (unbounded without)."""
        return self.persist.memory_budget_bytes if self.persist is not None else 1 << 62


# ------------------------------------------------------------------------ helpers

def _state_bytes(st) -> int:
    n = sum(v.numel() * v.element_size() for v in st.params.values())
    for s in st.optim["state"].values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def _warm_up() -> None:
    p = torch.zeros(1, requires_grad=True)
    torch.optim.Adam([p], foreach=False)


def _differs(what: str, have: dict, got: dict) -> str:
    keys = sorted(k for k in set(have) | set(got) if have.get(k) != got.get(k))
    return f"{what} does not match the traffic/configured {what} (differs in {', '.join(map(str, keys[:4]))})"


def _same_ring(a: RingSpec, b: RingSpec) -> bool:
    return (a.nranks, a.nchannels, a.protocol) == (b.nranks, b.nchannels, b.protocol)


def _initial_state(layout: JobLayout, training: TrainingSpec, tensors: dict, meta: dict | None):
    """The registered state at step 0: the weights, and when the trainer sent them its param
    groups and scheduler state as constructed (exact whatever the schedule's arguments)."""
    params = _initial_params(layout, tensors)
    if not meta:
        return params
    names = [p.name for p in layout.params]
    try:
        groups = training.groups(names)
        own = build_optimizer(training.optimizer, [torch.zeros(1)], [([torch.zeros(1)], gs) for _, gs in groups])
        merged = gockpt.merged_groups(own.param_groups, loads(meta["param_groups"]), [n for n, _ in groups])
        sched = meta.get("lr_scheduler")
        sched = loads(sched) if sched is not None else None
    except Exception as e:  # noqa: BLE001 - whatever a hostile state_meta provokes
        raise Refused(f"state_meta does not fit the training spec: {type(e).__name__}: {str(e)[:200]}") from None
    if (sched is None) == training.lr_schedule.enabled or (sched is not None and not isinstance(sched, dict)):
        raise Refused("state_meta must hold the scheduler state exactly when the training spec has a schedule")
    return ReplicaState(params=params, optim={"state": {}, "param_groups": merged}, lr_scheduler=sched,
                        training=training.to_dict(), layout=layout.to_dict())


def _initial_params(layout: JobLayout, tensors: dict) -> dict[str, torch.Tensor]:
    want = {gockpt.param_key(p.name): tuple(p.shape) for p in layout.params}
    extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
    if extra or missing:
        raise Refused(f"initial state does not match the layout: unexpected {extra[:3]}, missing {missing[:3]}")
    out = {}
    for k, shape in want.items():
        t = tensors[k]
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise Refused(f"{k}: {t.dtype} {tuple(t.shape)}, the layout says float32 {shape}")
        if not bool(torch.isfinite(t).all()):
            raise Refused(f"{k}: initial parameters hold inf or nan")
        out[k[2:]] = t  # a view of the message's own payload buffer: no copy needed
    return out


def _cloned(st):
    from dataclasses import replace

    return replace(st, params={k: v.clone() for k, v in st.params.items()},
                   optim={"state": {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                                    for n, s in st.optim["state"].items()},
                          "param_groups": [dict(g) for g in st.optim["param_groups"]]},
                   rng={k: v.clone() for k, v in st.rng.items()})


def restore_message(state, source: str) -> m.Message:
    """RESTORE_STATE for a ReplicaState: p:/o:/rng: tensors, the rest in ``meta``."""
    tensors = {gockpt.param_key(n): v for n, v in state.params.items()}
    unstepped = set(getattr(state, "unstepped", ()))
    for n, s in state.optim["state"].items():
        if n in unstepped:  # a placeholder: the trainer's optimizer keeps no state for it either
            continue
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                tensors[gockpt.state_key(n, k)] = v
    tensors.update({gockpt.rng_key(k): v for k, v in (state.rng or {}).items()})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state.optim["param_groups"]]
    meta = {"iterations_done": int(state.iterations_done), "step": int(state.step), "source": source,
            "param_groups": dumps(groups, "param_groups"),
            "lr_scheduler": dumps(state.lr_scheduler, "lr_scheduler") if state.lr_scheduler is not None else None,
            "loss_scale": state.loss_scale, "data_position": state.data_position}
    return m.make(m.RESTORE_STATE, tensors, step=int(state.iterations_done), layout=state.layout or {}, meta=meta)
