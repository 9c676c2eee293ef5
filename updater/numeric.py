"""The numeric policy: when the replica must equal the trainer bit for bit, and how far it may be
when it cannot (NUMERICS.md has the measurements).

The gradients on the wire are exact, and so are the values the trainer sends with each step
(clip coefficient, loss-scale decisions). What can still differ is the rounding of the optimizer
step itself: a CUDA fused or foreach kernel does not round as the CPU's kernels do. The replica
runs the trainer's implementation (fused, foreach or for-loop) where the CPU has it; when the
trainer's step runs on a CPU with that implementation the state is expected bit-exact and only
equal fingerprints pass. Otherwise each step of the two sides rounds each element once,
independently: the difference is a random walk of about one unit roundoff per step, so the
tolerance is ``coefficient * u(dtype) * sqrt(steps since the state was last the trainer's)``
with the coefficient of the optimizer measured (NUMERICS.md) and a margin.

Exactness is always checked first and reported as such; a tolerance is only ever used where the
arithmetic is known to differ.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from mirrorckpt.config.training import OptimizerSpec
from mirrorckpt.updater import fingerprint as fp

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float64": 2.0 ** -53}
# Largest measured distance / (u * sqrt(steps)) of the optimizer, times a margin of 4
# (NUMERICS.md: CPU fused vs for-loop over 2,000 steps, lr 1e-4..1e-1, with clipping, bf16 autocast).
COEFFICIENTS = {"adam": 16.0, "adamw": 16.0, "sgd": 16.0}
IMPLEMENTATIONS = ("mirror", "for-loop", "foreach", "fused")
# What the replica cannot mirror, whatever its implementation: said in the logs and NUMERICS.md.
NOT_MIRRORED = {
    "cuda": "CUDA kernels (fused/foreach AdamW/Adam/SGD) round, order and contract (FMA) differently from "
            "the CPU's; the replica runs the same implementation on the CPU and is compared within tolerance",
}


def float32_scalars(spec: OptimizerSpec) -> bool:
    """Whether the trainer's kernel takes its scalars as float32: torch's CUDA fused Adam and
    AdamW do (found on an H100 against recorded steps, NUMERICS.md). Three of its results then
    differ from the CPU's by more than rounding, the same way for every element: (1 - beta2)
    formed from the float32 0.999 is 1.3e-5 from the double's; AdamW's decay ``p - (lr * wd) * p``
    is not the CPU's ``p * (1 - lr * wd)`` with that factor rounded to float32 (up to 2^-25 of p
    each step, always the same way); and the bias corrections are float32 powers, off by up to
    hundreds of units of roundoff in the first steps. The replica steps with the kernel's
    scalars and its forms, whatever its implementation, and is left with rounding alone."""
    return spec.fused and spec.device == "cuda" and spec.name in ("adam", "adamw")


def _f32(x) -> float:
    return float(np.float32(float(x)))


def _kernel_group(optimizer, g: dict, spec: OptimizerSpec) -> None:
    """One param group changed so that torch's CPU step computes what the CUDA kernel does."""
    f32 = np.float32
    b1, b2 = (_f32(b) for b in g["betas"])
    g["betas"] = (b1, b2)
    stepped = [p for p in g["params"] if p.grad is not None]
    if g["weight_decay"] and g.get("decoupled_weight_decay", spec.name == "adamw"):
        decay = _f32(f32(_f32(g["lr"])) * f32(_f32(g["weight_decay"])))
        for p in stepped:
            p.add_(p, alpha=-decay)
        g["weight_decay"] = 0.0
    steps = {int(optimizer.state[p]["step"]) + 1 if "step" in optimizer.state.get(p, {}) else 1 for p in stepped}
    if len(steps) != 1:
        return  # parameters at different steps: their bias corrections differ, left as the CPU's
    t = steps.pop()
    # the kernel: step_size = lr / (1 - b1^t), denom = sqrt(v) / sqrt(1 - b2^t) + eps, in float32.
    # torch's CPU step forms both corrections in double; an lr and eps scaled by k give the
    # kernel's update up to rounding: (s/k) m / (sqrt(v)/c + eps/k) = s m / (sqrt(v)/(k c) + eps)
    bc1 = f32(1) - f32(b1) ** f32(t)
    bc2_sqrt = np.sqrt(f32(1) - f32(b2) ** f32(t))
    step_size = float(f32(_f32(g["lr"])) / bc1)
    k = math.sqrt(1 - b2 ** t) / float(bc2_sqrt)
    g["lr"] = step_size / k * (1 - b1 ** t)
    g["eps"] = _f32(g["eps"]) / k


@contextmanager
def kernel_scalars(optimizer, spec: OptimizerSpec):
    """The optimizer's groups as the trainer's kernel steps them (see float32_scalars), for one
    step; the groups' own values are given back after it."""
    if not float32_scalars(spec):
        yield
        return
    saved = [{k: g[k] for k in ("betas", "weight_decay", "lr", "eps")} for g in optimizer.param_groups]
    with torch.no_grad():
        for g in optimizer.param_groups:
            _kernel_group(optimizer, g, spec)
    try:
        yield
    finally:
        for g, old in zip(optimizer.param_groups, saved):
            g.update(old)


def replica_flags(spec: OptimizerSpec, impl: str = "mirror") -> dict:
    """The foreach/fused flags the replica runs: the trainer's (``mirror``; torch 2.13 has fused
    and foreach Adam, AdamW and SGD on the CPU), or the implementation named."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"replica implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")
    if impl == "mirror":
        return {"foreach": spec.foreach, "fused": spec.fused}
    return {"foreach": impl == "foreach", "fused": impl == "fused"}


@dataclass(frozen=True)
class Policy:
    exact: bool  # the two sides run the same arithmetic: anything but bit equality is drift
    coefficient: float
    why: str

    def tolerance(self, steps: int, dtype: str = "float32") -> float:
        """Largest distance (updater.fingerprint.distance) accepted ``steps`` optimizer steps after
        the state was last the trainer's own; 0 where exactness is expected."""
        if self.exact:
            return 0.0
        return self.coefficient * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"]) * math.sqrt(max(steps, 0) + 1)


def policy(spec: OptimizerSpec, impl: str = "mirror") -> Policy:
    """Exact when the trainer steps on a CPU with the implementation the replica runs."""
    mine = replica_flags(spec, impl)
    same = mine == {"foreach": spec.foreach, "fused": spec.fused}
    theirs = f"{spec.implementation} on {spec.device}"
    ours = "fused" if mine["fused"] else "foreach" if mine["foreach"] else "for-loop"
    if spec.device == "cpu" and same:
        return Policy(True, 0.0, f"trainer and replica both run {theirs}: bit-exact")
    why = f"trainer runs {theirs}, the replica {ours} on cpu"
    if float32_scalars(spec):
        why += " with the kernel's float32 scalars and decay"
    if spec.device in NOT_MIRRORED:
        why += f" ({NOT_MIRRORED[spec.device]})"
    return Policy(False, COEFFICIENTS[spec.name], why)


@dataclass
class Digest:
    """One side's fingerprints of a state at a step: exact words, and the distance stats (absent
    from a trainer that sends only words)."""

    words: dict[str, int]
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # element count per key (the replica's side)


@dataclass
class Verdict:
    match: str  # "exact", "tolerance" (within it) or "drift"
    step: int
    distance: float  # the largest over tensors (0.0 when exact)
    tolerance: float
    steps: int  # optimizer steps since the state was last the trainer's own
    distances: dict[str, float] = field(default_factory=dict)
    differing: list[str] = field(default_factory=list)  # beyond tolerance (or not bit-equal when exact)
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.match != "drift"

    def record(self) -> dict:
        """What a checkpoint's manifest keeps of it (updater.persist.Persister.mark_verified)."""
        worst = sorted(self.distances.items(), key=lambda kv: -kv[1])[:4]
        return {"match": self.match, "distance": self.distance, "tolerance": self.tolerance,
                "steps_since_exact": self.steps, "largest": {k: v for k, v in worst}}


def compare(want: Digest, have: Digest, pol: Policy, step: int, steps: int) -> Verdict:
    """The trainer's digest ``want`` against the replica's ``have`` at ``step``; ``steps``:
    optimizer steps since the replica's state was last the trainer's own (the random walk's
    length)."""
    keys = sorted(set(want.words) | set(have.words))
    missing = [k for k in keys if k not in want.words or k not in have.words]
    unequal = [k for k in keys if want.words.get(k) != have.words.get(k)]
    if not unequal:
        return Verdict("exact", step, 0.0, 0.0, steps, why=pol.why)
    tol = pol.tolerance(steps)
    if pol.exact or missing:
        return Verdict("drift", step, math.inf, tol, steps, differing=unequal, why=pol.why)
    distances = {}
    for k in unequal:
        a, b = want.stats.get(k), have.stats.get(k)
        distances[k] = math.inf if a is None or b is None else fp.distance(a, b, have.sizes.get(k, 0))
    worst = max(distances.values())
    beyond = [k for k, d in distances.items() if not d <= tol]
    return Verdict("drift" if beyond else "tolerance", step, worst, tol, steps, distances, beyond, pol.why)


def digest(named, step: int) -> Digest:
    """Both fingerprints of ``{key: tensor}`` (CPU tensors: the replica's) at ``step``."""
    named = dict(named)
    return Digest({k: fp.fingerprint(t) for k, t in named.items()},
                  {k: fp.stats(t, step, k).numpy() for k, t in named.items()},
                  {k: t.numel() for k, t in named.items()})
