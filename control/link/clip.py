"""Clipping seen without touching the user's call: the link compares a fixed sample of each
gradient before the clip with the same elements at ``optimizer.step()`` and finds the one float32
coefficient c with fl(before * c) == after for every sampled element, which is what torch's
``clip_grads_with_norm_`` (and every framework's call of it) multiplies by. Nothing is patched.

"Before" is where the clip cannot have happened yet: for fp32 parameters (the optimizer steps the
model's own), a copy of the sample taken at the end of each backward, after DDP has written the
reduced gradients (an autograd final callback queued from a final callback runs after DDP's
own); for bf16/fp16 models with fp32 masters, the model's gradients themselves, which the clip
of the masters leaves alone (fp16: times GradScaler's 1/scale, as its unscale_ forms it).

An empty sample (all-zero gradients), a change that is no single scaling (clip_grad_value_, a
per-tensor clip) or more than one fitting coefficient is reported as an error, never guessed."""

from __future__ import annotations

import logging

import torch
from mirrorckpt.control.link.describe import local

log = logging.getLogger("mirrorckpt.control.trainer")

SAMPLE_PER_TENSOR = 16  # elements of each gradient compared; a different mantissa each, mostly


def _indices(numel: int, device) -> torch.Tensor:
    step = max(1, numel // SAMPLE_PER_TENSOR)
    return torch.arange(0, numel, step, device=device)[:SAMPLE_PER_TENSOR]


def _sample(grads: list, indices: list[torch.Tensor]) -> torch.Tensor:
    parts = [local(g).detach().reshape(-1).float()[i] if g is not None else torch.zeros(len(i), device=i.device)
             for g, i in zip(grads, indices)]
    return torch.cat([p.to("cpu") for p in parts])


def coefficient(before: torch.Tensor, after: torch.Tensor) -> tuple[float | None, str]:
    """(c, "") with fl32(before * c) == after everywhere, c in (0, 1]; (None, why) otherwise."""
    if torch.equal(before, after):
        return 1.0, ""
    live = (before != 0) & torch.isfinite(before)
    if bool((after[~live] != before[~live]).any()):
        return None, "a zero or non-finite gradient element changed: not a clip by one coefficient"
    if not bool(live.any()):
        return None, "every sampled gradient element is zero"
    b, a = before[live], after[live]
    guess = torch.unique((a.double() / b.double()).float())[:8]
    candidates = set()
    for c in guess.tolist():
        t = torch.tensor(c, dtype=torch.float32)
        for _ in range(3):  # the guess and its float32 neighbours
            candidates.add(float(t))
            candidates.add(float(torch.nextafter(t, torch.tensor(0.0))))
            t = torch.nextafter(t, torch.tensor(2.0))
    fits = sorted(c for c in candidates if 0 < c <= 1 and torch.equal(b * torch.tensor(c, dtype=torch.float32), a))
    if len(fits) == 1:
        return fits[0], ""
    if not fits:
        return None, ("the gradients changed by no single float32 factor in (0, 1] (clip_grad_value_? a "
                      "per-tensor clip?)")
    return None, f"{len(fits)} float32 factors fit the sample ({fits[0]!r}..{fits[-1]!r})"


class ClipWatch:
    """Finds the coefficient each step's gradients were clipped by (see the module text)."""

    def __init__(self, link, scaler=None):
        self._link = link  # masters, model_params
        self._scaler = scaler
        self.own_params = all(m is p for m, p in zip(link.masters, link.model_params))
        self._indices = [_indices(local(p).numel(), p.device) for p in link.masters]
        self._before: torch.Tensor | None = None
        self._armed = False
        self._hooks = []
        self.errors = 0
        if self.own_params:
            self._hooks = [p.register_post_accumulate_grad_hook(self._arm) for p in link.masters]

    def _arm(self, _param) -> None:
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp)

    def _after_ddp(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._take)  # runs after DDP's finalize

    def _take(self) -> None:
        self._armed = False
        self._before = _sample([p.grad for p in self._link.masters], self._indices)

    def _before_clip(self) -> torch.Tensor | None:
        if self.own_params:
            before = self._before
            if before is None:
                return None
        else:
            before = _sample([p.grad for p in self._link.model_params], self._indices)
        if self._scaler is not None and self._scaler.is_enabled():
            inv = torch.tensor(1.0 / float(self._scaler.get_scale()), dtype=torch.float64).float()
            before = before * inv  # GradScaler.unscale_'s product, in float32
        return before

    def observe(self, step: int) -> float | None:
        """The coefficient of the step about to run (1.0: not clipped), or None with an error logged."""
        before = self._before_clip()
        if before is None:
            return None  # no backward seen (a step without gradients)
        after = _sample([p.grad for p in self._link.masters], self._indices)
        self._before = None
        coef, why = coefficient(before, after)
        if coef is None:
            self.errors += 1
            log.error("step %d: the clip the trainer applied cannot be told from its gradients (%s); the appliance "
                      "cannot follow this step: clip through link.clip_grad_norm_ or report it with note_clip",
                      step, why)
        return coef

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
