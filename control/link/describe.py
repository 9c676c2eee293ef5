"""What the link tells the appliance about the job, read from the trainer's own objects: the
buckets DDP all-reduces, the optimizer's recipe and implementation, the hyper-parameters each step
used, the RNG states."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from mirrorckpt.config import ddp
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import GROUP_OPTIONS, OptimizerSpec, ParamGroupSpec, TrainingSpec
from mirrorckpt.control.link.schedules import schedule_spec

log = logging.getLogger("mirrorckpt.control.trainer")

OPTIMIZER_NAMES = {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def local(t):
    """This process's piece of a tensor: a DTensor's local shard (a view of it, no copy), any other
    tensor itself. The link copies, fingerprints and sends only local tensors."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def ddp_options(ddp_model) -> str | None:
    """Why the appliance cannot follow this DDP model's options (config.ddp), or None."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        return None
    bad = ddp.unfollowed_option(bool(getattr(ddp_model, "find_unused_parameters", False)),
                                bool(getattr(ddp_model, "static_graph", False)))
    if bad is None:
        return None
    return (f"DistributedDataParallel({bad}=True): {ddp.UNFOLLOWED[bad]}; the appliance follows DDP without it "
            f"(find_unused_parameters, bucket_cap_mb, bucket_cap_mb_list and gradient_as_bucket_view are followed)")


def ddp_layout(ddp_model, params: list[torch.Tensor], names: list[str], ready_order: list[int]) -> JobLayout:
    """The buckets DDP (torch 2.x) all-reduces: iteration 0's assignment, then the rebuild in
    first-backward ready order with DDP's caps (config.ddp: the reducer's own assignment function)."""
    why = ddp_options(ddp_model)
    if why is not None:
        raise ValueError(why)
    cfg = getattr(ddp_model, "_bucket_config", None)
    limits = list(getattr(cfg, "per_bucket_bytes_caps", ()) or ())
    cap = int(getattr(ddp_model, "bucket_bytes_cap", 25 << 20))
    first_cap = int(getattr(cfg, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES))
    dtype = DTYPE_NAMES[params[0].dtype]
    specs = [ParamSpec(n, tuple(p.shape), "float32") for n, p in zip(names, params)]
    if getattr(ddp_model, "find_unused_parameters", False):
        fixed = [BucketSpec(tuple(b)) for b in ddp.used_map_buckets(params, cap, first_cap, limits)]
        return JobLayout(params=specs, buckets=fixed, grad_dtype=dtype, used_map=True)
    first = ddp.initial_buckets(params, limits)
    rebuilt = ddp.rebuilt_buckets(params, ready_order, cap, first_cap, limits)
    return JobLayout(params=specs, buckets=[BucketSpec(tuple(b)) for b in rebuilt],
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
                  names: dict[int, str] | None = None, report_schedule: bool = False) -> TrainingSpec:
    """The TrainingSpec of a torch optimizer (and scheduler): what the replica rebuilds.
    ``names`` (id of each optimizer parameter -> layout name) is needed for several groups."""
    name = OPTIMIZER_NAMES.get(type(optimizer))
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
    return TrainingSpec(optimizer=opt, lr_schedule=schedule_spec(scheduler, report_schedule), grad_dtype=grad_dtype,
                        param_groups=param_groups)



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

