"""`mirrorckpt plan`: checkpoint size, Young/Daly interval and expected goodput per checkpoint
strategy, from the model size (or a job file), the recipe, checkpoint costs, MTBF and step time.
The model is tools/goodput.py; the strategies and their inputs are tools/planner.py."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import click
from mirrorckpt.tools import goodput, planner
from mirrorckpt.tools.cliutil import Number

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class Count(click.ParamType):
    """A parameter count: 7e9, 7B, 350M, 1.3b."""
    name = "count"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(value), re.I)
        if not m or float(m.group(1)) <= 0:
            self.fail(f"{value!r}: expected a positive count such as 7e9, 7B or 350M", param, ctx)
        return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


# option name -> Inputs field (the CLI's spelling of each input)
OPTIONS = {
    "params": "params", "precision": "precision", "optimizer": "optimizer", "bytes_per_param": "bytes_per_param",
    "step_seconds": "step_s", "restart_seconds": "restart_s", "checkpoint_seconds": "sync_stall_s",
    "async_stall_seconds": "async_stall_s", "gockpt_stall_seconds": "gockpt_stall_s", "gockpt_steps": "gockpt_steps",
    "write_gbps": "write_GBps", "snapshot_gbps": "snapshot_GBps", "read_gbps": "read_GBps",
    "restore_gbps": "restore_GBps", "mirror_restore_seconds": "mirror_restore_s",
    "mirror_overhead_seconds": "mirror_step_overhead_s", "mirror_lag_seconds": "mirror_lag_s",
    "mirror_loss": "mirror_loss", "ranks": "ranks", "mirrors": "mirrors", "packets": "packets", "mtu": "mtu",
    "target": "target",
}

_POS = Number(min=0)


@click.command()
@click.option("--mtbf-hours", type=Number(min=0, min_open=True), required=True,
              help="Mean time between failures of the whole job.")
@click.option("--params", type=Count(), help="Model parameters (7e9, 7B, 350M).")
@click.option("--job", "job_file", type=click.Path(exists=True, dir_okay=False),
              help="A job file (config/example.toml): parameters, precision, optimizer, ring, mirrors.")
@click.option("--precision", type=click.Choice(list(goodput.PRECISIONS)), help="Training precision [bf16].")
@click.option("--optimizer", type=click.Choice(list(goodput.OPTIMIZER_STATES)), help="Optimizer [adam].")
@click.option("--bytes-per-param", type=_POS, help="Checkpoint bytes per parameter, instead of the recipe's.")
@click.option("--step-seconds", type=Number(min=0, min_open=True), help="One training step.")
@click.option("--restart-seconds", type=_POS, help="Detection and rescheduling after a failure [0].")
@click.option("--checkpoint-seconds", type=_POS, help="Stall of one synchronous checkpoint (measured or given).")
@click.option("--async-stall-seconds", type=_POS, help="Stall of one asynchronous checkpoint (the snapshot).")
@click.option("--gockpt-stall-seconds", type=_POS, help="Stall of one GoCkpt multi-step checkpoint.")
@click.option("--gockpt-steps", type=click.IntRange(min=1), help="Steps a GoCkpt checkpoint is copied over.")
@click.option("--write-gbps", type=Number(min=0, min_open=True), help="Storage write, GB/s (job total).")
@click.option("--snapshot-gbps", type=Number(min=0, min_open=True), help="Device-to-host copy, GB/s.")
@click.option("--read-gbps", type=Number(min=0, min_open=True), help="Storage read at restart, GB/s.")
@click.option("--restore-gbps", type=Number(min=0, min_open=True),
              help="Appliance-to-trainers restore, GB/s.")
@click.option("--mirror-restore-seconds", type=_POS, help="Restore from the appliance (measured or given).")
@click.option("--mirror-overhead-seconds", type=_POS, help="The control link's cost per step [0].")
@click.option("--mirror-lag-seconds", type=_POS, help="How far the appliance's replica trails [one step].")
@click.option("--mirror-loss", type=Number(min=0, max=1, max_open=True),
              help="Packet loss rate of a mirror link [1e-9, FlowCheck's measurement].")
@click.option("--ranks", type=click.IntRange(min=2), help="Data-parallel ranks in the ring [3].")
@click.option("--mirrors", type=click.IntRange(min=1), help="Mirrored ranks [2].")
@click.option("--packets", type=_POS, help="Packets of reduced gradients per iteration [gradient bytes / MTU].")
@click.option("--mtu", type=click.IntRange(min=256), help="RoCE path MTU, bytes [4096].")
@click.option("--target", type=Number(min=0, max=1), help="Fallback probability per iteration the "
              "recommended number of mirrors meets [1e-6].")
@click.option("--measured", "measured_file", type=click.Path(exists=True, dir_okay=False),
              help="Costs measured by `mirrorckpt bench --only stall` (its BENCHMARKS.json): bandwidths, and "
              "without --params that job's size, step time and GoCkpt stall.")
@click.option("--json", "as_json", is_flag=True, help="Print every result with its inputs as JSON.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write PNG plots into this folder.")
def plan(mtbf_hours, job_file, measured_file, as_json, plot_dir, **opts):
    """Expected goodput of synchronous, asynchronous, GoCkpt and mirror checkpointing."""
    kw, source = {}, {}
    if measured_file:
        kw, source = from_bench(measured_file, sized=opts.get("params") is not None or job_file is not None)
    if job_file:
        k, src = from_job(job_file)
        kw, source = kw | k, source | src
    for opt, fieldname in OPTIONS.items():
        if opts.get(opt) is not None:
            kw[fieldname], source[fieldname] = opts[opt], "given"
    if "mirrors" in kw and "ranks" in kw and kw["mirrors"] > kw["ranks"]:
        raise click.BadParameter(f"{kw['mirrors']} mirrored ranks in a ring of {kw['ranks']}", param_hint="--mirrors")
    source["mtbf_s"] = "given"
    try:
        inp = planner.Inputs(mtbf_s=mtbf_hours * 3600, source=source, **kw)
        result = planner.plan(inp)
        result["inputs"] = inputs(inp)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if plot_dir:
        from mirrorckpt.tools import plan_plot

        result["plots"] = plan_plot.write(inp, plot_dir)
    if as_json:
        click.echo(json.dumps(result, indent=1, default=list))
    else:
        click.echo(render(result))


def inputs(inp: planner.Inputs) -> dict:
    """Every input with its value, where it came from and the option that sets it."""
    flag = {f: "--" + o.replace("_", "-") for o, f in OPTIONS.items()} | {"mtbf_s": "--mtbf-hours"}
    return {f.name: {"value": getattr(inp, f.name), "source": inp.source.get(f.name, "default"),
                     "option": flag.get(f.name, "--job")}
            for f in dataclasses.fields(inp) if f.name != "source"}


def from_bench(path, sized: bool) -> tuple[dict, dict]:
    """Inputs measured by the stall benchmark: bandwidths from its state bytes over the measured
    times; unless the size comes from elsewhere (``sized``), that job itself (an fp32 Adam MLP)."""
    try:
        doc = json.loads(open(path).read())
        r, info = doc["results"]["stall"], doc.get("runs", {}).get("stall", doc.get("machine", {}))
        S = r["job"]["state_MB"] * 1e6

        def bw(*keys):
            x = r
            for k in keys:
                x = x[k]
            return S / (x["median_ms"] / 1e3) / 1e9

        kw = {"write_GBps": bw("torch.save", "stall"), "snapshot_GBps": bw("dcp.async_save", "stall"),
              "read_GBps": bw("restore", "disk"), "restore_GBps": bw("restore", "memory"),
              "mirror_step_overhead_s": r["mirror"]["link_per_step_ms"] / 1e3}
        if not sized:
            k7 = max((v for k, v in r.items() if k.startswith("gockpt_k")), key=lambda v: v["parts"])
            kw |= {"params": float(r["job"]["params"]), "precision": "fp32", "optimizer": "adam",
                   "step_s": r["none"]["step"]["median_ms"] / 1e3, "gockpt_steps": k7["parts"],
                   "gockpt_stall_s": k7["step_excess"]["median_ms"] / 1e3,
                   "sync_stall_s": r["torch.save"]["stall"]["median_ms"] / 1e3,
                   "async_stall_s": r["dcp.async_save"]["stall"]["median_ms"] / 1e3}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.BadParameter(f"{path}: no usable stall benchmark results ({type(e).__name__}: {e}); "
                                 "run `mirrorckpt bench --only stall`", param_hint="--measured") from None
    where = f"measured: {Path(path).name} stall section, {info.get('date', '?')}, {info.get('cpu', '?')}"
    return kw, {k: where for k in kw}


def from_job(path) -> tuple[dict, dict]:
    """Inputs a job file states: parameter count, precision, optimizer, ring size, mirror streams."""
    from mirrorckpt.config.jobfile import ConfigError, load_job

    try:
        job = load_job(path)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--job") from None
    kw = {"params": float(job.layout.total_numel if job.kind == "ddp" else sum(job.counts)),
          "precision": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[job.grad_dtype],
          "ranks": job.ring.nranks}
    opt = job.training.get("optimizer")
    if opt:
        name = opt.get("name", "adamw")
        if name == "sgd":
            name = "sgd-momentum" if opt.get("momentum", 0) else "sgd"
        elif opt.get("amsgrad"):
            name = "adam-amsgrad"
        kw["optimizer"] = name
    if job.mirrors:
        kw["streams"] = [(m.rank, m.direction) for m in job.mirrors]
        kw["mirrors"] = len({m.rank for m in job.mirrors})
    if "fallback_parts" in job.control:
        kw["gockpt_steps"] = job.control["fallback_parts"]
    return kw, {k: f"job file {job.path}" for k in kw}


def _s(x) -> str:
    if x is None:
        return "–"
    if x == 0 or 1 <= x < 120:
        return f"{x:.3g} s"
    if x < 1:
        return f"{x * 1e3:.3g} ms"
    return f"{x / 60:.2f} min"


def render(r: dict) -> str:
    c = r["checkpoint"]
    comp = " + ".join(f"{k} {v}" for k, v in c["recipe_components"].items())
    if c["params"] is None:
        size = f"checkpoint size: no --params (recipe {c['bytes_per_param']:g} B/param: {comp})"
    else:
        size = (f"checkpoint: {c['params']:.3g} params x {c['bytes_per_param']:g} B ({comp}) = "
                f"{c['checkpoint_bytes'] / 1e9:.3g} GB")
    lines = [size, f"MTBF {r['mtbf_hours']:.3g} h", "",
             f"{'strategy':<13} {'stall':>9} {'lag':>9} {'restart':>9} {'interval':>10}  {'why':<19} "
             f"{'waste, 1st order':>16} {'goodput':>8}"]
    for name, s in r["strategies"].items():
        if not s["available"]:
            lines.append(f"{name:<13} needs {' '.join(s['missing'])}")
            continue
        lines.append(f"{name:<13} {_s(s['stall_s']):>9} {_s(s['restorable_lag_s']):>9} "
                     f"{_s(s['restart_with_load_s']):>9} "
                     f"{_s(s['interval_s']):>10}  {s['interval_reason']:<19} "
                     f"{100 * s['waste_first_order']['total']:>15.2f}% {100 * s['goodput']:>7.2f}%")
    m = r["strategies"]["mirror"]
    fb = m.get("fallback")
    if fb:
        rec = fb.get("recommended_mirrors")
        lines += ["", f"mirror: an iteration is lost with probability {fb['probability_per_iteration']:.3g} "
                      f"({fb['mirrors']} of {fb['ranks']} ranks mirrored, loss rate {fb['loss_rate']:g}, "
                      f"{fb['packets_per_iteration']:.3g} packets, {fb.get('model', '')}); "
                      f"{'no number of mirrors' if rec is None else f'{rec} mirrored ranks'} "
                      f"meet{'s' if rec is None else ''} {fb['target_per_iteration']:g} per iteration"]
    lines += ["", "goodput: expected share of wall time that advances training (exponential failures, exact); "
                  "waste, 1st order: C/(tau+C) + tau/(2 MTBF) + (lag + restart)/MTBF. --json lists every input."]
    for p in r.get("plots", []):
        lines.append(f"wrote {p}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(plan())
