"""PyTorch DDP over gloo/TCP end to end: capture sources -> ops -> placements -> iterations.

``GlooJobStream`` is the gloo counterpart of ``pipeline.JobStream`` and shares everything after
the placer (``pipeline.Reassembly``: concatenator, start-up results, iteration assembly). What
the configuration does not give is read off the wire before anything is placed (the ops are
held until then):

* ranks: rank 0 is the address holding the TCPStore (the master port); the others follow the
  ring, since an all-reduce sends only from rank r to r-1 (all-gather: r to r+1);
* the layout: DDP's start-up (``config.ddp``): the all-gathered parameter count, the shapes
  broadcast, the initial-weight broadcast (its size gives the element size) and the two rebuild
  broadcasts (the bucket layout).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.config import ddp
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec, dtype_size
from mirrorckpt.parser import gloo_schedule as gs
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.gloo import GlooDecoder, GlooOp
from mirrorckpt.parser.gloo_state import GlooPlacer
from mirrorckpt.parser.infer import InferenceError
from mirrorckpt.parser.pipeline import Reassembly
from mirrorckpt.parser.tcp import StreamKey, addr_text

MASTER_PORT = 29500  # torch.distributed's default MASTER_PORT
ESIZE_DTYPES = {4: "float32", 2: "bfloat16", 8: "float64"}


@dataclass
class SourceStats:
    source: str
    frames: int = 0
    bytes: int = 0
    damage: str | None = None


class GlooStreams:
    """Several capture sources, each decoded on its own, batches taken oldest first."""

    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], tcp_window: int | None = None,
                 max_in_flight: int = 2):
        self.decoders = [GlooDecoder(k, tcp_window, max_in_flight) for k in range(len(sources))]
        self.stats = [SourceStats(name) for name, _ in sources]
        self._iters = [iter(b) for _, b in sources]

    def __iter__(self):
        heap = []
        for k, it in enumerate(self._iters):
            self._push(heap, k)
        while heap:
            _, k, b = heapq.heappop(heap)
            self.stats[k].frames += len(b)
            self.stats[k].bytes += b.nbytes
            ops = self.decoders[k].feed(b)
            if ops:
                yield ops
            self._push(heap, k)
        for d in self.decoders:
            ops = d.flush()
            if ops:
                yield ops

    def _push(self, heap, k: int) -> None:
        try:
            b = next(self._iters[k])
        except StopIteration:
            return
        except CaptureError as e:  # damaged part-way: keep what came before, say so
            self.stats[k].damage = str(e)
            return
        heapq.heappush(heap, (int(b.ts_ns[0]) if len(b) else 0, k, b))

    def tcp_keys(self) -> set[StreamKey]:
        return {k for d in self.decoders for k in d.tcp.streams}


class RankFinder:
    """Ranks from addresses: rank 0 holds the master port, the ring gives the rest."""

    def __init__(self, nranks: int | None, master_port: int = MASTER_PORT):
        self.nranks = nranks
        self.master_port = master_port
        self.edges: set[tuple[bytes, bytes, int]] = set()  # (src, dst, rank step of dst)
        self.hosts: set[bytes] = set()  # addresses with gloo ops

    def add(self, ops: list[GlooOp]) -> None:
        for op in ops:
            self.hosts.update((op.stream.src, op.stream.dst))
            if op.is_data and op.prefix == gs.PREFIX_ALLREDUCE:
                self.edges.add((op.stream.src, op.stream.dst, -1))
            elif op.is_data and op.prefix == gs.PREFIX_ALLGATHER:
                self.edges.add((op.stream.src, op.stream.dst, +1))

    def ranks(self, keys: set[StreamKey], notes: list[str]) -> dict[bytes, int] | None:
        zero = {k.src for k in keys if k.sport == self.master_port} | \
               {k.dst for k in keys if k.dport == self.master_port}
        if len(zero) != 1:
            return None
        n = self.nranks or len(self.hosts)
        if n < 2:
            return None
        ranks = {zero.pop(): 0}
        grew = True
        while grew:
            grew = False
            for src, dst, step in self.edges:
                if src in ranks and dst not in ranks:
                    ranks[dst] = (ranks[src] + step) % n
                    grew = True
                elif dst in ranks and src not in ranks:
                    ranks[src] = (ranks[dst] - step) % n
                    grew = True
                elif src in ranks and dst in ranks and ranks[dst] != (ranks[src] + step) % n:
                    raise InferenceError(f"the ring is inconsistent: {addr_text(src)} (rank {ranks[src]}) "
                                         f"sends ring traffic to {addr_text(dst)} (rank {ranks[dst]})")
        if len(ranks) < n or len(set(ranks.values())) != len(ranks):
            return None
        notes.append("ranks from the wire: " + ", ".join(f"{addr_text(a)} = {r}" for a, r in
                                                           sorted(ranks.items(), key=lambda x: x[1])))
        return ranks


@dataclass
class WireStartup:
    """DDP's start-up collectives read off the wire, in tag order (only trusted data ops)."""

    dtype: str | None = None
    nparams: int | None = None
    shapes: list[tuple[int, ...]] | None = None
    esize: int | None = None
    buckets: list[BucketSpec] | None = None
    notes: list[str] = field(default_factory=list)
    _halves: dict = field(default_factory=dict)
    _tags: list[int] = field(default_factory=list)  # tags of: count, shapes, init..., rebuild idx
    _rebuild_idx: np.ndarray | None = None
    _groups: int = 1  # initial-weight broadcasts (250 MiB groups)

    def add(self, ops: list[GlooOp]) -> None:
        for op in ops:
            if op.is_data and op.trusted and op.complete and self.buckets is None:
                self._op(op)

    def _op(self, op: GlooOp) -> None:
        last = self._tags[-1] if self._tags else -1
        if self.nparams is None:
            if op.prefix == gs.PREFIX_ALLGATHER and op.index in (0, 1):
                key = (op.source, op.stream, op.slot)
                h = self._halves.setdefault(key, {})
                h[op.index] = bytes(op.data)
                if len(h) == 2 and len(h[0]) + len(h[1]) == 8:  # rank's own int64, in two halves
                    n = int(np.frombuffer(h[0] + h[1], "<i8")[0])
                    if 1 <= n <= 1 << 20:
                        self.nparams = n
                        self._tags.append(op.tag)
            return
        if op.prefix != gs.PREFIX_BROADCAST or op.tag <= last:
            return
        if self.shapes is None:
            if op.length % 8 == 0:
                try:
                    self.shapes = ddp.parse_shapes(op.data.view("<i8"), self.nparams)
                    self._tags.append(op.tag)
                except ValueError:
                    pass
            return
        numel = sum(int(np.prod(s)) for s in self.shapes)
        if self.esize is None:
            for es in ([dtype_size(self.dtype)] if self.dtype else [4, 2, 8]):
                lay = self._layout(ESIZE_DTYPES[es] if not self.dtype else self.dtype)
                first = ddp.broadcast_groups(lay)[0]
                if op.length == sum(lay.params[i].numel for i in first) * es:
                    self.esize = es
                    self._groups = len(ddp.broadcast_groups(lay))
                    self._tags.append(op.tag)
                    break
            return
        if len(self._tags) < 2 + self._groups:
            self._tags.append(op.tag)  # a further initial-weight group
            return
        if self._rebuild_idx is None:
            if op.length == 4 * (self.nparams + 1):
                self._rebuild_idx = op.data.view("<i4").copy()
                self._tags.append(op.tag)
            return
        try:
            self.buckets = ddp.parse_rebuild(self._rebuild_idx, op.data.view("<i4"), self.nparams)
        except ValueError as e:
            self.notes.append(f"rebuild broadcasts unreadable: {e}")
            self._rebuild_idx = None

    def _layout(self, dtype: str, buckets=None) -> JobLayout:
        params = [ParamSpec(f"param{i}", tuple(s), "float32") for i, s in enumerate(self.shapes)]
        one = [BucketSpec(tuple(range(len(params))))]
        return JobLayout(params, list(buckets or one), list(one), dtype)

    def layout(self, final: bool = False) -> JobLayout | None:
        if self.esize is None:
            return None
        dtype = self.dtype or ESIZE_DTYPES[self.esize]
        if self.buckets is None:
            if not final:
                return None
            self.notes.append("rebuild broadcasts not seen: the first iteration's single bucket is kept")
        if not self.dtype and self.esize == 2:
            self.notes.append("gradient dtype taken as bfloat16 (2-byte elements); give the dtype to be sure")
        return self._layout(dtype, self.buckets)


class GlooJobStream:
    """Mirror captures of a gloo DDP job to collectives and iterations.

    ``model``/``ranks`` come from the configuration or, when absent, from the wire (see the
    module doc). Yields ``(collectives finished, iterations finished)`` like ``JobStream``."""

    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], model: JobModel | None = None,
                 ranks: dict[bytes, int] | None = None, nranks: int | None = None,
                 master_port: int = MASTER_PORT, dtype: str | None = None, tag_base: int = 0,
                 window: int | None = None, tcp_window: int | None = None, max_in_flight: int = 2,
                 max_held_ops: int = 500_000):
        self.streams = GlooStreams(sources, tcp_window, max_in_flight)
        self.model, self.ranks = model, ranks
        self.nranks = nranks or (model.ring.nranks if model is not None else None)
        self.finder = RankFinder(self.nranks, master_port)
        self.startup = WireStartup(dtype)
        self.tag_base, self.window, self.max_held = tag_base, window, max_held_ops
        self.notes: list[str] = []
        self.placer: GlooPlacer | None = None
        self.reassembly: Reassembly | None = None

    def __iter__(self):
        held: list[GlooOp] = []
        for ops in self.streams:
            if self.reassembly is None:
                held += ops
                self._setup(ops, final=False)
                if self.reassembly is None:
                    if len(held) > self.max_held:
                        raise InferenceError(f"{len(held)} ops seen and the job is still unknown: "
                                             + "; ".join(self._missing()))
                    continue
                ops, held = held, []
            yield self.reassembly.add(self.placer.feed(ops))
        if self.reassembly is None:
            self._setup([], final=True)
            yield self.reassembly.add(self.placer.feed(held))
        yield self.reassembly.add(self.placer.flush())
        yield self.reassembly.flush()

    def _missing(self) -> list[str]:
        out = []
        if self.ranks is None:
            out.append("the ranks (give the ring addresses, or capture the TCPStore connection and "
                       "all-reduce traffic)")
        if self.model is None:
            out.append("the layout (give it, or capture DDP's start-up from rank 0)")
        return out

    def _setup(self, ops: list[GlooOp], final: bool) -> None:
        self.finder.add(ops)
        if self.model is None:
            self.startup.add(ops)
        if self.ranks is None:
            self.ranks = self.finder.ranks(self.streams.tcp_keys(), self.notes)
        if self.model is None:
            layout = self.startup.layout(final)
            if layout is not None:
                n = self.nranks or (len(self.ranks) if self.ranks else len(self.finder.hosts))
                ring = RingSpec(nranks=n)
                self.model = JobModel.ddp(ring, layout)
                self.notes += self.startup.notes
                self.notes.append(f"DDP job from the wire: {len(layout.params)} parameters, "
                                  f"{len(layout.buckets)} buckets after the rebuild, {layout.grad_dtype}")
        if self.ranks is None or self.model is None:
            if final:
                raise InferenceError("cannot place the gloo traffic: missing " + "; ".join(self._missing()))
            return
        if self.model.ring.nranks != len(self.ranks):
            raise InferenceError(f"{len(self.ranks)} ranks on the wire, the job has {self.model.ring.nranks}")
        self.placer = GlooPlacer(self.model, self.ranks, self.tag_base)
        self.reassembly = Reassembly(self.model, self.ranks, {}, self.window, placer=self.placer)


def run_replay(captures: list[str], job=None, dtype: str | None = None, master_port: int = MASTER_PORT,
               tag_base: int = 0):
    """``mirrorckpt replay`` for gloo captures: (GlooJobStream, results, iterations), the same
    shape as ``tools.cmd_replay.run_parser`` returns."""
    from mirrorckpt.capture.pcapfile import open_capture

    kw = {}
    if job is not None:
        kw = dict(model=job.model(), ranks=job.ranks() or None)
    js = GlooJobStream([(c, open_capture(c)) for c in captures], dtype=dtype, master_port=master_port,
                       tag_base=tag_base, **kw)
    results, iterations = [], []
    for done, its in js:
        results += done
        iterations += its
    return js, results, iterations
