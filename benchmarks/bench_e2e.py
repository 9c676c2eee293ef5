"""End-to-end `mirrorckpt replay --config job.toml` as a user runs it, by the slope method (issue 16).

For each protocol a generated 2-rank, 2-channel job is captured twice, ``short`` and ``long``
steps of the same job (same seed and model): each capture is replayed in a fresh process
(``python -m mirrorckpt.tools.cli replay --config job.toml --quiet``), wall clock, best of
``repeat``, the sizes' runs interleaved. Start-up (imports, job set-up, exit) is the same in both,
so the slope (bytes_long - bytes_short) / (t_long - t_short) is the per-iteration rate of capture
bytes; the same slope of the CPU seconds (every thread) gives the rate per CPU second. The same captures are
also replayed ``repeat`` times with ``--json``, which adds every all-reduce's sha256: those runs
check every all-reduce against the generator's truth.json (sha256 per bucket), give the byte
counts, and have a slope of their own. The peak RSS of each run is recorded. A ``longer`` capture
of the same job gives the same slope over more bytes: a rate fast enough that the long capture runs
less than the noise guard (0.05 s) longer than the short one is still measured there. Simple and
LL are measured again on a job of 8 channels (``more_channels``): the same bytes in four times as
many QPs, whose cost per QP and batch a 2-channel job does not show.

The reference is a one-core memcpy measured in the same run: numpy ``copyto`` of 256 MiB
between two buffers already faulted in, best of 5 (GB/s of bytes copied).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PMTU = {"LL": 1024, "LL128": 4096, "Simple": 4096}
WIRE_PER_BYTE = {"LL": 2.0, "LL128": 2048 / 1920, "Simple": 1.0}  # wire bytes per user byte
PORTS_Gbit = (100, 400)  # mirror ports the cores are counted for
# FlowCheck's Fig. 10 jobs (parameters, bf16 gradients) and a 70B one, on 8 and 64 data-parallel ranks.
FIG10 = {"GPT-3 1.3B": 1.3e9, "Llama2-7B": 6.74e9, "Llama2-70B": 6.9e10}
FIG10_RANKS = (8, 64)


def fig10(rates: dict[str, float], grad_bytes: int = 2) -> dict:
    """From the per-core rates (GB of capture per CPU second, by protocol): ``cores``, the cores
    that keep up with a port at line rate, per protocol and port speed; ``jobs``, per job, ranks and
    protocol, the bytes one mirrored port carries per iteration (a rank's egress of a ring
    all-reduce: 2 (R-1)/R of the gradient, in wire bytes), their time on the wire at each port
    speed, and their processing time on one core."""
    cores = [{"protocol": p, "GB_per_cpu_second": r,
              "cores": {str(g): g / 8 / r for g in PORTS_Gbit}} for p, r in rates.items()]
    jobs = []
    for job, params in FIG10.items():
        for ranks in FIG10_RANKS:
            user = 2 * (ranks - 1) / ranks * params * grad_bytes
            for proto, rate in rates.items():
                wire = user * WIRE_PER_BYTE[proto]
                jobs.append({"job": job, "ranks": ranks, "protocol": proto, "port_GB_per_iteration": wire / 1e9,
                             "seconds_one_core": wire / (rate * 1e9),
                             "wire_seconds": {str(g): wire / (g / 8 * 1e9) for g in PORTS_Gbit}})
    return {"cores": cores, "jobs": jobs}


def memcpy_GBps(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    a = np.ones(nbytes, np.uint8)
    b = np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def build(out: Path, protocol: str, steps: int, model: str, channels: int = 2,
          mirrors: str = "0:egress,1:egress") -> dict:
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    truth = generate(GenConfig(ranks=2, channels=channels, protocol=protocol, model=model, steps=steps, seed=1,
                               mirrors=mirrors, wire=WireOptions(pmtu=PMTU[protocol]),
                               send_truth=False), out)
    # On disk before it is replayed, as a recorded capture is: else the kernel writes it back
    # (hundreds of MB, CPU on these 2 cores) during the timed replays, this one's or a later one's.
    os.sync()
    return truth


# Runs the command and writes its peak RSS (KiB) to the last line of stderr. A process started from
# this one would report this one's peak too (the kernel keeps the larger of the parent's image it
# replaced at exec): started from this small wrapper, the child's figure is its own.
# Its CPU seconds (user and system, every thread) go on the line before.
_WRAP = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
         "u = resource.getrusage(resource.RUSAGE_CHILDREN); print(u.ru_utime + u.ru_stime, file=sys.stderr); "
         "print(u.ru_maxrss, file=sys.stderr); sys.exit(rc)")


def replay_once(job_dir: Path, extra: tuple[str, ...] = ("--json",)) -> dict:
    """One `mirrorckpt replay --config --quiet` in a fresh process: wall and CPU seconds, peak RSS, its
    JSON report (None without ``--json``). The wall clock includes the wrapper's start (the same in
    every run: the slope cancels it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", _WRAP, sys.executable, "-m", "mirrorckpt.tools.cli", "replay", "--config",
           str(job_dir / "job.toml"), "--quiet", *extra]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        rc = subprocess.call(cmd, stdout=out, stderr=err, env=env)
        secs = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        text, tail = out.read().decode(), err.read().decode().split()
    if rc != 0:
        raise RuntimeError(f"replay of {job_dir} exited {rc}")
    return {"seconds": secs, "cpu_seconds": float(tail[-2]), "peak_rss_MB": int(tail[-1]) / 1024,
            "report": json.loads(text) if "--json" in extra else None}


def exact(report: dict, truth: dict) -> tuple[bool, int]:
    """Every iteration's buckets equal to truth (sha256), and how many all-reduces were checked."""
    got: dict[tuple[int, int], str | None] = {}
    for a in report["allreduces"]:
        if a["iteration"] is not None:
            got[(a["iteration"], a["bucket"])] = a["sha256"]
    want = {(it["index"], b): h for it in truth["iterations"] for b, h in enumerate(it["buckets_sha256"])}
    return got == want, len(want)


def slope(nbytes: int, dt: float) -> float | None:
    """GB per second between a short and a long run; None when the long run is no slower than the
    short one (noise on a shared machine, not a rate)."""
    return nbytes / dt / 1e9 if dt > 0.05 else None


def measure(protocol: str, model: str, short: int, long: int, repeat: int, tmp: Path,
            longer: int | None = None, channels: int = 2) -> dict:
    res: dict = {"protocol": protocol, "model": model, "pmtu": PMTU[protocol], "steps": [short, long],
                 "channels": channels}
    sizes = (short, long) + ((longer,) if longer else ())
    dirs = {n: tmp / f"{protocol}_{n}_c{channels}" for n in sizes}
    truths = {n: build(dirs[n], protocol, n, model, channels) for n in sizes}
    plain: dict[int, list] = {n: [] for n in sizes}
    checked: dict[int, list] = {n: [] for n in sizes}
    # Interleaved, a round of every size at a time: load that drifts over the minutes of a shared
    # machine then slows short and long runs alike instead of one size's block (the slope divides
    # a difference of tenths of a second).
    for _ in range(repeat):
        for n in sizes:
            plain[n].append(replay_once(dirs[n], ()))  # as the issue measures: no sha256 of every all-reduce
            checked[n].append(replay_once(dirs[n]))  # --json: every all-reduce checked
    runs = {}
    for n in sizes:
        best = min(plain[n], key=lambda r: r["seconds"])
        best_json = min(checked[n], key=lambda r: r["seconds"])
        verdicts = [exact(r["report"], truths[n]) for r in checked[n]]
        runs[n] = {"seconds": best["seconds"], "seconds_all": [r["seconds"] for r in plain[n]],
                   "cpu_seconds": best["cpu_seconds"], "json_seconds": best_json["seconds"],
                   "json_seconds_all": [r["seconds"] for r in checked[n]],
                   "bytes": best_json["report"]["capture_bytes"],
                   "peak_rss_MB": max(r["peak_rss_MB"] for r in plain[n] + checked[n]),
                   "exact": all(e for e, _ in verdicts), "allreduces_checked": sum(k for _, k in verdicts),
                   "capture_file_bytes": sum(f.stat().st_size for f in dirs[n].glob("*.pcap*"))}
    a, b = runs[short], runs[long]
    res["runs"] = {str(k): v for k, v in runs.items()}
    nbytes = b["bytes"] - a["bytes"]
    res["slope_GBps"] = slope(nbytes, b["seconds"] - a["seconds"])
    res["per_cpu_second_GB"] = slope(nbytes, b["cpu_seconds"] - a["cpu_seconds"])
    res["json_slope_GBps"] = slope(nbytes, b["json_seconds"] - a["json_seconds"])
    res["exact"] = a["exact"] and b["exact"]
    if longer:  # the same slope to a longer capture: a rate the 22-step one leaves inside its noise guard
        c = runs[longer]
        res["longer"] = longer
        res["slope_longer_GBps"] = slope(c["bytes"] - a["bytes"], c["seconds"] - a["seconds"])
        res["per_cpu_second_longer_GB"] = slope(c["bytes"] - a["bytes"], c["cpu_seconds"] - a["cpu_seconds"])
        res["exact"] = res["exact"] and c["exact"]
    return res


def _clean(tmp: Path, protocol: str) -> None:
    for s in list(tmp.iterdir()):
        if s.name.startswith(protocol + "_"):
            subprocess.run(["rm", "-rf", str(s)], check=True)


def memory(model: str, steps: tuple[int, int], tmp: Path) -> dict:
    """Peak RSS of replaying a short and a ten times longer Simple capture of the same job."""
    out = {}
    for n in steps:
        d = tmp / f"memory_{n}"
        truth = build(d, "Simple", n, model)
        r = replay_once(d)
        out[str(n)] = {"bytes": r["report"]["capture_bytes"], "peak_rss_MB": r["peak_rss_MB"],
                       "exact": exact(r["report"], truth)[0]}
        subprocess.run(["rm", "-rf", str(d)], check=True)
    return out


def run(protocols=("Simple", "LL", "LL128"), model: str = "linear:2000000", short: int = 2, long: int = 22,
        repeat: int = 5, memory_steps: tuple[int, int] | None = (12, 120), longer: int | None = 62,
        more_channels: int | None = 8, more_channels_protocols=("Simple", "LL")) -> dict:
    """``more_channels``: the same job on that many channels too (Simple and LL, the same captures'
    lengths): the packet path's and the placement's work per batch grows with the QPs a batch
    carries, so the rate of a 2-channel job does not hold for one on more."""
    out: dict = {"memcpy_GBps_before": memcpy_GBps(), "repeat": repeat, "interleaved": True}
    with tempfile.TemporaryDirectory() as t:
        if memory_steps:
            out["memory"] = memory(model, memory_steps, Path(t))
        for p in protocols:
            out[p] = measure(p, model, short, long, repeat, Path(t), longer)
            _clean(Path(t), p)
        if more_channels:
            out["channels"] = {"count": more_channels, "results": {}}
            for p in more_channels_protocols:
                out["channels"]["results"][p] = measure(p, model, short, long, repeat, Path(t), longer, more_channels)
                _clean(Path(t), p)
    out["memcpy_GBps_after"] = memcpy_GBps()
    out["memcpy_GBps"] = max(out["memcpy_GBps_before"], out["memcpy_GBps_after"])
    for x in [out[p] for p in protocols] + list(out.get("channels", {}).get("results", {}).values()):
        x["of_memcpy"] = x["slope_GBps"] / out["memcpy_GBps"] if x["slope_GBps"] else None
        if x.get("slope_longer_GBps"):
            x["of_memcpy_longer"] = x["slope_longer_GBps"] / out["memcpy_GBps"]
    # per CPU second, not the wall slope: the replay runs its packet path and placement on threads of their own
    out["fig10"] = fig10({p: out[p]["per_cpu_second_GB"] for p in protocols if out[p].get("per_cpu_second_GB")})
    out["load_average_after"] = os.getloadavg()
    return out


if __name__ == "__main__":
    protos = tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ("Simple", "LL", "LL128")
    print(json.dumps(run(protos), indent=1))
