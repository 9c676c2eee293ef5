"""What the trainer's optimizer step is made of: optimizer and its param groups, LR schedule,
clipping, fp16 loss scaling, and how the appliance persists the replica.

Plain dataclasses that round-trip through dicts (JSON, TOML, control-plane headers). Construction
validates and names the offending field; nothing here imports torch except the LR-schedule check,
which reads the scheduler's own signature so the accepted arguments cannot drift from torch's.
Functions a scheduler calls (LambdaLR's ``lr_lambda``, CyclicLR's ``scale_fn``) are named by an
importable path ``"package.module:function"``; only the updater resolves them.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import asdict, dataclass, field, fields

OPTIMIZERS = ("adam", "adamw", "sgd")
GRAD_DTYPES = ("float32", "bfloat16", "float16")

# torch.optim.lr_scheduler classes the replica rebuilds. Callables are importable paths,
# SequentialLR/ChainedScheduler take a list of scheduler specs, ReduceLROnPlateau steps on the
# metric the trainer reports with each step.
SCHEDULERS = (
    "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
    "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
    "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau",
)
_SCHEDULER_ARGS_REFUSED = ("optimizer", "verbose", "last_epoch")
# A schedule the appliance does not rebuild (closures, partials over nested functions, custom
# classes, schedulers stepped per epoch): the trainer reports every step's hyper-parameters and the
# scheduler's state with its STEP_META. kwargs: {"scheduler": "module:qualname"} of its class.
REPORTED = "reported"
# given as importable paths, or as a functools.partial of one: {"partial": path, "args": [...], "kwargs": {...}}
CALLABLE_ARGS = ("lr_lambda", "scale_fn")
_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
PARTIAL_KEYS = ("partial", "args", "kwargs")


def json_value_error(v, where: str) -> str | None:
    """Why ``v`` is not a plain JSON value (null, bool, finite number, string, list, object with
    string keys) that survives a round trip unchanged, or None."""
    if v is None or isinstance(v, (bool, str)):
        return None
    if isinstance(v, (int, float)):
        return None if math.isfinite(v) else f"{where} is {v!r}, not a finite number"
    if isinstance(v, list):
        return next((e for e in (json_value_error(x, f"{where}[{i}]") for i, x in enumerate(v)) if e), None)
    if isinstance(v, dict):
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            return f"{where} has a key {bad[0]!r} that is not a string"
        return next((e for e in (json_value_error(x, f"{where}.{k}") for k, x in v.items()) if e), None)
    return f"{where} is a {type(v).__name__}, not a JSON value (null, bool, number, string, list, object)"


def callable_error(v) -> str | None:
    """Why ``v`` names no function: neither an importable path nor a partial of one with JSON
    arguments; None when it does."""
    if isinstance(v, str):
        return None if _PATH.fullmatch(v) else f"{v!r:.80} is not an importable path 'package.module:function'"
    if not isinstance(v, dict) or set(v) != set(PARTIAL_KEYS):
        return f"{v!r:.80} is neither a path nor a partial {{partial: path, args: [...], kwargs: {{...}}}}"
    if not (isinstance(v["partial"], str) and _PATH.fullmatch(v["partial"])):
        return f"partial {v['partial']!r:.80} is not an importable path 'package.module:function'"
    if not isinstance(v["args"], list) or not isinstance(v["kwargs"], dict):
        return "a partial's args must be a list and its kwargs an object"
    return json_value_error(v["args"], "args") or json_value_error(v["kwargs"], "kwargs")


def callable_path(v) -> str:
    """The importable path a callable argument names (a partial's function)."""
    return v if isinstance(v, str) else v["partial"]
# Hyper-parameters a param group may set for itself (torch's per-group keys)
IMPLEMENTATION_FIELDS = ("foreach", "fused", "device")  # how the step is computed, not what
# torch param-group keys that choose the step's implementation: a restore keeps the trainer's own
TORCH_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize")


class SpecError(ValueError):
    """A training or persistence setting is invalid; the message names the field."""


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise SpecError(f"{where}: {msg}")


def _number(where: str, name: str, v, *, lo=None, lo_open=False, hi=None, hi_open=False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    _need(ok, where, f"{name} must be a finite number, got {v!r}")
    if lo is not None:
        _need(v > lo if lo_open else v >= lo, where, f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None:
        _need(v < hi if hi_open else v <= hi, where, f"{name} must be {'<' if hi_open else '<='} {hi}, got {v!r}")


def _from_dict(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise SpecError(f"{where}: expected a table/dict, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    _need(not unknown, where, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return cls(**d)


@dataclass
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd
    dampening: float = 0.0  # sgd
    nesterov: bool = False  # sgd
    amsgrad: bool = False  # adam/adamw
    maximize: bool = False
    foreach: bool = False  # default: the per-parameter for-loop implementation
    fused: bool = False
    # Where the trainer's step runs ("cpu", "cuda", ...): with foreach/fused, the arithmetic the
    # replica is compared against (updater.numeric decides exact or within tolerance from it).
    device: str = "cpu"

    def __post_init__(self):
        w = "optimizer"
        _need(self.name in OPTIMIZERS, w, f"name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        _number(w, "lr", self.lr, lo=0)
        self.betas = tuple(self.betas)
        _need(len(self.betas) == 2, w, f"betas must be two numbers, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _number(w, f"betas[{i}]", b, lo=0, hi=1, hi_open=True)
        _number(w, "eps", self.eps, lo=0)
        _number(w, "weight_decay", self.weight_decay, lo=0)
        _number(w, "momentum", self.momentum, lo=0)
        _number(w, "dampening", self.dampening, lo=0)
        for flag in ("nesterov", "amsgrad", "maximize", "foreach", "fused"):
            _need(isinstance(getattr(self, flag), bool), w, f"{flag} must be true or false")
        _need(not (self.foreach and self.fused), w, "foreach and fused are mutually exclusive")
        _need(isinstance(self.device, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,15}", self.device) is not None, w,
              f"device must be a torch device type such as 'cpu' or 'cuda', got {self.device!r}")
        if self.name == "sgd":
            _need(not self.amsgrad, w, "amsgrad applies to adam/adamw only")
            _need(not self.nesterov or (self.momentum > 0 and self.dampening == 0), w,
                  "nesterov needs momentum > 0 and dampening == 0")
        else:
            _need(self.momentum == 0 and self.dampening == 0 and not self.nesterov, w,
                  f"momentum/dampening/nesterov apply to sgd only, not {self.name}")

    @property
    def implementation(self) -> str:
        """"fused", "foreach" or "for-loop": which torch kernels run the step."""
        return "fused" if self.fused else "foreach" if self.foreach else "for-loop"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @staticmethod
    def from_dict(d: dict) -> OptimizerSpec:
        return _from_dict(OptimizerSpec, d, "optimizer")

    def with_options(self, options: dict, where: str = "param group") -> OptimizerSpec:
        """This spec with a param group's own hyper-parameters."""
        bad = sorted(set(options) - set(GROUP_OPTIONS))
        _need(not bad, where, f"unknown option(s) {', '.join(bad)} (a group may set {', '.join(GROUP_OPTIONS)})")
        d = self.to_dict()
        d.update(options)
        try:
            return OptimizerSpec.from_dict(d)
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None


@dataclass
class ParamGroupSpec:
    """One optimizer param group: its parameters (layout names, in the optimizer's order) and the
    hyper-parameters it sets itself (the rest come from the OptimizerSpec)."""

    params: list[str]
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        w = "param_groups"
        _need(isinstance(self.params, (list, tuple)) and all(isinstance(n, str) for n in self.params), w,
              "params must be a list of parameter names")
        self.params = list(self.params)
        _need(len(set(self.params)) == len(self.params), w, "a group lists a parameter twice")
        _need(isinstance(self.options, dict), w, "options must be a table/dict")
        self.options = dict(self.options)
        if "betas" in self.options and isinstance(self.options["betas"], (list, tuple)):
            self.options["betas"] = [float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else b
                                     for b in self.options["betas"]]

    def to_dict(self) -> dict:
        return {"params": list(self.params), "options": dict(self.options)}

    @staticmethod
    def from_dict(d: dict) -> ParamGroupSpec:
        return _from_dict(ParamGroupSpec, d, "param_groups")


@dataclass
class LRScheduleSpec:
    name: str = "none"  # "none" or a torch.optim.lr_scheduler class name from SCHEDULERS
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        w = "lr_schedule"
        if self.name == "none":
            _need(not self.kwargs, w, "name 'none' takes no kwargs")
            return
        if self.name == REPORTED:
            _need(isinstance(self.kwargs, dict) and set(self.kwargs) <= {"scheduler"}
                  and isinstance(self.kwargs.get("scheduler", ""), str), w,
                  f"name {REPORTED!r} takes only kwargs.scheduler, the class name it reports for")
            self.kwargs = dict(self.kwargs)
            return
        _need(self.name in SCHEDULERS, w,
              f"name must be 'none', {REPORTED!r} or one of {', '.join(SCHEDULERS)}, got {self.name!r}")
        _need(isinstance(self.kwargs, dict), w, f"kwargs must be a table/dict, got {type(self.kwargs).__name__}")
        self.kwargs = dict(self.kwargs)
        refused = sorted(set(self.kwargs) & set(_SCHEDULER_ARGS_REFUSED))
        _need(not refused, w, f"{self.name}: argument(s) {', '.join(refused)} cannot be given in a config")
        import torch.optim.lr_scheduler as lrs  # only here: the signature is torch's, not a copy

        sig = inspect.signature(getattr(lrs, self.name).__init__)
        accepted = [p for p in sig.parameters if p not in ("self", "optimizer") and p not in _SCHEDULER_ARGS_REFUSED]
        unknown = sorted(set(self.kwargs) - set(accepted))
        _need(not unknown, w,
              f"{self.name} got unknown argument(s) {', '.join(unknown)} (accepts: {', '.join(accepted)})")
        missing = [p for p in accepted if sig.parameters[p].default is inspect.Parameter.empty
                   and sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD and p not in self.kwargs]
        _need(not missing, w, f"{self.name} needs argument(s) {', '.join(missing)}")
        for arg in CALLABLE_ARGS:
            v = self.kwargs.get(arg)
            if v is None:
                continue
            given = v if isinstance(v, list) else [v]
            _need(bool(given), w, f"{self.name}: {arg} is an empty list")
            for item in given:
                err = callable_error(item)
                _need(err is None, w, f"{self.name}: {arg} must name a function by its importable path "
                                      f"'package.module:function', or a partial of one (or a list of them): {err}")
        if "schedulers" in self.kwargs:
            subs = self.kwargs["schedulers"]
            _need(isinstance(subs, list) and subs, w, f"{self.name}: schedulers must be a non-empty list of schedules")
            subs = [s if isinstance(s, LRScheduleSpec) else LRScheduleSpec.from_dict(s) for s in subs]
            _need(all(s.enabled and not s.needs_metrics and not s.reported and "schedulers" not in s.kwargs
                      for s in subs), w,
                  f"{self.name}: each scheduler must be a step-driven schedule (not none, "
                  f"ReduceLROnPlateau, or another chain)")
            self.kwargs["schedulers"] = [s.to_dict() for s in subs]

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def needs_metrics(self) -> bool:
        """Stepped with the metric the trainer passes (the trainer reports it with its steps)."""
        return self.name == "ReduceLROnPlateau"

    @property
    def reported(self) -> bool:
        """Not rebuilt: each step's hyper-parameters and scheduler state come from the trainer."""
        return self.name == REPORTED

    def callable_paths(self) -> list[str]:
        """Every importable path this schedule names, nested schedules included."""
        out = []
        for arg in CALLABLE_ARGS:
            v = self.kwargs.get(arg)
            out += [] if v is None else [callable_path(x) for x in (v if isinstance(v, list) else [v])]
        for sub in self.kwargs.get("schedulers", []):
            out += LRScheduleSpec.from_dict(sub).callable_paths()
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "kwargs": dict(self.kwargs)}

    @staticmethod
    def from_dict(d: dict) -> LRScheduleSpec:
        return _from_dict(LRScheduleSpec, d, "lr_schedule")


@dataclass
class ClipSpec:
    max_norm: float = 1.0
    norm_type: float = 2.0

    def __post_init__(self):
        _number("clip", "max_norm", self.max_norm, lo=0, lo_open=True)
        ok = self.norm_type == math.inf or (isinstance(self.norm_type, (int, float)) and self.norm_type > 0)
        _need(ok, "clip", f"norm_type must be > 0 or inf, got {self.norm_type!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> ClipSpec:
        return _from_dict(ClipSpec, d, "clip")


@dataclass
class LossScaleSpec:
    """fp16 dynamic loss scaling, torch.amp.GradScaler's defaults."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # Whether the trainer calls lr_scheduler.step() on an iteration whose optimizer step was
    # skipped for inf/nan (the usual `scaler.step(opt); sched.step()` loop does).
    scheduler_step_on_skip: bool = True

    def __post_init__(self):
        w = "loss_scale"
        _number(w, "init_scale", self.init_scale, lo=0, lo_open=True)
        _number(w, "growth_factor", self.growth_factor, lo=1, lo_open=True)
        _number(w, "backoff_factor", self.backoff_factor, lo=0, lo_open=True, hi=1, hi_open=True)
        _need(isinstance(self.growth_interval, int) and not isinstance(self.growth_interval, bool)
              and self.growth_interval >= 1, w,
              f"growth_interval must be an integer >= 1, got {self.growth_interval!r}")
        _need(isinstance(self.scheduler_step_on_skip, bool), w, "scheduler_step_on_skip must be true or false")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> LossScaleSpec:
        return _from_dict(LossScaleSpec, d, "loss_scale")


@dataclass
class PersistSpec:
    directory: str = "checkpoints"
    # A snapshot is due when this many iterations passed since the last one, or this much time;
    # either triggers, and with both None every new iteration is due.
    every_iterations: int | None = 1
    every_seconds: float | None = None
    keep_last: int = 3
    memory_budget_bytes: int = 4 << 30  # staging copies in flight may not exceed this
    job_name: str | None = None  # recorded in the root's identity; another job's name is refused
    writer_threads: int = 2  # DCP writer threads (one data file each) and hashing threads of a commit

    def __post_init__(self):
        w = "persist"
        _need(isinstance(self.directory, str) and self.directory != "", w, "directory must be a non-empty path")
        if self.every_iterations is not None:
            _need(isinstance(self.every_iterations, int) and not isinstance(self.every_iterations, bool)
                  and self.every_iterations >= 1, w,
                  f"every_iterations must be an integer >= 1, got {self.every_iterations!r}")
        if self.every_seconds is not None:
            _number(w, "every_seconds", self.every_seconds, lo=0, lo_open=True)
        _need(isinstance(self.keep_last, int) and self.keep_last >= 1, w,
              f"keep_last must be an integer >= 1, got {self.keep_last!r}")
        _need(isinstance(self.memory_budget_bytes, int) and self.memory_budget_bytes > 0, w,
              f"memory_budget_bytes must be a positive integer, got {self.memory_budget_bytes!r}")
        _need(self.job_name is None or (isinstance(self.job_name, str) and self.job_name != ""), w,
              f"job_name must be a non-empty string, got {self.job_name!r}")
        _need(isinstance(self.writer_threads, int) and not isinstance(self.writer_threads, bool)
              and 1 <= self.writer_threads <= 64, w,
              f"writer_threads must be an integer in 1..64, got {self.writer_threads!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> PersistSpec:
        return _from_dict(PersistSpec, d, "persist")


@dataclass
class TrainingSpec:
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleSpec = field(default_factory=LRScheduleSpec)
    clip: ClipSpec | None = None
    loss_scale: LossScaleSpec | None = None  # fp16 only; defaults to LossScaleSpec() for fp16
    persist: PersistSpec | None = None
    grad_dtype: str = "float32"  # gradient dtype on the wire; bf16/fp16 mean fp32 master copies
    # None: one group holding every parameter; else every layout parameter in exactly one group
    param_groups: list[ParamGroupSpec] | None = None

    def __post_init__(self):
        w = "training"
        if self.param_groups is not None:
            _need(isinstance(self.param_groups, list) and self.param_groups, w,
                  "param_groups must be a non-empty list")
            self.param_groups = [g if isinstance(g, ParamGroupSpec) else ParamGroupSpec.from_dict(g)
                                 for g in self.param_groups]
            names = [n for g in self.param_groups for n in g.params]
            _need(len(set(names)) == len(names), w, "a parameter is listed in two param groups")
            for i, g in enumerate(self.param_groups):
                self.optimizer.with_options(g.options, f"param_groups[{i}]")
        _need(self.grad_dtype in GRAD_DTYPES, w,
              f"grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {self.grad_dtype!r}")
        if self.grad_dtype == "float16":
            if self.loss_scale is None:
                self.loss_scale = LossScaleSpec()
        else:
            _need(self.loss_scale is None, w, f"loss_scale applies to float16 gradients only, not {self.grad_dtype}")
        for name, cls in (("optimizer", OptimizerSpec), ("lr_schedule", LRScheduleSpec)):
            _need(isinstance(getattr(self, name), cls), w, f"{name} must be a {cls.__name__}")

    @property
    def separable(self) -> bool:
        """True when one iteration's step can run bucket by bucket with the same bits: the optimizer
        is per-parameter and nothing couples the buckets (no global-norm clipping, no fp16 inf check)."""
        return self.optimizer.name in OPTIMIZERS and self.clip is None and self.grad_dtype != "float16"

    def groups(self, names: list[str]) -> list[tuple[list[str], OptimizerSpec]]:
        """(parameter names, that group's OptimizerSpec) of each param group, for the layout's
        parameter ``names``; raises SpecError unless every name sits in exactly one group."""
        if self.param_groups is None:
            return [(list(names), self.optimizer)]
        listed = [n for g in self.param_groups for n in g.params]
        missing, extra = sorted(set(names) - set(listed)), sorted(set(listed) - set(names))
        _need(not missing and not extra, "param_groups",
              f"groups must hold exactly the layout's parameters: missing {missing[:3]}, unknown {extra[:3]}")
        return [(list(g.params), self.optimizer.with_options(g.options, f"param_groups[{i}]"))
                for i, g in enumerate(self.param_groups)]

    def recipe(self) -> dict:
        """``to_dict`` without the optimizer's implementation (foreach, fused, device): two specs
        with the same recipe differ in rounding only, not in what the step computes."""
        d = self.to_dict()
        d["optimizer"] = {k: v for k, v in d["optimizer"].items() if k not in IMPLEMENTATION_FIELDS}
        return d

    def to_dict(self) -> dict:
        d = {
            "optimizer": self.optimizer.to_dict(),
            "lr_schedule": self.lr_schedule.to_dict(),
            "clip": self.clip.to_dict() if self.clip else None,
            "loss_scale": self.loss_scale.to_dict() if self.loss_scale else None,
            "persist": self.persist.to_dict() if self.persist else None,
            "grad_dtype": self.grad_dtype,
        }
        if self.param_groups is not None:
            d["param_groups"] = [g.to_dict() for g in self.param_groups]
        return d

    @staticmethod
    def from_dict(d: dict) -> TrainingSpec:
        if not isinstance(d, dict):
            raise SpecError(f"training: expected a table/dict, got {type(d).__name__}")
        known = {"optimizer", "lr_schedule", "clip", "loss_scale", "persist", "grad_dtype", "param_groups"}
        unknown = sorted(set(d) - known)
        _need(not unknown, "training", f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")

        def sub(key, cls):
            v = d.get(key)
            return None if v is None else cls.from_dict(v)

        return TrainingSpec(
            optimizer=OptimizerSpec.from_dict(d.get("optimizer", {})),
            lr_schedule=LRScheduleSpec.from_dict(d.get("lr_schedule") or {}),
            clip=sub("clip", ClipSpec),
            loss_scale=sub("loss_scale", LossScaleSpec),
            persist=sub("persist", PersistSpec),
            grad_dtype=d.get("grad_dtype", "float32"),
            param_groups=d.get("param_groups"),
        )
