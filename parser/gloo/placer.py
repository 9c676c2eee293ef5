"""The gloo placer: data ops -> ``Placement``s of the job's collectives, for the concatenator.

A data op is placed by three facts: the collective its tag belongs to (``TagMap``), its index
among the data ops of its (direction, slot) (``gloo.SlotTracker``) and the algorithm's send list
for that direction (``gloo_schedule``). Its length must equal the send's, and the ops of one
direction are only handed on once the whole send list has arrived with every length agreeing
(a prefix is handed on when the direction breaks off: a framing loss, or the end): a tag mapped
to the wrong collective shows up as a length mismatch and places nothing.

Tags (ProcessGroupGloo's collective counter) are mapped by arithmetic from the nearest mapped tag
below, checked by kind and lengths; a collective outside the job model (a barrier, a user
collective) only shifts the tags after it, and the first model collective whose kind and
lengths fit after the last mapped one is taken then. Without any mapped tag, tag - ``tag_base``
is the only candidate.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from mirrorckpt.config.ddp import ALLGATHER, CollSpec
from mirrorckpt.config.layout import dtype_size
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.gloo import schedule as gs
from mirrorckpt.parser.gloo.framing import GlooOp
from mirrorckpt.parser.placement import Placement, RingStep

SEARCH = 64  # model collectives tried past the last mapped one when a tag does not fit


class GlooSend:
    """The payload of a placement (what the concatenator reads: data, holes, connection, ts, and
    as an NCCL send does, nbytes and place_agreeing)."""

    __slots__ = ("connection", "data", "holes", "ts_ns", "op")

    def __init__(self, op: GlooOp, data, holes, connection: str):
        self.op, self.data, self.holes, self.ts_ns, self.connection = op, data, holes, op.ts_ns, connection

    @property
    def complete(self) -> bool:
        return not self.holes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def place_agreeing(self, dst, covered, start: int, n: int, es: int) -> None:
        return None  # its bytes are in ``data``: the concatenator places those


class TagMap:
    def __init__(self, model: JobModel, tag_base: int = 0):
        self.model = model
        self.base = tag_base
        self.coll: dict[int, int] = {}  # tag -> model collective
        self.extra: set[int] = set()  # tags of collectives outside the model

    def mark_extra(self, tag: int) -> None:
        if tag not in self.coll:
            self.extra.add(tag)

    def candidates(self, tag: int) -> list[int]:
        below = [t for t in self.coll if t < tag]
        if not below:
            c = tag - self.base
            return [c] if c >= 0 else []
        t0 = max(below)
        c0 = self.coll[t0]
        extras = sum(1 for t in self.extra if t0 < t < tag)
        pred = c0 + (tag - t0) - extras
        taken = set(self.coll.values())
        above = [self.coll[t] for t in self.coll if t > tag]
        limit = min(above) if above else c0 + (tag - t0) + SEARCH
        out = [pred] + [c for c in range(c0 + 1, min(pred, limit)) if c != pred]
        return [c for c in out if c not in taken and c < limit and self.model[c] is not None]

    def lookup(self, tag: int, fits) -> int | None:
        """The collective of ``tag``: mapped already, or the first candidate ``fits`` accepts."""
        c = self.coll.get(tag)
        if c is not None:
            return c
        for c in self.candidates(tag):
            if fits(c):
                self.coll[tag] = c
                return c
        return None


class GlooPlacer:
    """Turns data ops into verified ``Placement``s (``parser.pipeline.Placer``: ``add`` feeds a
    batch of ops, ``flush`` releases what is held at the end)."""

    def __init__(self, model: JobModel, ranks: dict[bytes, int], tag_base: int = 0,
                 max_segment: int = gs.MAX_SEGMENT_BYTES):
        self.model = model
        self.ranks = ranks
        self.nranks = model.ring.nranks
        self.max_segment = max_segment
        self.tags = TagMap(model, tag_base)
        self.counts = Counter()
        self.mismatches: list[str] = []
        self.pending: dict[tuple, list[Placement]] = {}  # direction key -> verified, held
        self.broken: set[tuple] = set()  # direction keys that mismatched
        self.epoch: dict[tuple, tuple] = {}  # (source, stream) -> (generation, epoch) last seen
        self.partial: dict[tuple, dict] = defaultdict(dict)  # all-gather elements split in halves
        self._sends: dict[tuple, list[gs.Send]] = {}

    # -- pipeline.Placer ---------------------------------------------------------------------------

    def add(self, ops: list[GlooOp], concat) -> None:
        for p in self.feed(ops):
            concat.add(p)

    def flush(self, concat) -> None:
        for p in self.release():
            concat.add(p)

    # -- ops -------------------------------------------------------------------------------------

    def sends(self, c: CollSpec, sender: int, receiver: int) -> list[gs.Send]:
        key = (c.kind, c.count, c.dtype, c.root, sender, receiver)
        s = self._sends.get(key)
        if s is None:
            s = self._sends[key] = gs.sends(c.kind, c.count * dtype_size(c.dtype), dtype_size(c.dtype),
                                            self.nranks, sender, receiver, c.root, self.max_segment)
        return s

    def feed(self, ops: list[GlooOp]) -> list[Placement]:
        out: list[Placement] = []
        for op in ops:
            sk = (op.source, op.stream)
            ep = (op.generation, op.epoch)
            if self.epoch.get(sk, ep) != ep:  # framing broke: what this stream held is final
                out += self._release(lambda k, sk=sk: k[:2] == sk)
            self.epoch[sk] = ep
            if not op.is_data:
                self.counts["notifications"] += 1
                continue
            out += self._op(op)
        return out

    def release(self) -> list[Placement]:
        """Every placement still held (the end of the traffic)."""
        return self._release(lambda k: True)

    def _release(self, which) -> list[Placement]:
        out = []
        for k in [k for k in self.pending if which(k)]:
            got = self.pending.pop(k)
            self.counts["released_partial"] += len(got)
            out += got
        return out

    def _op(self, op: GlooOp) -> list[Placement]:
        prefix = op.prefix
        kind = gs.KIND_OF_PREFIX.get(prefix)
        if kind is None:
            self.counts[f"not_in_model:{gs.PREFIX_NAMES.get(prefix, prefix)}"] += 1
            self.tags.mark_extra(op.tag)
            return []
        if not op.trusted:
            self.counts["untrusted"] += 1
            return []
        sender, receiver = self.ranks.get(op.stream.src), self.ranks.get(op.stream.dst)
        if sender is None or receiver is None:
            self.counts["unknown_rank"] += 1
            return []
        key = (op.source, op.stream, op.generation, op.slot)
        if key in self.broken:
            self.counts["after_mismatch"] += 1
            return []

        def fits(c: int) -> bool:
            spec = self.model[c]
            if spec.kind != kind:
                return False
            s = self.sends(spec, sender, receiver)
            return op.index < len(s) and s[op.index].length == op.length

        coll = self.tags.lookup(op.tag, fits)
        if coll is None:
            self.counts["no_collective"] += 1
            self._mismatch(key, f"{op.stream} tag {op.tag} ({gs.PREFIX_NAMES[prefix]}) op {op.index} of "
                                f"{op.length} B fits no collective of the job")
            return []
        spec = self.model[coll]
        sends = self.sends(spec, sender, receiver)
        if op.index >= len(sends) or sends[op.index].length != op.length:
            want = sends[op.index].length if op.index < len(sends) else "no op"
            self._mismatch(key, f"{op.stream} tag {op.tag} -> {spec.label} #{coll}: op {op.index} has "
                                f"{op.length} B, the schedule {want}")
            return []
        self.counts["placed"] += 1
        held = self.pending.setdefault(key, [])
        held += self._placements(op, coll, spec, sends[op.index], sender)
        if op.index == len(sends) - 1:  # the direction's whole send list agreed
            return self.pending.pop(key)
        return []

    def _mismatch(self, key, text: str) -> None:
        self.counts["mismatch"] += 1
        self.broken.add(key)
        dropped = self.pending.pop(key, [])
        self.counts["dropped_after_mismatch"] += len(dropped)
        if len(self.mismatches) < 20:
            self.mismatches.append(text)

    def _placements(self, op: GlooOp, coll: int, spec: CollSpec, s: gs.Send, sender: int) -> list[Placement]:
        es = dtype_size(spec.dtype)
        conn = f"{op.stream} (source {op.source})"
        if s.offset % es == 0 and s.length % es == 0:
            step = RingStep(op.index, 0, s.origin, s.offset // es, s.length // es, s.phase, 0, op.index,
                            s.length, s.length + 48)
            return [Placement(coll, spec, step, 0, sender, GlooSend(op, op.data, op.holes, conn), op.index)]
        if spec.kind != ALLGATHER:
            self.counts["unaligned"] += 1
            return []
        return self._halves(op, coll, spec, s, sender, conn, es)

    def _halves(self, op, coll, spec, s: gs.Send, sender, conn, es) -> list[Placement]:
        """All-gather halves may split an element (int64 parameter count: 4 + 4 bytes): whole
        elements are placed at once, a split one when both parts have arrived on this stream."""
        out = []
        first = -(-s.offset // es)
        last = (s.offset + s.length) // es  # exclusive
        if last > first:
            a = (first * es) - s.offset
            n = last - first
            step = RingStep(op.index, 0, s.origin, first, n, s.phase, 0, op.index, n * es, s.length + 48)
            holes = [(h - a, ln) for h, ln in op.holes]
            out.append(Placement(coll, spec, step, 0, sender,
                                 GlooSend(op, op.data[a:a + n * es], holes, conn), op.index))
        parts = self.partial[(op.source, op.stream, op.generation, op.slot, s.origin)]
        for e in {s.offset // es, (s.offset + s.length - 1) // es}:
            lo, hi = max(s.offset, e * es), min(s.offset + s.length, (e + 1) * es)
            if hi <= lo or (lo == e * es and hi == (e + 1) * es):
                continue
            got = parts.setdefault(e, {})
            got[lo - e * es] = (op.data[lo - s.offset:hi - s.offset], any(
                h < hi - s.offset and h + ln > lo - s.offset for h, ln in op.holes))
            if sum(len(v[0]) for v in got.values()) == es:
                data = b"".join(bytes(got[k][0]) for k in sorted(got))
                step = RingStep(op.index, 0, s.origin, e, 1, s.phase, 0, op.index, es, es + 48)
                holes = [(0, es)] if any(v[1] for v in got.values()) else []
                out.append(Placement(coll, spec, step, 0, sender,
                                     GlooSend(op, np.frombuffer(data, np.uint8), holes, conn), op.index))
                del parts[e]
        return out
