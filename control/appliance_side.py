"""The appliance's control plane: the replica and every change of it, under one lock.

``AppliancePlane`` owns the replica (through ``updater.appliance.Appliance``) and serialises
mirror iterations (``apply``, from the parser's driver) and control messages (handlers, from
connection threads). Content is validated before anything changes. The concerns live apart:

* REGISTER (here, with ``control.registration``): layout, ring and training spec must match what
  the appliance was configured with or what an earlier registration (and so the traffic being
  parsed) fixed; a plane that follows one DP group of a sharded job (``group``) takes only that
  group's sharded registration, with the same sharded layout every time (``on_shards`` may refuse
  it too); the initial state must hold exactly the layout's parameters as float32 of the layout's
  shapes. A registration without state (reconnection, appliance restart) when there is no
  consistent replica asks for a fallback. A REGISTER with a new run id is the job restarted on a
  new communicator: the plane re-arms.
* STEP_META (here): per step RNG states and data position, joined to the mirror iteration of that
  step; an iteration waits for its metadata (at most ``max_meta_lag`` iterations) so a state served
  for a restore always has them. Its step is the trainer's newest step (``facts``).
* FINGERPRINT: ``control.drift.DriftCheck``; a match marks the checkpoint of that step verified,
  drift turns the replica stale and asks for a fallback.
* FALLBACK_REQUEST, GOCKPT_PART / GOCKPT_DONE: ``control.fallback.FallbackController``; the verified
  rebuild replaces the replica, and mirror iterations that arrived meanwhile are replayed from it.
* RESTORE_REQUEST: ``control.restore_server.RestoreServer`` (never a silent rollback).

Iterations that reach the plane before the trainer registered (no replica can take them yet) are
held, up to ``max_buffered``, and applied once it has; one beyond that is counted and said.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from mirrorckpt.config.layout import JobLayout, RingSpec
from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.drift import DriftCheck
from mirrorckpt.control.endpoint import ControlServer, Refused
from mirrorckpt.control.fallback import FallbackController
from mirrorckpt.control.protection import Facts
from mirrorckpt.control.registration import check_recipe, initial_state
from mirrorckpt.control.restore_server import RestoreServer, cloned, restore_message  # noqa: F401
from mirrorckpt.parser.iteration import InitialWeights, ReducedIteration
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.appliance import Appliance
from mirrorckpt.updater.dcp_keys import loads
from mirrorckpt.updater.optim import plateau_state, warm_up
from mirrorckpt.updater.replica import Replica, ReplicaStale

log = logging.getLogger("mirrorckpt.control.appliance")


@dataclass
class PlaneStats:
    fallbacks_requested: int = 0
    fallbacks_done: int = 0
    fallbacks_failed: int = 0  # attempts whose rebuild did not verify, or timed out
    fallbacks_abandoned: int = 0  # fallbacks given up after max_attempts
    rearms: int = 0  # the job restarted (a new run id registered)
    dropped_other_run: int = 0  # iterations of a run that had ended
    dropped_unregistered: int = 0  # iterations beyond those held while no trainer had registered
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


WEIGHT_FINGERPRINTS_KEPT = 16  # a weights_only job's fingerprints kept for snapshots that come later


class AppliancePlane:
    def __init__(self, secret, *, host: str = "127.0.0.1", port: int = 0, training: TrainingSpec | None = None,
                 layout: JobLayout | None = None, ring: RingSpec | None = None, persist: PersistSpec | None = None,
                 parts: int = 7, fingerprint_every: int = 10, fallback_timeout: float = 60.0,
                 max_attempts: int = 3, max_meta_lag: int = 8, max_buffered: int = 256, on_iteration=None,
                 server_options: dict | None = None, lambda_modules: tuple[str, ...] = (),
                 replica_impl: str = "mirror", group: str | None = None, shards: ShardedLayout | None = None,
                 on_shards=None, max_lag_steps: int | None = None):
        self.training, self.layout, self.ring = training, layout, ring
        # a sharded job: the DP group this plane follows, the job's layout, and a check of both
        # (``on_shards(layout, group)``, raising Refused) before a registration is taken
        self.group, self.shards, self.on_shards = group, shards, on_shards
        # a sharded job registered weights_only (control.sharded): the trainer's parameter
        # fingerprints by step, which weight snapshots are checked against (ShardedAppliance.check_weights)
        self.weights_only = False
        self._trainer_params: dict[int, dict[str, int]] = {}
        self.replica_impl = replica_impl  # updater.numeric: the optimizer implementation the replica runs
        self.persist = persist
        self.max_meta_lag = max_meta_lag
        self.on_iteration = on_iteration
        # modules a registered schedule may name functions from (resolving one imports and calls it)
        self.lambda_modules = tuple(lambda_modules)
        self.lock = threading.RLock()
        self.app: Appliance | None = None
        self.stats = PlaneStats()
        self.registered = threading.Event()  # layout and training known (a trainer registered)
        self.trainer_attached = False
        self.trainer_step: int | None = None  # the trainer's newest step (REGISTER, STEP_META)
        self._trainer_seen: float | None = None
        self._replica_moved: tuple[int, float] | None = None  # (steps, monotonic time they were reached)
        self.fallbacks = FallbackController(self.stats, self._push, self._step_now, self._event, parts=parts,
                                            timeout=fallback_timeout, max_attempts=max_attempts)
        self.drift = DriftCheck(self.stats, fingerprint_every)
        # a restore may serve a state at most `max_lag_steps` behind the trainer (None: any)
        self.restores = RestoreServer(persist, max_lag_steps)
        self.stats.restores = self.restores.served
        self._metas: dict[int, dict] = {}  # step -> {"rng", "data_position"}
        self._waiting: collections.deque[ReducedIteration] = collections.deque()  # for their metadata
        self._buffer: collections.deque[ReducedIteration] = collections.deque(maxlen=max_buffered)
        self._early: collections.deque = collections.deque()  # items before any registration
        self._max_buffered = max_buffered
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
        spec = self.training.optimizer if self.training is not None else OptimizerSpec()
        threading.Thread(target=warm_up, args=(spec,), name="optimizer-warm-up", daemon=True).start()
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

    @property
    def fallback(self):
        """The fallback under way (``control.fallback.Fallback``), or None."""
        return self.fallbacks.current

    @property
    def parts(self) -> int:
        """The GoCkpt parts a fallback is asked in."""
        return self.fallbacks.parts

    @parts.setter
    def parts(self, k: int) -> None:
        self.fallbacks.parts = k

    @property
    def restore_hold(self) -> float:
        return self.restores.hold_seconds

    @restore_hold.setter
    def restore_hold(self, seconds: float) -> None:
        self.restores.hold_seconds = seconds

    def listen(self, on_commit=None, on_rearm=None) -> None:
        """Who hears of each committed checkpoint (its path, from the persister's thread) and of each
        re-arm (the new run's number, from a connection thread)."""
        with self.lock:
            self.on_commit, self.on_rearm = on_commit, on_rearm
            if self.app is not None:
                self.app.on_commit = on_commit

    def _event(self, kind: str, detail) -> None:
        self.stats.events.append((kind, detail))

    def _make_app(self, replica: Replica | None = None) -> None:
        self.app = Appliance(self.layout, self.training, self.persist, replica=replica,
                             on_stale=self._on_stale, on_iteration=self.on_iteration, impl=self.replica_impl)
        self.app.on_commit = self.on_commit
        self.registered.set()

    def facts(self) -> Facts:
        """What the plane knows for the protection verdict (``control.protection``)."""
        with self.lock:
            r, now = self.replica, time.monotonic()
            consistent = r is not None and r.stale is None and r.committable
            if r is not None and (self._replica_moved is None or self._replica_moved[0] != r.iterations_done):
                self._replica_moved = (r.iterations_done, now)
            stale = None
            if r is not None and r.stale is not None:
                stale = f"replica stale since step {r.iterations_done} (iteration {r.stale.iteration} incomplete " \
                        "or drifted)"
            return Facts(control=True, registered=self.trainer_attached, trainer_step=self.trainer_step,
                         trainer_seconds=None if self._trainer_seen is None else now - self._trainer_seen,
                         replica_step=r.iterations_done if consistent else None, replica_stale=stale,
                         replica_seconds=None if self._replica_moved is None else now - self._replica_moved[1],
                         fallback=self.fallback.reason if self.fallback is not None else None,
                         fallback_error=self.stats.fallback_error)

    def _saw_trainer(self, step: int) -> None:
        self.trainer_step = step if self.trainer_step is None else max(self.trainer_step, step)
        self._trainer_seen = time.monotonic()

    # ------------------------------------------------------------------ fallbacks
    def _on_stale(self, e: ReplicaStale) -> None:
        self.request_fallback(f"iteration {e.iteration} could not be reassembled")

    def request_fallback(self, reason: str, renew: bool = False) -> bool:
        """Ask the trainer for a GoCkpt checkpoint; False if one is already under way, or if the
        plane gave up and ``renew`` (a new registration) does not lift that."""
        with self.lock:
            return self.fallbacks.request(reason, renew)

    def _push(self, msg) -> int:
        return self.server.push(msg)

    def _step_now(self) -> int:
        r = self.replica
        return r.iterations_done if r is not None else 0

    def poll(self) -> None:
        """Re-ask a fallback that did not finish in time (called from apply and the handlers)."""
        with self.lock:
            self.fallbacks.poll()

    # ------------------------------------------------------------------ mirror iterations
    def initial_weights(self, w: InitialWeights) -> None:
        """DDP's start-up weights from the wire: the replica's step 0 when nobody registered one."""
        with self.lock:
            if self.app is None:
                self._hold_early(w)
            elif self.app.replica is None and self.fallback is None:
                self.app.initial_weights(w)

    def bucket(self, b) -> None:
        """Buckets are not stepped ahead here: an iteration waits for its step metadata."""

    def _hold_early(self, item) -> None:
        """An item before any registration: held until the trainer registers (bounded)."""
        if len(self._early) >= self._max_buffered:
            self.stats.dropped_unregistered += 1
            if self.stats.dropped_unregistered == 1:
                log.warning("iterations keep arriving and no trainer has registered the job: beyond the first %d, "
                            "they are dropped (counted in dropped_unregistered)", self._max_buffered)
            return
        self._early.append(item)

    def _release_early(self) -> None:
        early, self._early = list(self._early), collections.deque()
        for item in early:
            if isinstance(item, InitialWeights):
                self.initial_weights(item)
            else:
                self.apply(item)

    def apply(self, it: ReducedIteration) -> None:
        """One iteration from the parser (any thread)."""
        with self.lock:
            if it.run != self.run:
                self.stats.dropped_other_run += 1
                return  # the wire of a run that ended (its tail, flushed after the restart)
            if self.app is None:
                self._hold_early(it)
                return
            if self.wire_base:  # a restarted job: its DDP counts (and lays out buckets) from 0 again
                it = dataclasses.replace(it, index=it.index + self.wire_base, wire_index=it.index)
            self.poll()
            r = self.replica
            if r is None or r.stale is not None or self.fallback is not None:
                self._while_inconsistent(it, r)
                return
            if it.index < r.iterations_done + len(self._waiting):
                return  # already part of the state (e.g. arrived during a fallback)
            self._waiting.append(it)
            self._drain()

    def _while_inconsistent(self, it: ReducedIteration, r: Replica | None) -> None:
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

    def wait_metadata(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the trainer's step metadata of the iterations that wait for it
        (a capture file read to its end before the trainer reported those steps); True when none waits."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                if not self._waiting:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)

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
        got = self.drift.stepped(r)
        if got is not None:
            self._checked(r, *got)
        if self.drift.due(r.iterations_done) and self.app.persister is not None:
            self.app.persister.submit(r, force=True)  # a checkpoint at each step that can be proven

    def _checked(self, r: Replica, step: int, want, v) -> None:
        """What a fingerprint comparison means: a proven checkpoint, or drift (a resync)."""
        per = self.app.persister
        if v.ok:
            if per is not None:
                per.mark_verified(step, want.words, numeric=v.record())
            return
        if per is not None:  # what was committed after the last proven step is not served
            per.quarantine_after(reason=f"drift at step {step}")
        diff = v.differing
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
            check_recipe((self.layout, self.training, self.ring), (layout, training, ring), self.lambda_modules)
            state = None
            if msg.tensors:
                if b["step"] != 0:
                    raise Refused("REGISTER carries an initial state only at step 0")
                state = initial_state(layout, training, msg.tensors, b.get("state_meta"))
            self.layout, self.training = layout, training
            if shards is not None:
                self.shards, self.group = shards, b["group"]
                self.weights_only = bool(b.get("weights_only"))
            self.ring = ring or self.ring  # a restarted job may run on other addresses
            first = not self.trainer_attached
            self.trainer_attached = True
            if self.app is None:
                self._make_app()
            run_id = b.get("run")
            if run_id is not None and self.run_id is not None and run_id != self.run_id:
                self._rearm(b["step"], state is not None)
            self.run_id = run_id if run_id is not None else self.run_id
            self.restores.forget()
            self._saw_trainer(b["step"])
            reply = self._registered(b, layout, state)
            if first and self._early:
                self._release_early()
            return reply

    def _registered(self, b: dict, layout: JobLayout, state) -> m.Message:
        r = self.replica
        if r is not None and state is not None and r.iterations_done != 0:
            r = self.app.replica = None  # the job started over from its initial state
        if r is None and state is not None:
            self.app.replica = Replica(layout, self.training, state, self.replica_impl)
            self._event("registered", {"step": 0, "state": True})
            log.info("job %r registered at step 0 with its initial state (%d parameters)", b["job"],
                     len(layout.params))
            return m.make(m.ACK, info={"step": 0})
        self._event("registered", {"step": b["step"], "state": False})
        if r is None or r.stale is not None:
            if self.fallback is None:
                self.request_fallback("no consistent replica for this job (appliance start or restart)", renew=True)
            else:
                self.fallbacks.push()  # the trainer may not have heard it
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
            from mirrorckpt.control.registration import differs

            raise Refused(differs("sharded layout", self.shards.to_dict(), sl.to_dict()))
        if self.on_shards is not None:
            self.on_shards(sl, b["group"])
        return sl

    def _rearm(self, step: int, with_state: bool) -> None:
        """The job restarted from ``step`` (lock held): forget the old run's wire and metadata, go
        on from the replica when it holds that very step, else from the state registered with it,
        else ask for a fallback (the REGISTER handler does)."""
        self.run += 1
        self.wire_base = step
        self.fallbacks.forget()
        self._waiting.clear()
        self._buffer.clear()
        self._metas.clear()
        self.drift.clear()
        self._meta_missing_at = None
        self.trainer_step = None  # the new run reports its own (from `step`, which REGISTER brings)
        r = self.replica
        kept = r is not None and r.committable and r.iterations_done == step and not with_state
        held = self.restores.held()
        if not kept and not with_state and held is not None and held.iterations_done == step:
            # the job resumed from the state served it; the replica had moved on with the old run
            self.app.replica = r = Replica(self.layout, self.training, cloned(held))
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
            self._saw_trainer(step)
            r = self.replica
            meta = {"rng": rng, "data_position": msg.body.get("data_position")}
            for k in ("clip", "skipped", "unused"):  # what the trainer decided: the replica takes it as given
                if msg.body.get(k) is not None:
                    meta[k] = msg.body[k]
            schedule = self.training.lr_schedule if self.training is not None else None
            if "lr_scheduler" in msg.body and schedule is not None and (schedule.needs_metrics or schedule.reported):
                try:
                    groups = len(self.training.groups([p.name for p in self.layout.params]))
                    state = loads(msg.body["lr_scheduler"])
                    meta["lr_scheduler"] = state if schedule.reported else plateau_state(state, groups)
                except Exception as e:  # noqa: BLE001 - whatever hostile text provokes
                    raise Refused(f"STEP_META lr_scheduler: {type(e).__name__}: {str(e)[:120]}") from None
            if schedule is not None and schedule.reported and msg.body.get("hparams") is not None:
                meta["hparams"] = msg.body["hparams"]  # checked by the replica against its groups
            if r is not None and step <= r.iterations_done:
                if step == r.iterations_done and r.stale is None and not self._waiting:
                    r.rng = {k: v for k, v in rng.items()}  # late metadata of the current step
                    r.data_position = meta["data_position"]
                return
            if len(self._metas) > 4 * self.max_meta_lag + 64:
                self._metas.pop(min(self._metas))
            self._metas[step] = meta
            self._drain()

    def _on_fingerprint(self, msg: m.Message, peer) -> None:
        step = msg.body["step"]
        try:
            fps = gockpt.digest_of(msg.body["fingerprints"], msg.tensors)
        except gockpt.PartError as e:
            raise Refused(f"FINGERPRINT: {e}") from None
        with self.lock:
            if self.weights_only:
                self._trainer_params[step] = {k: w for k, w in fps.words.items() if k.startswith("model.")}
                for old in sorted(self._trainer_params)[:-WEIGHT_FINGERPRINTS_KEPT]:
                    del self._trainer_params[old]
            r = self.replica
            if r is None or r.stale is not None or self.fallback is not None:
                return
            v = self.drift.trainer_digest(step, fps, r)
            if v is not None:
                self._checked(r, step, fps, v)

    def trainer_parameters(self, step: int) -> dict[str, int] | None:
        """The trainer's parameter fingerprints of ``step`` ("model.<fqn>" -> word sum, its local
        shards) when a weights_only job sent them (every ``fingerprint_every`` steps), else None."""
        with self.lock:
            return self._trainer_params.get(step)

    def _on_part(self, msg: m.Message, peer) -> None:
        with self.lock:
            self.fallbacks.part(msg.body, msg.tensors, self.layout, self.training, self.replica_impl)

    def _on_done(self, msg: m.Message, peer) -> None:
        with self.lock:
            got = self.fallbacks.done(msg.body, msg.tensors, self.layout, self.training, self.replica_impl)
            if got is None:
                return
            rep, rb, want, v = got
            self._install(rep, rb)
            self.fallbacks.completed()
            if self.app.persister is not None:
                self.app.persister.mark_verified(rep.iterations_done, want.words, source="gockpt", numeric=v.record())

    def _install(self, rep: Replica, rb: gockpt.Rebuild) -> None:
        self.app.replica = rep
        self.stats.max_distance = 0.0
        self._meta_missing_at = None
        self.drift.clear(after=rep.iterations_done)
        self._event("resynced", {"step": rep.iterations_done, "parts": rb.parts, "start": rb.start})
        log.warning("replica resynced at step %d by a GoCkpt checkpoint (%d parts from step %d)", rep.iterations_done,
                    rb.parts, rb.start)
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

    def _on_restore(self, msg: m.Message, peer) -> m.Message | None:
        want = msg.body.get("step")
        with self.lock:
            r = self.replica
            held = self.restores.held()
            if held is not None and (want is None or want == held.iterations_done):
                # the other ranks of the resuming job: the same step
                return self.restores.reply(held, "memory", self.trainer_step,
                                           self.restores.check_behind(held.iterations_done, "memory",
                                                                      self.trainer_step, msg.body))
            if r is not None and r.committable and self._meta_missing_at != r.iterations_done and \
                    (want is None or want == r.iterations_done):
                return self.restores.from_memory(r.state(), self.trainer_step, msg.body, peer, msg.rid)
            trainer_step = self.trainer_step
        return self.restores.from_disk(trainer_step, msg.body)

