"""`mirrorckpt plan`'s arithmetic: from a job's size, recipe, checkpoint costs and failure rate to
each strategy's timeline (tools/goodput.py) and goodput, every result with the inputs it used.

Strategies and the times they are given (seconds; S checkpoint bytes, G gradient bytes, T a step):
* synchronous: stall C = --checkpoint-seconds, else S / write bandwidth (+ S / snapshot bandwidth
  when the state must first leave the GPU); restorable at once (W = 0).
* asynchronous (DCP async_save): stall C = S / snapshot bandwidth; restorable after the background
  write, W = S / write bandwidth, and the next save waits for it (tau >= W).
* gockpt (multi-step, the project's fallback): the state copied over k steps; stall from
  goodput.gockpt_stall; W = k T + S / write bandwidth, tau >= W.
* mirror (the appliance): a checkpoint every step (tau = T) at no stall but the control link's
  per-step cost; W = the appliance's lag (at most a step by default); iterations the mirror loses
  (FlowCheck Eq. 2) fall back to a GoCkpt checkpoint, averaged in to first order.
Restart R = the given restart time + loading the checkpoint (S / read bandwidth from storage, or
from the appliance over the network). Bandwidths are the job's aggregate, in GB/s (1e9 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from mirrorckpt.parser import lossmodel
from mirrorckpt.tools import goodput as gp

STRATEGIES = ("synchronous", "asynchronous", "gockpt", "mirror")
GB = 1e9


@dataclass
class Inputs:
    mtbf_s: float
    params: float | None = None
    precision: str = "bf16"
    optimizer: str = "adam"
    bytes_per_param: float | None = None
    step_s: float | None = None
    restart_s: float = 0.0
    sync_stall_s: float | None = None
    async_stall_s: float | None = None
    gockpt_stall_s: float | None = None
    gockpt_steps: int | None = None
    write_GBps: float | None = None
    snapshot_GBps: float | None = None
    read_GBps: float | None = None
    restore_GBps: float | None = None
    mirror_restore_s: float | None = None
    mirror_step_overhead_s: float = 0.0
    mirror_lag_s: float | None = None
    mirror_loss: float = 1e-9
    ranks: int = 3
    mirrors: int = 2
    streams: list | None = None  # [(rank, "egress"|"ingress"|"both")] from a job file
    packets: float | None = None
    mtu: int = 4096
    target: float = 1e-6
    source: dict = field(default_factory=dict)  # input name -> where it came from; "default" if absent

    def __post_init__(self):
        if not (self.mtbf_s > 0 and math.isfinite(self.mtbf_s)):
            raise ValueError(f"MTBF {self.mtbf_s!r} s: expected a positive number")
        if not 0 <= self.mirror_loss < 1:
            raise ValueError(f"mirror loss rate {self.mirror_loss!r}: expected 0 <= p < 1")
        if self.ranks < 2:
            raise ValueError(f"{self.ranks} ranks: a ring has at least 2")
        if not 1 <= self.mirrors <= self.ranks:
            raise ValueError(f"{self.mirrors} mirrored ranks: expected 1..{self.ranks} (the ring's ranks)")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name != "mtbf_s" and v < 0:
                raise ValueError(f"{f.name} = {v!r}: expected a value >= 0")


class _Used:
    """Collects the inputs and intermediate values one result was computed from."""

    def __init__(self, inp: Inputs, best: bool = True):
        self.inp, self.d, self.best = inp, {}, best

    def __call__(self, name: str):
        v = getattr(self.inp, name)
        self.d[name] = {"value": v, "source": self.inp.source.get(name, "default")}
        return v

    def derived(self, name: str, value, how: str):
        self.d[name] = {"value": value, "source": f"derived: {how}"}
        return value


def sizes(inp: Inputs) -> dict:
    recipe = gp.checkpoint_bytes_per_param(inp.precision, inp.optimizer)
    bpp = inp.bytes_per_param if inp.bytes_per_param is not None else recipe["total"]
    out = {"precision": inp.precision, "optimizer": inp.optimizer, "bytes_per_param": bpp,
           "bytes_per_param_source": "recipe" if inp.bytes_per_param is None else "given",
           "recipe_components": recipe["components"], "params": inp.params,
           "params_source": inp.source.get("params")}
    if inp.params is not None:
        out["checkpoint_bytes"] = inp.params * bpp
        out["gradient_bytes"] = inp.params * gp.GRAD_BYTES[inp.precision]
    return out


def plan(inp: Inputs, best: bool = True) -> dict:
    """Every strategy's result; ``best`` adds the exact model's best interval (a search, slower)."""
    sz = sizes(inp)
    out = {"mtbf_s": inp.mtbf_s, "mtbf_hours": inp.mtbf_s / 3600, "checkpoint": sz, "strategies": {}}
    for name in STRATEGIES:
        u = _Used(inp, best)
        u("mtbf_s")
        try:
            r = globals()[f"_{name}"](inp, sz, u, out["strategies"])
        except _Missing as e:
            r = {"available": False, "missing": e.args[0]} | e.partial
        r["used"] = u.d
        out["strategies"][name] = r
    return out


class _Missing(Exception):
    """A strategy cannot be evaluated; the argument names the inputs that would make it possible,
    ``partial`` keeps what could be computed."""

    def __init__(self, missing: list, partial: dict | None = None):
        super().__init__(missing)
        self.partial = partial or {}


def _load(inp, sz, u, via: str):
    """Seconds to bring the checkpoint back: 'storage' or 'appliance'."""
    if via == "appliance" and inp.mirror_restore_s is not None:
        return u("mirror_restore_s"), "given"
    bw_name = "read_GBps" if via == "storage" else "restore_GBps"
    if "checkpoint_bytes" in sz and getattr(inp, bw_name) is not None:
        return u.derived("load_s", sz["checkpoint_bytes"] / (u(bw_name) * GB), f"checkpoint bytes / {bw_name}"), \
            "derived"
    return 0.0, f"not modelled (give --{'read-gbps' if via == 'storage' else 'restore-gbps'})"


def _finish(inp, u, C, W, load, load_note, floors: dict, fixed: tuple | None = None) -> dict:
    """The result for one strategy: Young's interval raised to the ``floors`` (reason -> seconds),
    or a ``fixed`` (interval, reason)."""
    R = u("restart_s") + load
    yd = math.sqrt(2 * C * inp.mtbf_s)
    if fixed is None:
        tau, reason = yd, "Young/Daly"
        for why, v in floors.items():
            if v and v > tau:
                tau, reason = v, why
    else:
        tau, reason = fixed
    t = gp.Timeline(tau=tau, C=C, W=W, R=R)
    w = gp.waste_first_order(t, inp.mtbf_s)
    r = {"available": True, "stall_s": C, "restorable_lag_s": W, "load_s": load, "load": load_note,
         "restart_with_load_s": R, "young_daly_s": yd, "interval_s": tau, "interval_min": tau / 60,
         "interval_reason": reason, "waste_first_order": w, "goodput_first_order": 1 - w["total"],
         "goodput": gp.goodput(t, inp.mtbf_s), "lost_work_per_failure_s": tau / 2 + W}
    if fixed is None and u.best:  # what the exact model would choose, beside Young's interval
        best = gp.best_interval(t, inp.mtbf_s, lo=max([v for v in floors.values() if v] + [0.0]))
        r["best_interval_s"] = best
        r["goodput_at_best_interval"] = gp.goodput(gp.Timeline(best, C, W, R), inp.mtbf_s)
    if inp.step_s:
        r["interval_steps"] = tau / inp.step_s
    return r


def _need(cond, *what, partial=None):
    if not cond:
        raise _Missing(list(what), partial)


def _synchronous(inp, sz, u, done):
    if inp.sync_stall_s is not None:
        C = u("sync_stall_s")
    else:
        _need("checkpoint_bytes" in sz and inp.write_GBps, "--checkpoint-seconds", "or --params with --write-gbps")
        S = sz["checkpoint_bytes"]
        C = S / (u("write_GBps") * GB) + (S / (u("snapshot_GBps") * GB) if inp.snapshot_GBps else 0.0)
        u.derived("sync_stall_s", C, "checkpoint bytes / write_GBps (+ / snapshot_GBps when given)")
    load, note = _load(inp, sz, u, "storage")
    return _finish(inp, u, C, 0.0, load, note, {"one step": inp.step_s and u("step_s")})


def _write_s(inp, sz, u):
    if "checkpoint_bytes" in sz and inp.write_GBps:
        return u.derived("write_s", sz["checkpoint_bytes"] / (u("write_GBps") * GB), "checkpoint bytes / write_GBps")
    return 0.0


def _asynchronous(inp, sz, u, done):
    if inp.async_stall_s is not None:
        C = u("async_stall_s")
    else:
        _need("checkpoint_bytes" in sz and inp.snapshot_GBps, "--async-stall-seconds",
              "or --params with --snapshot-gbps")
        C = u.derived("async_stall_s", sz["checkpoint_bytes"] / (u("snapshot_GBps") * GB),
                      "checkpoint bytes / snapshot_GBps")
    W = _write_s(inp, sz, u)
    load, note = _load(inp, sz, u, "storage")
    r = _finish(inp, u, C, W, load, note, {"background write": W, "one step": inp.step_s and u("step_s")})
    if not W:
        r["restorable_lag"] = "write not modelled (give --params with --write-gbps)"
    return r


def _gockpt(inp, sz, u, done):
    have_bw = "checkpoint_bytes" in sz and inp.snapshot_GBps and inp.step_s
    if inp.gockpt_steps is not None:
        k = u("gockpt_steps")
    elif have_bw:
        k = u.derived("gockpt_steps", gp.best_gockpt_steps(sz["checkpoint_bytes"], sz["gradient_bytes"],
                      u("snapshot_GBps") * GB, u("step_s")), "the k in 1..64 with the least stall")
    else:
        k = u.derived("gockpt_steps", 7, "GoCkpt's choice of 7 parts")
    if inp.gockpt_stall_s is not None:
        C = u("gockpt_stall_s")
    else:
        _need(have_bw, "--gockpt-stall-seconds", "or --params with --snapshot-gbps and --step-seconds")
        C = u.derived("gockpt_stall_s", gp.gockpt_stall(sz["checkpoint_bytes"], sz["gradient_bytes"],
                      inp.snapshot_GBps * GB, inp.step_s, k), "(k-1)/2 G/B + max(0, S/B - k T)")
    copy = k * u("step_s") if inp.step_s else 0.0
    W = copy + _write_s(inp, sz, u)
    load, note = _load(inp, sz, u, "storage")
    r = _finish(inp, u, C, W, load, note, {"k-step copy + write": W})
    r["steps"] = k
    return r


def _mirror(inp, sz, u, done):
    try:
        fb, missing = _fallback(inp, sz, u), []
    except _Missing as e:
        fb, missing = None, e.args[0]
    _need(inp.step_s and not missing, *(missing + ([] if inp.step_s else ["--step-seconds"])),
          partial=fb and {"fallback": fb})
    T = u("step_s")
    C, W = u("mirror_step_overhead_s"), (u("mirror_lag_s") if inp.mirror_lag_s is not None else
                                         u.derived("mirror_lag_s", T, "one step: the appliance keeps up or falls back"))
    q = fb["probability_per_iteration"]
    if q > 0:
        g = done.get("gockpt", {})
        _need(g.get("available"), "a GoCkpt stall for the fallback (--gockpt-stall-seconds, "
              "or --params with --snapshot-gbps)", partial={"fallback": fb})
        k = g["steps"]
        rate = q / (1 + q * k)  # fallbacks per step; the k steps of one cannot start another
        in_window = rate * (k + 1)
        fb.update(gockpt_stall_s=g["stall_s"], gockpt_steps=k, fallbacks_per_step=rate,
                  share_of_steps_in_fallback=in_window)
        C += rate * g["stall_s"]
        W += in_window * (k + 1) * T / 2  # a failure inside a fallback loses back to before it
    load, note = _load(inp, sz, u, "appliance")
    r = _finish(inp, u, C, W, load, note, {}, fixed=(T, "every step"))
    r["fallback"] = fb
    return r


def _fallback(inp, sz, u) -> dict:
    p = u("mirror_loss")
    if p == 0:
        K = 0.0  # nothing is lost, whatever the traffic
    elif inp.packets is not None:
        K = u("packets")
    else:
        _need("gradient_bytes" in sz, "--params or --packets (for the mirror's loss model)")
        K = u.derived("packets", math.ceil(sz["gradient_bytes"] / u("mtu")), "gradient bytes / mtu")
    N, M = u("ranks"), u("mirrors")
    out = {"loss_rate": p, "ranks": N, "mirrors": M, "packets_per_iteration": K, "model": "FlowCheck Eq. 2"}
    out |= gp.fallback(p, N, M, K, u("target"))
    if inp.streams:
        out["streams"] = [list(s) for s in u("streams")]
        out["probability_per_iteration"] = lossmodel.fail_probability(p, lossmodel.copies(N, inp.streams), K) + 0.0
        out["model"] = "per-chunk copies of the job file's mirror streams"
    return out


def sweep(inp: Inputs, name: str, values) -> dict[str, list]:
    """Goodput of every strategy as one input varies ('mtbf_s' or 'params'). Sizes: costs given in
    seconds scale with the checkpoint bytes (params); step time, bandwidths and MTBF stay fixed."""
    out = {s: [] for s in STRATEGIES}
    for v in values:
        if name == "params":
            f = v / inp.params
            scaled = {k: getattr(inp, k) * f for k in ("sync_stall_s", "async_stall_s", "gockpt_stall_s",
                                                        "mirror_restore_s") if getattr(inp, k) is not None}
            x = replace(inp, params=v, **scaled)
        else:
            x = replace(inp, **{name: v})
        res = plan(x, best=False)["strategies"]
        for s in STRATEGIES:
            out[s].append(res[s]["goodput"] if res[s]["available"] else None)
    return out
