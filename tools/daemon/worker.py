"""One capture process per mirror port (or per worker of a split port).

    [capture thread] -> drop-if-full queue -> ([compact thread]) -> [decode thread] -> out

The capture thread reads the source; a batch that does not fit ``local_bytes`` of captured bytes
waiting is dropped and counted (the capture edge). The decode thread runs the packet path (frame
walk, ICRC, reassembly, NCCL sends) and puts typed messages on ``out``: ``Sends``, ``Note``,
``Fatal``, ``Seen`` and, last, ``Ended``. Counters go through shared memory instead (``COUNTERS``):
they must not wait behind the sends in the bounded queue, or the drop counters would freeze exactly
while the pipeline backs up.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

from mirrorckpt.config.layout import live_source
from mirrorckpt.parser import memory

# Frames per DPDK batch at most: half of DpdkPort's default pool (8191 mbufs); the driver and
# the per-lcore cache hold the rest.
DPDK_MAX_BATCH = 4096
# A file-fed worker's frames interleave with its siblings' in the file's pages: walking every other
# ~1 KB frame costs the decode what walking them all does (the prefetchers pull the skipped lines in).
# A third thread copies the worker's frames into compact pieces of about COMPACT_BYTES first, at most
# COMPACT_AHEAD pieces ahead of the decode (the memory this costs stays small).
COMPACT_BYTES = 16 << 20
COMPACT_AHEAD = 2
FANOUT_WAIT_S = 60.0  # for the other workers of a port to join its AF_PACKET fanout group
SEEN_EVERY_S = 5.0  # how often a worker says what its frames are (a port without RoCE names what it sees)

# The worker's counters, in the shared int64 array the main process reads. "capturing": 1 once the
# source is open (and a port's fanout group whole): frames sent before then are not seen. "roce":
# RoCEv2 packets decoded. "cpu_*_ns": CPU time of the capture thread (with the compact thread, when
# there is one) and of the decode thread so far: which of its stages limits the port. "mirror_*":
# frames the mirror lost on its way (GRE sequence gaps) and frames the switch cut
# (parser.encap.MirrorHealth).
COUNTERS = ("frames", "bytes", "dropped_capture", "dropped_kernel", "icrc", "capturing", "cpu_capture_ns",
            "cpu_decode_ns", "roce", "mirror_lost", "mirror_truncated")


@dataclass
class WorkerSpec:
    port: int
    source: str
    batch_frames: int = 65536
    local_bytes: int = 256 << 20  # captured bytes held between capture and decode before dropping
    icrc: bool = True
    nccl_version: str | None = None  # None: the decoder reads the release's wire facts from the traffic
    pace: str | float | None = None  # file replay: None (as fast as possible), "recorded", Gbit/s
    # a capture file's share: the worker of each UDP source port (parser.split's plan, made once by
    # the daemon so every worker of the port holds the same); None: port mod N, as a live port's kernel
    lut: object = None
    share: tuple[int, int] = (0, 1)  # worker k of N on this port: the frames of its QP pairs (capture.fanout)
    encap: object = None  # config.encap.EncapSpec: the mirror encapsulations taken off (None: any)


# -- what a worker tells the main process ----------------------------------------------------

@dataclass(frozen=True)
class Sends:
    """Decoded sends, with what the decoder has seen of the NCCL release (the parser decides it);
    ``span``: where their bytes lie in the worker's send ring (None: pickled with them)."""
    port: int
    sends: list
    cts: str | None
    imm_order: str | None
    span: object = None


@dataclass(frozen=True)
class Note:
    """Something the operator must hear of (logged as a warning)."""
    port: int
    text: str


@dataclass(frozen=True)
class Fatal:
    """The port's traffic contradicts the configuration: the daemon stops."""
    port: int
    text: str


@dataclass(frozen=True)
class Seen:
    """What the port's frames were so far, by class, most common first (``parser.roce.Counters``)."""
    port: int
    classes: dict


@dataclass(frozen=True)
class MirrorLoss:
    """Frames each remote mirror session lost so far (its GRE sequence numbers' gaps)."""
    port: int
    sessions: dict


@dataclass(frozen=True)
class Ended:
    """The source ended; ``damage`` says why when it failed."""
    port: int
    damage: str | None


def split_connection(decoder) -> str | None:
    """What to tell the operator when a connection seems to cut its messages over several QPs
    (NCCL_IB_QPS_PER_CONNECTION > 1): a port's workers are split by QP pair, so each message's
    pieces land in different workers and come out incomplete (never wrong). A message that lost a
    whole piece looks the same, hence a warning, not a stop. A connection whose QPs are all in the
    worker proves them with its first message's pieces (``nq``); one missing some never does."""
    cut = decoder.cut_connections()
    if not cut:
        return None
    return (f"connection {cut[0]} cuts messages over several QPs (NCCL_IB_QPS_PER_CONNECTION > 1, or a "
            "lost piece): [[mirror]] workers > 1 splits a port by QP pair, so the pieces of such messages "
            "land in different workers and no iteration they carry can be reassembled; use workers = 1 for "
            "this port if it persists (`mirrorckpt doctor` shows the QPs per connection)")


def worker_main(spec: WorkerSpec, out, stop, shared=None, ring=None) -> None:
    """A capture process's entry point (see ``CaptureWorker``)."""
    CaptureWorker(spec, out, stop, shared, ring).run()


class CaptureWorker:
    """Sends go to the main process through ``out`` (their bytes through ``ring``, a
    sendring.SendRing, when given), counters through ``shared`` (an int64 array laid out as COUNTERS)."""

    def __init__(self, spec: WorkerSpec, out, stop, shared=None, ring=None):
        from mirrorckpt.parser.roce.packet_path import PacketPath

        self.spec, self.out, self.stop, self.shared, self.ring = spec, out, stop, shared, ring
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.local: queue.Queue = queue.Queue()
        self.held = 0  # bytes waiting in `local`; the capture edge drops beyond spec.local_bytes
        self.lock = threading.Lock()
        self.parent = os.getppid()  # a daemon killed outright (SIGKILL) must not leave its workers capturing
        self.path = PacketPath(icrc=spec.icrc, nccl_version=spec.nccl_version, stream=spec.port, messages=False,
                               encapsulation=spec.encap)
        if ring is not None:
            # Every batch the decode thread gets stays valid (a file's mapping, or a live batch's own
            # copy): a Simple send's bytes, or an LL send's words as the decode read them, go from the
            # batch straight into the ring (SendRing.pack), not through its run's buffer first.
            self.path.defer_copies()
        k, n = spec.share
        # a capture file's port split over workers: every worker reads the file and keeps its QP
        # pairs' frames, which reach its decode through `compact`
        self.file_split = n > 1 and not live_source(spec.source)
        self.ready: queue.Queue = queue.Queue(COMPACT_AHEAD) if self.file_split else self.local
        self.cpu_compact_ns = 0
        self.threads = [threading.Thread(target=self._decode, name="decode", daemon=True)]
        if self.file_split:
            self.threads.append(threading.Thread(target=self._compact, name="compact", daemon=True))

    def publish(self) -> None:
        if self.shared is not None:
            self.shared[:] = [int(self.counters[k]) for k in COUNTERS]

    def _given_up(self) -> bool:  # while the ring is full
        return self.stop.is_set() or os.getppid() != self.parent

    def _put(self, sends) -> None:
        fam = self.path.nccl.family
        cts = fam.cts.name if fam.cts else None
        packed = self.ring.pack(sends, self._given_up) if self.ring is not None else [(sends, None)]
        for bare, span in packed:
            self.out.put(Sends(self.spec.port, bare, cts, fam.imm_order, span))

    def _taken(self, batch):  # a batch leaves `local`: the capture edge may hold more
        if batch is not None:
            with self.lock:
                self.held -= batch.nbytes
        return batch

    def _hand_over(self, piece) -> bool:
        while self.threads[0].is_alive():  # a decode thread that died takes nothing more
            try:
                self.ready.put(piece, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def _compact(self) -> None:
        try:
            while (b := self._taken(self.local.get())) is not None:
                for piece in b.pieces(COMPACT_BYTES):
                    if not self._hand_over(piece.copy()):  # copy_ranges drops the GIL
                        return
                    self.cpu_compact_ns = time.thread_time_ns()
        finally:  # however it ends (a copy that failed too), the decode waits for nothing more
            self._hand_over(None)

    def _next_batch(self):
        return self.ready.get() if self.file_split else self._taken(self.local.get())

    def _seen(self, last: float) -> float:
        """Says what the port's frames are, at most every SEEN_EVERY_S (never waiting: a full queue
        means sends are flowing, which says enough)."""
        c = self.path.counters
        self.counters["roce"] = sum(v for k, v in c.classes.items() if k.startswith("roce:"))
        now = time.monotonic()
        if now - last < SEEN_EVERY_S:
            return last
        try:
            self.out.put_nowait(Seen(self.spec.port, dict(c.classes.most_common(8))))
        except queue.Full:
            pass
        return now

    def _mirror(self) -> None:
        """What the mirror encapsulation showed: each session's losses as they grow, a truncated
        mirror said once (it can never be followed)."""
        from mirrorckpt.parser import encap

        mirror, c = self.path.counters.mirror, self.counters
        if mirror.lost != c["mirror_lost"]:
            self.out.put(MirrorLoss(self.spec.port, {s["session"]: s["lost"] for s in mirror.sessions()}))
        if mirror.truncated and not c["mirror_truncated"]:
            self.out.put(Note(self.spec.port, encap.truncation_advice(mirror)))
        c["mirror_lost"], c["mirror_truncated"] = mirror.lost, mirror.truncated

    def _decode(self) -> None:
        from mirrorckpt.parser.errors import VersionMismatch

        warned, seen = None, 0.0
        try:
            while (b := self._next_batch()) is not None:
                _, sends = self.path.feed(b)
                self.counters["icrc"] = self.path.counters.icrc_failed
                self.counters["cpu_decode_ns"] = time.thread_time_ns()
                self._mirror()
                seen = self._seen(seen)
                self.publish()
                if self.spec.share[1] > 1 and not warned:
                    warned = split_connection(self.path.nccl)
                    if warned:
                        self.out.put(Note(self.spec.port, warned))
                if sends:
                    self._put(sends)
            _, sends = self.path.flush()
            if sends:
                self._put(sends)
            self._seen(0.0)
            self.counters["cpu_decode_ns"] = time.thread_time_ns()
        except VersionMismatch as e:  # the stated release (or the port's own earlier traffic) is contradicted
            self.out.put(Fatal(self.spec.port, str(e)))
            self.stop.set()
            while self._next_batch() is not None:  # let the capture thread finish
                pass

    def _open(self):
        from mirrorckpt.capture.batch import CaptureError
        from mirrorckpt.capture.source import open_source, paced
        from mirrorckpt.parser import encap
        from mirrorckpt.parser.roce import split

        spec, (k, n) = self.spec, self.spec.share
        # AF_PACKET hands over whole ring blocks; files and DPDK take a frame count per batch
        # (DPDK's at most DPDK_MAX_BATCH: a batch must fit in the port's mbuf pool)
        opts = {} if spec.source.startswith("afpacket:") else {"batch_frames": spec.batch_frames}
        if n > 1 and spec.source.startswith("afpacket:"):  # the kernel splits the port (capture.fanout)
            opts.update(fanout_workers=n, fanout_worker=k, fanout_walk=encap.split_walk(spec.encap))
        if spec.source.startswith("dpdk:"):
            opts["batch_frames"] = min(spec.batch_frames, DPDK_MAX_BATCH)
        src = open_source(spec.source, **opts)
        it = paced(src, spec.pace) if spec.pace is not None else src
        if self.file_split:
            it = (split.share(b, k, n, spec.lut, spec.encap) for b in it)
        elif n > 1 and not (hasattr(src, "wait_fanout") and src.wait_fanout(FANOUT_WAIT_S)):
            raise CaptureError(f"{spec.source}: worker {k} of {n}: not every worker joined the port's fanout "
                               f"group within {FANOUT_WAIT_S:g} s (their frames would be captured by nobody)")
        return src, it

    def _capture(self, src, it) -> None:
        # a live source reuses its buffers once we move on; a file's batches are views of a
        # read-only mapping that stays valid
        keep = getattr(src, "stable_batches", False)
        c = self.counters
        c["capturing"] = 1
        self.publish()
        for batch in it:
            c["frames"] += len(batch)
            c["bytes"] += batch.nbytes
            with self.lock:
                room = self.held == 0 or self.held + batch.nbytes <= self.spec.local_bytes
                if room:
                    self.held += batch.nbytes
            if room:
                self.local.put(batch if keep else batch.copy())
            else:
                c["dropped_capture"] += len(batch)
            kstats = getattr(src, "kernel_drops", None)
            if kstats is not None:
                c["dropped_kernel"] = int(kstats() if callable(kstats) else kstats)
            c["cpu_capture_ns"] = time.thread_time_ns() + self.cpu_compact_ns
            self.publish()
            if self.stop.is_set():
                break
            if os.getppid() != self.parent:  # orphaned (sources yield at least every poll): nobody reads
                os._exit(1)  # the queue, and a put or the decode thread could wait on it forever

    def run(self) -> None:
        from mirrorckpt.capture.batch import CaptureError

        memory.freeze_startup_heap()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
        for t in self.threads:
            t.start()
        damage = None
        try:
            self._capture(*self._open())
        except CaptureError as e:
            damage = str(e)
        except Exception as e:  # noqa: BLE001  (any other failure must not look like a clean end of the source)
            damage = f"{type(e).__name__}: {e}"
        finally:
            cpu = time.thread_time_ns()
            self.local.put(None)
            for t in self.threads[::-1]:
                t.join()
            self.counters["cpu_capture_ns"] = cpu + self.cpu_compact_ns
            self.publish()
            self.out.put(Ended(self.spec.port, damage))
