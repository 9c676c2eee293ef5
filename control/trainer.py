"""Trainer-side integration: one call after building the DDP model and its optimizer.

    link = mirrorckpt.control.trainer.attach(ddp_model, optimizer, appliance=("10.0.0.9", 7070),
                                             secret=SECRET, scheduler=scheduler, data=loader)
    ... the usual DDP loop, unchanged ...
    link.close()

Everything happens in the optimizer's step hooks (``register_step_pre_hook`` /
``register_step_post_hook``): the first pre-hook registers the job (layout, ring, training spec,
initial state); every post-hook sends STEP_META (lr, loss scale, RNG states, data position: what
the wire does not carry); every ``fingerprint_every`` steps a FINGERPRINT of the state, computed
off the training thread; a FALLBACK_REQUEST from the appliance starts a GoCkpt checkpoint at the
next step boundary (schedule in ``control.gockpt``). Only the leader rank (0) talks to the
appliance: plain DDP keeps every rank's state identical.

Each iteration is counted once per ``optimizer.step()`` call, and once per step a GradScaler
skipped for inf/nan (``attach(scaler=...)`` wraps the scaler's ``update``, which sees the skip the
hooks cannot): STEP_META says ``skipped`` and the replica skips as the trainer did. Clipping
through ``link.clip_grad_norm_`` (or torch's, reported by ``link.note_clip``) sends the clip
coefficient the trainer applied, which the replica multiplies by instead of recomputing a norm
whose reduction order is the trainer's device's.

``restore_from_appliance`` / ``restore_from_disk`` load the five state components (parameters,
optimizer state, scheduler and counters, RNG states, data position) into a fresh job; ``attach``
calls them with ``restore=``.

``TrainerLink`` composes the parts of ``control.link``, one concern each: ``transport`` (client,
sender thread), ``meta`` (STEP_META), ``fingerprints``, ``fallbacks`` (GoCkpt), and ``restore``;
``describe`` and ``schedules`` read the job's description from the trainer's objects.
"""


from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from mirrorckpt.config.ddp import reducer_params
from mirrorckpt.config.layout import JobLayout, RingSpec
from mirrorckpt.config.training import ClipSpec, TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.link.checks import AttachError, check_attach  # noqa: F401  (AttachError: API)
from mirrorckpt.control.link.clip import ClipWatch
from mirrorckpt.control.link.describe import (  # noqa: F401  (re-exported: the trainer API)
    DTYPE_NAMES,
    clip_coefficient,
    ddp_layout,
    group_dicts,
    hyper_parameters,
    implementation,
    local,
    rng_states,
    set_rng_states,
    training_spec,
    unwrap,
)
from mirrorckpt.control.link.fallback import Fallbacks
from mirrorckpt.control.link.fingerprints import Fingerprints
from mirrorckpt.control.link.meta import ScalerWatch, StepMeta
from mirrorckpt.control.link.restore import (  # noqa: F401  (re-exported: the trainer API)
    Restored,
    RestoreRefused,
    load_restore_state,
    load_trainer_state,
    parse_restore,
    restore_from_appliance,
    restore_from_disk,
)
from mirrorckpt.control.link.schedules import schedule_spec  # noqa: F401  (re-exported)
from mirrorckpt.control.link.transport import Transport
from mirrorckpt.updater.dcp_keys import dumps

log = logging.getLogger("mirrorckpt.control.trainer")


@dataclass
class LinkStats:
    steps: int = 0
    hook_seconds: float = 0.0  # all time spent in our hooks
    fallbacks: list[dict] = field(default_factory=list)  # one record per finished checkpoint
    fingerprints_sent: int = 0
    step_meta_dropped: int = 0
    skipped_steps: int = 0  # optimizer steps a GradScaler skipped (inf/nan), reported as such


class TrainerLink:
    def __init__(self, ddp_model, optimizer, *, appliance: tuple[str, int] | None, secret,
                 scheduler=None, scaler=None, data=None, training: TrainingSpec | None = None,
                 ring: RingSpec | None = None, job: str = "job", parts: int = 7,
                 fingerprint_every: int = 10, leader: int = 0, role: str = "trainer",
                 max_grad_norm: float | None = None, norm_type: float = 2.0, client_options: dict | None = None,
                 report_schedule: bool = False):
        self.ddp_model, self.optimizer = ddp_model, optimizer
        self.module = unwrap(ddp_model)
        self.scheduler, self.scaler, self.data = scheduler, scaler, data
        self.ring, self.job, self.default_parts = ring, job, parts
        # This start of the job: a restart (new communicator) registers with another id, a
        # reconnection with the same one.
        self.run = secrets.token_hex(8)
        named = reducer_params(self.module)
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        self.masters = self._masters(optimizer)
        self.grad_dtype = DTYPE_NAMES[self.model_params[0].dtype]
        self._auto_training = training is None  # read from the optimizer: clipping is learned from the first step
        self.training = training or training_spec(optimizer, scheduler, self.grad_dtype,
                                                  {id(p): n for n, p in zip(self.names, self.masters)},
                                                  report_schedule=report_schedule)
        if max_grad_norm is not None and self.training.clip is None:
            self.training = dataclasses.replace(self.training, clip=ClipSpec(float(max_grad_norm), float(norm_type)))
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.leader = self.rank == leader
        self.iterations_done = 0
        self.restored: Restored | None = None
        self.layout: JobLayout | None = None
        self.stats = LinkStats()
        self._ready: list[int] = []
        self._ready_hooks = []
        self._lock = threading.Lock()
        self.copier = gockpt.copier_for(self.masters)
        schedule = self.training.lr_schedule
        self.meta = StepMeta(self, schedule.needs_metrics and scheduler is not None,
                             schedule.reported and scheduler is not None)
        self.fingerprints = Fingerprints(fingerprint_every, self)
        self.fallbacks = Fallbacks(self)
        self.transport: Transport | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        self._scaler_watch = ScalerWatch(scaler, optimizer, self._skipped_step) \
            if scaler is not None and self.leader else None
        if self.leader and appliance is not None:
            for i, p in enumerate(self.model_params):
                self._ready_hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready.append(i)))
            self.transport = Transport(appliance, secret, role, handlers={m.FALLBACK_REQUEST: self._on_fallback},
                                       on_connect=self._on_connect, copier=lambda: self.copier,
                                       dropped=self._dropped, client_options=client_options)
        self.clip_watch = ClipWatch(self, scaler) if self._talks else None
        self._unfollowed_clip = False

    def _masters(self, optimizer) -> list[torch.Tensor]:
        opt = [p for g in optimizer.param_groups for p in g["params"]]
        if len(opt) != len(self.model_params):
            raise ValueError(f"optimizer holds {len(opt)} parameters, the model {len(self.model_params)}")
        if {id(p) for p in opt} == {id(p) for p in self.model_params}:
            return list(self.model_params)  # fp32: the optimizer steps the model's own parameters
        return opt  # fp32 masters of a low-precision model: its groups, concatenated, in model order

    # ---------------------------------------------------------------- public state
    @property
    def client(self):
        return self.transport.client if self.transport is not None else None

    @property
    def fingerprint_every(self) -> int:
        return self.fingerprints.every

    @property
    def defer_fallbacks(self) -> bool:
        """True: a fallback request waits (pending) until this is False again at a step boundary."""
        return self.fallbacks.defer

    @defer_fallbacks.setter
    def defer_fallbacks(self, value: bool) -> None:
        self.fallbacks.defer = value

    @property
    def fallback_pending(self) -> bool:
        """A FALLBACK_REQUEST arrived; it starts after the next optimizer step not deferred."""
        return self.fallbacks.pending

    @property
    def _talks(self) -> bool:
        return self.leader and self.transport is not None

    def named_state(self) -> dict[str, torch.Tensor]:
        return {k: local(v) for k, v in gockpt._named_state(self.names, self.masters, self.optimizer).items()}

    # ---------------------------------------------------------------- what the wire does not carry
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's (master) parameters, with the
        coefficient it applied sent to the appliance in this step's STEP_META."""
        grads = [p.grad for p in self.masters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_norm, total, foreach)
        self.note_clip(total, max_norm, norm_type)
        return total

    def note_clip(self, total_norm, max_norm: float, norm_type: float = 2.0) -> None:
        """Report a clip done with torch's own ``clip_grad_norm_`` (its returned ``total_norm``):
        the coefficient is formed exactly as torch forms it, on the same device (no host sync
        here; the sender thread reads it)."""
        self.meta.note_clip(total_norm, max_norm, norm_type)

    def _observe_clip(self) -> None:
        """The clip of the step about to run, seen on its gradients when the loop clipped with
        torch's (or a framework's) own call rather than through the link (control.link.clip)."""
        coef = self.clip_watch.observe(self.iterations_done + 1)
        if coef is None or self.meta.clip is not None:
            return
        spec = self.training.clip
        if spec is not None:
            self.meta.note_coefficient(coef, spec.max_norm, spec.norm_type)
        elif coef < 1 and not self._unfollowed_clip:
            self._unfollowed_clip = True
            log.error("step %d: the gradients were clipped (factor %r) but attach was given no max_grad_norm, so the "
                      "job registered no clipping and the appliance does not follow it: pass attach(max_grad_norm=) "
                      "with the value the loop clips to", self.iterations_done + 1, coef)

    def _skipped_step(self) -> None:
        self.iterations_done += 1
        self.stats.skipped_steps += 1
        self.meta.clip = None
        if not self._talks:
            return
        self.meta.release()
        self.fallbacks.abandon(f"step {self.iterations_done} was skipped (inf/nan)")
        self.meta.record(self.iterations_done, skipped=True)
        if not self.meta.holds:
            self.meta.release()

    # ---------------------------------------------------------------- messages
    def _emit(self, build, copy: gockpt.Copy | None = None) -> None:
        if self.transport is not None:
            self.transport.emit(build, copy)

    def _dropped(self) -> None:
        self.stats.step_meta_dropped += 1

    def _register_msg(self, with_state: bool) -> m.Message:
        tensors, extra = {}, {}
        if with_state:  # the initial state: weights, and the groups and schedule as constructed
            tensors = {gockpt.param_key(n): local(p.detach()).to("cpu", copy=True)
                       for n, p in zip(self.names, self.masters)}
            extra["state_meta"] = {
                "param_groups": dumps(group_dicts(self.optimizer), "param_groups"),
                "lr_scheduler": (dumps(self.scheduler.state_dict(), "lr_scheduler")
                                 if self.scheduler is not None else None)}
        return m.make(m.REGISTER, tensors, job=self.job, step=self.iterations_done, run=self.run,
                      layout=self.layout.to_dict(),
                      ring=self.ring.to_dict() if self.ring is not None else None, training=self.training.to_dict(),
                      **extra, **self._register_extra())

    def _on_connect(self, client) -> list:
        # A reconnection (or an appliance restart): register again, without state; the appliance
        # asks for a fallback checkpoint when it has no consistent replica.
        with self._lock:
            if self.layout is None:
                return []
            return [self._register_msg(with_state=False)]

    def _on_fallback(self, msg: m.Message, client) -> None:
        self.fallbacks.requested(msg)

    # ---------------------------------------------------------------- hooks
    def _pre(self, optimizer, args, kwargs):
        """Before the step. A step given a closure (Lightning's) makes its gradients inside
        ``step()``, after this hook: the work then runs when the closure returns."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            self._before_step()
            return None

        def closure_then_link():
            out = closure()
            self._before_step()
            return out
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_link}
        return (args[0], closure_then_link, *args[2:]), kwargs

    def _before_step(self) -> None:
        t0 = time.perf_counter()
        if self._talks:
            self._observe_clip()
            if self.layout is None:
                self._first_register()
            self.meta.release()
            self.fingerprints.send_pending()
            self.fallbacks.before_step(t0)
        self.stats.hook_seconds += time.perf_counter() - t0

    def _first_register(self) -> None:
        for h in self._ready_hooks:
            h.remove()
        self._ready_hooks = []
        order = list(dict.fromkeys(self._ready))
        if sorted(order) != list(range(len(self.model_params))):
            order = list(reversed(range(len(self.model_params))))  # no backward seen: DDP's default
        clip = self.meta.clip
        if self._auto_training and self.training.clip is None and clip is not None:
            self.training = dataclasses.replace(self.training, clip=ClipSpec(clip[2], clip[3]))
        with self._lock:
            self.layout = self._job_layout(order)
            fresh = self.iterations_done == 0 and not any(self.optimizer.state.get(p) for p in self.masters)
            msg = self._register_msg(with_state=fresh)
        self._emit(lambda _t: msg)

    def _post(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        self.iterations_done += 1
        self.stats.steps += 1
        if self._scaler_watch is not None:
            self._scaler_watch.stepped = True
        if not self._talks:
            self.meta.clip = None
        else:
            t = self.iterations_done
            self.meta.record(t, found_inf=kwargs.get("found_inf"))
            if not self.meta.holds:
                self.meta.release()
            self.fallbacks.after_step(t)
            if self.fallbacks.run is None and self.fingerprints.due(t):
                self.fingerprints.take(t)
        self.stats.hook_seconds += time.perf_counter() - t0

    def _job_layout(self, order: list[int]) -> JobLayout:
        """The layout this link registers (the buckets DDP all-reduces, ``order``: first-backward
        ready order)."""
        return ddp_layout(self.ddp_model, self.model_params, self.names, order)

    def _register_extra(self) -> dict:
        """More REGISTER body fields (a sharded link adds its layout and DP group)."""
        return {}

    # ---------------------------------------------------------------- lifecycle
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every message handed over so far has been written to the appliance."""
        return self.transport is None or self.transport.flush(timeout)

    def close(self, flush_timeout: float = 30.0) -> None:
        if self._talks:
            self.meta.release()
            self.fallbacks.close()
            self.fingerprints.send_pending()  # the job's last one: the appliance checks its final state too
        if self._scaler_watch is not None:
            self._scaler_watch.remove()
            self._scaler_watch = None
        if self.clip_watch is not None:
            self.clip_watch.close()
        for h in self._hooks + self._ready_hooks:
            h.remove()
        self._hooks, self._ready_hooks = [], []
        if self.transport is not None:
            self.transport.close(flush_timeout)
        self.copier.close()


# ------------------------------------------------------------------------------- the one call

def attach(ddp_model, optimizer, *, appliance: tuple[str, int] | None, secret, scheduler=None, scaler=None,
           data=None, training: TrainingSpec | None = None, ring: RingSpec | None = None, job: str = "job",
           parts: int = 7, fingerprint_every: int = 10, restore: str | None = None, allow_behind: bool = False,
           max_grad_norm: float | None = None, norm_type: float = 2.0, connect_timeout: float = 0.0,
           client_options: dict | None = None, report_schedule: bool = False) -> TrainerLink:
    """Attach a DDP model and its optimizer to the appliance; see the module docstring.

    Every argument is checked first (``control.link.checks``: AttachError names the one that does
    not fit). ``data``: an object with ``state_dict()``/``load_state_dict()`` for the data position
    (JSON), e.g. torchdata's StatefulDataLoader. ``restore``: None, "appliance" (pull the appliance's
    state; a state further behind the trainer's last reported step than the appliance's limit is
    refused, RestoreRefused, unless ``allow_behind``), or a checkpoint root on disk; every rank
    restores. ``max_grad_norm`` (and ``norm_type``): the loop clips the gradients to this norm with
    torch's ``clip_grad_norm_`` or a framework's; the link finds each step's coefficient on the
    gradients (control.link.clip), nothing in the loop changes. ``connect_timeout``: seconds to
    wait for the first connection. ``report_schedule``: the scheduler is not stepped once per
    optimizer step (Lightning's ``interval="epoch"``): its hyper-parameters and state are sent with
    every step instead of the appliance rebuilding it (as for any schedule it cannot import)."""
    if any(hasattr(p, "placements") for p in unwrap(ddp_model).parameters()):
        # its local shards are not the parameters a single ring registers: refused here, not at its first fallback
        raise ValueError("the model's parameters are DTensors (TP, FSDP2): attach a sharded job with "
                         "mirrorckpt.control.sharded.attach_sharded")
    check_attach(ddp_model, optimizer, scheduler=scheduler, scaler=scaler, data=data, appliance=appliance,
                 restore=restore)
    restored = None
    if restore == "appliance":
        restored = restore_from_appliance(ddp_model, optimizer, appliance=appliance, secret=secret,
                                          scheduler=scheduler, scaler=scaler, data=data, allow_behind=allow_behind,
                                          client_options=client_options)
    elif restore is not None:
        restored = restore_from_disk(ddp_model, optimizer, restore, scheduler=scheduler, scaler=scaler, data=data)
    link = TrainerLink(ddp_model, optimizer, appliance=appliance, secret=secret, scheduler=scheduler,
                       scaler=scaler, data=data, training=training, ring=ring, job=job, parts=parts,
                       fingerprint_every=fingerprint_every, max_grad_norm=max_grad_norm, norm_type=norm_type,
                       client_options=client_options, report_schedule=report_schedule)
    return started(link, restored, connect_timeout)


def started(link: TrainerLink, restored: Restored | None, connect_timeout: float) -> TrainerLink:
    """A new link counts from the restored step, once connected (``connect_timeout`` s at most)."""
    if restored is not None:
        link.iterations_done = restored.iterations_done
        link.restored = restored
    if connect_timeout and link.client is not None and not link.client.wait_connected(connect_timeout):
        log.warning("the appliance did not answer within %g s: training goes on unprotected until it does "
                    "(the link keeps trying and registers the job when it connects)", connect_timeout)
    return link
