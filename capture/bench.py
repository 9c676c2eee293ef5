"""Capture-file read throughput, for the benchmark suite (no timing lives in the tests).

`bench_read` times a full pass of the reader over a file and, for scale, a plain numpy copy of
the same bytes through a memory map: the copy touches every byte once, the reader only the
record/block headers, so the ratio shows how close the walk gets to memory speed.
`build_bench_capture` makes a large pcapng by repeating the frames of some real captures.
"""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np
from mirrorckpt.capture.pcapfile import DEFAULT_BATCH_FRAMES, open_capture, read_all
from mirrorckpt.capture.writer import PcapngWriter


def build_bench_capture(path, sources, target_bytes: int = 1 << 30) -> int:
    """Writes a pcapng of about target_bytes holding the sources' frames over and over, with
    timestamps moved forward each round so they keep increasing; returns the frame count."""
    batches = [read_all(s) for s in sources]
    batches = [b for b in batches if len(b)]
    if not batches:
        raise ValueError(f"no frames in {list(map(str, sources))}")
    written = 0
    with PcapngWriter(path, interfaces=[("bench", 1, 0)]) as w:
        shift = 0
        while written < target_bytes:
            for b in batches:
                start = int(b.ts_ns[0])
                b.ts_ns = b.ts_ns - start + shift
                b.iface = np.zeros(len(b), np.int32)
                w.write_batch(b)
                shift = int(b.ts_ns.max()) + 1000
                written += int(b.caplen.sum()) + 32 * len(b)
        return w.frames


def bench_read(path, batch_frames: int = DEFAULT_BATCH_FRAMES, copy: bool = True) -> dict:
    """One timed pass of the reader (after a warm-up pass that brings the file into the page
    cache) and, if `copy`, one timed numpy copy of the mapped file."""
    size = Path(path).stat().st_size
    for _ in range(2):  # the first pass warms the page cache; the second is the one kept
        t0 = time.perf_counter()
        frames = 0
        with open_capture(path, batch_frames) as reader:
            for batch in reader:
                frames += len(batch)
            captured = reader.stats.bytes
        seconds = time.perf_counter() - t0
    out = {"path": str(path), "file_bytes": size, "frames": frames, "captured_bytes": captured,
           "batch_frames": batch_frames, "seconds": seconds,
           "frames_per_s": frames / seconds, "gb_per_s": size / seconds / 1e9}
    if copy:
        # Two references: a copy out of a fresh mapping (pays the same page faults as the
        # reader) and a copy between two arrays already in memory (memory bandwidth alone).
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            src = np.frombuffer(mm, np.uint8)
            dst = np.empty_like(src)
            dst[:] = 1  # fault the destination pages in before timing
            t0 = time.perf_counter()
            np.copyto(dst, src)
            mapped_s = time.perf_counter() - t0
            del src
        again = np.empty_like(dst)
        again[:] = 1
        t0 = time.perf_counter()
        np.copyto(again, dst)
        memory_s = time.perf_counter() - t0
        out.update(copy_mapped_gb_per_s=size / mapped_s / 1e9,
                   copy_memory_gb_per_s=size / memory_s / 1e9)
    return out


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", help="captures whose frames fill the bench file")
    ap.add_argument("--size", type=float, default=1.0, help="bench file size in GB")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        big = Path(d) / "bench.pcapng"
        t0 = time.perf_counter()
        n = build_bench_capture(big, args.sources, int(args.size * 1e9))
        write_s = time.perf_counter() - t0
        result = bench_read(big)
        result.update(write_seconds=write_s, write_gb_per_s=big.stat().st_size / write_s / 1e9)
        print(json.dumps(result, indent=1))
