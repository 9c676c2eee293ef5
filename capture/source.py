"""Picking a capture backend from a spec string, and replaying batches at a chosen pace.

A spec is `KIND:ARGS` or a plain file path. Each kind maps to "module:function", imported only
when used (so a missing DPDK does not break file replay); the function takes ARGS and the
options. Adding a backend is one line in `BACKENDS`, e.g. "afpacket": "...afpacket:open_ring".
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from mirrorckpt.capture.batch import CaptureError, FrameBatch

BACKENDS: dict[str, str] = {
    "file": "mirrorckpt.capture.pcapfile:open_capture",
    "afpacket": "mirrorckpt.capture.afpacket:open_ring",  # afpacket:IFACE
    "dpdk": "mirrorckpt.capture.dpdk:open_port",  # dpdk:net_pcap0,rx_pcap=FILE
}

# Pacing splits batches so no piece spans more than this much replay time.
PACE_SLICE_NS = 1_000_000


def open_source(spec, **opts) -> Iterable[FrameBatch]:
    """Opens a capture source: "file:PATH", "PATH", or another registered "KIND:ARGS"."""
    if isinstance(spec, Path):
        kind, args = "file", str(spec)
    else:
        kind, sep, args = str(spec).partition(":")
        if not sep or kind not in BACKENDS:
            if sep and kind.isidentifier() and len(kind) > 1 and not Path(spec).exists():
                raise CaptureError(f"{spec}: unknown capture source kind {kind!r} "
                                   f"(known: {', '.join(sorted(BACKENDS))}, or a file path)")
            kind, args = "file", str(spec)
    module, _, func = BACKENDS[kind].partition(":")
    opener = getattr(importlib.import_module(module), func)
    return opener(args, **opts)


def paced(batches: Iterable[FrameBatch], mode: None | str | float = None, *,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[FrameBatch]:
    """Replays batches: as fast as possible (None), at the recorded timestamps ("recorded"),
    or at `mode` Gbit/s of wire bytes (float). Batches are cut into pieces of at most 1 ms of
    replay time; each piece is yielded when its first frame is due."""
    if mode is None:
        yield from batches
        return
    if mode == "recorded":
        gbps = None
    elif isinstance(mode, (int, float)) and not isinstance(mode, bool) and mode > 0:
        gbps = float(mode)
    else:
        raise ValueError(f"pace mode must be None, 'recorded' or a rate in Gbit/s > 0, not {mode!r}")
    start_wall = None
    t0 = 0  # replay-time origin (ns): first recorded timestamp, or 0 for a fixed rate
    sent_bits = 0.0
    for batch in batches:
        if not len(batch):
            continue
        if gbps is None:
            if start_wall is None:
                t0 = int(batch.ts_ns[0])
            due = batch.ts_ns - t0
        else:
            # Frame i is due once the frames before it have left at the given rate.
            bits = np.cumsum(batch.wirelen * 8.0)
            due = ((sent_bits + np.concatenate(([0.0], bits[:-1]))) / gbps).astype(np.int64)
            sent_bits += float(bits[-1])
        if start_wall is None:
            start_wall = clock()
        slot = due // PACE_SLICE_NS
        cuts = np.flatnonzero(slot[1:] != slot[:-1]) + 1
        firsts = [0, *cuts.tolist()]
        for piece, first in zip(batch.split_at(cuts), firsts):
            wait = start_wall + due[first] / 1e9 - clock()
            if wait > 0:
                sleep(wait)
            yield piece
