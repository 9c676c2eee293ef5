"""End-to-end `replay` throughput: capture files -> decode -> reassembly -> NCCL sends -> ring state machine
-> concatenator -> reduced buffers of every iteration (no replica), beside the packet-path figures.

The workload is a large generated job (tools.generator): 2 ranks, one channel, NCCL 2.18, a
``linear:1000000`` model (one 4 MB fp32 bucket), as many iterations as make ``target_bytes`` of
capture over the two mirror streams (the egress of rank 0 and of rank 1: every iteration is
complete). Two protocols: LL at PMTU 1024 (64 KB-step messages, many frames) and Simple at PMTU 4096
(large messages), like bench_packet_path's two workloads.

Per workload, each timed once, after the imports `replay` does on its first call:

* ``two_streams``: ``tools.cmd_replay.run`` on the two capture files, exactly what
  ``mirrorckpt replay --config job.toml rank0_egress.pcapng rank1_egress.pcapng`` runs; every
  iteration is checked against truth.json (``exact``);
* ``one_stream``: rank 0's egress alone (half of every iteration is missing; the same per-stream
  work without the time merge of several streams).

MirrorStreams merges the streams in 4 ms slices (1 ms until 2026-11-24): with a strict frame-by-frame merge of two
nanosecond clocks this benchmark ran ~30x slower (0.003 GB/s) in the first BENCHMARKS run.

GB/s counts captured bytes (frame bytes, as the packet path does), Mpps frames per second.
``run()`` returns {"replay": {protocol: {...}}, "packet_path": bench_packet_path.run(...)}, the replay figures
also as fractions of the packet path's on the same protocol (``of_packet_path_*``).
``mirrorckpt bench --only replay`` runs it.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from pathlib import Path

import numpy as np

COUNT = 1_000_000
FILES = ["rank0_egress.pcapng", "rank1_egress.pcapng"]


def build_capture(out: Path, protocol: str, target_bytes: int) -> dict:
    """A 2-rank job whose two egress captures hold about ``target_bytes``; returns its truth."""
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    pmtu = 1024 if protocol == "LL" else 4096
    wire_per_byte = 2 if protocol == "LL" else 1  # an LL line carries 8 data bytes in 16
    per_iteration = 2 * wire_per_byte * 4 * COUNT  # two streams, each rank sends its half twice
    steps = max(2, math.ceil(target_bytes / per_iteration))
    return generate(GenConfig(ranks=2, channels=1, protocol=protocol, model=f"linear:{COUNT}", steps=steps,
                              seed=1, mirrors="0:egress,1:egress", wire=WireOptions(pmtu=pmtu),
                              send_truth=False), out)


def _exact(iterations, truth) -> bool:
    want = [it["buckets_sha256"] for it in truth["iterations"]]
    got = [[hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for b in it.buckets]
           if it.complete else None for it in iterations]
    return got == want


def _figures(js, iterations, seconds: float, truth) -> dict:
    nbytes = js.report().bytes
    frames = js.report().frames
    return {"seconds": seconds, "bytes": nbytes, "frames": frames, "GBps": nbytes / seconds / 1e9,
            "Mpps": frames / seconds / 1e6, "iterations": len(iterations),
            "complete": sum(it.complete for it in iterations), "exact": _exact(iterations, truth)}


def replay_files(out: Path, files: list[str], truth) -> dict:
    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.tools import cmd_replay

    job = load_job(out / "job.toml")
    t = time.perf_counter()
    js, _, iterations, _ = cmd_replay.run([str(out / f) for f in files], job, nccl_version=job.ring.nccl_version)
    return _figures(js, iterations, time.perf_counter() - t, truth)


def run_replay(protocol: str, target_bytes: int) -> dict:
    import mirrorckpt.updater.appliance  # noqa: F401  (replay imports it, and torch, on its first call)

    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        t = time.perf_counter()
        truth = build_capture(out, protocol, target_bytes)
        gen = time.perf_counter() - t
        res = {"protocol": protocol, "steps": len(truth["iterations"]), "generate_seconds": gen,
               "capture_file_bytes": sum((out / f).stat().st_size for f in FILES)}
        res["one_stream"] = replay_files(out, FILES[:1], truth)
        res["two_streams"] = replay_files(out, FILES, truth)
    return res


def run(target_bytes: int = 256 << 20, packet_path_bytes: int = 1 << 30, quick: bool = False,
        packet_path: dict | None = None) -> dict:
    """Replay of both workloads, then bench_packet_path.run in the same process (or ``packet_path``,
    its result from earlier in the same run); each replay figure also as a fraction of the packet
    path's (ICRC checked) on the same protocol."""
    from mirrorckpt.benchmarks import bench_packet_path

    if quick:
        target_bytes, packet_path_bytes = min(target_bytes, 48 << 20), min(packet_path_bytes, 1 << 28)
    out = {"replay": {p: run_replay(p, target_bytes) for p in ("LL", "Simple")}}
    out["packet_path"] = pp = packet_path or bench_packet_path.run(packet_path_bytes)
    for proto, r in out["replay"].items():
        ref = pp.get(proto.lower(), {})
        for k in ("one_stream", "two_streams"):
            if "ours_icrc_GBps" in ref:
                r[k]["of_packet_path_GBps"] = r[k]["GBps"] / ref["ours_icrc_GBps"]
                r[k]["of_packet_path_Mpps"] = r[k]["Mpps"] / ref["ours_icrc_Mpps"]
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
