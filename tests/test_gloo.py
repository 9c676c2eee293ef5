"""The gloo/TCP decoder on synthetic traffic: TCP reassembly, gloo framing and recovery, the
send lists, and whole DDP jobs written the way gloo writes them (no root needed).

``SynthJob`` writes a DDP job's collectives as gloo ops (notifications, data ops in each
algorithm's send order, concurrent collectives interleaved op by op) into TCP connections
(full mesh, initiator's sequence-number preamble, TCPStore connections to rank 0), cuts them
into segments and frames, and keeps the true result of every collective; tests then damage the
frames (drop, duplicate, corrupt, reorder, attach late) and check that every iteration the
decoder calls complete is bit-identical to the truth.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from common import collect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, BROADCAST
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec, dtype_size
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.gloo import framing as gloo
from mirrorckpt.parser.gloo import schedule as gs
from mirrorckpt.parser.gloo import tcp
from mirrorckpt.parser.gloo.job import GlooJobStream
from mirrorckpt.parser.headers import GLOO_OP
from mirrorckpt.tools.generator.tcpframes import tcp_frame

# -- frames -------------------------------------------------------------------------------------


def addr16(ip: str) -> bytes:
    a = ipaddress.ip_address(ip)
    return a.packed if a.version == 6 else b"\0" * 10 + b"\xff\xff" + a.packed


def op_bytes(opcode: int, slot: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return GLOO_OP.pack(nbytes=48 + len(payload), opcode=opcode, slot=slot, length=n) + payload


# -- a synthetic gloo DDP job -----------------------------------------------------------------


@dataclass
class Direction:
    sender: int
    receiver: int
    src: str
    dst: str
    sport: int
    dport: int
    isn: int
    initiator: bool
    chunks: list = field(default_factory=list)  # (time, bytes)


class SynthJob:
    """A DDP job on ``P`` ranks written as gloo would write it; ``truth`` holds every result."""

    def __init__(self, P=3, seed=0, v6=False, vlan=None, mss=1448, max_segment=gs.MAX_SEGMENT_BYTES,
                 iterations=4, shapes=((64, 32), (64,), (16, 64), (16,)), buckets=((3, 2), (1, 0)),
                 isn_near_wrap=False, extra_barrier_after: int | None = None):
        self.P, self.rng, self.mss, self.vlan = P, random.Random(seed), mss, vlan
        self.nprng = np.random.default_rng(seed)
        self.max_segment = max_segment
        self.ips = [f"fd00::{r + 1}" if v6 else f"10.9.0.{r + 1}" for r in range(P)]
        params = [ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)]
        one = [BucketSpec(tuple(range(len(params))))]
        self.layout = JobLayout(params, [BucketSpec(b) for b in buckets], one, "float32")
        self.t = 0
        self.dirs: dict[tuple[int, int], Direction] = {}
        for i in range(P):
            for j in range(i + 1, P):  # j connects to i's listener, as rank 1 did to rank 0
                self._connect(j, i, 50000 + 10 * j + i, 40000 + i, isn_near_wrap)
        self.store: list[tuple[int, bytes]] = []
        for r in range(1, P):  # TCPStore clients on the master port of rank 0
            self._connect(r, 0, 45000 + r, 29500, isn_near_wrap, store=True)
        self.truth: dict[int, np.ndarray] = {}  # collective index -> result bytes
        self.times: dict[int, tuple[int, int]] = {}  # collective index -> emission time range
        self.tag = 0
        self.model = JobModel.ddp(RingSpec(P), self.layout)
        self._run(iterations, extra_barrier_after)

    # connections ----------------------------------------------------------------------------
    def _connect(self, a: int, b: int, aport: int, bport: int, near_wrap: bool, store=False):
        isn_a = (1 << 32) - 5000 if near_wrap else self.rng.randrange(1 << 32)
        isn_b = (1 << 32) - 777 if near_wrap else self.rng.randrange(1 << 32)
        da = Direction(a, b, self.ips[a], self.ips[b], aport, bport, isn_a, True)
        db = Direction(b, a, self.ips[b], self.ips[a], bport, aport, isn_b, False)
        key = (a, b) if not store else ("store", a)
        rkey = (b, a) if not store else ("store-reply", a)
        self.dirs[key], self.dirs[rkey] = da, db
        self.t += 1
        da.syn_t = self.t
        db.syn_t = self.t
        if store:
            self._emit(da, b"\x01set key\x00" * 3)
            self._emit(db, b"\x00ok")
        else:
            self._emit(da, int(a + 1).to_bytes(8, "little"))  # the initiator's sequence number

    def _emit(self, d: Direction, data: bytes) -> None:
        self.t += 1
        d.chunks.append((self.t, data))

    # ops --------------------------------------------------------------------------------------
    def _sends(self, spec, data: np.ndarray) -> list[list[tuple[int, int, bytes]]]:
        """Per sender, its (receiver, op bytes) in order, notifications included."""
        P, es = self.P, dtype_size(spec.dtype)
        prefix = {ALLREDUCE: gs.PREFIX_ALLREDUCE, BROADCAST: gs.PREFIX_BROADCAST,
                  ALLGATHER: gs.PREFIX_ALLGATHER}[spec.kind]
        slot = gs.make_slot(prefix, self.tag)
        per = []
        for s in range(P):
            out = []
            for d in range(P):
                if d == s:
                    continue
                nbytes = spec.count * es
                for snd in gs.sends(spec.kind, nbytes, es, P, s, d, spec.root, self.max_segment):
                    if spec.kind == ALLREDUCE and snd.phase != "reduced":
                        payload = self.nprng.integers(0, 256, snd.length, dtype=np.uint8).tobytes()
                    elif spec.kind == ALLGATHER:
                        base = snd.origin * nbytes + snd.offset
                        payload = data[base: base + snd.length].tobytes()
                    else:
                        payload = data[snd.offset: snd.offset + snd.length].tobytes()
                    out.append((d, op_bytes(gloo.NOTIFY_RECV_READY, slot, length=snd.length), True))
                    out.append((d, op_bytes(gloo.NOTIFY_SEND_READY, slot, length=snd.length), False))
                    out.append((d, op_bytes(gloo.SEND_UNBOUND_BUFFER, slot, payload), False))
            per.append(out)
        return per

    def _collective(self, index: int, spec):
        es = dtype_size(spec.dtype)
        n = spec.count * (self.P if spec.kind == ALLGATHER else 1)
        if spec.label == "param_count":
            data = np.full(self.P, len(self.layout.params), "<i8").view(np.uint8)
        elif spec.label == "shapes":
            vals = [v for p in self.layout.params for v in (*p.shape, *_strides(p.shape))]
            data = np.array(vals, "<i8").view(np.uint8)
        elif spec.label == "rebuild_indices":
            idx = [i for b in self.layout.buckets for i in b.params] + [len(self.layout.buckets)]
            data = np.array(idx, "<i4").view(np.uint8)
        elif spec.label == "rebuild_sizes":
            data = np.array([len(b.params) for b in self.layout.buckets], "<i4").view(np.uint8)
        else:
            data = self.nprng.standard_normal(n).astype("<f4").view(np.uint8)
        assert len(data) == n * es
        self.truth[index] = data
        ops = self._sends(spec, data)
        self.tag += 1
        return ops

    def _barrier(self):
        slot = gs.make_slot(gs.PREFIX_BARRIER, self.tag)
        self.tag += 1
        per = []
        for s in range(self.P):
            d = 1
            out = []
            while d < self.P:
                out.append(((s + d) % self.P, op_bytes(gloo.SEND_UNBOUND_BUFFER, slot), False))
                d <<= 1
            per.append(out)
        return per

    def _write(self, ops_lists):
        """Writes the ops of concurrent collectives, interleaved op by op per sender."""
        merged = []
        for s in range(self.P):
            queues = [list(ops[s]) for ops in ops_lists]
            while any(queues):
                q = self.rng.choice([q for q in queues if q])
                merged.append((s,) + q.pop(0))
        for s, d, b, reverse in merged:
            # a receive notification travels from the receiver to the sender
            self._emit(self.dirs[(d, s)] if reverse else self.dirs[(s, d)], b)

    def _run(self, iterations: int, barrier_after: int | None) -> None:
        m = self.model
        i = 0
        pending = []
        while True:
            spec = m[i]
            if spec is None or (spec.iteration is not None and spec.iteration >= iterations):
                break
            ops = self._collective(i, spec)
            t0 = self.t
            if spec.label == "grad":
                pending.append((i, ops))  # DDP's buckets run on two worker threads
                if len(pending) == 2 or spec.bucket == len(m.grads(spec.iteration)) - 1:
                    self._write([o for _, o in pending])
                    for k, _ in pending:
                        self.times[k] = (t0, self.t)
                    pending = []
            else:
                self._write([ops])
                self.times[i] = (t0, self.t)
            if barrier_after is not None and i == barrier_after:
                self._write([self._barrier()])
            i += 1
        self.ncoll = i

    # frames -----------------------------------------------------------------------------------
    def frames(self, mirror: list[tuple[int, str]] | None = None) -> list[tuple[int, bytes]]:
        """(time, frame) of the mirrored directions: [(rank, "both" | "egress" | "ingress")]."""
        mirror = mirror or [(1, "both")]
        out = []
        for d in self.dirs.values():
            if not any((dirn in ("both", "egress") and d.sender == r) or
                       (dirn in ("both", "ingress") and d.receiver == r) for r, dirn in mirror):
                continue
            flags = tcp.SYN if d.initiator else tcp.SYN | tcp.ACK
            out.append((d.syn_t, tcp_frame(d.src, d.dst, d.sport, d.dport, d.isn, b"", flags, self.vlan)))
            seq = d.isn + 1
            for t, data in d.chunks:
                pos = 0
                while pos < len(data):
                    n = min(len(data) - pos, self.rng.choice([self.mss, self.mss, 7, 48, 200]))
                    out.append((t, tcp_frame(d.src, d.dst, d.sport, d.dport, seq, data[pos:pos + n],
                                             vlan=self.vlan)))
                    seq += n
                    pos += n
        out.sort(key=lambda x: x[0])
        return out

    def iteration_truth(self, i: int) -> list[np.ndarray]:
        first = self.model.first_of_iteration(i)
        n = len(self.model.grads(i))
        extra = 2 if i == 1 else 0
        return [self.truth[first + extra + b] for b in range(n)]

    def ranks(self) -> dict[bytes, int]:
        return {addr16(ip): r for r, ip in enumerate(self.ips)}


def _strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def batches(frames: list[tuple[int, bytes]], size: int = 50) -> list[FrameBatch]:
    out = []
    for k in range(0, len(frames), size):
        part = frames[k:k + size]
        out.append(FrameBatch.from_frames([f for _, f in part], "synth", ts_ns=[t for t, _ in part]))
    return out


def decode(job: SynthJob, frames, config=True, batch=50, **kw):
    if config:
        kw.setdefault("model", job.model)
        kw.setdefault("ranks", job.ranks())
    js = GlooJobStream([("synth", batches(frames, batch))], max_segment=job.max_segment, **kw)
    results, its, weights = collect(js)
    js.weights = weights  # the initial weights item, for the tests that check it
    return js, results, its


def check_iterations(job: SynthJob, its) -> tuple[int, int]:
    """(complete, incomplete); every complete iteration must equal the truth bit for bit."""
    good = bad = 0
    for it in its:
        if not it.complete:
            assert it.buckets == []
            bad += 1
            continue
        want = job.iteration_truth(it.index)
        assert len(it.buckets) == len(want)
        for got, w in zip(it.buckets, want):
            assert np.array_equal(got.view(np.uint8), w), f"iteration {it.index} is WRONG"
        good += 1
    return good, bad


# -- whole jobs ---------------------------------------------------------------------------------


def test_job_from_the_wire_alone():
    job = SynthJob(seed=1)
    js, results, its = decode(job, job.frames(), config=False)
    assert check_iterations(job, its) == (4, 0)
    assert js.weights is not None and np.array_equal(js.weights.values.view(np.uint8), job.truth[2])
    assert [p.shape for p in js.model.layout.params] == [p.shape for p in job.layout.params]
    assert js.model.layout.buckets == job.layout.buckets
    placement = js.report().placement
    assert placement["mismatch"] == 0 and placement["untrusted"] == 0


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_every_ring_size_and_mirrored_rank(P):
    for rank in range(P):
        job = SynthJob(P=P, seed=10 + P, iterations=3, max_segment=1024)
        js, _, its = decode(job, job.frames([(rank, "both")]), config=False)
        assert check_iterations(job, its) == (3, 0), (P, rank, js.report().mismatches)


def test_ipv6_vlan_small_segments_and_sequence_wrap():
    job = SynthJob(seed=2, v6=True, vlan=42, mss=100, isn_near_wrap=True, iterations=3)
    _, _, its = decode(job, job.frames(), config=False)
    assert check_iterations(job, its) == (3, 0)


@pytest.mark.parametrize("batch", [3, 50, 100_000])
def test_two_ranks_egress_only(batch):
    """Live rings hand over small batches: the job must not be settled on the first hosts seen."""
    job = SynthJob(seed=3)
    js, _, its = decode(job, job.frames([(0, "egress"), (1, "egress")]), config=False, batch=batch)
    assert check_iterations(job, its) == (4, 0)
    assert sorted(js.ranks.values()) == [0, 1, 2] and js.model.ring.nranks == 3


def test_one_direction_alone_is_never_complete():
    """Egress of one rank carries (P-1)/P of each bucket's final values: incomplete, not wrong."""
    job = SynthJob(seed=4)
    _, results, its = decode(job, job.frames([(2, "egress")]))
    assert check_iterations(job, its) == (0, 4)
    grads = [r for r in results if r.spec.label == "grad"]
    assert grads and all(0.5 < r.coverage < 1 for r in grads)


def test_a_collective_outside_the_model_shifts_the_tags():
    job = SynthJob(seed=5, extra_barrier_after=8)  # a user barrier inside iteration 2
    js, _, its = decode(job, job.frames())
    assert check_iterations(job, its) == (4, 0)
    assert js.report().placement["not_in_model:barrier"] > 0


def test_duplicates_agree_and_reordering_within_the_window():
    job = SynthJob(seed=6)
    fr = job.frames()
    rng = random.Random(0)
    out = []
    for t, f in fr:
        out.append((t, f))
        if rng.random() < 0.1:  # a retransmission, later
            out.append((t + rng.randrange(1, 5), f))
    for k in range(1, len(out) - 1, 7):  # swap neighbours
        out[k], out[k + 1] = out[k + 1], out[k]
    js, _, its = decode(job, out)
    assert check_iterations(job, its) == (4, 0)
    dups = sum(d.tcp.streams[k].stats.duplicate_bytes for d in js.streams.decoders for k in d.tcp.streams)
    assert dups > 0


def _conflicting_copy(job: SynthJob, fr, needle: bytes):
    k = next(k for k, (_, f) in enumerate(fr) if needle in f)
    t, f = fr[k]
    bad = bytearray(f)
    bad[f.index(needle) + 5] ^= 0x01
    return fr[:k + 1] + [(t, bytes(bad))] + fr[k + 1:]


def test_a_conflicting_copy_makes_its_iteration_incomplete():
    job = SynthJob(seed=7)
    coll = job.model.first_of_iteration(2)  # iteration 2, bucket 0
    # chunk 0 travels only 2 -> 1 on rank 1's port: its one copy is now disputed
    js, _, its = decode(job, _conflicting_copy(job, job.frames(), job.truth[coll][:64].tobytes()))
    assert check_iterations(job, its) == (3, 1)
    assert not its[2].complete and list(its[2].holes) == [0] and its[2].holes[0][0][0] == 1
    conflicts = sum(s.stats.conflict_bytes for d in js.streams.decoders for s in d.tcp.streams.values())
    assert conflicts == 1
    # the last chunk crosses the port twice (1 -> 0 and 2 -> 1): the other copy fills the hole
    _, _, its = decode(job, _conflicting_copy(job, job.frames(), job.truth[coll][-64:].tobytes()))
    assert check_iterations(job, its) == (4, 0)


def test_attach_mid_run_with_the_configured_layout():
    job = SynthJob(seed=8, iterations=6)
    fr = job.frames()
    cut = len(fr) // 3
    _, _, its = decode(job, fr[cut:])
    good, bad = check_iterations(job, its)
    assert good >= 2 and bad >= 1
    done = [it.complete for it in its]
    first = done.index(True)
    assert all(done[first:]), done  # from the first complete iteration on, nothing is missed


# -- loss never makes a wrong iteration -------------------------------------------------------


@settings(max_examples=int(__import__("os").environ.get("MCK8_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=hst.integers(0, 10_000), drop=hst.floats(0.0, 0.05), attach=hst.floats(0, 0.5),
       corrupt=hst.integers(0, 3))
def test_damage_never_yields_a_wrong_iteration(seed, drop, attach, corrupt):
    job = SynthJob(seed=seed % 7, iterations=4, max_segment=2048)
    rng = random.Random(seed)
    fr = job.frames()
    fr = fr[int(len(fr) * attach):]
    fr = [x for x in fr if rng.random() >= drop]
    for _ in range(corrupt):  # a second copy that disagrees
        k = rng.randrange(len(fr))
        t, f = fr[k]
        if len(f) > 100:
            b = bytearray(f)
            b[rng.randrange(80, len(b))] ^= 1 << rng.randrange(8)
            fr.insert(k + 1, (t, bytes(b)))
    _, _, its = decode(job, fr)
    check_iterations(job, its)  # complete ones are exact; the rest carry no gradient


# -- pieces -------------------------------------------------------------------------------------


def test_tcp_stream_holes_settle_and_conflicts():
    key = tcp.StreamKey(addr16("10.0.0.1"), addr16("10.0.0.2"), 1, 2)
    st = tcp.TcpStream(key, window_bytes=100)
    st.restart(1000, 0)
    data = np.arange(256, dtype=np.uint8)
    put = lambda a, ln, off: st.place(np.array([a]), np.array([ln]), np.array([off]), data)  # noqa: E731
    put(1000, 10, 0)
    put(1020, 10, 20)  # a hole at 1010..1020
    st.settle()
    assert st.settled == 1010 and st.holes(1000, 1030) == [(10, 10)]
    put(1010, 10, 10)
    st.settle()
    assert st.settled == 1030 and st.holes(1000, 1030) == []
    assert bytes(st.view(1000, 1030)) == bytes(range(30))
    put(1030, 10, 30)
    put(1030, 10, 31)  # a copy that disagrees: the bytes that differ are holes
    put(1040, 10, 40)
    assert st.holes(1030, 1050) == [(0, 10)]
    assert st.stats.conflict_bytes == 10
    put(1400, 10, 0)  # far ahead: holes more than ``window_bytes`` behind it are given up
    st.settle()
    assert st.settled == 1310 and st.stats.lost_bytes == 260
    put(1100, 10, 0)  # too late now
    assert st.stats.late_bytes == 10
    put(1310, 90, 0)  # still in time: fills up to the run at 1400
    st.settle()
    assert st.settled == 1410 and st.holes(1310, 1410) == []
    st.settle(final=True)
    assert st.settled == st.hi == 1410
    # a hole on a quiet stream is given up after hole_ns of capture time
    st.hole_ns = 1000
    put(1420, 5, 0)
    st.settle(now=5000)
    assert st.settled == 1410
    st.settle(now=5999)
    assert st.settled == 1410
    st.settle(now=6000)
    assert st.settled == 1425 and st.holes(1410, 1425) == [(0, 10)]


def test_tcp_decode_ignores_checksums_and_reads_tso_super_frames():
    payload = bytes(range(256)) * 250  # 64000 bytes in one frame
    f = tcp_frame("10.0.0.1", "10.0.0.2", 5, 6, 7, payload)
    segs, c = tcp.decode(FrameBatch.from_frames([f]))
    assert len(segs) == 1 and segs.pay_len[0] == len(payload) and int(segs.seq[0]) == 7
    short = tcp_frame("10.0.0.1", "10.0.0.2", 5, 6, 7, b"abc")  # padded to 60 bytes
    segs, _ = tcp.decode(FrameBatch.from_frames([short]))
    assert segs.pay_len[0] == 3


def test_framing_recovers_only_on_a_chain_of_preambles():
    slot = gs.make_slot(gs.PREFIX_ALLREDUCE, 9)
    ops = [op_bytes(gloo.NOTIFY_SEND_READY, slot, length=40), op_bytes(gloo.SEND_UNBOUND_BUFFER, slot, bytes(40)),
           op_bytes(gloo.NOTIFY_RECV_READY, slot, length=8)]
    fake = op_bytes(gloo.NOTIFY_SEND_READY, slot, length=1)  # a lone preamble in the garbage
    stream = b"\x07" * 13 + fake + b"\x05" * 30 + b"".join(ops) * 2
    key = tcp.StreamKey(addr16("10.0.0.1"), addr16("10.0.0.2"), 1, 2)
    st = tcp.TcpStream(key)
    st.restart(0, 0)  # joined mid-way: no SYN, framing unknown
    st.place(np.array([0]), np.array([len(stream)]), np.array([0]), np.frombuffer(stream, np.uint8))
    st.settle(final=True)
    fr = gloo.GlooFramer(st)
    got = fr.pull()
    assert [o.opcode for o in got] == [2, 1, 3, 2, 1, 3]
    assert got[0].pos == 13 + 48 + 30 and fr.counts["resync"] == 1
    assert got[0].epoch == 1


def test_slot_tracker_distrusts_the_collectives_in_flight_at_a_loss():
    tr = gloo.SlotTracker()
    key = tcp.StreamKey(b"a" * 16, b"b" * 16, 1, 2)

    def op(tag, epoch, data=True):
        o = gloo.GlooOp(key, 0, 0, epoch, 0, gloo.SEND_UNBOUND_BUFFER if data else gloo.NOTIFY_SEND_READY,
                        gs.make_slot(4, tag), 4)
        tr.annotate(o)
        return o

    assert op(5, 0).trusted and op(6, 0).trusted  # from the SYN: all counted
    assert not op(6, 1).trusted  # seen before the loss
    assert not op(7, 1).trusted  # only one smaller tag (6) seen since the loss
    assert not op(5, 1).trusted
    o = op(8, 1)
    assert o.trusted and o.index == 0  # 5 and 7 (two smaller tags) were active after the loss


def test_allreduce_sends_cover_the_buffer():
    for P in (2, 3, 4, 7):
        for T in (4, 12, 4 * 1001, 9_549_660, 3 << 20):
            geo = gs.ring_geometry(T, 4, P)
            assert geo.segments % P == 0 and geo.segments >= 2 * P and geo.segment_bytes % 4 == 0
            covered = np.zeros(T, np.int32)
            for r in range(P):
                ag = [s for s in gs.allreduce_sends(T, 4, P, r) if s.phase == "reduced"]
                mine = np.zeros(T, bool)
                for s in ag:
                    mine[s.offset:s.offset + s.length] = True
                    assert s.length > 0
                covered += mine
                # rank r forwards every chunk but the one of rank r - 1
                assert all(s.origin != (r - 1) % P for s in ag)
            assert covered.min() >= P - 1 >= 1  # every byte reaches every other rank


def test_ring_geometry_matches_the_documented_example():
    geo = gs.ring_geometry(9_549_660, 4, 3)
    assert (geo.segments, geo.per_rank) == (12, 4) and geo.segment_bytes == 795_808
    assert len(gs.allreduce_sends(9_549_660, 4, 3, 0)) == 16


def test_broadcast_tree_and_allgather_pieces():
    for P in range(2, 9):
        for root in range(P):
            got = sorted(c for r in range(P) for c in gs.broadcast_children(P, root, r))
            assert got == sorted(set(range(P)) - {root})
        pieces = {}
        for r in range(P):
            for s in gs.allgather_sends(10, P, r):
                pieces.setdefault(s.origin, []).append((s.offset, s.length))
        for ps in pieces.values():
            assert sorted(set(ps)) == [(0, 5), (5, 5)] and len(ps) == 2 * (P - 1)


def test_a_quiet_stream_gives_up_its_hole_on_capture_time():
    r = tcp.TcpReassembler(hole_ns=1_000_000)
    a = [tcp_frame("10.0.0.1", "10.0.0.2", 1, 2, 100, b"x" * 10),
         tcp_frame("10.0.0.1", "10.0.0.2", 1, 2, 120, b"y" * 10)]
    b = lambda seq: tcp_frame("10.0.0.3", "10.0.0.4", 3, 4, seq, b"z" * 10)  # noqa: E731
    feed = lambda fr, t: r.feed(*_segs(FrameBatch.from_frames(fr, ts_ns=[t] * len(fr))), now=t)  # noqa: E731
    feed(a, 0)
    quiet = r.streams[next(k for k in r.streams if k.sport == 1)]
    assert quiet.settled == 110
    assert quiet not in feed([b(0)], 500_000)  # the hole at 110 has waited since 0
    assert quiet not in feed([b(10)], 999_999)
    assert quiet in feed([b(20)], 1_000_000) and quiet.settled == 130 and quiet.stats.lost_bytes == 10


def _segs(batch):
    segs, _ = tcp.decode(batch)
    return segs, batch.data
