"""Goodput under injected failures: a real 2-rank CPU DDP job killed at exponential random times
(seeded) and restarted from each strategy's latest checkpoint until it reaches a fixed step
count (tools/testbed/failures.py), in one run, with the goodput model's prediction beside it.

Every strategy meets the same failure draws (one seed). The prediction takes the run's own
measured costs: step time T, stall C per checkpoint, lag W until a checkpoint can be restored,
restart time R (kill to the first step of the new incarnation: process group, DDP, restore), and
gives the wall time three ways:
* ``same_draws``: ``goodput.simulate`` replaying the very failure draws of the run, mean costs;
* ``conditioned``: the same draws and the run's own restart times in order, with the compute
  times (T, C, W) scaled within +-SPREAD, the prediction nearest the measured wall. This is what
  the test holds to TOLERANCE: a failure a few milliseconds either side of a checkpoint's end, or
  one slow restart that lets one more failure in, moves the wall by a whole interval, so the mean
  costs alone agree only when no draw falls near such an edge;
* ``expected``: work / ``goodput.goodput`` (the mean over failure draws), with the 10th-90th
  percentile band of ``simulate`` over other seeds: a run with a few failures scatters that far.

The mirror's step includes the test rig's making of NCCL's frames on rank 0 (``rig_s``: a NIC's
work on a real system), so its wall time carries that too; goodput is work / wall with each
strategy's own step. The mirror's W: the appliance survives the job, so iterations already on the wire when the job
dies are still applied while the job restarts; what is lost is the lag beyond the restart time.

Run: ``python -m mirrorckpt.benchmarks.bench_goodput`` (prints JSON).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path

import numpy as np
from mirrorckpt.tools import goodput as gp
from mirrorckpt.tools.testbed import failures

TOLERANCE = 0.05  # measured wall vs the conditioned prediction, relative
SPREAD = 0.05  # how well one run knows its compute times: the first steps after a restart run slower


def _mean(xs, default=0.0) -> float:
    return statistics.fmean(xs) if xs else default


def timeline(r: failures.Run, every: int) -> tuple[gp.Timeline, dict]:
    """The strategy's (tau, C, W, R) from what its run measured."""
    T = _mean(r.step_s)
    restarts = [f["restart_s"] for f in r.failures if "restart_s" in f]
    R = _mean(restarts)
    if r.strategy == "mirror":
        lag = _mean(r.lag_s)
        t = gp.Timeline(tau=T, C=0.0, W=max(0.0, lag - R), R=R)
    else:
        t = gp.Timeline(tau=every * T, C=_mean(r.stall_s), W=_mean(r.lag_s), R=R)
    return t, {"step_s": T, "stall_s": t.C, "lag_s": _mean(r.lag_s), "restorable_lag_s": t.W, "restart_s": R,
               "interval_s": t.tau}


def conditioned(t: gp.Timeline, mtbf_s: float, work_s: float, seed: int, restarts: list[float],
                wall_s: float) -> dict:
    """The same-draws prediction with the run's restarts, nearest ``wall_s`` over compute times
    scaled within +-SPREAD."""
    best = None
    for k in np.linspace(1 - SPREAD, 1 + SPREAD, 21):
        tk = gp.Timeline(tau=t.tau * k, C=t.C * k, W=t.W * k, R=t.R)
        p = gp.simulate(tk, mtbf_s, work_s * k, np.random.default_rng(seed), restarts)
        if best is None or abs(wall_s / p - 1) < abs(best["error"]):
            best = {"wall_s": p, "scale": float(k), "error": wall_s / p - 1}
    return best


def predict(t: gp.Timeline, mtbf_s: float, work_s: float, seed: int, band_seeds: int = 2000) -> dict:
    same = gp.simulate(t, mtbf_s, work_s, np.random.default_rng(seed))
    others = [gp.simulate(t, mtbf_s, work_s, np.random.default_rng(s)) for s in range(10_000, 10_000 + band_seeds)]
    g = gp.goodput(t, mtbf_s)
    return {"same_draws_wall_s": same, "expected_wall_s": work_s / g, "goodput": g,
            "p10_wall_s": float(np.percentile(others, 10)), "p90_wall_s": float(np.percentile(others, 90))}


def lost_per_failure(r: failures.Run) -> list[int]:
    """Steps of work each failure undid (the last step logged before the kill minus the step the
    next incarnation resumed from; a step's log line follows its optimizer step, so the appliance
    can hold one the log does not show yet), for failures whose restart got as far as resuming."""
    return [max(0, f["last_step"] - f["restored_step"]) for f in r.failures
            if f.get("last_step") is not None and "restored_step" in f]


def run(steps: int = 300, every: int = 20, mtbf_s: float = 6.0, seed: int = 1, dims=(128, 512, 512, 64),
        device_s: float = 0.05, strategies=failures.STRATEGIES, workdir: Path | None = None) -> dict:
    out = {"job": {"steps": steps, "checkpoint_every": every, "mtbf_s": mtbf_s, "seed": seed, "dims": list(dims),
                   "device_s": device_s, "world": 2,
                   "params": sum(dims[k] * dims[k + 1] + dims[k + 1] for k in range(len(dims) - 1))},
           "tolerance": TOLERANCE, "strategies": {}}
    with tempfile.TemporaryDirectory() as td:
        base = Path(workdir or td)
        for s in strategies:
            r = failures.run_strategy(s, base, steps=steps, every=every, mtbf_s=mtbf_s, seed=seed, dims=dims,
                                      device_s=device_s)
            t, used = timeline(r, every)
            work = steps * used["step_s"]
            pred = predict(t, mtbf_s, work, seed)
            restarts = [f["restart_s"] for f in r.failures if "restart_s" in f]
            pred["conditioned"] = conditioned(t, mtbf_s, work, seed, restarts, r.wall_s)
            lost = lost_per_failure(r)
            out["strategies"][s] = {
                "measured": {"wall_s": r.wall_s, "goodput": work / r.wall_s, "failures": len(r.failures),
                             "incarnations": r.incarnations, "steps_run": len(r.step_s),
                             "steps_lost_per_failure": lost, "restore_s": _mean(r.restore_s),
                             "failure_log": r.failures, "appliance": r.appliance},
                "model_inputs": used | {"work_s": work, "rig_s": _mean(r.rig_s), "link_s": _mean(r.link_s)},
                "predicted": pred,
                "same_draws_error": r.wall_s / pred["same_draws_wall_s"] - 1,
            }
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))
