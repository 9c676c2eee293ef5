"""The torch pieces of the trainer's step, built from a TrainingSpec: the real torch.optim class, its
LR scheduler, and fp16 dynamic loss scaling with GradScaler's arithmetic."""

from __future__ import annotations

import torch

from ..config.training import LossScaleSpec, LRScheduleSpec, OptimizerSpec


def state_keys(spec: OptimizerSpec) -> tuple[str, ...]:
    """Optimizer state keys a parameter holds once it has been stepped (torch 2.13)."""
    if spec.name == "sgd":
        return ("momentum_buffer",) if spec.momentum != 0 else ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if spec.amsgrad else ())


def build_optimizer(spec: OptimizerSpec, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    common = dict(lr=spec.lr, weight_decay=spec.weight_decay, maximize=spec.maximize,
                  foreach=spec.foreach, fused=spec.fused)
    if spec.name == "sgd":
        return torch.optim.SGD(params, momentum=spec.momentum, dampening=spec.dampening,
                               nesterov=spec.nesterov, **common)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(params, betas=tuple(spec.betas), eps=spec.eps, amsgrad=spec.amsgrad, **common)


def build_scheduler(spec: LRScheduleSpec, optimizer: torch.optim.Optimizer):
    if not spec.enabled:
        return None
    return getattr(torch.optim.lr_scheduler, spec.name)(optimizer, **spec.kwargs)


def fresh_state(spec: OptimizerSpec, param: torch.Tensor) -> dict:
    """State equivalent to "never stepped", for a checkpoint written before a parameter's first step.

    Adam from step 0 with zero moments takes bit-identical steps to a fresh Adam (lerp/addcmul on
    zeros). SGD's fresh momentum buffer is cloned from the first gradient, which a zero buffer
    matches only with dampening == 0.
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
