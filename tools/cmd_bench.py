"""`mirrorckpt bench`: runs the benchmarks in one process and writes BENCHMARKS.md.

Every claim is a ratio between two measurements taken in the same run (the machines are shared
and noisy: absolute numbers move between runs, ratios much less). The raw results are kept as
JSON beside the report, both in the working directory unless --out says otherwise. Sections that
drive the test rigs (tools/testbed, not in the installed package) or read the shared captures
beside the repository need a source checkout, and say so in their result.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import click
from mirrorckpt.tools.cliutil import writable_dir
from mirrorckpt.tools.progress import Progress

SERVE_WORKERS = ("shared ring, 1 worker", "shared ring, 2 workers")  # bench_serve.VARIANTS

# name -> (module, function, kwargs for a full run, kwargs for --quick)
SECTIONS = {
    "packet_path": ("mirrorckpt.benchmarks.bench_packet_path", "run", {"target_bytes": 1 << 30},
                    {"target_bytes": 1 << 28}),
    "replay": ("mirrorckpt.benchmarks.bench_replay", "run", {}, {"quick": True}),
    "updater": ("mirrorckpt.benchmarks.bench_updater", "run_all", {"nparams": 50_000_000},
                {"nparams": 10_000_000}),
    "capture": ("mirrorckpt.benchmarks.bench_capture", "run_all", {"seconds": 3.0}, {"seconds": 1.0}),
    "stall": ("mirrorckpt.benchmarks.bench_checkpoint_stall", "run_all", {}, {}),
    "goodput": ("mirrorckpt.benchmarks.bench_goodput", "run", {}, {"steps": 120, "mtbf_s": 3.0, "every": 10}),
    "joint": ("mirrorckpt.benchmarks.bench_joint", "run", {"nparams": 16_000_000}, {"nparams": 4_000_000, "reps": 2}),
    "e2e": ("mirrorckpt.benchmarks.bench_e2e", "run", {}, {"repeat": 2, "memory_steps": None, "longer": None,
                                                          "more_channels": None}),
    "serve": ("mirrorckpt.benchmarks.bench_serve", "run", {}, {"repeat": 1, "long": 12}),
    # one port on one and two workers alone: for a machine with a core for each thread
    "serve_workers": ("mirrorckpt.benchmarks.bench_serve", "run", {"protocols": ("LL", "Simple"), "repeat": 2,
                                                                    "variants": SERVE_WORKERS},
                      {"protocols": ("LL",), "repeat": 1, "long": 12, "variants": SERVE_WORKERS}),
    "latency": ("mirrorckpt.benchmarks.bench_latency", "run", {}, {"sizes": ("64,128,32", "512,1024,512"),
                                                                    "steps": 12}),
    "large": ("mirrorckpt.benchmarks.bench_large", "run_all", {},
              {"sizes": (1_000_000, 4_000_000, 10_000_000), "commit_params": 10_000_000}),
    "decap": ("mirrorckpt.benchmarks.bench_decap", "run", {}, {"target_bytes": 1 << 24, "repeat": 7}),
}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import torch

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
            "cores": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__}


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def render(results: dict, info: dict, runs: dict | None = None) -> str:
    """``runs``: section -> the machine record of the run that measured it, where that run was not
    ``info``'s (a ``--only`` run merged into an earlier report)."""
    runs = runs or {}
    out = ["# Benchmarks", "",
           f"Measured by `{info.get('command', 'mirrorckpt bench')}` on {info['date']}: {info['cpu']}, "
           f"{info['cores']} cores, load average {', '.join(f'{x:.1f}' for x in info['load_average'])} at the "
           f"start; torch {info['torch']}, numpy {info['numpy']}. The machines are shared: read absolute numbers "
           "as orders of magnitude and compare within one run. Raw numbers: `BENCHMARKS.json`.", ""]
    later = {n: r for n, r in runs.items() if n in results and r != info}
    if later:
        out += ["Sections measured by a later run: " + "; ".join(
            f"{n} by `{r.get('command', '?')}` on {r['date']} (load average "
            f"{', '.join(f'{x:.1f}' for x in r['load_average']) if r.get('load_average') else 'not recorded'})"
            for n, r in later.items()) +
            ". Each table names its run.", ""]
    for name, res in results.items():
        # a section that failed keeps its error message, shown as it came
        failed = isinstance(res, dict) and "error" in res
        render_section = _render_generic if failed else globals().get(f"_render_{name}", _render_generic)
        out += _captioned(render_section(name, res), _caption(runs.get(name, info)))
        out.append("")
    return "\n".join(out)


def _caption(info: dict) -> str:
    """Machine, command and date, written above every table."""
    cmd = info.get("command", "command not recorded")
    return f"*{info['cpu']}, {info['cores']} cores · `{cmd}` · {info['date']}*"


def _captioned(lines: list[str], caption: str) -> list[str]:
    out = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            out += [caption, ""]
        out.append(line)
    return out


def _render_packet_path(name, r) -> list[str]:
    lines = ["## Packet path: decode + ICRC + PSN placement", "",
             "Two workloads, each a capture tiled with its PSNs moved on and its ICRCs recomputed; one core. "
             "`ll`: the real capture iter_40000_p2p_iter10 (NCCL LL, 16-64 KB messages, PMTU 1024); "
             "`simple`: a generated Simple-protocol job (messages up to 1 MB, PMTU 4096). The fair baseline is a "
             "plain numpy + zlib decoder (`bench_packet_path.straightforward`): header fields read with numpy "
             "for a whole batch at fixed offsets, `zlib.crc32` per packet over masks built per batch, each "
             "WRITE payload appended to its QP's message; it handles only in-order traffic of the workloads' "
             "one header form (mirrorckpt also walks VLAN/IPv4 variants and places by PSN with loss, "
             "duplicates and reordering). scapy, per-packet objects, for scale.", "",
             "| workload | path | GB/s of capture | Mpackets/s | ratio |", "|---|---|---|---|---|"]
    for wl, x in r.items():
        size = f"{wl} ({x['bytes'] / 1e9:.2f} GB, {x['frames']:,} frames)"
        plain = "plain_icrc_Mpps" in x
        lines += [
            f"| {size} | mirrorckpt, ICRC checked (the default"
            + (f", {x['icrc_backend']}" if x.get("icrc_backend") else "") + f") | {_f(x['ours_icrc_GBps'])} | "
            f"{_f(x['ours_icrc_Mpps'])} | " + (f"{x['ratio_vs_plain_icrc']:.1f}x plain numpy + zlib; " if plain
                                               else "") + f"{x['ratio_vs_scapy_icrc']:.0f}x scapy (packets/s) |",
            f"| | mirrorckpt, ICRC off | {_f(x['ours_noicrc_GBps'])} | {_f(x['ours_noicrc_Mpps'])} | "
            + (f"{x['ratio_vs_plain_noicrc']:.1f}x plain numpy; " if plain else "")
            + f"{100 * x['ratio_vs_memcpy_noicrc']:.0f}% of memcpy |"]
        if plain:
            lines += [
                f"| | plain numpy + zlib decoder, ICRC checked, first {x['plain_frames']:,} frames | "
                f"{_f(x['plain_icrc_GBps'])} | {_f(x['plain_icrc_Mpps'])} | 1x |",
                f"| | plain numpy decoder, ICRC off | {_f(x['plain_noicrc_GBps'])} | {_f(x['plain_noicrc_Mpps'])} "
                f"| 1x |"]
        lines += [
            f"| | scapy `Ether(raw)` to BTH fields and payload | {_f(x['scapy_GBps'], 4)} | "
            f"{_f(x['scapy_Mpps'], 4)} | 1x |",
            f"| | numpy memcpy of the same bytes (the physical limit) | {_f(x['memcpy_GBps'])} | – | 100% |"]
    return lines


def _render_decap(name, r) -> list[str]:
    lines = ["## Packet path through a remote mirror's encapsulation", "",
             "The same frames bare and each inside ERSPAN type II (GRE with a sequence number, the mirror "
             "session's gaps followed), through decode + ICRC + PSN placement on one thread, timed by its CPU "
             "time. On a shared machine that moves by +-20 % from run to run with the other load, so the two run "
             "in pairs, back to back, the order alternating: the ratio is the median of the pairs' ratios (their "
             "quartiles beside it), and of the best times. The encapsulated capture has 50 more bytes a frame.", "",
             "| workload | ICRC | bare, Mpackets/s | ERSPAN II, Mpackets/s | ERSPAN II / bare, median of pairs "
             "(quartiles) | of the best |", "|---|---|---|---|---|---|"]
    for wl, x in r.items():
        size = f"{wl} ({x['bare_bytes'] / 1e6:.0f} MB bare, {x['frames']:,} frames)"
        for i, tag in enumerate(("icrc", "noicrc")):
            q = x.get(f"ratio_{tag}_quartiles") or []
            quart = f" ({_f(q[0], 3)}-{_f(q[2], 3)})" if len(q) == 3 else ""
            lines.append(f"| {size if i == 0 else ''} | {'checked' if tag == 'icrc' else 'off'} | "
                         f"{_f(x[f'bare_{tag}_Mpps'])} | {_f(x[f'erspan2_{tag}_Mpps'])} | "
                         f"{_f(x[f'ratio_{tag}'], 3)}{quart} | {_f(x.get(f'ratio_{tag}_best'), 3)} |")
    return lines


def _render_replay(name, r) -> list[str]:
    lines = ["## End-to-end replay: capture files to every iteration's reduced buckets", "",
             "A generated 2-rank job (one channel, `linear:1000000`: one 4 MB fp32 bucket), the egress of both "
             "ranks. `two streams` is `mirrorckpt replay --config job.toml` on the two files; "
             "`one stream` rank 0's egress alone. Ratios are to the packet path (ICRC checked) on the same "
             "protocol in the same run.", "",
             "| protocol | run | GB/s of capture | Mpackets/s | of packet path | iterations complete, exact |",
             "|---|---|---|---|---|---|"]
    for proto, x in r["replay"].items():
        first = f"{proto} ({x['capture_file_bytes'] / 1e6:.0f} MB, {x['steps']} steps)"
        for k, label in (("two_streams", "two streams"), ("one_stream", "one stream")):
            y = x[k]
            lines.append(f"| {first} | {label} | {_f(y['GBps'])} | {_f(y['Mpps'])} | "
                         f"{100 * y.get('of_packet_path_GBps', 0):.0f}% | {y['complete']}/{y['iterations']}"
                         f"{', exact' if y['exact'] else (', NOT exact' if y['complete'] else '')} |")
            first = ""
    return lines


def _render_updater(name, r) -> list[str]:
    mem = r["memory"]
    bound = mem["traffic_GBps"]  # DRAM traffic of a copy: read + write
    lines = ["## CPU replica and persistence", "",
             f"Memory-bandwidth bound measured in the same run: {bound:.1f} GB/s of memory traffic, the more of "
             f"a {mem['bytes'] / 2**30:.0f} GiB copy (the faster of numpy and torch `copy_` with "
             f"{mem.get('threads', '?')} threads, {mem['copy_GBps']:.1f} GB/s copied, read + write) and a STREAM "
             f"triad in torch ({_f(mem.get('triad_GBps'), 1)} GB/s, two reads + a write); both count explicit "
             "reads and writes only, like the optimizer's figure. An fp32 Adam/AdamW step "
             "touches about 28 bytes per parameter.", "",
             "| replica step | threads | Mparams/s | GB/s at 28 B/param | of the bound |", "|---|---|---|---|---|"]
    for x in r["replica"]:
        label = f"{x['optimizer']} {x['impl']}" + (" bf16 grads" if x["grad_dtype"] == "bfloat16" else "") + \
            (" pipelined" if x["pipelined"] else "")
        lines.append(f"| {label} ({x['nparams'] / 1e6:.0f} M params) | {x['threads']} | {x['Mparams_per_s']:.0f} | "
                     f"{x['GBps_at_28B']:.1f} | {100 * x['GBps_at_28B'] / bound:.0f}% |")
    p = r["persist"]
    lines += ["", "| persistence of the same state | seconds | GB/s | ratio |", "|---|---|---|---|",
              f"| plain sequential write + fsync | {p['plain_write_s']:.2f} | {p['plain_GBps']:.2f} | 1x |",
              f"| committed DCP checkpoint (manifest, fsyncs, pointer) | {p['write_checkpoint_s']:.2f} | "
              f"{p['write_checkpoint_GBps']:.2f} | {p['ratio_to_plain']:.2f}x |",
              f"| snapshot for the background writer (what the replica waits for) | {p['submit_warm_s']:.3f} | "
              f"{p['submit_warm_GBps']:.1f} | – |",
              f"| verify (hash every file, read back every tensor) | {p['verify_s']:.2f} | "
              f"{p['verify_GBps']:.2f} | – |"]
    return lines


def _render_capture(name, r) -> list[str]:
    mem = r.get("memcpy", {})
    lines = ["## Receive rate per backend", "",
             f"Against a numpy memcpy of the same bytes ({_f(mem.get('gbit_s'), 1)} Gbit/s) and tcpdump "
             "writing to /dev/null on the same interface, one run. Live rows are capped by the injector on "
             "this 2-core VM (offered load in the last column); drain rows read frames queued first. The file and "
             "drain rows hand on frames in place (views of mapped memory, no copy), so they can exceed a copy's "
             "rate.", "",
             "| backend | Mpackets/s | Gbit/s | of memcpy | offered Mpps |", "|---|---|---|---|---|"]
    for k, v in r.items():
        if k == "memcpy" or not isinstance(v, dict) or "mpps" not in v:
            continue
        lines.append(f"| {k} | {_f(v['mpps'], 3)} | {_f(v['gbit_s'])} | {100 * v.get('vs_memcpy', 0):.1f}% | "
                     f"{_f(v.get('offered_mpps'), 3)} |")
    return lines


def _ms(x: dict | None) -> str:
    if not x:
        return "–"
    return f"{x['median_ms']:.1f} ({x['min_ms']:.1f}–{x['max_ms']:.1f}, n={x['n']})"


def _render_stall(name, r) -> list[str]:
    job = r.get("job", {})
    ref = r.get("torch.save", {}).get("stall", {}).get("median_ms")

    def rel(x):
        return f"{x['median_ms'] / ref:.2f}x" if ref and x else "–"

    lines = ["## Training stall per checkpoint", "",
             f"One CPU training job ({job.get('params', 0) / 1e6:.1f} M parameters, Adam, "
             f"{job.get('state_MB', 0):.0f} MB of state, {job.get('threads', '?')} thread), one run. Milliseconds: "
             "median (min–max, n). GoCkpt: the training thread's time inside the checkpoint hooks, and the "
             "excess of the k+1 affected steps over the median step (on a CPU trainer the copies compete "
             "with training for the same cores; on a GPU they are side-stream copies).", "",
             "| method | stall per checkpoint, ms | of torch.save |", "|---|---|---|"]
    if "none" in r:
        lines.append(f"| none (one training step, for scale) | {_ms(r['none'].get('step'))} | – |")
    for k in ("torch.save", "dcp.save", "dcp.async_save"):
        if k in r:
            lines.append(f"| `{k}` | {_ms(r[k].get('stall'))} | {rel(r[k].get('stall'))} |")
    for k in sorted(x for x in r if x.startswith("gockpt_k")):
        x = r[k]
        lines.append(f"| GoCkpt fallback, k={x.get('parts')}: hooks | {_ms(x.get('hook_stall'))} | "
                     f"{rel(x.get('hook_stall'))} |")
        lines.append(f"| GoCkpt fallback, k={x.get('parts')}: excess of the affected steps | "
                     f"{_ms(x.get('step_excess'))} | {rel(x.get('step_excess'))} |")
    if "mirror" in r:
        m = r["mirror"]
        f = m.get("following")
        if f:
            lines.append(
                f"| mirror mode (a checkpoint every iteration): per step, with the appliance following a 2-rank "
                f"DDP job of {f['params'] / 1e6:.1f} M parameters ({f['followed_steps']} of {f['steps']} steps "
                f"followed) | {f['stall_per_checkpoint_ms']:.1f} ± {f['noise_ms']:.1f} (mean step "
                f"{f['mean_step_mirror_ms']:.1f} vs {f['mean_step_none_ms']:.1f} without, less "
                f"{f['rig_frames_ms']:.1f} of the rig's frame making; ± two standard errors) | "
                + ("within noise of 0 |" if abs(f["stall_per_checkpoint_ms"]) <= f["noise_ms"] else
                   f"{rel({'median_ms': f['stall_per_checkpoint_ms']})} |"))
        else:
            lines.append(f"| mirror mode (a checkpoint every iteration) | not measured (this report predates "
                         f"it); step {_ms(m.get('step'))} | – |")
        lines.append(f"| mirror mode: the control link's hooks on the job above, per step | "
                     f"{m['link_per_step_ms']:.1f} (step {_ms(m.get('step'))}) | "
                     f"{rel({'median_ms': m['link_per_step_ms']})} |")
    if "restore" in r:
        x = r["restore"]
        lines += ["", "| restore (step reached) | ms |", "|---|---|",
                  f"| from appliance memory (step {x.get('memory_step')}) | {_ms(x.get('memory'))} |",
                  f"| from disk (step {x.get('disk_step')}) | {_ms(x.get('disk'))} |"]
    return lines


def _render_goodput(name, r) -> list[str]:
    j = r["job"]
    lines = ["## Goodput under injected failures", "",
             f"A 2-rank CPU DDP job (gloo; an MLP of {j['params'] / 1e6:.2f} M parameters, Adam; each step also "
             f"sleeps {1e3 * j['device_s']:.0f} ms for the accelerator's share) trains {j['steps']} steps while it is "
             f"killed (SIGKILL, every rank) at times drawn from an exponential MTBF of {j['mtbf_s']:g} s (seed "
             f"{j['seed']}: every strategy meets the same draws) and restarted from its strategy's latest checkpoint: "
             f"`dcp.save` or `dcp.async_save` every {j['checkpoint_every']} steps, or the appliance's replica "
             "(`restore_from_appliance`). Wall time from the first step to the last. The model's prediction takes "
             "the run's own measured step T, stall C, restorable lag W and restart R (kill to the next first "
             "step): `same draws` is `goodput.simulate` on this run's failure draws, `expected` work / goodput "
             "with the 10th-90th percentile of other draws. The mirror's T includes the test rig's making of "
             "NCCL's frames on rank 0 (`rig`; a NIC's work on a real system); goodput is work / wall with each "
             "strategy's own T.", "",
             "| strategy | failures | steps lost per failure | T ms | C ms | W ms | R ms | wall s, measured | "
             "same draws | error | expected (p10-p90) | goodput |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, x in r["strategies"].items():
        m, p, u = x["measured"], x["predicted"], x["model_inputs"]
        lost = ", ".join(str(k) for k in m["steps_lost_per_failure"]) or "–"
        rig = f" ({1e3 * u['rig_s']:.0f} rig)" if u.get("rig_s") else ""
        lines.append(f"| {s} | {m['failures']} | {lost} | {1e3 * u['step_s']:.0f}{rig} | {1e3 * u['stall_s']:.0f} | "
                     f"{1e3 * u['restorable_lag_s']:.0f} | {1e3 * u['restart_s']:.0f} | {m['wall_s']:.2f} | "
                     f"{p['same_draws_wall_s']:.2f} | {100 * x['same_draws_error']:+.1f}% | "
                     f"{p['expected_wall_s']:.2f} ({p['p10_wall_s']:.2f}-{p['p90_wall_s']:.2f}) | "
                     f"{100 * m['goodput']:.1f}% |")
    mir = r["strategies"].get("mirror", {}).get("measured", {}).get("appliance")
    if mir:
        lines += ["", f"Mirror: {mir['restores'].get('memory', 0)} restores from the appliance's memory, "
                      f"{mir['fallbacks_requested']} GoCkpt fallbacks, {mir['drift_events']} drift events. "
                      "Its W is the appliance's lag beyond the restart (iterations already on the wire are applied "
                      "while the job restarts)."]
    return lines


def merge(doc: dict, results: dict, info: dict) -> dict:
    """An earlier report with ``results``' sections replaced, each recorded with ``info``."""
    runs = dict(doc.get("runs", {}))
    for name in results:
        runs[name] = info
    return {"machine": doc["machine"], "results": doc["results"] | results, "runs": runs}


def _render_joint(name, r) -> list[str]:
    lines = ["## Joint checkpoints of a sharded job", "",
             f"A TP={r['tp']} job ({r['nparams'] / 1e6:.1f} M parameters in {r['groups']} DP groups, fp32 + Adam: "
             f"{r['state_MB']:.0f} MB of state), its groups dealt to 1, 2 or 4 appliance processes on this machine "
             "(one gloo group, one shared disk); one joint round each: agreement, `dcp.save` of every slice, "
             "hashes, manifest and commit. Against `dcp.save` of the same state unsharded from one process, and "
             "one appliance's committed checkpoint of it. Seconds: median of "
             f"{r['reps']}.", "",
             "| save | seconds | of dcp.save |", "|---|---|---|",
             f"| `dcp.save`, one process, unsharded | {r['dcp_save']['median_s']:.2f} | 1x |",
             f"| committed checkpoint, one appliance, unsharded (updater.persist) | "
             f"{r['write_checkpoint']['median_s']:.2f} | "
             f"{r['write_checkpoint']['median_s'] / r['dcp_save']['median_s']:.2f}x |"]
    for w in (1, 2, 4):
        x = r.get(f"joint_{w}")
        if x:
            lines.append(f"| joint round, {w} appliance process{'es' if w > 1 else ''} | {x['median_s']:.2f} | "
                         f"{x['of_dcp_save']:.2f}x |")
    return lines


def _render_e2e(name, r) -> list[str]:
    protos = [p for p in ("Simple", "LL", "LL128") if p in r]
    lines = ["## End to end, by the slope method", "",
             "`mirrorckpt replay --config job.toml --quiet` in a fresh process on a 2-step and a 22-step capture of "
             f"one generated job (2 ranks, 2 channels, `{r[protos[0]]['model']}` fp32, the egress of both ranks; "
             "written to disk before they are replayed, by `capture.writer` in whole 2 MB spans, so the page cache "
             "holds them in large folios, as it does a capture read from disk; one still cached from small writes "
             "maps in small folios, a fault each, and walks slower: 13-28 ms more per 336 MB measured here), "
             f"wall clock, best of {r.get('repeat', 3)} each"
             f"{', a round of every capture at a time' if r.get('interleaved') else ''}: the slope between them is "
             "the per-iteration rate, start-up cancels; the "
             "same slope of the CPU seconds (every thread of the process) is the rate per CPU second. "
             "The same captures replayed with `--json` (which adds every all-reduce's sha256, on threads of their "
             "own: one per two cores past two) check every all-reduce against the generator's truth, and "
             "have a slope of their own. "
             "The packet path runs on a thread of its own; from capture files a Simple send's final values, and "
             "an LL send's words as the decode thread read them (right after each packet's ICRC), are placed "
             "straight from the capture by the consumer (`nccl.LazySend`; handed over as columns, "
             "`SendBlock`, with no object per send), the reduce-scatter half never copied. "
             f"One-core memcpy in the same run: {r['memcpy_GBps']:.1f} GB/s (numpy copyto of 256 MiB, best of 5; "
             f"{r['memcpy_GBps_before']:.1f} before, {r['memcpy_GBps_after']:.1f} after).", "",
             "| protocol (PMTU) | capture, short / long | seconds, short / long | GB/s of capture (slope) | of memcpy |"
             " GB per CPU second | with `--json`: GB/s | peak RSS MB, short / long | every all-reduce exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    longer = [p for p in protocols_present(r, protos) if r[p].get("longer")]
    for p in protocols_present(r, protos):
        x = r[p]
        a, b = (x["runs"][str(k)] for k in x["steps"])
        checked = sum(v["allreduces_checked"] for v in x["runs"].values())
        dt = b["seconds"] - a["seconds"]  # a guarded slope is still shown, in brackets
        raw = (b["bytes"] - a["bytes"]) / dt / 1e9 if x["slope_GBps"] is None and dt > 0 else None
        rate = f"– ({raw:.2f})" if raw else _f(x["slope_GBps"])
        share = f"– ({100 * raw / r['memcpy_GBps']:.1f}%)" if raw else \
            f"{_f(100 * x['of_memcpy'] if x['of_memcpy'] else None, 1)}%"
        lines.append(f"| {p} ({x['pmtu']}) | {a['bytes'] / 1e6:.0f} / {b['bytes'] / 1e6:.0f} MB | "
                     f"{a['seconds']:.2f} / {b['seconds']:.2f} | {rate} | {share} | "
                     f"{_f(x.get('per_cpu_second_GB'))} | {_f(x.get('json_slope_GBps'))} | "
                     f"{a['peak_rss_MB']:.0f} / {b['peak_rss_MB']:.0f} | "
                     f"{'yes' if x['exact'] else 'NO'} ({checked}) |")
    if longer:
        lines += ["", "A slope whose long run is less than 0.05 s slower than the short one is not taken as a rate "
                  "(`–`, its value in brackets: inside the start-up noise). The same slope to a longer capture of "
                  f"the same job, best of {r.get('repeat', 3)}:", "",
                  "| protocol | capture, short / longer | seconds, short / longer | GB/s of capture (slope) | "
                  "of memcpy |", "|---|---|---|---|---|"]
        for p in longer:
            x = r[p]
            a, c = x["runs"][str(x["steps"][0])], x["runs"][str(x["longer"])]
            lines.append(f"| {p} ({x['longer']} steps) | {a['bytes'] / 1e6:.0f} / {c['bytes'] / 1e6:.0f} MB | "
                         f"{a['seconds']:.2f} / {c['seconds']:.2f} | {_f(x.get('slope_longer_GBps'))} | "
                         f"{_f(100 * x['of_memcpy_longer'] if x.get('of_memcpy_longer') else None, 1)}% |")
    lines += _render_channels(r, protos)
    if r.get("load_average_after"):
        load = ", ".join(f"{x:.1f}" for x in r["load_average_after"])
        lines += ["", f"Load average at the end of the section: {load} "
                  "(2 cores shared with other engineers: a load above 2 slows every row)."]
    spread = [(p, [r[p]["runs"][str(k)].get("seconds_all") for k in r[p]["steps"]]) for p in protos]
    if all(all(s) for _, ss in spread for s in ss):
        lines += ["", "Start-up noise: the wall seconds of every run without `--json`, short capture / long "
                  "capture (a slope whose long-minus-short difference is not well above the spread of either "
                  "is noise, not a rate): " + "; ".join(
                      f"{p} {' '.join(f'{v:.2f}' for v in a)} / {' '.join(f'{v:.2f}' for v in b)}"
                      for p, (a, b) in spread) + "."]
    if r.get("memory"):
        m = list(r["memory"].items())
        lines += ["", "Memory: peak RSS of `replay --config` on two Simple captures of the same job, "
                  "one ten times longer.", "",
                  "| capture | peak RSS MB | every all-reduce exact |", "|---|---|---|"]
        for steps, x in m:
            lines.append(f"| {steps} steps, {x['bytes'] / 1e6:.0f} MB | {x['peak_rss_MB']:.0f} | "
                         f"{'yes' if x['exact'] else 'NO'} |")
    fig = r.get("fig10")
    if isinstance(fig, dict) and fig.get("cores"):
        ports = list(fig["cores"][0]["cores"])
        lines += ["", "FlowCheck's Fig. 10 for this appliance, from the rates per CPU second above (bf16 gradients; a "
                  "mirrored port carries one rank's egress of the ring all-reduce, 2 (R-1)/R of the gradient per "
                  "iteration in the protocol's wire bytes). Cores that keep up with a port at line rate, one "
                  "worker's pipeline per core at the measured rate:", "",
                  "| protocol | GB per CPU second | " + " | ".join(f"cores for {g} Gbit/s" for g in ports) + " |",
                  "|---|---|" + "---|" * len(ports)]
        for c in fig["cores"]:
            lines.append(f"| {c['protocol']} | {c['GB_per_cpu_second']:.2f} | " +
                         " | ".join(f"{c['cores'][g]:.1f}" for g in ports) + " |")
        lines += ["", "Per job: the bytes on the port per iteration, their time on the wire, and their processing "
                  "time on one core (its ratio to the wire time is the cores above). NCCL's tuner picks Simple (or "
                  "LL128 where it is enabled) for DDP's 25 MB buckets; the LL rows price the same bytes in LL's form:",
                  "",
                  "| job | DP ranks | protocol | GB on the port per iteration | " +
                  " | ".join(f"on the wire at {g} Gbit/s, s" for g in ports) + " | processing on one core, s |",
                  "|---|---|---|---|" + "---|" * len(ports) + "---|"]
        for f in fig["jobs"]:
            lines.append(f"| {f['job']} | {f['ranks']} | {f['protocol']} | {f['port_GB_per_iteration']:.1f} | " +
                         " | ".join(f"{f['wire_seconds'][g]:.2f}" for g in ports) +
                         f" | {f['seconds_one_core']:.1f} |")
    return lines


def _render_channels(r: dict, protos: list[str]) -> list[str]:
    """The same job on more channels: the rate by the count of channels (QPs) the capture carries,
    from the longest captures measured (the most bytes over the start-up's noise)."""
    more = r.get("channels")
    if not isinstance(more, dict) or not more.get("results"):
        return []
    n = more["count"]
    lines = ["", f"The same job on {n} channels (the same captures' lengths, best of {r.get('repeat', 3)}): the "
             f"same bytes in {n // 2} times as many QPs. The packet path's and the placement's work per batch is "
             "per QP and per run, not per byte, so a capture of more channels costs more per byte; real jobs run "
             "4-32 channels. Each slope from the 2-step capture to the longest one; cores for a port at line "
             "rate from the rate per CPU second:", "",
             "| protocol | channels | slope to | GB/s of capture | of memcpy | GB per CPU second | cores for 100 / "
             "400 Gbit/s | every all-reduce exact |", "|---|---|---|---|---|---|---|---|"]
    for p in protos:
        if p not in more["results"] or not isinstance(r.get(p), dict):
            continue
        for y in (r[p], more["results"][p]):
            far = y.get("slope_longer_GBps") is not None
            rate = y["slope_longer_GBps"] if far else y["slope_GBps"]
            cpu = y.get("per_cpu_second_longer_GB") if far else y.get("per_cpu_second_GB")
            cores = f"{100 / 8 / cpu:.1f} / {400 / 8 / cpu:.1f}" if cpu else "–"
            share = f"{100 * rate / r['memcpy_GBps']:.1f}%" if rate else "–"
            steps = y["longer"] if far else y["steps"][1]
            lines.append(f"| {p} | {y.get('channels', 2)} | {steps} steps | {_f(rate)} | {share} | {_f(cpu)} | "
                         f"{cores} | {'yes' if y['exact'] else 'NO'} |")
    return lines


def _render_serve(name, r) -> list[str]:
    protos = [p for p in ("Simple", "LL", "LL128") if isinstance(r.get(p), dict)]
    x0 = r[protos[0]]
    lines = ["## File-fed `serve`, by the slope method", "",
             f"`mirrorckpt serve` in a fresh process on a {x0['steps'][0]}-step and a {x0['steps'][1]}-step capture "
             f"of one generated job (2 ranks, 2 channels, `{x0['model']}` fp32) mirrored at one port in both "
             "directions (the whole ring on one port), wall clock and CPU time of the daemon and its capture "
             f"workers, best of {r.get('repeat', 3)} each; the slope is the per-iteration rate, start-up cancels. "
             "The replica steps "
             "every iteration (AdamW). `[capture] queue_bytes` is above the capture size, so a file offered faster "
             "than the daemon decodes does not drop at the capture edge (as a live port would) and every run "
             f"applies every iteration. {r['cores']} cores, "
             + ("shared by the workers, the parser thread and the updater thread" if r["cores"] < 8 else
                "a core for each of the workers' threads, the parser thread and the updater thread")
             + f"; one-core memcpy in the same run: {r['memcpy_GBps']:.1f} GB/s."
             + (f" {r['note']}" if r.get("note") else ""), "",
             "| protocol | capture, short / long | variant | seconds, short / long | GB/s of capture (slope) | "
             "× one worker (ring) | GB/s from the workers' start (slope) | × one worker | GB per CPU second | "
             "every iteration applied |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in protos:
        x = r[p]
        s, lg = (str(k) for k in x["steps"])
        first = True
        one = x["variants"].get("shared ring, 1 worker", {})
        for v, y in x["variants"].items():
            a, b = y["runs"][s], y["runs"][lg]
            size = f"{x['bytes'][s] / 1e6:.0f} / {x['bytes'][lg] / 1e6:.0f} MB" if first else ""
            lines.append(f"| {p if first else ''} | {size} | {v} | {a['seconds']:.2f} / {b['seconds']:.2f} | "
                         f"{_f(y['slope_GBps'])} | {_f(_ratio(y, one, 'slope_GBps'))} | "
                         f"{_f(y.get('in_run_slope_GBps'))} | "
                         f"{_f(_ratio(y, one, 'in_run_slope_GBps'))} | {_f(y['GB_per_cpu_second'])} | "
                         f"{'yes' if y['every_iteration'] else 'NO'} |")
            first = False
    stages = [(p, v, y["stage_cpu_s_per_GB"]) for p in protos for v, y in r[p]["variants"].items()
              if "stage_cpu_s_per_GB" in y]
    if stages:  # bench_serve.STAGES, in its order
        shared = ("; on this machine the threads share the cores, and a thread's CPU time grows when others "
                  "compete with it for them and for memory bandwidth." if r["cores"] < 8 else ".")
        lines += ["", "CPU seconds per GB of capture of each stage's thread in the same runs (slope; the capture "
                  "and decode threads of the busiest worker; the updater's own thread). With a core for each "
                  "thread, a variant's rate would be bound by its largest entry" + shared, "",
                  "| protocol | variant | " + " | ".join(stages[0][2]) + " |", "|---|---|" + "---|" * len(stages[0][2])]
        for i, (p, v, st) in enumerate(stages):
            shown = p if i == 0 or stages[i - 1][0] != p else ""
            lines.append(f"| {shown} | {v} | " + " | ".join(f"{x:.2f}" for x in st.values()) + " |")
    if r.get("load_average_after"):
        load = ", ".join(f"{x:.1f}" for x in r["load_average_after"])
        lines += ["", f"Load average at the end of the section: {load}."]
    return lines


def _render_serve_workers(name, r) -> list[str]:
    lines = _render_serve(name, r)
    lines[0] = "## One port on one and on two workers, file-fed `serve`"
    return lines


def _ratio(y: dict, one: dict, key: str) -> float | None:
    return y[key] / one[key] if one.get(key) and y.get(key) else None


def protocols_present(r: dict, protos: list[str]) -> list[str]:
    return [p for p in protos if isinstance(r.get(p), dict) and "runs" in r[p]]


def _render_latency(name, r) -> list[str]:
    lines = ["## From the last packet to the replica's step and the committed checkpoint", "",
             "A live job through a port mirror (`bench_latency`): two CPU trainer processes, tc mirroring both "
             "ports to a monitor interface, `serve` capturing it with AF_PACKET and committing a checkpoint "
             "after every iteration. Times run from the kernel timestamp of an iteration's last captured packet "
             "to its replica step and to its checkpoint's commit (the `mirrorckpt_step_latency_seconds` and "
             "`mirrorckpt_commit_latency_seconds` metrics); the wire period is the time between consecutive "
             "iterations' last packets. A complete collective is final once every stream is two collectives past "
             "it (`parser.concat.Concatenator.settle_margin`; an incomplete one waits for the collective window, "
             "two iterations' worth, at least 8), or after 2 s of quiet wire: a job with one bucket per "
             "iteration steps two wire periods after its last packet, one with more buckets sooner. The commit "
             "adds its own write.", "",
             "| parameters | gradient MB | iterations applied | wire period ms | to step p50 / p90 ms | "
             "to step, wire periods (p50) | to commit p50 / p90 ms |", "|---|---|---|---|---|---|---|"]
    for j in r["jobs"]:
        st, co, per = j["to_step"], j["to_commit"], j["wire_period_ms"]
        lines.append(f"| {j['params']:,} | {j['grad_MB']:.1f} | {j['applied']} of {j['steps']} | {per:.0f} | "
                     f"{_f(st.get('p50_ms'), 0)} / {_f(st.get('p90_ms'), 0)} | "
                     f"{_f(st['p50_ms'] / per if per and st.get('p50_ms') else None, 1)} | "
                     f"{_f(co.get('p50_ms'), 0)} / {_f(co.get('p90_ms'), 0)} |")
    return lines


def _render_large(name, r) -> list[str]:
    lines = ["## Large states: fallback, restore, commit", "",
             "A one-part GoCkpt fallback of an fp32 AdamW job (two param groups, OneCycleLR), trainer and "
             "appliance in one process over loopback: from the request to the verified resync, two or three "
             "training steps included; the restore is `restore_from_appliance` into a fresh job (64 MiB frames). "
             "State: parameters and Adam's two moments, 12 bytes per parameter.", "",
             "| parameters | state MB | fallback s | trainer stall ms | restore s | restore GB/s |",
             "|---|---|---|---|---|---|"]
    for x in r["fallback"]:
        lines.append(f"| {x['nparams'] / 1e6:.0f} M | {x['state_bytes'] / 1e6:.0f} | {x['fallback_s']:.2f} | "
                     f"{1e3 * x['trainer_stall_s']:.1f} | {x['restore_s']:.2f} | {x['restore_GBps']:.2f} |")
    c = r["commit"]
    lines += ["", f"A committed checkpoint of {c['nparams'] / 1e6:.0f} M parameters ({c['state_bytes'] / 1e6:.0f} MB: "
              "DCP files, sha256 of every tensor, file and byte range, fsyncs, pointer) against a plain sequential "
              "write + fsync of the same bytes, one run; `[persist] writer_threads` defaults to "
              f"{c['default_threads']}.",
              "", "| write | seconds | GB/s | ratio |", "|---|---|---|---|",
              f"| plain sequential write + fsync | {c['plain_s']:.2f} | {c['plain_GBps']:.2f} | 1x |"]
    for x in c["commits"]:
        lines.append(f"| committed checkpoint, {x['threads']} writer thread(s) | {x['seconds']:.2f} | "
                     f"{x['GBps']:.2f} | "
                     f"{x['ratio_to_plain']:.2f}x |")
    return lines


def _needs_checkout(e: Exception) -> str | None:
    """Why a section could not run from an installed package, or None for any other failure."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("mirrorckpt.tools.testbed"):
        return "drives the test rigs (tools/testbed), which the installed package does not ship"
    if isinstance(e, FileNotFoundError) and "shared/captures" in str(e.filename or ""):
        return f"reads {e.filename}, beside the repository"
    return None


def _render_generic(name, r) -> list[str]:
    return [f"## {name}", "", "```json", json.dumps(r, indent=1, default=str)[:20000], "```"]


@click.command()
@click.option("--only", "--section", "only", multiple=True, type=click.Choice(list(SECTIONS)),
              help="Run only these sections; their results replace those sections in an existing report.")
@click.option("--quick", is_flag=True, help="Smaller sizes (minutes, not tens of minutes).")
@click.option("--out", type=click.Path(dir_okay=False), default="BENCHMARKS.md", show_default=True,
              help="The report (BENCHMARKS.json beside it); relative to the working directory.")
def bench(only, quick, out):
    """Run the benchmarks and write BENCHMARKS.md (and BENCHMARKS.json beside it)."""
    writable_dir(Path(out).parent, "--out")  # found out before the benchmarks run, not after
    info = machine()
    info["command"] = " ".join(["mirrorckpt bench", *(f"--only {n}" for n in only), *(["--quick"] if quick else [])])
    results = {}
    names = list(only or SECTIONS)
    with Progress("[bench]", total=len(names), unit="sections", tick=1.0) as bar:
        for i, name in enumerate(names):
            module, func, full, small = SECTIONS[name]
            bar.echo(f"[bench] {name} ...")
            bar.set(i, note=name)
            t0 = time.perf_counter()
            try:
                fn = getattr(importlib.import_module(module), func)
                kwargs = dict(small if quick else full)
                if name == "replay" and "error" not in results.get("packet_path", {"error": 1}):
                    kwargs["packet_path"] = results["packet_path"]  # measured minutes ago, in this run
                results[name] = fn(**kwargs)
            except Exception as e:  # one failing section must not lose the others' numbers
                why = _needs_checkout(e)
                results[name] = {"error": f"needs a source checkout: this section {why}; run `mirrorckpt bench` "
                                          "from a git clone installed with `pip install -e .`" if why
                                 else f"{type(e).__name__}: {e}"}
                if why:
                    bar.echo(f"[bench] {name}: {results[name]['error']}")
            bar.echo(f"[bench] {name}: {time.perf_counter() - t0:.0f} s")
            bar.set(i + 1)
    outp = Path(out)
    doc = {"machine": info, "results": results}
    if only and outp.with_suffix(".json").exists():  # keep the other sections, each with its own run
        doc = merge(json.loads(outp.with_suffix(".json").read_text()), results, info)
    outp.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    outp.write_text(render(doc["results"], doc["machine"], doc.get("runs")))
    click.echo(f"wrote {outp} and {outp.with_suffix('.json')}")
    if any("error" in r for r in results.values() if isinstance(r, dict)):
        sys.exit(1)
