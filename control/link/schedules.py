"""A torch LR scheduler read back as an LRScheduleSpec: its constructor arguments, and the
functions it calls (LambdaLR's lambdas) named by importable paths the appliance resolves; or, for
a schedule the appliance cannot rebuild, a "reported" spec (the trainer sends each step's
hyper-parameters and the scheduler's state instead)."""

from __future__ import annotations

import collections
import functools
import inspect
import logging

from mirrorckpt.config.training import REPORTED, SCHEDULERS, LRScheduleSpec, callable_error
from mirrorckpt.updater.optim import resolve

log = logging.getLogger("mirrorckpt.control.trainer")


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


def _callable(fn):
    """A scheduler function as the spec records it: its path, or for a functools.partial of a
    module-level function (transformers' get_*_schedule_with_warmup) the function's path with the
    partial's arguments, which must be plain JSON values (config.training.callable_error)."""
    if not isinstance(fn, functools.partial):
        return _path(fn)
    out = {"partial": _path(fn.func), "args": list(fn.args), "kwargs": dict(fn.keywords)}
    err = callable_error(out)
    if err is not None:
        raise ValueError(f"scheduler function {fn!r:.120}: the partial's arguments cannot be sent to the "
                         f"appliance: {err}")
    return out


def _one_or_list(values: list):
    return values[0] if len(set(map(repr, values))) == 1 else list(values)


def _scheduler_kwargs(scheduler) -> dict:
    """Constructor arguments read back from a scheduler. Values the constructor only turns into
    state (OneCycleLR's pct_start, CyclicLR's step sizes) are recovered as well as floats allow;
    the replica then loads the scheduler's state_dict, which holds them exactly."""
    cls = type(scheduler).__name__
    groups = scheduler.optimizer.param_groups if hasattr(scheduler, "optimizer") else []
    if cls in ("SequentialLR", "ChainedScheduler"):
        kw = {"schedulers": [rebuilt_spec(s).to_dict() for s in scheduler._schedulers]}
        if cls == "SequentialLR":
            kw["milestones"] = list(scheduler._milestones)
        return kw
    if cls in ("LambdaLR", "MultiplicativeLR"):
        return {"lr_lambda": _one_or_list([_callable(f) for f in scheduler.lr_lambdas])}
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
            kw["scale_fn"] = _callable(scheduler._scale_fn_custom)
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


def rebuilt_spec(scheduler) -> LRScheduleSpec:
    """A scheduler's constructor arguments read back from it (see ``_scheduler_kwargs``);
    ValueError when the appliance could not rebuild it from them."""
    name = type(scheduler).__name__
    if name not in SCHEDULERS:
        raise ValueError(f"{type(scheduler).__module__}.{type(scheduler).__qualname__} is not a torch scheduler class "
                         f"the appliance rebuilds")
    return LRScheduleSpec(name=name, kwargs=_scheduler_kwargs(scheduler))


def reported_spec(scheduler) -> LRScheduleSpec:
    cls = type(scheduler)
    return LRScheduleSpec(name=REPORTED, kwargs={"scheduler": f"{cls.__module__}:{cls.__qualname__}"})


def schedule_spec(scheduler, report: bool = False) -> LRScheduleSpec:
    """The spec the replica follows ``scheduler`` by: rebuilt from its constructor arguments when
    it can be, else (or with ``report``: a scheduler not stepped once per optimizer step) reported."""
    if scheduler is None:
        return LRScheduleSpec()
    if report:
        return reported_spec(scheduler)
    try:
        return rebuilt_spec(scheduler)
    except ValueError as e:
        log.info("scheduler %s is followed from the trainer's reports: %s", type(scheduler).__name__, e)
        return reported_spec(scheduler)
