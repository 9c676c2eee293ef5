"""What ``attach`` checks before it hooks anything: each argument's type, named, and the DDP options
the appliance cannot follow, so a job fails at attach and not inside the optimizer's first step."""

from __future__ import annotations

import torch
from mirrorckpt.config.training import json_value_error
from mirrorckpt.control.link.describe import ddp_options


class AttachError(ValueError):
    """An argument of ``attach`` the link cannot work with; the message names it and what to give."""


def appliance_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as the ``appliance=`` tuple (a command line's --appliance); ValueError otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_data(data) -> None:
    """``data`` holds the data position: ``state_dict()`` / ``load_state_dict()`` (JSON-able)."""
    if data is None:
        return
    if callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None)):
        err = json_value_error(data.state_dict(), "state_dict()")
        if err is not None:
            raise AttachError(f"data: the position it reports travels as JSON, but its {err} (StatefulDataLoader with "
                              "shuffle=True keeps a torch.Generator state: use a DistributedSampler(shuffle=True, "
                              "seed=...) with set_epoch, whose position is a few integers)")
        return
    if isinstance(data, torch.utils.data.DataLoader):
        raise AttachError("data: a torch DataLoader has no state_dict()/load_state_dict(), so its position cannot "
                          "be kept; use torchdata's StatefulDataLoader (torchdata.stateful_dataloader) with the same "
                          "arguments, or pass an object with state_dict()/load_state_dict()")
    raise AttachError(f"data: {_kind(data)} has no state_dict()/load_state_dict(); give the object that holds the "
                      "data position (torchdata's StatefulDataLoader, or one of your own with both methods)")


def check_scheduler(scheduler, optimizer) -> None:
    if scheduler is None:
        return
    lrs = torch.optim.lr_scheduler
    if not isinstance(scheduler, (lrs.LRScheduler, lrs.ReduceLROnPlateau)):
        raise AttachError(f"scheduler: {_kind(scheduler)} is not a torch.optim.lr_scheduler scheduler (LRScheduler "
                          "or ReduceLROnPlateau); a framework's container of schedulers goes in as the one it holds")
    stepped = getattr(scheduler, "optimizer", optimizer)
    if stepped is not optimizer and getattr(stepped, "optimizer", None) is not optimizer:  # (accelerate's wrapper)
        raise AttachError("scheduler: it steps another optimizer than the one given to attach")


def check_scaler(scaler) -> None:
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise AttachError(f"scaler: {_kind(scaler)} is not a torch.amp.GradScaler (torch.cuda.amp.GradScaler is one)")


def check_attach(model, optimizer, *, scheduler=None, scaler=None, data=None, appliance=None,
                 restore=None) -> None:
    """Every argument of ``attach``; AttachError naming the first that does not fit."""
    if not isinstance(model, torch.nn.Module):
        raise AttachError(f"model: {_kind(model)} is not a torch.nn.Module (the DDP model, or the module itself)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(f"optimizer: {_kind(optimizer)} is not a torch.optim.Optimizer")
    why = ddp_options(model)
    if why is not None:
        raise AttachError(why)
    check_scheduler(scheduler, optimizer)
    check_scaler(scaler)
    check_data(data)
    if appliance is not None and not (isinstance(appliance, tuple) and len(appliance) == 2
                                      and isinstance(appliance[0], str) and isinstance(appliance[1], int)):
        raise AttachError(f"appliance: {appliance!r} is not a (host, port) tuple")
    if restore is not None and not isinstance(restore, str) and not hasattr(restore, "__fspath__"):
        raise AttachError(f"restore: {restore!r} is neither 'appliance' nor a checkpoint root path")
    if restore == "appliance" and appliance is None:
        raise AttachError("restore='appliance' needs appliance=(host, port)")
