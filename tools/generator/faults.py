"""Faults a mirror port can suffer, applied to one capture file's generated RC frames.

Each RC frame independently gets at most one fault, with the given probabilities:
  loss       the frame is missing from the file;
  duplicate  the frame appears twice in a row;
  reorder    the frame swaps places with the next one (timestamps stay in file order);
  corrupt    one byte after the BTH is changed, so its ICRC fails;
  truncate   the capture keeps fewer bytes than the frame had (caplen < len).
Besides, with ``message_loss`` a whole RDMA WRITE message (FIRST to LAST, or ONLY, of one QP) is
missing, every frame of it: the loss a frame-by-frame rate almost never produces, and the one
that leaves no partial message behind to show where it was.
Every fault is recorded with the frame index it has in the written file (a lost frame: the index
the next frame took), the QP, PSN and opcode, so tests can check that damage stays where it was put.
Noise frames are never faulted.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from mirrorckpt.parser.roce import opcodes
from mirrorckpt.tools.generator.frames import FrameSet

KINDS = ("loss", "duplicate", "reorder", "corrupt", "truncate")
MIN_CAPLEN = 14  # a truncated frame keeps at least its Ethernet header


@dataclass
class FaultOptions:
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    truncate: float = 0.0
    seed: int = 0
    message_loss: float = 0.0  # per RDMA WRITE message: all of its frames missing

    def __post_init__(self):
        for k in KINDS:
            v = getattr(self, k)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{k} rate {v} is not between 0 and 1")
        if not 0.0 <= self.message_loss <= 1.0:
            raise ValueError(f"--message-loss rate {self.message_loss} is not between 0 and 1")
        if self.total > 1.0:
            raise ValueError(f"fault rates add up to {self.total}, more than 1")

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in KINDS)

    def any(self) -> bool:
        return self.total > 0 or self.message_loss > 0


class FaultInjector:
    def __init__(self, opts: FaultOptions, file_name: str):
        self.opts = opts
        self.file = file_name
        self.rng = np.random.default_rng([opts.seed, zlib.crc32(file_name.encode())])
        self.written = 0  # frames written to the file before the current batch
        self.records: list[dict] = []

    def apply(self, fs: FrameSet) -> FrameSet:
        n = len(fs)
        if not n or not self.opts.any():
            self.written += n
            return fs
        u = self.rng.random(n)
        kind = np.full(n, -1)
        edge = 0.0
        for k, name in enumerate(KINDS):
            hit = fs.rc & (u >= edge) & (u < edge + getattr(self.opts, name))
            kind[hit] = k
            edge += getattr(self.opts, name)
        whole = self._whole_messages(fs) if self.opts.message_loss else np.zeros(n, bool)
        kind[whole] = len(KINDS)
        # a swap needs a next frame that is itself untouched and not already swapped
        swap = np.flatnonzero(kind == KINDS.index("reorder"))
        keep_swaps = []
        taken = np.zeros(n + 1, bool)
        for i in swap.tolist():
            if i + 1 < n and kind[i + 1] == -1 and not taken[i] and not taken[i + 1]:
                keep_swaps.append(i)
                taken[i] = taken[i + 1] = True
            else:
                kind[i] = -1
        content = np.arange(n)  # frame shown at each time position
        if keep_swaps:
            s = np.asarray(keep_swaps)
            content[s], content[s + 1] = s + 1, s
        reps = np.ones(n, np.int64)
        reps[(kind[content] == KINDS.index("loss")) | (kind[content] == len(KINDS))] = 0
        reps[kind[content] == KINDS.index("duplicate")] = 2
        pos = np.repeat(np.arange(n), reps)  # time position of every written frame
        src = content[pos]
        out = fs.take(src)
        out.ts = fs.ts[pos]
        out_index = np.cumsum(reps) - reps  # written index of each position's first copy
        extra = []
        starts = self._first_lost if self.opts.message_loss else whole
        for i in np.flatnonzero((kind >= 0) & ((kind < len(KINDS)) | starts)).tolist():
            name = KINDS[kind[i]] if kind[i] < len(KINDS) else "message_loss"
            p = int(np.flatnonzero(content == i)[0])  # where frame i shows up
            rec = {"file": self.file, "frame": self.written + int(out_index[p]), "kind": name,
                   "qp": int(fs.dqp[i]), "psn": int(fs.psn[i]), "opcode": opcodes.name(int(fs.opcode[i])),
                   "ts_ns": int(fs.ts[p])}
            at = int(out_index[p])
            if name == "truncate":
                ln = int(out.caplen[at])
                out.caplen[at] = int(self.rng.integers(MIN_CAPLEN, ln))
                rec["caplen"] = int(out.caplen[at])
            elif name == "corrupt":
                frame = fs.data[fs.offset[i]:fs.offset[i] + fs.caplen[i]].copy()
                b = int(self.rng.integers(fs.body_lo[i], fs.body_hi[i]))
                frame[b] ^= np.uint8(self.rng.integers(1, 256))
                rec["byte"] = b
                extra.append((at, frame))
            elif name == "reorder":
                rec["swapped_with_psn"] = int(fs.psn[i + 1])
            elif name == "message_loss":
                rec["frames"] = int(self._lost_run[i])
            self.records.append(rec)
        if extra:  # corrupted copies live after the batch's bytes
            base = fs.data.size
            blobs = [f for _, f in extra]
            out.data = np.concatenate([fs.data] + blobs)
            offs = base + np.cumsum([0] + [b.size for b in blobs[:-1]])
            for (at, _), o in zip(extra, offs):
                out.offset[at] = o
        self.written += len(out)
        return out

    def _whole_messages(self, fs: FrameSet) -> np.ndarray:
        """Frames of the RDMA WRITE messages chosen to be lost whole (a message's frames are
        those of its QP from its FIRST/ONLY to its closing packet; all within one batch, as the
        wire emits them). ``_lost_run`` notes each dropped message's frame count at its first."""
        n = len(fs)
        drop = np.zeros(n, bool)
        self._lost_run = np.zeros(n, np.int64)
        write = fs.rc & opcodes.IS_WRITE[fs.opcode]
        for q in np.unique(fs.dqp[write]).tolist():
            rows = np.flatnonzero(write & (fs.dqp == q))
            op = fs.opcode[rows]
            mid = np.cumsum(opcodes.IS_FIRST[op]) - 1  # message of each row (-1: one begun earlier)
            nmsg = int(mid[-1]) + 1
            if nmsg <= 0:
                continue
            pick = self.rng.random(nmsg) < self.opts.message_loss
            hit = (mid >= 0) & pick[np.maximum(mid, 0)]
            drop[rows[hit]] = True
            for k in np.flatnonzero(pick).tolist():
                r = rows[mid == k]
                self._lost_run[r[0]] = len(r)
        self._first_lost = self._lost_run > 0  # one record per message, at its first frame
        return drop
