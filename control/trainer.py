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
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from mirrorckpt.config import ddp
from mirrorckpt.config.ddp import reducer_params
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec
from mirrorckpt.config.training import (
    GROUP_OPTIONS,
    ClipSpec,
    LRScheduleSpec,
    OptimizerSpec,
    ParamGroupSpec,
    TrainingSpec,
)
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.endpoint import ControlClient
from mirrorckpt.updater.dcp_keys import dumps, loads
from mirrorckpt.updater.optim import resolve, state_keys

log = logging.getLogger("mirrorckpt.control.trainer")

_OPTIMIZER_NAMES = {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------------- job description

def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def local(t):
    """This process's piece of a tensor: a DTensor's local shard (a view of it, no copy), any other
    tensor itself. The link copies, fingerprints and sends only local tensors."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def ddp_layout(ddp_model, params: list[torch.Tensor], names: list[str], ready_order: list[int]) -> JobLayout:
    """The buckets DDP (torch 2.x) all-reduces: one bucket in iteration 0, then the rebuild in
    first-backward ready order with DDP's caps (config.ddp: the reducer's own assignment function)."""
    cfg = getattr(ddp_model, "_bucket_config", None)
    if getattr(cfg, "has_custom_per_bucket_caps", False) or getattr(ddp_model, "find_unused_parameters", False) \
            or getattr(ddp_model, "static_graph", False):
        raise ValueError("DDP with per-bucket caps, find_unused_parameters or static_graph buckets its first "
                         "iteration differently; the appliance follows DDP's default options only")
    first = ddp.initial_buckets(params)
    cap = int(getattr(ddp_model, "bucket_bytes_cap", 25 << 20))
    first_cap = int(getattr(cfg, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES))
    rebuilt = ddp.rebuilt_buckets(params, ready_order, cap, first_cap)
    dtype = _DTYPE_NAMES[params[0].dtype]
    return JobLayout(params=[ParamSpec(n, tuple(p.shape), "float32") for n, p in zip(names, params)],
                     buckets=[BucketSpec(tuple(b)) for b in rebuilt],
                     first_buckets=[BucketSpec(tuple(b)) for b in first], grad_dtype=dtype)


def _num(v):
    return float(v.item()) if isinstance(v, torch.Tensor) else v


def _options(g: dict, name: str, scheduler) -> dict:
    """A torch param group's hyper-parameters as OptimizerSpec fields, with the values schedulers
    move taken at their start (``initial_lr``; a cycled momentum at its maximum, which is where
    OneCycleLR/CyclicLR start it), so the spec is the same at whatever step it is read."""
    out = {"lr": float(_num(g.get("initial_lr", g["lr"]))), "weight_decay": float(_num(g["weight_decay"])),
           "maximize": bool(g.get("maximize", False))}
    cycled = "max_momentum" in g and getattr(scheduler, "cycle_momentum", False)
    if name == "sgd":
        out.update(momentum=float(g["max_momentum"] if cycled else g["momentum"]),
                   dampening=float(g["dampening"]), nesterov=bool(g["nesterov"]))
    else:
        b1, b2 = (float(_num(b)) for b in g["betas"])
        out.update(betas=(float(g["max_momentum"]) if cycled else b1, b2), eps=float(g["eps"]),
                   amsgrad=bool(g["amsgrad"]))
    return out


def implementation(optimizer: torch.optim.Optimizer) -> dict:
    """The implementation the optimizer's step actually runs: {foreach, fused, device}. An unset
    ``foreach`` is torch's default for these parameters (foreach on CUDA tensors, the for-loop on
    CPU ones), resolved by torch's own rule."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    g0 = optimizer.param_groups[0]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fused, foreach = bool(g0.get("fused") or False), g0.get("foreach")
    if foreach is None and not fused:
        _, foreach = _default_to_fused_or_foreach(params, bool(g0.get("differentiable", False)), use_fused=False)
        if foreach and isinstance(g0.get("lr"), torch.Tensor) and not g0.get("capturable", False):
            foreach = False  # torch's exception to its own default
    return {"foreach": bool(foreach) and not fused, "fused": fused,
            "device": params[0].device.type if params else "cpu"}


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grads_with_norm_`` multiplies the gradients by, formed by
    the same operations on the same device (torch 2.13)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def training_spec(optimizer: torch.optim.Optimizer, scheduler=None, grad_dtype: str = "float32",
                  names: dict[int, str] | None = None) -> TrainingSpec:
    """The TrainingSpec of a torch optimizer (and scheduler): what the replica rebuilds.
    ``names`` (id of each optimizer parameter -> layout name) is needed for several groups."""
    name = _OPTIMIZER_NAMES.get(type(optimizer))
    if name is None:
        raise ValueError(f"optimizer {type(optimizer).__name__} is not one the replica reproduces (Adam, AdamW, SGD)")
    groups = optimizer.param_groups
    base = _options(groups[0], name, scheduler)
    g0 = groups[0]
    opt = OptimizerSpec(name=name, **implementation(optimizer), **base)
    param_groups = None
    if len(groups) > 1:
        if names is None:
            raise ValueError("several param groups: the parameters' names are needed")
        param_groups = []
        for g in groups:
            if g.get("foreach") != g0.get("foreach") or bool(g.get("fused") or False) != opt.fused:
                raise ValueError("param groups with different foreach/fused settings are not reproduced")
            own = _options(g, name, scheduler)
            param_groups.append(ParamGroupSpec([names[id(p)] for p in g["params"]],
                                               {k: v for k, v in own.items() if v != base[k]}))
    return TrainingSpec(optimizer=opt, lr_schedule=schedule_spec(scheduler), grad_dtype=grad_dtype,
                        param_groups=param_groups)


def _path(fn) -> str:
    """The importable path of a function the appliance must call too (LambdaLR's lambdas)."""
    path = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
    try:
        same = resolve(path) is fn
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"scheduler function {fn!r} is not a module-level function the appliance can import "
                         f"(lambdas, closures and bound methods cannot be named); define it at module level")
    return path


def _one_or_list(values: list):
    return values[0] if len(set(map(repr, values))) == 1 else list(values)


def _scheduler_kwargs(scheduler) -> dict:
    """Constructor arguments read back from a scheduler. Values the constructor only turns into
    state (OneCycleLR's pct_start, CyclicLR's step sizes) are recovered as well as floats allow;
    the replica then loads the scheduler's state_dict, which holds them exactly."""
    cls = type(scheduler).__name__
    groups = scheduler.optimizer.param_groups if hasattr(scheduler, "optimizer") else []
    if cls in ("SequentialLR", "ChainedScheduler"):
        kw = {"schedulers": [schedule_spec(s).to_dict() for s in scheduler._schedulers]}
        if cls == "SequentialLR":
            kw["milestones"] = list(scheduler._milestones)
        return kw
    if cls in ("LambdaLR", "MultiplicativeLR"):
        return {"lr_lambda": _one_or_list([_path(f) for f in scheduler.lr_lambdas])}
    if cls == "OneCycleLR":
        ph = scheduler._schedule_phases
        g = groups[0]
        return {"max_lr": _one_or_list([g["max_lr"] for g in groups]), "total_steps": scheduler.total_steps,
                "pct_start": (ph[0]["end_step"] + 1) / scheduler.total_steps,
                "anneal_strategy": getattr(scheduler, "_anneal_func_type", "cos"),
                "cycle_momentum": scheduler.cycle_momentum,
                "base_momentum": _one_or_list([g.get("base_momentum", 0.85) for g in groups]),
                "max_momentum": _one_or_list([g.get("max_momentum", 0.95) for g in groups]),
                "div_factor": g["max_lr"] / g["initial_lr"], "final_div_factor": g["initial_lr"] / g["min_lr"],
                "three_phase": len(ph) == 3}
    if cls == "CyclicLR":
        up = scheduler.total_size * scheduler.step_ratio
        kw = {"base_lr": _one_or_list(list(scheduler.base_lrs)), "max_lr": _one_or_list(list(scheduler.max_lrs)),
              "step_size_up": up, "step_size_down": scheduler.total_size - up, "mode": scheduler.mode,
              "gamma": scheduler.gamma, "scale_mode": scheduler.scale_mode,
              "cycle_momentum": scheduler.cycle_momentum}
        if scheduler.cycle_momentum:
            kw.update(base_momentum=_one_or_list(list(scheduler.base_momentums)),
                      max_momentum=_one_or_list(list(scheduler.max_momentums)))
        if getattr(scheduler, "_scale_fn_custom", None) is not None:
            kw["scale_fn"] = _path(scheduler._scale_fn_custom)
        return kw
    if cls == "ReduceLROnPlateau":
        return {"mode": scheduler.mode, "factor": scheduler.factor, "patience": scheduler.patience,
                "threshold": scheduler.threshold, "threshold_mode": scheduler.threshold_mode,
                "cooldown": scheduler.cooldown, "min_lr": _one_or_list(list(scheduler.min_lrs)),
                "eps": scheduler.eps}
    kwargs = {}
    for p in inspect.signature(type(scheduler).__init__).parameters:
        if p in ("self", "optimizer", "last_epoch", "verbose"):
            continue
        if hasattr(scheduler, p):
            v = getattr(scheduler, p)
            kwargs[p] = sorted(v.elements()) if isinstance(v, collections.Counter) else (
                list(v) if isinstance(v, (tuple, set)) else v)
    return kwargs


def schedule_spec(scheduler) -> LRScheduleSpec:
    """A scheduler's constructor arguments read back from it (see ``_scheduler_kwargs``)."""
    if scheduler is None:
        return LRScheduleSpec()
    return LRScheduleSpec(name=type(scheduler).__name__, kwargs=_scheduler_kwargs(scheduler))


def hyper_parameters(optimizer) -> list[dict]:
    """Each param group's hyper-parameters as the step about to run uses them (JSON numbers):
    everything a scheduler may move between steps (lr, betas, momentum, weight decay...)."""
    out = []
    for g in optimizer.param_groups:
        d = {}
        for k in GROUP_OPTIONS:
            if k in g:
                v = g[k]
                d[k] = [float(_num(x)) for x in v] if isinstance(v, (tuple, list)) else (
                    v if isinstance(v, bool) else float(_num(v)))
        out.append(d)
    return out


def group_dicts(optimizer) -> list[dict]:
    """The param groups without their parameters (what the replica's groups must hold)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def rng_states() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda{i}"] = torch.cuda.get_rng_state(i)
    return out


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    for name, t in states.items():
        if name == "torch":
            torch.set_rng_state(t.to(torch.uint8).clone())
        elif name.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state(t.to(torch.uint8).clone(), int(name[4:]))
        else:
            log.warning("RNG state %r has no place in this process; ignored", name)


# ------------------------------------------------------------------------------- the link

@dataclass
class FallbackRun:
    """One GoCkpt checkpoint in progress on the trainer."""

    start: int  # boundary N
    plan: list[list[int]]
    reason: str
    state_copy: gockpt.Copy | None = None  # part j of S_{N+j}, in flight
    grad_copy: gockpt.Copy | None = None
    held: tuple | None = None  # the last part, sent with the tail
    fingerprint: gockpt.Copy | None = None
    stall: float = 0.0  # seconds the training thread spent on this checkpoint
    blocked_parts: int = 0  # parts whose copy was not done when the step needed the state
    state_bytes: int = 0
    grad_bytes: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def parts(self) -> int:
        return len(self.plan)


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
                 client_options: dict | None = None):
        self.ddp_model, self.optimizer = ddp_model, optimizer
        self.module = unwrap(ddp_model)
        self.scheduler, self.scaler, self.data = scheduler, scaler, data
        self.ring, self.job, self.default_parts = ring, job, parts
        # This start of the job: a restart (new communicator) registers with another id, a
        # reconnection with the same one.
        self.run = secrets.token_hex(8)
        self.fingerprint_every = fingerprint_every
        named = reducer_params(self.module)
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        self.masters = self._masters(optimizer)
        self.grad_dtype = _DTYPE_NAMES[self.model_params[0].dtype]
        self._auto_training = training is None  # read from the optimizer: clipping is learned from the first step
        self.training = training or training_spec(optimizer, scheduler, self.grad_dtype,
                                                  {id(p): n for n, p in zip(self.names, self.masters)})
        self._plateau = self.training.lr_schedule.needs_metrics and scheduler is not None
        self._held_meta = None  # STEP_META waiting for the plateau scheduler's step
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.leader = self.rank == leader
        self.iterations_done = 0
        self.layout: JobLayout | None = None
        self.stats = LinkStats()
        self._ready: list[int] = []
        self._ready_hooks = []
        self._boundary: dict = {}  # rng, data position, lr at the last boundary
        self._request: dict | None = None
        # True: a fallback request waits (pending) until this is False again at a step boundary;
        # a sharded job's groups start their fallbacks at one step this way (control.sharded)
        self.defer_fallbacks = False
        self._run: FallbackRun | None = None
        self._fp_pending: tuple[int, gockpt.Copy] | None = None
        self._clip: tuple | None = None  # (total_norm, coef) tensors of this iteration's clip
        self._lock = threading.Lock()
        self.copier = gockpt.copier_for(self.masters)
        self.client: ControlClient | None = None
        self._sendq: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        self._scaler_update = None
        if scaler is not None and self.leader:
            self._wrap_scaler(scaler)
        if self.leader and appliance is not None:
            for i, p in enumerate(self.model_params):
                self._ready_hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready.append(i)))
            host, port = appliance
            self.client = ControlClient(host, port, secret, role, handlers={m.FALLBACK_REQUEST: self._on_fallback},
                                        on_connect=self._on_connect, **(client_options or {}))
            self._sender = threading.Thread(target=self._send_loop, name="mirrorckpt-link", daemon=True)
            self._sender.start()
            self.client.start()

    def _masters(self, optimizer) -> list[torch.Tensor]:
        opt = [p for g in optimizer.param_groups for p in g["params"]]
        if len(opt) != len(self.model_params):
            raise ValueError(f"optimizer holds {len(opt)} parameters, the model {len(self.model_params)}")
        if {id(p) for p in opt} == {id(p) for p in self.model_params}:
            return list(self.model_params)  # fp32: the optimizer steps the model's own parameters
        return opt  # fp32 masters of a low-precision model: its groups, concatenated, in model order


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
        total = torch.as_tensor(total_norm).detach()
        self._clip = (total, clip_coefficient(total, max_norm), float(max_norm), float(norm_type))

    def _wrap_scaler(self, scaler) -> None:
        """GradScaler skips ``optimizer.step()`` on inf/nan, so the hooks never see that iteration;
        its ``update`` (called every iteration) does: report the skip from there."""
        orig = scaler.update

        def update(new_scale=None):
            st = getattr(scaler, "_per_optimizer_states", {}).get(id(self.optimizer), {})
            found = st.get("found_inf_per_device") or {}
            skipped = not self._stepped and bool(sum(float(v.item()) for v in found.values()))  # synced by step
            orig(new_scale)
            self._stepped = False
            if skipped:
                self._skipped_step()
        scaler.update = update
        self._scaler_update = orig
        self._stepped = False

    def _plan_bytes(self, layout: JobLayout, parts: int) -> list[int]:
        """Sizes of the host copies one fallback makes: part j's state once, its gradients in
        each of the steps N+j..N+k-1."""
        keys = state_keys(self.training.optimizer)
        plan = gockpt.split(layout, parts)
        gsize = gockpt.GRAD_DTYPES[self.training.grad_dtype].itemsize
        out = []
        for j, part in enumerate(plan):
            for i in part:
                nb = 4 * layout.params[i].numel
                gb = gsize * layout.params[i].numel
                out += [nb] + [gb] * (len(plan) - j) + [4 if k == "step" else nb for k in keys]
        return out

    def _skipped_step(self) -> None:
        self.iterations_done += 1
        self.stats.skipped_steps += 1
        self._clip = None
        if not (self.leader and self.client is not None):
            return
        self._release_meta()
        if self._run is not None:
            log.warning("GoCkpt checkpoint from step %d abandoned: step %d was skipped (inf/nan)", self._run.start,
                        self.iterations_done)
            self._run = None
        t = self.iterations_done
        self._boundary = {"rng": {k: v.clone() for k, v in rng_states().items()},
                          "data_position": self.data.state_dict() if self.data is not None else None,
                          "lr": hyper_parameters(self.optimizer)[0]["lr"], "hparams": hyper_parameters(self.optimizer),
                          "skipped": True}
        self._held_meta = (t, self._boundary, float(self.scaler.get_scale()))
        self._release_meta()

    # ---------------------------------------------------------------- messages
    def _emit(self, build, copy: gockpt.Copy | None = None) -> None:
        """Hand a message to the sender thread; ``build(tensors)`` runs there once ``copy`` is done."""
        if self.client is not None:
            self._sendq.put((copy, build))

    def _send_loop(self) -> None:
        while True:
            item = self._sendq.get()
            if item is None:
                return
            copy, build = item
            try:
                msg = build(_result(self.copier, copy) if copy is not None else None)
                if msg is not None and not self.client.send(msg):
                    self.stats.step_meta_dropped += 1
            except Exception as e:  # noqa: BLE001 - a lost message is logged; the appliance re-asks
                log.error("control message not sent: %s: %s", type(e).__name__, e)

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
        parts = max(1, min(gockpt.MAX_PARTS, msg.body["parts"]))
        with self._lock:
            self._request = {"parts": parts, "reason": msg.body["reason"], "at": msg.body["step"]}
            layout = self.layout
        if layout is not None:  # pinned buffers for the whole plan, here and not in the training thread
            self.copier.reserve(self._plan_bytes(layout, parts))
        log.info("fallback requested by the appliance (%s) at its step %d, %d parts",
                 msg.body["reason"], msg.body["step"], parts)

    # ---------------------------------------------------------------- hooks
    def _pre(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        if self.leader and self.client is not None:
            if self.layout is None:
                self._first_register()
            self._release_meta()
            if self._fp_pending is not None:
                step, c = self._fp_pending
                self._fp_pending = None
                self.copier.fence(c)
                self._emit(lambda d, step=step: m.make(m.FINGERPRINT, gockpt.digest_tensors(d), step=step,
                                                       fingerprints=d.words), c)
                self.stats.fingerprints_sent += 1
            if self._run is not None:
                self._pre_fallback(self._run, t0)
        self.stats.hook_seconds += time.perf_counter() - t0

    def _first_register(self) -> None:
        for h in self._ready_hooks:
            h.remove()
        self._ready_hooks = []
        order = list(dict.fromkeys(self._ready))
        if sorted(order) != list(range(len(self.model_params))):
            order = list(reversed(range(len(self.model_params))))  # no backward seen: DDP's default
        if self._auto_training and self.training.clip is None and self._clip is not None:
            self.training = dataclasses.replace(self.training, clip=ClipSpec(self._clip[2], self._clip[3]))
        with self._lock:
            self.layout = self._job_layout(order)
            fresh = self.iterations_done == 0 and not any(self.optimizer.state.get(p) for p in self.masters)
            msg = self._register_msg(with_state=fresh)
        self._emit(lambda _t: msg)

    def _post(self, optimizer, args, kwargs) -> None:
        t0 = time.perf_counter()
        self.iterations_done += 1
        self.stats.steps += 1
        self._stepped = True
        clip, self._clip = self._clip, None
        if self.leader and self.client is not None:
            t = self.iterations_done
            hp = hyper_parameters(optimizer)  # what step t used: the scheduler moves them only after
            self._boundary = {"rng": {k: v.clone() for k, v in rng_states().items()},
                              "data_position": self.data.state_dict() if self.data is not None else None,
                              "lr": hp[0]["lr"], "hparams": hp, "clip": clip,
                              # a fused step given GradScaler's found_inf skips inside the kernel
                              "found_inf": kwargs.get("found_inf")}
            scale = float(self.scaler.get_scale()) if self.scaler is not None else None
            self._boundary["loss_scale"] = scale  # the scale this step's gradients carried
            self._held_meta = (t, self._boundary, scale)
            if not self._plateau:
                self._release_meta()
            run = self._run
            if run is not None:
                self._post_fallback(run, t)
            with self._lock:
                req, self._request = (None, self._request) if self.defer_fallbacks else (self._request, None)
            if req is not None and self.layout is not None:
                if run is not None:
                    log.warning("fallback %d..: abandoned for a new request", run.start)
                self._start_fallback(req, t)
            elif req is not None:
                with self._lock:
                    self._request = req  # not registered yet: start after the first step
            if self._run is None and self.fingerprint_every and t % self.fingerprint_every == 0:
                self._fp_pending = (t, self.copier.digest(self._named_state(), t))
        self.stats.hook_seconds += time.perf_counter() - t0

    def _release_meta(self) -> None:
        """Send the held STEP_META; with ReduceLROnPlateau at the next optimizer step (or close),
        when the loop has stepped the scheduler on its metric, with the scheduler's state."""
        held, self._held_meta = self._held_meta, None
        if held is None:
            return
        t, meta, scale = held
        extra = {"lr_scheduler": dumps(self.scheduler.state_dict(), "lr_scheduler")} if self._plateau else {}

        def build(_t):  # the sender thread: reading the clip and found_inf tensors waits there
            out = dict(extra)
            if meta.get("clip") is not None:
                total, coef = meta["clip"][:2]
                out["clip"] = {"total_norm": float(total.item()), "coef": float(coef.item())}
            if meta.get("skipped"):
                out["skipped"] = True
            elif meta.get("found_inf") is not None:
                out["skipped"] = bool(meta["found_inf"].item())
            return m.make(m.STEP_META, {gockpt.rng_key(k): v for k, v in meta["rng"].items()},
                          step=t, lr=meta["lr"], loss_scale=scale, data_position=meta["data_position"], **out)
        self._emit(build)

    def _job_layout(self, order: list[int]) -> JobLayout:
        """The layout this link registers (the buckets DDP all-reduces, ``order``: first-backward
        ready order)."""
        return ddp_layout(self.ddp_model, self.model_params, self.names, order)

    def _register_extra(self) -> dict:
        """More REGISTER body fields (a sharded link adds its layout and DP group)."""
        return {}

    @property
    def fallback_pending(self) -> bool:
        """A FALLBACK_REQUEST arrived; it starts after the next optimizer step not deferred."""
        with self._lock:
            return self._request is not None

    def _named_state(self) -> dict[str, torch.Tensor]:
        return {k: local(v) for k, v in gockpt._named_state(self.names, self.masters, self.optimizer).items()}

    # ---------------------------------------------------------------- GoCkpt (trainer half)
    def _part_state(self, j: int, plan) -> dict[str, torch.Tensor]:
        out = {}
        for i in plan[j]:
            n, p = self.names[i], self.masters[i]
            out[gockpt.param_key(n)] = local(p)
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[gockpt.state_key(n, k)] = local(v)
        return out

    def _start_fallback(self, req: dict, t: int) -> None:
        plan = gockpt.split(self.layout, req["parts"])
        self._run = run = FallbackRun(start=t, plan=plan, reason=req["reason"])
        t0 = time.perf_counter()
        run.state_copy = self.copier.copy(self._part_state(0, plan))
        run.stall += time.perf_counter() - t0
        log.info("GoCkpt checkpoint from step %d in %d parts (%s)", t, run.parts, req["reason"])

    def _pre_fallback(self, run: FallbackRun, t0: float) -> None:
        j = self.iterations_done - run.start
        if j < run.parts:
            if not run.state_copy.done():
                run.blocked_parts += 1  # GoCkpt's rule: a part not done in its step is finished blocking
            self.copier.fence(run.state_copy)
            # bf16/fp16: the reduced gradients (the model's, in the wire dtype) travel, half the
            # bytes; the rebuild forms the master gradients from them as the replica does
            src = self.masters if self.training.grad_dtype == "float32" else self.model_params
            grads = {}
            for jj in range(j + 1):
                for i in run.plan[jj]:
                    g = src[i].grad
                    g = local(g) if g is not None else torch.zeros_like(local(src[i]))
                    grads[gockpt.grad_key(self.names[i])] = g
            run.grad_copy = self.copier.copy(grads)
        else:  # step N+k: the state is S_{N+k}; send the last part with the tail, then DONE
            self.copier.fence(run.fingerprint)
            self._finish_fallback(run)
        run.stall += time.perf_counter() - t0

    def _post_fallback(self, run: FallbackRun, t: int) -> None:
        t0 = time.perf_counter()
        j = t - 1 - run.start  # the step just taken was N+j
        self.copier.fence(run.grad_copy)
        b = self._boundary
        hp = {"hparams": b["hparams"]}
        if self.training.grad_dtype != "float32":  # what turns the reduced gradients into the masters'
            hp["loss_scale"] = b.get("loss_scale") if self.training.loss_scale is not None else None
            hp["clip"] = b["clip"][1] if b.get("clip") is not None else None
        state, grads = run.state_copy, run.grad_copy
        if j < run.parts - 1:
            self._emit(self._part_builder(run, j, state, grads, hp, None), _Both(state, grads))
            run.state_copy = self.copier.copy(self._part_state(j + 1, run.plan))
        else:
            run.held = (j, state, grads, hp)
            run.fingerprint = self.copier.digest(self._named_state(), t)
        run.stall += time.perf_counter() - t0

    def _part_builder(self, run: FallbackRun, j: int, state, grads, hp: dict, tail: dict | None):
        names = [self.names[i] for i in run.plan[j]]
        start, parts = run.start, run.parts

        def build(both):
            st, gr = both
            tensors = {**st, **gr}
            slices = {"params": names, "hparams": hp["hparams"]}
            if "loss_scale" in hp:  # bf16/fp16 jobs; the clip coefficient is read here, off the training thread
                if hp["loss_scale"] is not None:
                    slices["loss_scale"] = hp["loss_scale"]
                if hp["clip"] is not None:
                    slices["clip"] = float(hp["clip"].item())
            if tail is not None:
                slices["tail"] = tail["body"]
                tensors.update({gockpt.rng_key(k): v for k, v in tail["rng"].items()})
            run.state_bytes += sum(v.numel() * v.element_size() for v in st.values())
            run.grad_bytes += sum(v.numel() * v.element_size() for v in gr.values())
            return m.make(m.GOCKPT_PART, tensors, step=start + j, index=j, parts=parts, slices=slices)
        return build

    def _tail(self) -> dict:
        body = {"iterations_done": self.iterations_done, "step": self.iterations_done,
                "param_groups": dumps(group_dicts(self.optimizer), "param_groups"),
                "lr_scheduler": (dumps(self.scheduler.state_dict(), "lr_scheduler")
                                 if self.scheduler is not None else None),
                "loss_scale": ({"scale": float(self.scaler.get_scale()),
                                "growth_tracker": int(self.scaler._get_growth_tracker())}
                               if self.scaler is not None else None),
                "data_position": self._boundary.get("data_position")}
        return {"body": body, "rng": self._boundary.get("rng", {})}

    def _finish_fallback(self, run: FallbackRun) -> None:
        j, state, grads, hp = run.held
        self._emit(self._part_builder(run, j, state, grads, hp, self._tail()), _Both(state, grads))
        fps = run.fingerprint
        final = run.start + run.parts
        self._emit(lambda d: m.make(m.GOCKPT_DONE, gockpt.digest_tensors(d), step=final, parts=run.parts,
                                    fingerprints=d.words), fps)
        self._run = None
        rec = {"start": run.start, "parts": run.parts, "stall_s": run.stall, "blocked_parts": run.blocked_parts,
               "seconds": time.perf_counter() - run.t0}
        self.stats.fallbacks.append(rec)
        log.info("GoCkpt checkpoint steps %d..%d done: %d parts, training stalled %.2f ms (%d parts blocking)",
                 run.start, final, run.parts, run.stall * 1e3, run.blocked_parts)

    # ---------------------------------------------------------------- lifecycle
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every message handed over so far has been written to the appliance."""
        end = time.monotonic() + timeout
        while not self._sendq.empty() and time.monotonic() < end:
            time.sleep(0.005)
        return self.client is None or self.client.flush(max(0.0, end - time.monotonic()))

    def close(self, flush_timeout: float = 30.0) -> None:
        if self.leader and self.client is not None:
            self._release_meta()
        run = self._run
        if run is not None and self.leader:
            if run.held is not None:  # only the tail is missing: the state at close is S_{N+k}
                self.copier.fence(run.fingerprint)
                self._finish_fallback(run)
            else:
                log.warning("GoCkpt checkpoint from step %d abandoned at close", run.start)
                self._run = None
        if self._scaler_update is not None:
            self.scaler.update = self._scaler_update
            self._scaler_update = None
        for h in self._hooks + self._ready_hooks:
            h.remove()
        self._hooks, self._ready_hooks = [], []
        if self.client is not None:
            self.flush(flush_timeout)
            self._sendq.put(None)
            self._sender.join(flush_timeout)
            self.client.close(flush_timeout=flush_timeout)
        self.copier.close()


class _Both(gockpt.Copy):
    """Two copies awaited together (a part's state and its gradients)."""

    def __init__(self, a: gockpt.Copy, b: gockpt.Copy):
        super().__init__()
        self.a, self.b = a, b


def _result(copier, c):
    if isinstance(c, _Both):
        return (copier.result(c.a), copier.result(c.b))
    return copier.result(c)


# ------------------------------------------------------------------------------- restore

@dataclass
class Restored:
    source: str
    iterations_done: int
    step: int
    data_position: object
    rng: dict


@torch.no_grad()
def load_trainer_state(module, optimizer, scheduler, params: dict, ostate: dict, groups: list[dict],
                       sched_state) -> None:
    """Parameters, optimizer state by name (none for a name it lacks), param groups and scheduler
    state into a trainer's module, optimizer and scheduler."""
    named = reducer_params(module)
    names = [n for n, _ in named]
    if sorted(params) != sorted(names):
        raise ValueError(f"restored parameters differ from the model's: {sorted(set(params) ^ set(names))[:5]}")
    for n, p in named:
        src = params[n]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{n}: restored shape {tuple(src.shape)}, model has {tuple(p.shape)}")
        p.copy_(src)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = {id(p) for p in opt_params}
    masters = [p for _, p in named] if by_id == {id(p) for _, p in named} else opt_params
    for (n, p), mp in zip(named, masters):
        if mp is not p:
            mp.copy_(params[n])
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"restored state has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}")
    index = {id(p): i for i, p in enumerate(opt_params)}
    state = {index[id(mp)]: dict(ostate[n]) for n, mp in zip(names, masters) if n in ostate}
    out, k = [], 0
    for g, mine in zip(groups, optimizer.param_groups):
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        g["params"] = list(range(k, k + len(mine["params"])))
        k += len(mine["params"])
        out.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": out})
    if scheduler is not None:
        if sched_state is None:
            raise ValueError("the restored state has no scheduler state, but a scheduler was given")
        scheduler.load_state_dict(sched_state)


def parse_restore(reply: m.Message) -> tuple[dict, dict, dict, dict]:
    """(parameters, optimizer state per name, RNG states, meta) of a RESTORE_STATE message."""
    meta = reply.body.get("meta") or {}
    params, ostate, rng = {}, {}, {}
    for k, v in reply.tensors.items():
        kind, _, rest = k.partition(":")
        if kind == "p":
            params[rest] = v
        elif kind == "o":
            n, _, key = rest.rpartition(":")
            ostate.setdefault(n, {})[key] = v.clone()
        elif kind == "rng":
            rng[rest] = v.clone()
    return params, ostate, rng, meta


def load_restore_state(module, optimizer, scheduler, reply) -> tuple[dict, dict]:
    """A RESTORE_STATE message into ``module``, ``optimizer`` and ``scheduler``; (meta, rng states).
    Parameters the appliance holds no optimizer state for (never stepped) get none here either."""
    if reply.type != m.RESTORE_STATE:
        raise ValueError(f"appliance answered {reply.type}, not RESTORE_STATE")
    params, ostate, rng, meta = parse_restore(reply)
    groups = loads(meta["param_groups"])
    sched = loads(meta["lr_scheduler"]) if meta.get("lr_scheduler") is not None else None
    load_trainer_state(module, optimizer, scheduler, params, ostate, groups, sched)
    return meta, rng


def restore_from_appliance(model, optimizer, *, appliance: tuple[str, int], secret, scheduler=None, data=None,
                           timeout: float = 60.0, role: str = "trainer",
                           client_options: dict | None = None) -> Restored:
    """Pull the appliance's latest consistent state (RESTORE_REQUEST) into model and optimizer,
    scheduler, RNG and ``data`` (``load_state_dict`` of the data position). ``client_options``:
    ControlClient keywords, e.g. ``ssl_context`` (control.tls.client_context) and ``server_hostname``."""
    module = unwrap(model)
    host, port = appliance
    with ControlClient(host, port, secret, role, **{"backoff_max": 0.5, **(client_options or {})}) as cli:
        if not cli.wait_connected(timeout):
            raise ConnectionError(f"appliance {host}:{port} not reachable in {timeout:g} s")
        reply = cli.request(m.make(m.RESTORE_REQUEST, step=None), timeout=timeout)
    meta, rng = load_restore_state(module, optimizer, scheduler, reply)
    set_rng_states(rng)
    dp = meta.get("data_position")
    if data is not None and dp is not None:
        data.load_state_dict(dp)
    return Restored("appliance", int(meta["iterations_done"]), int(meta["step"]), dp, rng)


def restore_from_disk(model, optimizer, root, *, scheduler=None, data=None) -> Restored:
    """Load the latest committed checkpoint under ``root`` (verified) the same way."""
    from mirrorckpt.updater.restore import load_into

    r = load_into(unwrap(model), optimizer, root, scheduler=scheduler)
    set_rng_states(r.rng)
    if data is not None and r.data_position is not None:
        data.load_state_dict(r.data_position)
    return Restored(str(r.path), r.iterations_done, r.step, r.data_position, r.rng)


# ------------------------------------------------------------------------------- the one call

def attach(ddp_model, optimizer, *, appliance: tuple[str, int] | None, secret, scheduler=None, scaler=None,
           data=None, training: TrainingSpec | None = None, ring: RingSpec | None = None, job: str = "job",
           parts: int = 7, fingerprint_every: int = 10, restore: str | None = None,
           connect_timeout: float = 0.0, client_options: dict | None = None) -> TrainerLink:
    """Attach a DDP model and its optimizer to the appliance; see the module docstring.

    ``data``: an object with ``state_dict()``/``load_state_dict()`` for the data position (JSON).
    ``restore``: None, "appliance" (pull the appliance's state), or a checkpoint root on disk;
    every rank restores. ``connect_timeout``: seconds to wait for the first connection."""
    if any(hasattr(p, "placements") for p in unwrap(ddp_model).parameters()):
        # its local shards are not the parameters a single ring registers: refused here, not at its first fallback
        raise ValueError("the model's parameters are DTensors (TP, FSDP2): attach a sharded job with "
                         "mirrorckpt.control.sharded.attach_sharded")
    restored = None
    if restore == "appliance":
        restored = restore_from_appliance(ddp_model, optimizer, appliance=appliance, secret=secret,
                                          scheduler=scheduler, data=data, client_options=client_options)
    elif restore is not None:
        restored = restore_from_disk(ddp_model, optimizer, restore, scheduler=scheduler, data=data)
    link = TrainerLink(ddp_model, optimizer, appliance=appliance, secret=secret, scheduler=scheduler,
                       scaler=scaler, data=data, training=training, ring=ring, job=job, parts=parts,
                       fingerprint_every=fingerprint_every, client_options=client_options)
    return started(link, restored, connect_timeout)


def started(link: TrainerLink, restored: Restored | None, connect_timeout: float) -> TrainerLink:
    """A new link counts from the restored step, once connected (``connect_timeout`` s at most)."""
    if restored is not None:
        link.iterations_done = restored.iterations_done
        link.restored = restored
    if connect_timeout and link.client is not None:
        link.client.wait_connected(connect_timeout)
    return link
