"""The torch pieces of the trainer's step, built from a TrainingSpec: the real torch.optim class
with its param groups, its LR scheduler, and fp16 dynamic loss scaling with GradScaler's
arithmetic."""

from __future__ import annotations

import functools
import importlib

import torch
from mirrorckpt.config.training import (
    CALLABLE_ARGS,
    GROUP_OPTIONS,
    LossScaleSpec,
    LRScheduleSpec,
    OptimizerSpec,
    SpecError,
)


def state_keys(spec: OptimizerSpec) -> tuple[str, ...]:
    """Optimizer state keys a parameter holds once it has been stepped (torch 2.13)."""
    if spec.name == "sgd":
        return ("momentum_buffer",) if spec.momentum != 0 else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if spec.amsgrad else ())


def group_options(spec: OptimizerSpec) -> dict:
    """A param group's hyper-parameters as torch names them."""
    out = dict(lr=spec.lr, weight_decay=spec.weight_decay, maximize=spec.maximize)
    if spec.name == "sgd":
        out.update(momentum=spec.momentum, dampening=spec.dampening, nesterov=spec.nesterov)
    else:
        out.update(betas=tuple(spec.betas), eps=spec.eps, amsgrad=spec.amsgrad)
    return out


def build_optimizer(spec: OptimizerSpec, params: list[torch.Tensor],
                    groups: list[tuple[list[torch.Tensor], OptimizerSpec]] | None = None) -> torch.optim.Optimizer:
    """The torch optimizer over ``params`` (one group), or over ``groups`` (tensors and each
    group's spec, in the trainer's group order)."""
    if groups is None:
        groups = [(params, spec)]
    torch_groups = [{"params": list(ps), **group_options(gs)} for ps, gs in groups]
    common = dict(foreach=spec.foreach, fused=spec.fused, **group_options(spec))
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(spec.name)
    if cls is None:  # a spec changed after its validation (the dataclass is mutable)
        raise SpecError(f"optimizer: name must be one of sgd, adam, adamw, got {spec.name!r}")
    return cls(torch_groups, **common)


def warm_up(spec: OptimizerSpec) -> None:
    """Builds one optimizer of ``spec`` on a throwaway tensor: torch's first optimizer imports its
    compiler stack (about 1.7 s here), which would otherwise delay the job's first replica step."""
    build_optimizer(spec, [torch.zeros(1)])


def resolve(path: str):
    """The function an importable path ``package.module:qualified.name`` names."""
    module, _, qual = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path}: cannot be resolved here ({type(e).__name__}: {e})") from None
    if not callable(obj):
        raise ValueError(f"{path}: names a {type(obj).__name__}, not a function")
    return obj


def resolve_callable(v):
    """The function a callable argument names: ``resolve`` of a path, or a functools.partial of
    the resolved function with the recorded args and kwargs (config.training.callable_error)."""
    if isinstance(v, str):
        return resolve(v)
    return functools.partial(resolve(v["partial"]), *v["args"], **v["kwargs"])


def build_scheduler(spec: LRScheduleSpec, optimizer: torch.optim.Optimizer):
    """The torch scheduler the spec rebuilds; None without one, or for a reported schedule (the
    trainer sends each step's hyper-parameters: ``set_hparams``)."""
    if not spec.enabled or spec.reported:
        return None
    kwargs = dict(spec.kwargs)
    for arg in CALLABLE_ARGS:
        v = kwargs.get(arg)
        if v is not None:
            kwargs[arg] = [resolve_callable(p) for p in v] if isinstance(v, list) else resolve_callable(v)
    if "schedulers" in kwargs:  # built in order on the same optimizer, as the trainer did
        kwargs["schedulers"] = [build_scheduler(LRScheduleSpec.from_dict(d), optimizer) for d in kwargs["schedulers"]]
        if spec.name == "ChainedScheduler":
            kwargs["optimizer"] = optimizer
            return torch.optim.lr_scheduler.ChainedScheduler(**kwargs)
    try:
        return getattr(torch.optim.lr_scheduler, spec.name)(optimizer, **kwargs)
    except (TypeError, ValueError) as e:  # torch's own argument checks, named for the operator
        raise SpecError(f"lr_schedule: {spec.name} cannot be built: {e}") from None


def step_scheduler(scheduler, spec: LRScheduleSpec, meta: dict | None) -> None:
    """The trainer's scheduler step after one iteration. ReduceLROnPlateau steps on a metric the
    wire does not carry, whenever the training loop chooses: the trainer reports its state after
    each iteration (``plateau_state``) and the replica takes it, with the lrs it set."""
    if not spec.needs_metrics:
        scheduler.step()
        return
    st = (meta or {}).get("lr_scheduler")
    if st is not None:
        scheduler.load_state_dict(st)
        for g, lr in zip(scheduler.optimizer.param_groups, st["_last_lr"]):
            g["lr"] = lr


def hparams_error(hp, groups: list[dict]) -> str | None:
    """Why ``hp`` is not one hyper-parameter dict per param group of ``groups`` (torch's groups):
    known keys the group has, finite values, flags unchanged; None when it is."""
    import math

    def finite(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not (isinstance(hp, list) and len(hp) == len(groups)):
        return f"hparams must list the hyper-parameters of each of the {len(groups)} param group(s)"
    for g, d in zip(groups, hp):
        if not (isinstance(d, dict) and finite(d.get("lr")) and d["lr"] >= 0):
            return "each group's hparams need a finite lr >= 0"
        for k, v in d.items():
            if k not in GROUP_OPTIONS or k not in g:
                return f"hparams: {k!r} is not a hyper-parameter of the group"
            if isinstance(g[k], bool):  # flags pick the algorithm and its state: never moved
                if v is not g[k]:
                    return f"hparams: {k} must stay {g[k]}"
            elif isinstance(g[k], tuple):
                if not (isinstance(v, list) and len(v) == len(g[k]) and all(map(finite, v))):
                    return f"hparams: {k} must be {len(g[k])} finite numbers"
            elif not (finite(v) and v >= 0):
                return f"hparams: {k} must be a finite number >= 0"
    return None


def set_hparams(optimizer: torch.optim.Optimizer, hp: list[dict]) -> None:
    """Each param group takes the hyper-parameters a step ran with (checked by ``hparams_error``)."""
    for g, d in zip(optimizer.param_groups, hp):
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def plateau_state(d, groups: int) -> dict:
    """A reported ReduceLROnPlateau state, checked: ValueError unless it fits ``groups`` groups."""
    import math

    def finite(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not isinstance(d, dict):
        raise ValueError("the plateau scheduler state must be an object")
    lrs, mins = d.get("_last_lr"), d.get("min_lrs")
    for name, v in (("_last_lr", lrs), ("min_lrs", mins)):
        if not (isinstance(v, list) and len(v) == groups and all(finite(x) and x >= 0 for x in v)):
            raise ValueError(f"plateau state: {name} must be {groups} finite numbers >= 0")
    for k in ("factor", "eps", "threshold", "last_epoch", "patience", "cooldown", "cooldown_counter",
              "num_bad_epochs"):
        if not finite(d.get(k)):
            raise ValueError(f"plateau state: {k} must be a finite number")
    return d


def fresh_state(spec: OptimizerSpec, param: torch.Tensor) -> dict:
    """State equivalent to "never stepped", for a checkpoint written before a parameter's first step.

    Adam from step 0 with zero moments takes bit-identical steps to a fresh Adam (lerp/addcmul on
    zeros). SGD's fresh momentum buffer is cloned from the first gradient, which a zero buffer
    matches only with dampening == 0: the checkpoint lists such parameters as unstepped
    (dcp_keys ``extra.unstepped``) and every loader drops their placeholder.
    """
    out = {}
    for k in state_keys(spec):
        out[k] = torch.tensor(0.0, dtype=torch.float32) if k == "step" else torch.zeros_like(param)
    return out


class LossScaler:
    """fp16 dynamic loss scale. Same kernels and float32 scale as torch.amp.GradScaler on CPU."""

    def __init__(self, spec: LossScaleSpec):
        self.spec = spec
        self.scale = torch.full((1,), float(spec.init_scale), dtype=torch.float32)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32)

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Multiply ``grads`` by 1/scale in place; True if any of them holds inf or nan."""
        found_inf = torch.zeros((1,), dtype=torch.float32)
        inv_scale = self.scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        s = self.spec
        torch._amp_update_scale_(self.scale, self.growth_tracker, torch.tensor([float(found_inf)]),
                                 s.growth_factor, s.backoff_factor, s.growth_interval)

    def state_dict(self) -> dict:
        return {"scale": float(self.scale.item()), "growth_tracker": int(self.growth_tracker.item())}

    def load_state_dict(self, d: dict) -> None:
        try:
            scale, tracker = float(d["scale"]), int(d["growth_tracker"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"loss-scale state needs numeric 'scale' and 'growth_tracker', got {d!r}") from e
        self.scale.fill_(scale)
        self.growth_tracker.fill_(tracker)
