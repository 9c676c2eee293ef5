"""Restoring a trainer: the appliance's state (RESTORE_REQUEST) or a committed checkpoint on disk
into the model, optimizer, scheduler, RNG and data position of a fresh job."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from mirrorckpt.config.ddp import reducer_params
from mirrorckpt.control import messages as m
from mirrorckpt.control.channel import RemoteError
from mirrorckpt.control.endpoint import ControlClient
from mirrorckpt.control.link.describe import set_rng_states, unwrap
from mirrorckpt.updater.dcp_keys import loads
from mirrorckpt.updater.restore import keep_implementation

log = logging.getLogger("mirrorckpt.control.trainer")


@dataclass
class Restored:
    source: str
    iterations_done: int
    step: int
    data_position: object
    rng: dict
    trainer_step: int | None = None  # the trainer's last step the appliance had heard of (None: none)
    behind: int | None = None  # steps the restored state is behind it


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
    keep_implementation(out, optimizer.param_groups)
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


class RestoreRefused(RuntimeError):
    """The appliance refused to serve a state (its message says why, e.g. a state further behind
    the trainer's last reported step than its protection limit)."""


def load_scaler(scaler, loss_scale: dict | None) -> None:
    """A GradScaler's scale and growth tracker as restored (its factors and interval stay its own)."""
    if scaler is None:
        return
    if loss_scale is None:
        raise ValueError("the restored state has no loss scale (not an fp16 job), but a scaler was given")
    scaler.load_state_dict({**scaler.state_dict(), "scale": float(loss_scale["scale"]),
                            "_growth_tracker": int(loss_scale["growth_tracker"])})


def _said(restored: Restored) -> str:
    if restored.trainer_step is None:
        return "the appliance has no step reported by the trainer"
    return f"{restored.behind} step(s) behind the trainer's last reported step {restored.trainer_step}"


def restore_from_appliance(model, optimizer, *, appliance: tuple[str, int], secret, scheduler=None, scaler=None,
                           data=None, allow_behind: bool = False, timeout: float = 60.0, role: str = "trainer",
                           client_options: dict | None = None) -> Restored:
    """Pull the appliance's latest consistent state (RESTORE_REQUEST) into model and optimizer,
    scheduler, GradScaler, RNG and ``data`` (``load_state_dict`` of the data position).
    The appliance refuses a state further behind the trainer's last reported step than its
    protection limit unless ``allow_behind``: that refusal raises RestoreRefused with its reason
    (nothing is loaded). ``client_options``: ControlClient keywords, e.g. ``ssl_context``
    (control.tls.client_context) and ``server_hostname``."""
    module = unwrap(model)
    host, port = appliance
    body = {"step": None, **({"allow_behind": True} if allow_behind else {})}
    with ControlClient(host, port, secret, role, **{"backoff_max": 0.5, **(client_options or {})}) as cli:
        if not cli.wait_connected(timeout):
            raise ConnectionError(f"appliance {host}:{port} not reachable in {timeout:g} s")
        try:
            reply = cli.request(m.make(m.RESTORE_REQUEST, **body), timeout=timeout)
        except RemoteError as e:
            raise RestoreRefused(f"appliance {host}:{port} refused the restore: {e}") from None
    meta, rng = load_restore_state(module, optimizer, scheduler, reply)
    load_scaler(scaler, meta.get("loss_scale"))
    set_rng_states(rng)
    dp = meta.get("data_position")
    if data is not None and dp is not None:
        data.load_state_dict(dp)
    out = Restored(f"appliance {host}:{port} ({meta.get('source', 'memory or disk')})", int(meta["iterations_done"]),
                   int(meta["step"]), dp, rng, trainer_step=meta.get("trainer_step"), behind=meta.get("behind"))
    log.info("restored step %d from %s, %s%s", out.iterations_done, out.source, _said(out),
             " (allow_behind)" if allow_behind else "")
    return out


def restore_from_disk(model, optimizer, root, *, scheduler=None, scaler=None, data=None) -> Restored:
    """Load the latest committed checkpoint under ``root`` (verified) the same way."""
    from mirrorckpt.updater.restore import load_into

    r = load_into(unwrap(model), optimizer, root, scheduler=scheduler, scaler=scaler)
    set_rng_states(r.rng)
    if data is not None and r.data_position is not None:
        data.load_state_dict(r.data_position)
    out = Restored(str(r.path), r.iterations_done, r.step, r.data_position, r.rng)
    log.info("restored step %d from the checkpoint %s", out.iterations_done, out.source)
    return out
