"""The packet path through a remote mirror's encapsulation: the same frames bare and inside
ERSPAN type II (GRE with sequence numbers, the mirror sessions followed), decoded, ICRC-checked and
placed by PSN (``bench_packet_path.ours``), in one run.

Workloads as bench_packet_path's: ``ll``, the real LL capture tiled (PMTU 1024: the most frames
per byte, where a per-frame cost shows most), and ``simple``, a generated Simple job (PMTU 4096).
The path runs on one thread, timed by its CPU time (``time.thread_time``); on a shared machine even
that moves by +-20 % from run to run with the other load (caches, memory bandwidth), more than the
difference measured, so the two run in ``repeat`` pairs, back to back, the order alternating, and
the ratio is the median of the pairs' ratios (each pair saw about the same load); the ratio of the
best times and the pairs' quartiles are kept beside it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from mirrorckpt.benchmarks.bench_packet_path import BASE, large_capture, ours, simple_base
from mirrorckpt.tools.generator.encap import EncapOptions, Encapsulator


def run(target_bytes: int = 1 << 26, repeat: int = 15) -> dict:
    out = {"ll": run_one(target_bytes, BASE, repeat)}
    with tempfile.TemporaryDirectory() as d:
        out["simple"] = run_one(target_bytes, simple_base(Path(d)), repeat)
    return out


def run_one(target_bytes: int, base: Path, repeat: int) -> dict:
    bare = large_capture(target_bytes, base)
    wrapped = Encapsulator(EncapOptions(kind="erspan2")).wrap_batch(bare)
    res = {"frames": len(bare), "bare_bytes": bare.nbytes, "erspan2_bytes": wrapped.nbytes}
    for icrc in (True, False):
        cpu = {"bare": [], "erspan2": []}
        ratios = []
        for r in range(repeat):
            runs = (("bare", bare), ("erspan2", wrapped))
            for name, batch in runs if r % 2 == 0 else runs[::-1]:
                t = time.thread_time()
                ours(batch, icrc)
                cpu[name].append(time.thread_time() - t)
            ratios.append(cpu["erspan2"][-1] / cpu["bare"][-1])
        tag = "icrc" if icrc else "noicrc"
        for name, t in cpu.items():
            res[f"{name}_{tag}_cpu_s"] = min(t)
            res[f"{name}_{tag}_Mpps"] = len(bare) / min(t) / 1e6
        # per mirrored frame: what following the job through the encapsulation costs
        res[f"ratio_{tag}"] = statistics.median(ratios)
        res[f"ratio_{tag}_quartiles"] = statistics.quantiles(ratios, n=4)
        res[f"ratio_{tag}_best"] = min(cpu["erspan2"]) / min(cpu["bare"])
    return res


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
