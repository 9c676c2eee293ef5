"""The goodput model behind `mirrorckpt plan`: checkpoint size, Young/Daly interval and the expected
share of wall time that advances training, per checkpoint strategy.

Failures form a Poisson process of mean interval MTBF. A strategy is four times:
  tau  compute between two checkpoints (the interval),
  C    how long one checkpoint stalls training,
  W    how long after its stall a checkpoint becomes restorable (a background write, GoCkpt's k
       steps, the appliance's lag),
  R    restart: detection, rescheduling and loading the checkpoint.
A failure rolls training back to the last restorable checkpoint. Counting from the moment a
checkpoint becomes restorable, the next one does after s = tau + C of failure-free time, and each
failure costs a failure-free run of R + W (restart, then recompute up to where it became
restorable) before trying again. The expectation of that renewal time is exact for exponential
failures (the derivation of Daly 2006, with W added to the restart):

    E[period] = MTBF * exp((R + W) / MTBF) * (exp(s / MTBF) - 1),      goodput = tau / E[period]

To first order in 1/MTBF this is the textbook's waste plus the restart and lag terms:

    waste ~ C / (tau + C) + tau / (2 MTBF) + (W + R) / MTBF

and Young's interval tau = sqrt(2 C MTBF) minimises it. ``simulate`` replays the same timeline
event by event (a check on the algebra, and the prediction the failure-injection run is held to).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from mirrorckpt.parser import lossmodel

# checkpoint bytes per parameter: (weights in compute precision, fp32 master copy)
PRECISIONS = {"fp32": (4, 0), "bf16": (2, 4), "fp16": (2, 4)}
# fp32 optimizer state tensors per parameter (torch's own state dicts)
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "adam-amsgrad": 3, "sgd-momentum": 1, "sgd": 0}
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def checkpoint_bytes_per_param(precision: str, optimizer: str) -> dict:
    """The bytes one parameter adds to a checkpoint, by component. Gradients are not saved (they
    are recomputed after a restart): bf16 + fp32 master + Adam is 2 + 4 + 8 = 14 bytes, fp32 + Adam
    4 + 8 = 12."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZER_STATES)}")
    weights, master = PRECISIONS[precision]
    parts = {f"weights ({precision})": weights}
    if master:
        parts["fp32 master weights"] = master
    n = OPTIMIZER_STATES[optimizer]
    if n:
        parts[f"{optimizer} state ({n} x fp32)"] = 4 * n
    return {"components": parts, "total": sum(parts.values())}


@dataclass
class Timeline:
    """One strategy's times, in seconds (see the module docstring)."""
    tau: float
    C: float
    W: float
    R: float

    def __post_init__(self):
        for k in ("tau", "C", "W", "R"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{k} = {v!r}: expected a finite time >= 0")
        if self.tau <= 0:
            raise ValueError(f"tau = {self.tau}: the interval must be > 0")


def goodput(t: Timeline, mtbf: float) -> float:
    """Expected share of wall time that advances training (exact for exponential failures)."""
    x = (t.tau + t.C) / mtbf
    log_period = math.log(mtbf) + (t.R + t.W) / mtbf + (x + math.log(-math.expm1(-x)))  # log of E[period]
    return math.exp(math.log(t.tau) - log_period)


def waste_first_order(t: Timeline, mtbf: float) -> dict:
    """The first-order terms of the waste, each a share of wall time, and their sum."""
    parts = {"checkpoint_stall": t.C / (t.tau + t.C), "lost_work": t.tau / (2 * mtbf),
             "restorable_lag": t.W / mtbf, "restart": t.R / mtbf}
    parts["total"] = sum(parts.values())
    return parts


def simulate(t: Timeline, mtbf: float, work: float, rng: np.random.Generator, restarts=()) -> float:
    """Wall time to finish ``work`` seconds of compute on the timeline, failures drawn from ``rng``
    (exponential, mean ``mtbf``); a failure during a stall, a pending write or a restart counts too.
    The run ends with its last segment's compute (no checkpoint after it). ``restarts``: the
    durations of the first restarts that complete, in order (a run's measured ones); later
    restarts take ``t.R``."""
    nseg = math.ceil(work / t.tau - 1e-9)
    wall, fail = 0.0, rng.exponential(mtbf)
    seg = safe = done = 0  # segments done; segments in the newest restorable checkpoint; restarts
    pending = deque()  # (segments, wall time it becomes restorable), oldest first
    while seg < nseg:
        last = seg + 1 == nseg
        dur = min(t.tau, work - seg * t.tau) + (0.0 if last else t.C)
        if wall + dur <= fail:
            wall += dur
            seg += 1
            if not last:
                pending.append((seg, wall + t.W))
            while pending and pending[0][1] <= wall:
                safe = pending.popleft()[0]
            continue
        wall = fail  # a failure: back to the newest restorable checkpoint, then restart
        while pending and pending[0][1] <= wall:
            safe = pending.popleft()[0]
        seg = safe
        pending.clear()
        r = restarts[done] if done < len(restarts) else t.R
        while True:  # the restart must run r seconds without a failure
            fail = wall + rng.exponential(mtbf)
            if fail >= wall + r:
                wall += r
                done += 1
                break
            wall = fail
    return wall


def best_interval(t: Timeline, mtbf: float, lo: float = 0.0) -> float:
    """The interval (>= lo) with the highest exact goodput, everything else as in ``t``: a golden
    section search on log(tau) (goodput is unimodal in tau: overhead falls, lost work grows)."""
    def g(x):
        return goodput(Timeline(math.exp(x), t.C, t.W, t.R), mtbf)

    a = math.log(max(lo, 1e-6 * mtbf, 1e-9))
    b = math.log(max(100 * mtbf, math.exp(a) * 2))
    r = (math.sqrt(5) - 1) / 2
    c, d = b - r * (b - a), a + r * (b - a)
    for _ in range(80):
        if g(c) >= g(d):
            b, d = d, c
            c = b - r * (b - a)
        else:
            a, c = c, d
            d = a + r * (b - a)
    return math.exp((a + b) / 2)


def fallback(p: float, ranks: int, mirrors: int, packets: float, target: float) -> dict:
    """Mirror loss -> probability that an iteration cannot be reassembled (FlowCheck Eq. 2, M
    mirrored ranks' streams in a ring of N) and the fewest mirrored ranks that meet ``target``."""
    by = {m: lossmodel.eq2(p, m, ranks, packets) + 0.0 for m in range(1, ranks + 1)}  # + 0.0: no -0.0
    rec = next((m for m in by if by[m] <= target), None)
    return {"probability_per_iteration": by[mirrors], "recommended_mirrors": rec, "target_per_iteration": target,
            "by_mirrors": by}


def gockpt_stall(state_bytes: float, grad_bytes: float, snapshot_Bps: float, step: float, k: int) -> float:
    """Training stall of one GoCkpt checkpoint copied over k steps: the state goes in k parts, each
    hidden behind one step while it fits in it (the rest stalls), and at step i the gradients of the
    i parts already copied follow them (on the critical path): sum_{i<k} (i/k) G/B = (k-1)/2 G/B."""
    return (k - 1) / 2 * grad_bytes / snapshot_Bps + max(0.0, state_bytes / snapshot_Bps - k * step)


def best_gockpt_steps(state_bytes: float, grad_bytes: float, snapshot_Bps: float, step: float,
                      kmax: int = 64) -> int:
    """The k in 1..kmax with the smallest stall (the first, on ties)."""
    return min(range(1, kmax + 1), key=lambda k: (gockpt_stall(state_bytes, grad_bytes, snapshot_Bps, step, k), k))
