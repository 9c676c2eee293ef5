"""The replica's state as a DCP state dict: key names, the extra keys, and the way back.

Top-level layout (what `dcp.save` flattens with "." joins; keys equal the trainer's
`torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` for a model whose
parameter FQNs are the layout's names):

    model.<name>                          fp32 master parameter
    optim.state.<name>.<key>              optimizer state (adam/adamw: step, exp_avg, exp_avg_sq
                                          [, max_exp_avg_sq]; sgd: momentum_buffer)
    optim.param_groups.<g>.<hyperparameter> every param group g, "params" lists its names

Extra keys, ignored by a trainer that loads only {"model", "optim"}:

    extra.format          "mirrorckpt/1"
    extra.iterations_done training-loop iterations applied (the checkpoint's directory number)
    extra.step            optimizer steps taken (fewer than iterations when fp16 steps were skipped)
    extra.layout          JSON: config.layout.JobLayout.to_dict()
    extra.training        JSON: config.training.TrainingSpec.to_dict()
    extra.lr_scheduler    tagged JSON of the scheduler's state_dict() (only with a scheduler)
    extra.loss_scale      JSON {"scale", "growth_tracker"} (fp16 only)
    extra.rng.<name>      uint8 tensor: a trainer-provided RNG state (when the trainer sent it)
    extra.data_position   JSON: trainer-provided data-loader position (when sent)
    extra.unstepped       JSON list of the parameters no optimizer step has touched yet (their
                          optim.state holds optim.fresh_state placeholders, which DCP's fixed key
                          set needs); a loader drops their state so the first step is a fresh
                          one (SGD clones its first gradient, a zero buffer would damp it)

JSON rather than pickled objects keeps the extras readable and free of code; the tagged form
keeps the tuples and Counters some schedulers hold.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

FORMAT = "mirrorckpt/1"


@dataclass
class ReplicaState:
    """Everything needed to continue the replica (or the trainer) exactly."""

    params: dict[str, torch.Tensor]  # fp32 masters by layout name
    optim: dict  # {"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}
    iterations_done: int = 0
    step: int = 0
    lr_scheduler: dict | None = None
    loss_scale: dict | None = None
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    data_position: object = None
    layout: dict | None = None
    training: dict | None = None
    unstepped: list[str] = field(default_factory=list)  # names whose optimizer state is a placeholder


# ---- tagged JSON ----------------------------------------------------------------------------

def _enc(v, where: str):
    if isinstance(v, collections.Counter):
        return {"__counter__": [[_enc(k, where), int(c)] for k, c in v.items()]}
    if isinstance(v, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in v):
            return {k: _enc(x, f"{where}.{k}") for k, x in v.items()}
        return {"__items__": [[_enc(k, where), _enc(x, f"{where}[{k!r}]")] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, where) for x in v]}
    if isinstance(v, list):
        return [_enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"{where}: cannot store a {type(v).__name__} in a checkpoint extra")


def _dec(v):
    if isinstance(v, dict):
        if "__counter__" in v:
            return collections.Counter({_dec(k): c for k, c in v["__counter__"]})
        if "__items__" in v:
            return {_dec(k): _dec(x) for k, x in v["__items__"]}
        if "__tuple__" in v:
            return tuple(_dec(x) for x in v["__tuple__"])
        return {k: _dec(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


def dumps(v, where: str = "value") -> str:
    return json.dumps(_enc(v, where), sort_keys=True)


def loads(s: str):
    return _dec(json.loads(s))


# ---- nested checkpoint dict -------------------------------------------------------------------

def rng_tensor(v, where: str) -> torch.Tensor:
    """A trainer RNG state as a uint8 tensor (torch.get_rng_state() already is one)."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().contiguous().view(torch.uint8).reshape(-1).clone()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(v), dtype=torch.uint8)
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v).view(np.uint8).reshape(-1).copy())
    raise TypeError(f"{where}: an RNG state must be a tensor, bytes or ndarray, got {type(v).__name__}")


def to_checkpoint(s: ReplicaState) -> dict:
    """Nested state dict for dcp.save. Tensors are referenced, not copied."""
    extra = {
        "format": FORMAT,
        "iterations_done": int(s.iterations_done),
        "step": int(s.step),
        "layout": dumps(s.layout or {}, "layout"),
        "training": dumps(s.training or {}, "training"),
    }
    if s.lr_scheduler is not None:
        extra["lr_scheduler"] = dumps(s.lr_scheduler, "lr_scheduler")
    if s.loss_scale is not None:
        extra["loss_scale"] = dumps(s.loss_scale, "loss_scale")
    if s.rng:
        extra["rng"] = {k: rng_tensor(v, f"rng.{k}") for k, v in s.rng.items()}
    if s.data_position is not None:
        extra["data_position"] = dumps(s.data_position, "data_position")
    if s.unstepped:
        extra["unstepped"] = dumps(sorted(s.unstepped), "unstepped")
    return {"model": dict(s.params), "optim": s.optim, "extra": extra}


def from_checkpoint(sd: dict, where: str = "checkpoint") -> ReplicaState:
    """Inverse of to_checkpoint, from a nested dict as dcp.load fills it."""
    try:
        extra = sd["extra"]
        if extra.get("format") != FORMAT:
            raise ValueError(f"{where}: extra.format is {extra.get('format')!r}, expected {FORMAT!r}")

        def js(key):
            return loads(extra[key]) if key in extra else None

        return ReplicaState(
            params=dict(sd["model"]),
            optim=sd["optim"],
            iterations_done=int(extra["iterations_done"]),
            step=int(extra["step"]),
            lr_scheduler=js("lr_scheduler"),
            loss_scale=js("loss_scale"),
            rng=dict(extra.get("rng") or {}),
            data_position=js("data_position"),
            layout=js("layout") or None,
            training=js("training") or None,
            unstepped=list(js("unstepped") or []),
        )
    except KeyError as e:
        raise ValueError(f"{where}: required key {e.args[0]!r} missing") from None


# ---- flat keys, as DCP names them --------------------------------------------------------------

def _is_leaf(v) -> bool:
    # DCP (torch/distributed/checkpoint/_traverse.py): mappings are walked; a list is walked only
    # when it holds a tensor or a container that is walked; anything else is one stored value.
    if isinstance(v, Mapping):
        return False
    if not isinstance(v, list):
        return True
    return not any(isinstance(x, torch.Tensor) or not _is_leaf(x) for x in v)


def map_leaves(sd: Mapping, fn) -> dict:
    """Copy of the nested state dict with every stored value replaced by fn(dcp flat key, value)."""

    def walk(path: str, v):
        if isinstance(v, Mapping):
            return {k: walk(f"{path}.{k}", x) for k, x in v.items()}
        if _is_leaf(v):
            return fn(path, v)
        return [walk(f"{path}.{i}", x) for i, x in enumerate(v)]

    return {k: walk(str(k), v) for k, v in sd.items()}


def flatten(sd: Mapping) -> dict[str, object]:
    """{dcp flat key: value} in DCP's traversal order."""
    out: dict[str, object] = {}
    map_leaves(sd, lambda k, v: out.__setitem__(k, v))
    return out


def unflatten(flat: dict[str, object], paths: dict[str, tuple]) -> dict:
    """Nested dict from flat keys and DCP's planner_data (flat key -> path of keys and list indices)."""
    root: dict = {}
    for key, value in flat.items():
        path = paths.get(key, tuple(key.split(".")))
        node = root
        for part, nxt in zip(path[:-1], path[1:]):
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
            else:
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root


def required_keys(layout: dict, training: dict, weights_only: bool = False) -> list[str]:
    """Flat keys every committed checkpoint of this layout/training must hold (``weights_only``: a
    weight snapshot, updater.weights: the extras and the parameters)."""
    from mirrorckpt.config.training import TrainingSpec
    from mirrorckpt.updater.optim import state_keys

    names = [p["name"] for p in layout.get("params", [])]
    keys = [f"extra.{k}" for k in ("format", "iterations_done", "step", "layout", "training")]
    keys += [f"model.{n}" for n in names]
    if weights_only:
        return keys
    if not training.get("optimizer"):
        return keys + ["optim.param_groups.0.params", "optim.param_groups.0.lr"]
    for g, (gnames, spec) in enumerate(TrainingSpec.from_dict(training).groups(names)):
        keys += [f"optim.param_groups.{g}.params", f"optim.param_groups.{g}.lr"]
        keys += [f"optim.state.{n}.{k}" for n in gnames for k in state_keys(spec)]
    return keys
