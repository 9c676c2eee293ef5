"""REGISTER's content checks on the appliance: the trainer's layout, recipe and ring against what
is fixed (configuration, an earlier registration, the traffic being parsed), and its initial state."""

from __future__ import annotations

import torch
from mirrorckpt.config.layout import JobLayout, RingSpec
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control.endpoint import Refused
from mirrorckpt.updater.dcp_keys import ReplicaState, loads
from mirrorckpt.updater.optim import build_optimizer


def check_recipe(have: tuple, got: tuple, lambda_modules: tuple[str, ...]) -> None:
    """``have``: the (layout, training, ring) fixed so far (each None when not yet); ``got``: the
    registration's. Refused on any difference, or on a schedule naming a function from a module
    the appliance does not import from."""
    layout0, training0, ring0 = have
    layout, training, ring = got
    if layout0 is not None and layout.to_dict() != layout0.to_dict():
        raise Refused(differs("layout", layout0.to_dict(), layout.to_dict()))
    if training0 is not None and training.recipe() != training0.recipe():
        raise Refused(differs("training", training0.recipe(), training.recipe()))
    if training0 is None:
        foreign = [p for p in training.lr_schedule.callable_paths() if p.partition(":")[0] not in lambda_modules]
        if foreign:
            allowed = ", ".join(lambda_modules) or "none"
            raise Refused(f"the schedule names function {foreign[0]!r}; this appliance imports scheduler "
                          f"functions only from its lambda_modules ({allowed})")
    if ring0 is not None and ring is not None and not same_ring(ring0, ring):
        raise Refused("ring does not match the configured ring "
                      f"({ring0.nranks} ranks, {ring0.protocol}, {ring0.nchannels} channels)")


def differs(what: str, have: dict, got: dict) -> str:
    keys = sorted(k for k in set(have) | set(got) if have.get(k) != got.get(k))
    return f"{what} does not match the traffic/configured {what} (differs in {', '.join(map(str, keys[:4]))})"


def same_ring(a: RingSpec, b: RingSpec) -> bool:
    return (a.nranks, a.nchannels, a.protocol) == (b.nranks, b.nchannels, b.protocol)


def initial_state(layout: JobLayout, training: TrainingSpec, tensors: dict, meta: dict | None):
    """The registered state at step 0: the weights, and when the trainer sent them its param
    groups and scheduler state as constructed (exact whatever the schedule's arguments)."""
    params = initial_params(layout, tensors)
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


def initial_params(layout: JobLayout, tensors: dict) -> dict[str, torch.Tensor]:
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


