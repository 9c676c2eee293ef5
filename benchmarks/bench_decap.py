"""The packet path through a remote mirror's encapsulation: the same frames bare and inside
ERSPAN type II (GRE with sequence numbers, the mirror sessions followed), decoded, ICRC-checked and
placed by PSN (``bench_packet_path.ours``), in one run, alternating, best of ``repeat`` each.

Workloads as bench_packet_path's: ``ll``, the real LL capture tiled (PMTU 1024: the most frames
per byte, where a per-frame cost shows most), and ``simple``, a generated Simple job (PMTU 4096).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mirrorckpt.benchmarks.bench_packet_path import BASE, large_capture, ours, simple_base
from mirrorckpt.tools.generator.encap import EncapOptions, Encapsulator


def run(target_bytes: int = 1 << 28, repeat: int = 3) -> dict:
    out = {"ll": run_one(target_bytes, BASE, repeat)}
    with tempfile.TemporaryDirectory() as d:
        out["simple"] = run_one(target_bytes, simple_base(Path(d)), repeat)
    return out


def run_one(target_bytes: int, base: Path, repeat: int) -> dict:
    bare = large_capture(target_bytes, base)
    wrapped = Encapsulator(EncapOptions(kind="erspan2")).wrap_batch(bare)
    res = {"frames": len(bare), "bare_bytes": bare.nbytes, "erspan2_bytes": wrapped.nbytes}
    for icrc in (True, False):
        times = {"bare": [], "erspan2": []}
        for _ in range(repeat):  # alternating, so a change of the machine's load hits both
            times["bare"].append(ours(bare, icrc))
            times["erspan2"].append(ours(wrapped, icrc))
        tag = "icrc" if icrc else "noicrc"
        for name, t in times.items():
            res[f"{name}_{tag}_s"] = min(t)
            res[f"{name}_{tag}_Mpps"] = len(bare) / min(t) / 1e6
        # per mirrored frame and per byte of the mirrored traffic: what following the job costs
        res[f"ratio_{tag}"] = min(times["erspan2"]) / min(times["bare"])
    return res


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
