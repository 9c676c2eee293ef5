"""Several mirror streams of one job, from capture files, decoded side by side and merged in time
order: the file form of the send-stream contract (``parser.streams.SendStream``).

A send stream is what the job stream reads (``SendStream``): lists of decoded units (NCCL sends;
gloo ops for the gloo transport) in roughly wire order, and ``WIRE_IDLE`` when a live stream went
quiet, so that what is already complete is handed on. ``MirrorStreams`` (files), the gloo
``GlooStreams`` and the daemon's ``QueueStreams`` implement it.

Each capture source keeps its own packet path (PSN spaces are per QP and a QP may appear in two
sources: both directions of a port, or one rank's egress that is the next rank's ingress); the
sends meet only in the concatenator, where duplicate copies must agree. Batches are taken from
the source whose next frame is oldest, so the concatenator sees the job in (roughly) wire order.

"Roughly" is deliberate: a stream is fed up to ``merge_ns`` past the other streams' next frame.
With a NIC's nanosecond clock two streams interleave frame by frame, and a strict merge would call
the packet path for a frame or two at a time (its cost is per call: ~30x slower end to end). The
concatenator keeps a frontier per stream, so milliseconds of skew between streams change no
verdict (the loss sweep checks its verdicts against a strict merge); they only delay when a
collective is final. 4 ms (50 MB of a 100 Gbit/s stream; a batch is at most 16 MB) costs
about 12 % less time on LL than 1 ms did: the packet path's Python is per call.

With ``ahead`` > 0 the reading and decoding (frame walk, ICRC, PSN reassembly, NCCL sends) run on
a thread of their own, at most ``ahead`` lists of sends before the caller: their compiled kernels
let go of the GIL, so they overlap the placement that follows (a Simple replay's packet path was
two thirds of its time). The caller sees the same lists in the same order, and ``ended`` as it was
when the list it just got was made, never later (a stream counted ended early would let the
concatenator finalize collectives before that stream's last sends).

That thread stayed the slower side, so where every source's batches stay valid after the next
(capture files: views of their mapping) a Simple send's payload, or an LL send's words as the
decode read them, is copied from its batch when the caller reads it (``nccl.LazySend``,
``MessageRun.pending``, ``MessageRun.ll_pending``): the concatenator reads the final values only,
so the reduce-scatter half of a ring all-reduce is never copied, and what is copied is copied on
the caller's thread. An LL128 send is read from its batch on the packet path (its flags checked
and its data taken out in one pass), never copied whole first. The caller then gives the
capture's pages back, up to the parts of the list it takes (``CaptureReader.release_before``)
and not past packets held from an earlier part that the list's sends read where they lie
(``PacketPath.holds_from``): the walk's own release would run ahead of the copies, and a page
read after it stays mapped. A live source's batches are ring slots, given back after the next:
there the copy stays on the packet path.

Those sources are also walked and decoded (frame walk, header decode, ICRC and, while each
payload is in cache, its LL reading: compiled, without the GIL) on a thread per source,
``DECODE_AHEAD`` batches before the packet path (``_Ahead``), so that what stays on the packet
path's thread is the reassembly and the NCCL decoding, and the walk's and the ICRC's time runs
beside the caller's placement on the other core.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser import roce
from mirrorckpt.parser.roce.nccl import NcclSend
from mirrorckpt.parser.roce.packet_path import PacketPath
from mirrorckpt.parser.streams import WIRE_IDLE, StreamStats, WireIdle  # noqa: F401

# Batches a source is walked and decoded ahead of its packet path (each up to BATCH_BYTES of capture).
DECODE_AHEAD = 1


class MirrorStreams:
    def __init__(self, sources: list[tuple[str, Iterable[FrameBatch]]], icrc: bool = True,
                 nccl_version: str | None = None, protocol: str | None = None, merge_ns: int = 4_000_000,
                 ahead: int = 0, encapsulation: EncapSpec | None = None, blocks: bool = False):
        """``blocks``: lists may hold ``SendBlock``s (a reader that places with ``RingPlacer``: the
        job stream); else sends only."""
        self.paths = [PacketPath(icrc=icrc, nccl_version=nccl_version, protocol=protocol, stream=k, messages=False,
                                 encapsulation=encapsulation, blocks=blocks)
                      for k in range(len(sources))]
        self.ended: set[int] = set()  # streams with nothing more to come
        self.nstreams = len(sources)
        self.merge_ns = merge_ns
        self.stats = [StreamStats(name, mirror=p.counters.mirror) for (name, _), p in zip(sources, self.paths)]
        self._iters = [iter(b) for _, b in sources]
        self.ahead = ahead
        # per stream, the last part fed since the last list, and the first byte its sends may read
        # before it (PacketPath.holds_from)
        self._fed: dict[int, tuple[FrameBatch, int | None]] = {}
        self._decoded: list[_Ahead] = []  # per stream, its batches decoded ahead (see _read_ahead)

    def __iter__(self) -> Iterator[list[NcclSend]]:
        if self.ahead <= 0:
            return self._merge(self.ended)
        return self._read_ahead()

    def _read_ahead(self) -> Iterator[list[NcclSend]]:
        """``_merge`` on a thread, ``ahead`` lists in front of the caller (see the module doc)."""
        stop = threading.Event()
        # Simple sends stay in their batch until the caller reads them (LazySend), on its thread,
        # where placement leaves room (the packet path's thread is the slower side): only when
        # every source's batches stay valid after the next (a capture file's mapping). Their pages
        # are then given back here, up to the parts of the list taken (release_before), not by the walk.
        defer = all(getattr(it, "stable_batches", False) and hasattr(it, "release_before") for it in self._iters)
        if defer:
            for p, it in zip(self.paths, self._iters):
                p.defer_copies()
                it.consumer_releases = True
                it.consumer_prefetches = p.icrc  # the decode's ICRC prefetches each frame
            self._decoded = [_Ahead(_decoded(it, p), DECODE_AHEAD, stop, "mirror-decode")
                             for it, p in zip(self._iters, self.paths)]
        ended: set[int] = set()

        def lists():
            for sends in self._merge(ended):
                fed, self._fed = self._fed, {}
                yield sends, fed, frozenset(ended)

        # ``ahead`` lists wait for the caller while the thread makes the next one
        reader = _Ahead(lists(), self.ahead + 1, stop, "mirror-read")
        try:
            while True:
                try:
                    sends, fed, now = reader.next()
                except StopIteration:
                    self.ended = set(ended)  # the thread is done with it
                    return
                self.ended = set(now)
                if defer:  # the lists before this one are done with, and their batches' pages
                    for k, (part, keep) in fed.items():
                        self._iters[k].release_before(part, keep)
                yield sends
        finally:
            stop.set()  # the caller stopped early (an error, a closed generator): let the threads end
            for t in [reader, *self._decoded]:
                t.join()
            self._decoded = []

    def _merge(self, ended: set[int]) -> Iterator[list[NcclSend]]:
        """Frames of all streams in timestamp order: the stream with the oldest next frame is fed
        up to ``merge_ns`` past the next frame of any other stream (batches are cut there, not copied)."""
        # per stream, its next batch and that batch's packets (None: decoded when fed)
        heads: dict[int, tuple[FrameBatch, roce.RocePackets | None]] = {}
        for k in range(len(self._iters)):
            b = self._next(k)
            if b is not None:
                heads[k] = b
        while heads:
            k = min(heads, key=lambda j: (int(heads[j][0].ts_ns[0]) if len(heads[j][0]) else -1, j))
            b, pk = heads.pop(k)
            others = [int(h.ts_ns[0]) for h, _ in heads.values() if len(h)]
            cut = len(b)
            if others and len(b):
                # frames up to (and including) the other streams' next timestamp + merge_ns go now
                cut = max(1, int(np.searchsorted(b.ts_ns, min(others) + self.merge_ns, side="right")))
            (part, pk), rest = ((b, pk), None) if cut >= len(b) else _split_decoded(b, pk, cut)
            st = self.stats[k]
            st.frames += len(part)
            st.bytes += part.nbytes
            _, sends = self.paths[k].feed(part, pk)
            keep, was = self.paths[k].holds_from, self._fed.get(k)
            if was is not None and was[1] is not None:  # fed twice before a list: the earlier holds too
                keep = was[1] if keep is None else min(keep, was[1])
            self._fed[k] = (part, keep)
            if sends:
                yield sends
            nb = rest if rest is not None else self._next(k)
            if nb is not None:
                heads[k] = nb
            else:
                # Everything this stream still holds (messages waiting behind a hole) goes out
                # before the stream counts as ended: only then may others finalize without it.
                _, sends = self.paths[k].flush()
                if sends:
                    yield sends
                ended.add(k)

    def _next(self, k: int) -> tuple[FrameBatch, roce.RocePackets | None] | None:
        try:
            if self._decoded:
                return self._decoded[k].next()
            return next(self._iters[k]), None
        except StopIteration:
            return None
        except CaptureError as e:  # damaged part-way: keep what came before, say so
            self.stats[k].damage = str(e)
            return None

    @property
    def counters(self) -> roce.Counters:
        c = roce.Counters()
        for p in self.paths:
            c.add(p.counters)
        return c

    @property
    def decoders(self):
        return [p.nccl for p in self.paths]


def _split(b: FrameBatch, cut: int) -> tuple[FrameBatch, FrameBatch]:
    """The first ``cut`` frames and the rest, sharing the batch's buffer."""
    return b.select(slice(0, cut)), b.select(slice(cut, None), b.first_index + cut)


def _split_decoded(b: FrameBatch, pk: roce.RocePackets | None, cut: int):
    """``_split``, each part with its packets (None: not decoded yet)."""
    first, rest = _split(b, cut)
    if pk is None:
        return (first, None), (rest, None)
    j = int(np.searchsorted(pk.frame, cut))  # rows are in frame order
    later = pk.take(slice(j, None))
    later.frame = later.frame - cut
    return (first, pk.take(slice(0, j))), (rest, later)


def _decoded(batches, path: PacketPath) -> Iterator[tuple[FrameBatch, roce.RocePackets]]:
    for b in batches:
        yield b, path.decode(b)


class _Ahead:
    """The items of ``source`` (an iterator) made on a thread of its own, at most ``depth`` made
    before the caller takes them (the next is made only once one is taken: a capture batch walked
    early keeps its pages mapped, a list of sends made early its buffers). ``next`` raises what
    ``source`` raised, in its place, and StopIteration at its end."""

    _END = object()

    def __init__(self, source, depth: int, stop: threading.Event, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(depth)
        self._stop = stop
        self._t = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
        self._t.start()

    def _run(self, source) -> None:
        try:
            while True:
                while not self._room.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                item = next(source, self._END)
                self._q.put(item)
                if item is self._END:
                    return
        except BaseException as e:  # noqa: BLE001 - raised again where the item was asked for
            self._q.put(_Raised(e))

    def next(self):
        item = self._q.get()
        if item is self._END or isinstance(item, _Raised):
            self._q.put(self._END)  # asked again after the end: the end again
            if item is self._END:
                raise StopIteration
            raise item.error
        self._room.release()
        return item

    def join(self) -> None:
        self._t.join()


class _Raised:
    """What the source of an ``_Ahead`` raised (an item may itself be an exception)."""

    def __init__(self, error: BaseException):
        self.error = error
