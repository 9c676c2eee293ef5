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
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.config import ddp
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec, address_text, dtype_size
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.gloo import schedule as gs
from mirrorckpt.parser.gloo.framing import GlooDecoder, GlooOp
from mirrorckpt.parser.gloo.placer import GlooPlacer
from mirrorckpt.parser.gloo.tcp import StreamKey
from mirrorckpt.parser.pipeline import CollectiveAssembler, Item, JobReport
from mirrorckpt.parser.streams import StreamStats

MASTER_PORT = 29500  # torch.distributed's default MASTER_PORT
ESIZE_DTYPES = {4: "float32", 2: "bfloat16", 8: "float64"}


class GlooStreams:
    """Several capture sources, each decoded on its own, batches taken oldest first."""

    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], tcp_window_bytes: int | None = None,
                 max_in_flight: int = 2, encapsulation: EncapSpec | None = None):
        self.decoders = [GlooDecoder(k, tcp_window_bytes, max_in_flight, encapsulation) for k in range(len(sources))]
        self.stats = [StreamStats(name, mirror=d.mirror) for (name, _), d in zip(sources, self.decoders)]
        self.nstreams = 0  # the gloo placer merges every source's ops: no per-stream frontier
        self.ended: set[int] = set()
        self._iters = [iter(b) for _, b in sources]

    def __iter__(self):
        heap = []
        for k in range(len(self._iters)):
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

    def gloo_hosts(self, master_port: int = MASTER_PORT) -> set[bytes]:
        """Both ends of every connection that opened with gloo's sequence-number preamble and
        framed cleanly since (the full mesh, idle pairs included; not the TCPStore)."""
        return {a for d in self.decoders for k, f in d.framers.items()
                if f.seq_number is not None and f.epoch == 0 and master_port not in (k.sport, k.dport)
                for a in (k.src, k.dst)}


class RankFinder:
    """Ranks from addresses: rank 0 holds the master port, the ring gives the rest."""

    def __init__(self, nranks: int | None, master_port: int = MASTER_PORT,
                 max_segment: int = gs.MAX_SEGMENT_BYTES):
        self.nranks = nranks
        self.master_port = master_port
        self.max_segment = max_segment
        self.edges: set[tuple[bytes, bytes, int]] = set()  # (src, dst, rank of dst - rank of src)
        self.data_hosts: set[bytes] = set()  # addresses that sent or received data ops
        self.allreduce_seen = False
        self.lengths: dict = {}  # (source, stream) -> tag -> [all-reduce data op lengths]
        self.tree: set[tuple[bytes, bytes]] = set()  # broadcast data: parent -> child

    def add(self, ops: list[GlooOp]) -> None:
        for op in ops:
            if not op.is_data:
                continue
            self.data_hosts.update((op.stream.src, op.stream.dst))
            if op.prefix == gs.PREFIX_ALLREDUCE:
                self.edges.add((op.stream.src, op.stream.dst, -1))
                self.allreduce_seen = True
                if op.trusted:
                    seq = self.lengths.setdefault((op.source, op.stream), {}).setdefault(op.tag, [])
                    if op.index == len(seq):
                        seq.append(op.length)
            elif op.prefix == gs.PREFIX_ALLGATHER:
                self.edges.add((op.stream.src, op.stream.dst, +1))
            elif op.prefix == gs.PREFIX_BROADCAST:
                self.tree.add((op.stream.src, op.stream.dst))

    def fit(self, model: JobModel, n: int) -> dict[bytes, int]:
        """Senders whose all-reduce op lengths fit the ring schedule of one rank only (the
        short or empty last segments sit at a rank-dependent place in the send order)."""
        specs = {(c.count, c.dtype) for i in (0, 1) for c in model.grads(i)}
        out = {}
        for (_, stream), tags in self.lengths.items():
            possible = set(range(n))
            for seq in tags.values():
                fits = set()
                for count, dt in specs:
                    es = dtype_size(dt)
                    for r in range(n):
                        want = [x.length for x in gs.allreduce_sends(count * es, es, n, r, self.max_segment)]
                        if want[:len(seq)] == seq:
                            fits.add(r)
                possible &= fits
            if len(possible) == 1:
                out[stream.src] = possible.pop()
        return out

    def ranks(self, streams: GlooStreams, notes: list[str], final: bool = False,
              model: JobModel | None = None) -> dict[bytes, int] | None:
        """Address -> rank when the evidence fixes it: all ``n`` ranks, or (once two all-reduces
        were seen, or at the end) every host that carried data."""
        keys = streams.tcp_keys()
        zero = {k.src for k in keys if k.sport == self.master_port} | \
               {k.dst for k in keys if k.dport == self.master_port}
        hosts = streams.gloo_hosts(self.master_port) | self.data_hosts | zero
        n = self.nranks or (model.ring.nranks if model is not None else None)
        if n is None or len(zero) > 1 or len(hosts) > n:
            return None  # the ring size comes from the configuration or DDP's start-up
        anchors = {a: 0 for a in zero}
        if model is not None:
            for a, r in self.fit(model, n).items():
                if anchors.setdefault(a, r) != r:
                    raise InferenceError(f"{address_text(a)}: the TCPStore says rank {anchors[a]}, the "
                                         f"all-reduce schedule rank {r}")
        # DDP's broadcasts all come from rank 0: a broadcast send is an edge of that tree.
        tree = {(p, c) for p in range(n) for c in gs.broadcast_children(n, 0, p)}
        pairs = [(a, b, tree) for a, b in self.tree]
        sols = solve_ranks(sorted(hosts), self.edges, anchors, n, pairs)
        if not sols:
            raise InferenceError("no rank assignment fits the ring traffic")
        fixed = {a: sols[0][a] for a in hosts if all(s[a] == sols[0][a] for s in sols)}
        enough = len(self.lengths_tags()) >= 2 or final
        if not (len(fixed) == n or (enough and self.data_hosts <= set(fixed))):
            return None
        notes.append("ranks from the wire: " + ", ".join(f"{address_text(a)} = {r}" for a, r in
                                                           sorted(fixed.items(), key=lambda x: x[1])))
        return fixed

    def lengths_tags(self) -> set[int]:
        return {t for tags in self.lengths.values() for t in tags}


def solve_ranks(hosts: list[bytes], edges, anchors: dict[bytes, int], n: int, pairs=(),
                limit: int = 64) -> list[dict[bytes, int]]:
    """Every assignment of distinct ranks 0..n-1 to ``hosts`` that keeps each edge
    (rank(dst) = rank(src) + step mod n), each anchor and each pair constraint (a, b, allowed
    (rank a, rank b) pairs); at most ``limit`` of them."""
    rel: dict[bytes, tuple[bytes, int]] = {}  # host -> (component root, offset from it)

    def find(a):
        r, off = rel.get(a, (a, 0))
        if r == a:
            return a, 0
        root, o2 = find(r)
        rel[a] = (root, (off + o2) % n)
        return root, (off + o2) % n

    for src, dst, step in edges:
        (rs, os_), (rd, od) = find(src), find(dst)
        if rs == rd:
            if (os_ + step - od) % n:
                return []
            continue
        rel[rd] = (rs, (os_ + step - od) % n)  # rank(rd) = rank(rs) + os + step - od
    comps: dict[bytes, list[tuple[bytes, int]]] = {}
    for a in hosts:
        root, off = find(a)
        comps.setdefault(root, []).append((a, off))
    base: dict[bytes, set[int]] = {}
    for root, members in comps.items():
        opts = set(range(n))
        for a, off in members:
            if a in anchors:
                opts &= {(anchors[a] - off) % n}
        base[root] = opts
    roots = sorted(comps, key=lambda r: len(base[r]))
    out: list[dict[bytes, int]] = []

    def walk(k, used, acc):
        if len(out) >= limit:
            return
        if k == len(roots):
            out.append(dict(acc))
            return
        root = roots[k]
        for b in sorted(base[root]):
            vals = [(a, (b + off) % n) for a, off in comps[root]]
            rs = {v for _, v in vals}
            if len(rs) < len(vals) or rs & used:
                continue
            acc.update(vals)
            if any(a in acc and b in acc and (acc[a], acc[b]) not in ok for a, b, ok in pairs):
                for a, _ in vals:
                    del acc[a]
                continue
            walk(k + 1, used | rs, acc)
            for a, _ in vals:
                del acc[a]

    walk(0, set(), {})
    return out


@dataclass
class WireStartup:
    """DDP's start-up collectives read off the wire (trusted, complete data ops), by tag order:
    the parameter count (all-gather), the shapes (broadcast), the initial weights (broadcasts of
    ``ddp.broadcast_groups``; their size gives the element size) and the two rebuild broadcasts."""

    dtype: str | None = None
    notes: list[str] = field(default_factory=list)
    ops: dict = field(default_factory=dict)  # tag -> [op]
    nparams: int | None = None
    nranks: int | None = None  # from the count all-gather: each rank sends 2(P-1) halves
    shapes: list[tuple[int, ...]] | None = None
    esize: int | None = None
    buckets: list[BucketSpec] | None = None

    def add(self, ops: list[GlooOp]) -> None:
        for op in ops:
            if op.is_data and op.trusted and op.complete and op.prefix in (gs.PREFIX_ALLGATHER,
                                                                          gs.PREFIX_BROADCAST):
                self.ops.setdefault(op.tag, []).append(op)

    def _read(self) -> None:
        """Walks the tags in order; stops where the start-up is not (yet) visible."""
        tags = sorted(self.ops)
        bcast = [t for t in tags if self.ops[t][0].prefix == gs.PREFIX_BROADCAST]
        self.nparams = self.nranks = self.shapes = self.esize = self.buckets = None
        t_pc = None
        for t in tags:
            if self.ops[t][0].prefix == gs.PREFIX_ALLGATHER:
                n = self._count(self.ops[t])
                if n is not None:
                    self.nparams, t_pc = n, t
                    sent = max(sum(1 for o in self.ops[t] if (o.source, o.stream) == k)
                               for k in {(o.source, o.stream) for o in self.ops[t]})
                    self.nranks = sent // 2 + 1 if sent % 2 == 0 else None
                    break
        if t_pc is None:
            return
        later = [t for t in bcast if t > t_pc]
        for k, t in enumerate(later):
            op = self.ops[t][0]
            if op.length % 8 == 0:
                try:
                    self.shapes = ddp.parse_shapes(op.data.view("<i8"), self.nparams)
                except ValueError:
                    continue
                later = later[k + 1:]
                break
        if self.shapes is None or not later:
            return
        first = self.ops[later[0]][0].length
        for es in ([dtype_size(self.dtype)] if self.dtype else [4, 2, 8]):
            groups = ddp.broadcast_groups(self._layout(self.dtype or ESIZE_DTYPES[es]))
            if first == sum(self.shapes_numel[i] for i in groups[0]) * es:
                self.esize = es
                later = later[len(groups):]
                break
        if self.esize is None or len(later) < 2:
            return
        a, b = self.ops[later[0]][0], self.ops[later[1]][0]
        if a.length != 4 * (self.nparams + 1):
            return
        try:
            self.buckets = ddp.parse_rebuild(a.data.view("<i4"), b.data.view("<i4"), self.nparams)
        except ValueError as e:
            note = f"rebuild broadcasts unreadable: {e}"
            if note not in self.notes:
                self.notes.append(note)

    @staticmethod
    def _count(ops: list[GlooOp]) -> int | None:
        """A rank's own int64 parameter count: its first two all-gather sends (two halves)."""
        by = {}
        for op in ops:
            by.setdefault((op.source, op.stream), {})[op.index] = op
        for h in by.values():
            if 0 in h and 1 in h and h[0].length + h[1].length == 8:
                n = int(np.frombuffer(bytes(h[0].data) + bytes(h[1].data), "<i8")[0])
                if 1 <= n <= 1 << 20:
                    return n
        return None

    @property
    def shapes_numel(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]

    def _layout(self, dtype: str, buckets=None) -> JobLayout:
        params = [ParamSpec(f"param{i}", tuple(s), "float32") for i, s in enumerate(self.shapes)]
        one = [BucketSpec(tuple(range(len(params))))]
        return JobLayout(params, list(buckets or one), list(one), dtype)

    def layout(self, final: bool = False) -> JobLayout | None:
        self._read()
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
    module doc). Yields the same typed items as ``pipeline.JobStream``, and the same report."""

    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], model: JobModel | None = None,
                 ranks: dict[bytes, int] | None = None, nranks: int | None = None,
                 master_port: int = MASTER_PORT, dtype: str | None = None, tag_base: int = 0,
                 collective_window: int | None = None, tcp_window_bytes: int | None = None,
                 max_in_flight: int = 2, max_held_ops: int = 500_000, max_segment: int = gs.MAX_SEGMENT_BYTES,
                 encapsulation: EncapSpec | None = None):
        self.streams = GlooStreams(sources, tcp_window_bytes, max_in_flight, encapsulation)
        self.model, self.ranks = model, ranks
        self.nranks = nranks or (model.ring.nranks if model is not None else None)
        self.finder = RankFinder(self.nranks, master_port, max_segment)
        self.startup = WireStartup(dtype)
        self.tag_base, self.collective_window, self.max_held = tag_base, collective_window, max_held_ops
        self.max_segment = max_segment  # gloo AllreduceOptions::setMaxSegmentSize (torch never sets it)
        self.notes: list[str] = []
        self.placer: GlooPlacer | None = None
        self.assembler: CollectiveAssembler | None = None

    def __iter__(self) -> Iterator[Item]:
        held: list[GlooOp] = []
        for ops in self.streams:
            if self.assembler is None:
                held += ops
                self._setup(ops, final=False)
                if self.assembler is None:
                    if len(held) > self.max_held:
                        raise InferenceError(f"{len(held)} ops seen and the job is still unknown: "
                                             + "; ".join(self._missing()))
                    continue
                ops, held = held, []
            yield from self.assembler.items(self.assembler.add(ops))
        if self.assembler is None:
            self._setup([], final=True)
            yield from self.assembler.items(self.assembler.add(held))
        yield from self.assembler.items(self.assembler.flush())

    def report(self) -> JobReport:
        placement, mismatches = self.assembler.report() if self.assembler is not None else (Counter(), [])
        return JobReport(list(self.notes), placement, mismatches, list(self.streams.stats))

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
            layout = self.startup.layout(final)
            n = self.nranks or self.startup.nranks
            if layout is not None and n is not None:
                self.model = JobModel.ddp(RingSpec(nranks=n), layout)
                self.notes += self.startup.notes
                self.notes.append(f"DDP job from the wire: {len(layout.params)} parameters, "
                                  f"{len(layout.buckets)} buckets after the rebuild, {layout.grad_dtype}")
        if self.ranks is None:
            self.ranks = self.finder.ranks(self.streams, self.notes, final, self.model)
        if self.ranks is None or self.model is None:
            if final:
                raise InferenceError("cannot place the gloo traffic: missing " + "; ".join(self._missing()))
            return
        if self.ranks and max(self.ranks.values()) >= self.model.ring.nranks:
            raise InferenceError(f"rank {max(self.ranks.values())} on the wire, the job has "
                                 f"{self.model.ring.nranks} ranks")
        self.placer = GlooPlacer(self.model, self.ranks, self.tag_base, self.max_segment)
        self.assembler = CollectiveAssembler(self.model, self.placer, self.collective_window)


def open_job_stream(captures: list[str], job=None, dtype: str | None = None,
                    master_port: int = MASTER_PORT, tag_base: int = 0) -> GlooJobStream:
    """A GlooJobStream over capture files, configured from a ``config.jobfile.JobConfig`` when
    given (its ring addresses, when present, fix the ranks); the hook ``mirrorckpt replay
    --transport gloo`` uses."""
    from mirrorckpt.capture.pcapfile import open_capture

    kw = {}
    if job is not None:
        kw = dict(model=JobModel.from_job(job), ranks=job.ring.ranks_by_address() or None, encapsulation=job.encap)
    return GlooJobStream([(c, open_capture(c)) for c in captures], dtype=dtype, master_port=master_port,
                         tag_base=tag_base, **kw)
