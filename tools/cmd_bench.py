"""`mirrorckpt bench`: runs the benchmarks in one process and writes BENCHMARKS.md.

Every claim is a ratio between two measurements taken in the same run (the machines are shared
and noisy: absolute numbers move between runs, ratios much less). The raw results are kept as
JSON beside the report.
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
from mirrorckpt.tools.progress import Progress

REPO = Path(__file__).resolve().parents[1]

# name -> (module, function, kwargs for a full run, kwargs for --quick)
SECTIONS = {
    "packet_path": ("mirrorckpt.benchmarks.bench_packet_path", "run", {"target_bytes": 1 << 30},
                    {"target_bytes": 1 << 28}),
    "replay": ("mirrorckpt.benchmarks.bench_replay", "run", {}, {"quick": True}),
    "updater": ("mirrorckpt.benchmarks.bench_updater", "run_all", {"nparams": 50_000_000},
                {"nparams": 10_000_000}),
    "capture": ("mirrorckpt.benchmarks.bench_capture", "run_all", {"seconds": 3.0}, {"seconds": 1.0}),
    "stall": ("mirrorckpt.benchmarks.bench_checkpoint_stall", "run_all", {}, {}),
    "large": ("mirrorckpt.benchmarks.bench_large", "run_all", {},
              {"sizes": (1_000_000, 4_000_000, 10_000_000), "commit_params": 10_000_000}),
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


def render(results: dict, info: dict, section_info: dict | None = None) -> str:
    """The report; ``section_info`` holds the machine info of sections run apart (``--only``)."""
    out = ["# Benchmarks", "",
           f"Measured by `mirrorckpt bench` on {info['date']}: {info['cpu']}, {info['cores']} cores, load "
           f"average {', '.join(f'{x:.1f}' for x in info['load_average'])} at the start; torch {info['torch']}, "
           f"numpy {info['numpy']}. The machines are shared: read absolute numbers as orders of magnitude and "
           "compare within one run. Raw numbers: `BENCHMARKS.json`.", ""]
    for name, res in results.items():
        # a section that failed keeps its error message, shown as it came
        failed = isinstance(res, dict) and "error" in res
        render_section = _render_generic if failed else globals().get(f"_render_{name}", _render_generic)
        out += _captioned(render_section(name, res), _caption((section_info or {}).get(name, info)))
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
    lines = ["## Packet path: decode + ICRC + PSN placement (issue 2)", "",
             "Two workloads, each a capture tiled with its PSNs moved on and its ICRCs recomputed; one core. "
             "`ll`: the real capture iter_40000_p2p_iter10 (NCCL LL, 16-64 KB messages, PMTU 1024); "
             "`simple`: a generated Simple-protocol job (messages up to 1 MB, PMTU 4096).", "",
             "| workload | path | GB/s of capture | Mpackets/s | ratio |", "|---|---|---|---|---|"]
    for wl, x in r.items():
        size = f"{wl} ({x['bytes'] / 1e9:.2f} GB, {x['frames']:,} frames)"
        lines += [
            f"| {size} | mirrorckpt, ICRC checked ({x.get('icrc_backend', 'zlib')}) | {_f(x['ours_icrc_GBps'])} | "
            f"{_f(x['ours_icrc_Mpps'])} | "
            f"{x['ratio_vs_scapy_icrc']:.0f}x scapy (packets/s) |",
            f"| | mirrorckpt, ICRC off | {_f(x['ours_noicrc_GBps'])} | {_f(x['ours_noicrc_Mpps'])} | "
            f"{100 * x['ratio_vs_memcpy_noicrc']:.0f}% of memcpy |",
            f"| | scapy `Ether(raw)` to BTH fields and payload | {_f(x['scapy_GBps'], 4)} | "
            f"{_f(x['scapy_Mpps'], 4)} | 1x |",
            f"| | numpy memcpy of the same bytes (the physical limit) | {_f(x['memcpy_GBps'])} | – | 100% |"]
    return lines


def _render_replay(name, r) -> list[str]:
    lines = ["## End-to-end replay: capture files to every iteration's reduced buckets (issues 2, 4)", "",
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
    lines = ["## CPU replica and persistence (issue 5)", "",
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
    lines = ["## Receive rate per backend (issue 7)", "",
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

    lines = ["## Training stall per checkpoint (issue 6)", "",
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
        lines.append(f"| mirror mode (a checkpoint every iteration) | {m['stall_per_checkpoint_ms']:.1f}; the "
                     f"control link costs {m['link_per_step_ms']:.1f} per step (step {_ms(m.get('step'))}) | 0 |")
    if "restore" in r:
        x = r["restore"]
        lines += ["", "| restore (step reached) | ms |", "|---|---|",
                  f"| from appliance memory (step {x.get('memory_step')}) | {_ms(x.get('memory'))} |",
                  f"| from disk (step {x.get('disk_step')}) | {_ms(x.get('disk'))} |"]
    return lines


def _render_large(name, r) -> list[str]:
    lines = ["## Large states: fallback, restore, commit (issue 15)", "",
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
              f"write + fsync of the same bytes, one run; `[persist] writer_threads` defaults to {c['default_threads']}.",
              "", "| write | seconds | GB/s | ratio |", "|---|---|---|---|",
              f"| plain sequential write + fsync | {c['plain_s']:.2f} | {c['plain_GBps']:.2f} | 1x |"]
    for x in c["commits"]:
        lines.append(f"| committed checkpoint, {x['threads']} writer thread(s) | {x['seconds']:.2f} | {x['GBps']:.2f} | "
                     f"{x['ratio_to_plain']:.2f}x |")
    return lines


def _render_generic(name, r) -> list[str]:
    return [f"## {name}", "", "```json", json.dumps(r, indent=1, default=str)[:20000], "```"]


@click.command()
@click.option("--only", multiple=True, type=click.Choice(list(SECTIONS)), help="Run only these sections.")
@click.option("--quick", is_flag=True, help="Smaller sizes (minutes, not tens of minutes).")
@click.option("--out", type=click.Path(dir_okay=False), default=str(REPO / "BENCHMARKS.md"), show_default=True)
def bench(only, quick, out):
    """Run the benchmarks and write BENCHMARKS.md (and BENCHMARKS.json beside it)."""
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
                results[name] = {"error": f"{type(e).__name__}: {e}"}
            bar.echo(f"[bench] {name}: {time.perf_counter() - t0:.0f} s")
            bar.set(i + 1)
    outp = Path(out)
    doc = {"machine": info, "results": results}
    if only and outp.with_suffix(".json").exists():  # the other sections keep their numbers and captions
        old = json.loads(outp.with_suffix(".json").read_text())
        by = old.get("section_machine", {})
        by.update({n: info for n in names})
        doc = {"machine": old["machine"], "results": {**old["results"], **results}, "section_machine": by}
    outp.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    outp.write_text(render(doc["results"], doc["machine"], doc.get("section_machine")))
    click.echo(f"wrote {outp} and {outp.with_suffix('.json')}")
    if any("error" in r for r in results.values() if isinstance(r, dict)):
        sys.exit(1)
