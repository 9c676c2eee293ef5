"""MirrorStreams reading ahead on its own thread hands on exactly what it hands on without it: the
same lists of sends in the same order, and each stream counted ended no earlier than its last
sends; an error of the thread comes out in the caller, and a caller that stops early stops it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from common import FLOWCHECK, PCAPS, flowcheck_captures
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser.roce.streams import MirrorStreams


def _sources(name, batch_frames: int):
    """A bundled capture's files by name, or those of a folder (a Path)."""
    where = name if isinstance(name, Path) else PCAPS / name
    return [(str(p), open_capture(p, batch_frames=batch_frames)) for p in sorted(where.glob("*.pcap*"))]


def _walk(name, ahead: int, batch_frames: int = 8) -> tuple[list, MirrorStreams]:
    ms = MirrorStreams(_sources(name, batch_frames), ahead=ahead)
    seen = []
    for sends in ms:
        seen.append(([(s.stream, s.connection, s.seq, s.flag, s.ts_ns, s.psn, s.form, s.data.tobytes(), s.holes)
                      for s in sends], set(ms.ended)))
    return seen, ms


@pytest.mark.parametrize("name", flowcheck_captures())
@pytest.mark.parametrize("batch_frames", [64, 4096])
def test_the_real_captures_read_ahead_give_the_same_sends(name, batch_frames):
    """Read ahead (copies deferred, LL read by the decode) each real capture gives the sends it
    gives read in place, bytes, flags, protocols and holes alike."""
    def walk(ahead):
        ms = MirrorStreams([(name, open_capture(FLOWCHECK / name, batch_frames=batch_frames))], ahead=ahead)
        return [[(s.connection, s.seq, s.flag, s.protocol, s.ts_ns, s.psn, s.form, s.data.tobytes(), s.holes)
                 for s in sends] for sends in ms]

    want = walk(0)
    assert sum(map(len, want)) >= 8
    assert walk(2) == want


@pytest.mark.parametrize("name, columns", [("demo", True), ("simple_r3_both", True), ("ll128_bf16_v229", False),
                                           ("ll_r2_noise_faults", False), ("split_v212_ipv4_wrap", False)])
def test_sends_as_columns_are_the_sends_the_run_lane_makes(name: str, columns: bool):
    """``blocks=True`` (the job stream's form): a ``SendBlock``'s sends, made objects, are the
    ``LazySend``s the run lane makes one by one, every field, bytes and where they lie alike."""
    from mirrorckpt.parser.roce.sends import SendBlock

    def walk(blocks):
        ms, out, nblocks = MirrorStreams(_sources(name, 4096), ahead=1, blocks=blocks), [], 0
        for sends in ms:
            nblocks += sum(type(s) is SendBlock for s in sends)
            for s in (x for u in sends for x in (u.sends() if type(u) is SendBlock else (u,))):
                src = s.__dict__.get("_source")
                out.append((type(s).__name__, s.connection, s.qp, s.protocol, s.holes, s.wire_bytes, s.size, s.va,
                            s.form, s.flag, s.seq, s.cts, s.ts_ns, s.length_known, s.stream, s.psn, s.npkts, s.pmtu,
                            s.qp_index, s.nqps, s.cut, s.pieces, s.lone_piece, s.nbytes,
                            src[1:] if src is not None else None, s.data.tobytes()))
        return out, nblocks

    (want, none), (got, nblocks) = walk(False), walk(True)
    assert none == 0 and got == want and len(want) >= 8
    # Simple bytes left in the capture come as columns; LL128 is read on the packet path, and a
    # capture with faults in every batch or sends in the split form goes message by message
    assert (nblocks > 0) == columns, nblocks


@pytest.mark.parametrize("name", ["demo", "simple_r3_both", "ll_r2_noise_faults", "ll128_bf16_v229"])
def test_reading_ahead_hands_on_the_same_sends_and_ends(name):
    want, plain = _walk(name, ahead=0)
    got, ahead = _walk(name, ahead=2)
    assert len(want) >= 3  # small batches: several lists, so the thread runs ahead of the caller
    assert got == want
    assert ahead.ended == plain.ended == set(range(plain.nstreams))
    assert [(s.frames, s.bytes) for s in ahead.stats] == [(s.frames, s.bytes) for s in plain.stats]
    assert ahead.counters.classes == plain.counters.classes


def test_an_error_of_the_reading_thread_comes_out_in_the_caller():
    def broken():
        yield from list(open_capture(PCAPS / "demo" / "rank0_egress.pcapng", batch_frames=64))[:3]
        raise RuntimeError("disk gone")

    ms = MirrorStreams([("x", broken())], ahead=2)
    with pytest.raises(RuntimeError, match="disk gone"):
        for _ in ms:
            pass


def test_a_caller_that_stops_early_stops_the_thread():
    ms = MirrorStreams(_sources("demo", 16), ahead=1)
    it = iter(ms)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name in ("mirror-read", "mirror-decode")]


def test_capture_files_are_decoded_ahead_on_threads_of_their_own(monkeypatch):
    """The walk, header decode and ICRC of a capture file run on a thread per source, before the
    packet path takes the batch; its packets are those of decoding the batch there."""
    from mirrorckpt.parser.roce.packet_path import PacketPath

    where = []
    real = PacketPath.decode
    monkeypatch.setattr(PacketPath, "decode", lambda self, b: where.append(threading.current_thread().name) or
                        real(self, b))
    want, _ = _walk("ll_r2_noise_faults", ahead=0)
    assert where and set(where) == {"MainThread"}
    where.clear()
    got, _ = _walk("ll_r2_noise_faults", ahead=1)
    assert got == want
    assert where and set(where) == {"mirror-decode"}


@pytest.mark.parametrize("icrc", [True, False])
def test_capture_walks_leave_the_frames_to_a_decode_that_prefetches_them(icrc):
    """The decode prefetches each frame whose ICRC it checks: decoded ahead, the capture's walk
    then asks for the records' boundaries only (CaptureReader.consumer_prefetches); without the
    ICRC check it keeps asking for every line."""
    sources = _sources("ll_r2_noise_faults", 8)
    ms = MirrorStreams(sources, ahead=1, icrc=icrc)
    assert sum(len(s) for s in ms)
    assert [r.consumer_prefetches for _, r in sources] == [icrc] * len(sources)


def test_the_decode_thread_walks_at_most_decode_ahead_batches_before_the_packet_path(monkeypatch):
    """Each batch walked early keeps its capture pages mapped: the thread walks the next one only
    once the packet path took one."""
    from mirrorckpt.parser.roce import streams

    taken, walked, most = [0], [0], [0]
    real_next = streams._Ahead.next

    def next_(self):
        got = real_next(self)
        if threading.current_thread().name == "mirror-read":  # a batch taken by the packet path
            taken[0] += 1
        return got

    class Counted:
        """A capture reader that counts the batches walked."""

        stable_batches = True

        def __init__(self, reader):
            self.reader = reader

        def __iter__(self):
            return self

        def __next__(self):
            b = next(self.reader)
            walked[0] += 1
            most[0] = max(most[0], walked[0] - taken[0])
            return b

        def release_before(self, batch, keep_from=None):
            self.reader.release_before(batch, keep_from)

    monkeypatch.setattr(streams._Ahead, "next", next_)
    ms = MirrorStreams([(name, Counted(r)) for name, r in _sources("ll_r2_noise_faults", 8)[:1]], ahead=1)
    assert sum(1 for _ in ms) >= 3 and taken[0] > 3
    assert 1 <= most[0] <= streams.DECODE_AHEAD


def test_a_capture_damaged_part_way_ends_the_same_decoded_ahead(tmp_path):
    """A capture cut off mid-frame: the sends before the damage and the damage itself, as without
    reading ahead."""
    for p in sorted((PCAPS / "demo").glob("*.pcap*")):
        raw = p.read_bytes()
        (tmp_path / p.name).write_bytes(raw[:len(raw) * 2 // 3 + 5])
    want, plain = _walk(tmp_path, ahead=0)
    got, ahead = _walk(tmp_path, ahead=1)
    assert got == want and len(want) >= 3
    assert [s.damage for s in ahead.stats] == [s.damage for s in plain.stats]
    assert all(s.damage for s in plain.stats)


@pytest.mark.parametrize("name", ["ll_r2_noise_faults", "demo", "ll128_bf16_v229"])
def test_ll_read_while_reassembling_gives_the_sends_of_reading_it_after(name, monkeypatch):
    """Reassembly reads each whole message as LL while its packets are in cache (RdmaMessage.ll);
    the NCCL sends are those of decoding every message afterwards, on LL and on other protocols."""
    import numpy as np
    from mirrorckpt.capture._pack import copy_ranges
    from mirrorckpt.parser.roce import _place, reassembly

    want, _ = _walk(name, ahead=0)
    used = []
    real = _place.gather_ll

    def spy(*a):
        real(*a)
        used.append(int((a[8] != 0).sum()))

    monkeypatch.setattr(reassembly._place, "gather_ll", spy)
    got, _ = _walk(name, ahead=0)
    assert got == want
    assert sum(used) > 0 if name != "ll128_bf16_v229" else sum(used) == 0  # LL messages read so, no others

    def copy_only(src, src_off, length, msg_rows, msg_bytes, buf, out_off, out, flags, *a):
        copy_ranges(src, src_off, buf, np.concatenate([[0], np.cumsum(length[:-1])]), length)
        flags[:] = 0

    monkeypatch.setattr(reassembly._place, "gather_ll", copy_only)
    assert _walk(name, ahead=0)[0] == want


def _job(tmp_path_factory, protocol: str, pmtu: int):
    """A generated 2-rank job, the egress of both ranks (the e2e benchmark's shape, small)."""
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    out = tmp_path_factory.mktemp(protocol)
    generate(GenConfig(ranks=2, channels=2, protocol=protocol, model="linear:300000", steps=3, seed=1,
                       mirrors="0:egress,1:egress", wire=WireOptions(pmtu=pmtu), send_truth=False), out)
    return out


@pytest.fixture(scope="module")
def simple_job(tmp_path_factory):
    return _job(tmp_path_factory, "Simple", 4096)


@pytest.fixture(scope="module")
def ll_job(tmp_path_factory):
    return _job(tmp_path_factory, "LL", 1024)


@pytest.mark.parametrize("name,deferred", [("simple", True), ("demo", True), ("ll128_bf16_v229", False)])
def test_reading_ahead_leaves_simple_payload_copies_to_the_reader_of_the_sends(name, deferred, simple_job,
                                                                                monkeypatch):
    """Read ahead from capture files, a Simple send's payload, or an LL send's words as the decode
    read them, are copied from the batch when the caller reads its bytes (the same bytes as copied
    at once); runs of LL128 messages, and an LL message that does not read as intact LL, are read on
    the packet path's thread and copied there."""
    from mirrorckpt.parser.roce import reassembly

    def walk(ahead):
        return _walk(simple_job, ahead, 1024)[0] if name == "simple" else _walk(name, ahead, 64)[0]

    want = walk(0)
    filled = []
    real = reassembly.MessageRun.fill_range

    def fill_range(self, k, ll=False):
        if (self.ll_pending if ll else self.pending) is not None:
            a, b = self.bounds(k, ll)
            filled.append((threading.current_thread() is threading.main_thread(), b - a, ll))
        real(self, k, ll)

    monkeypatch.setattr(reassembly.MessageRun, "fill_range", fill_range)
    got = walk(1)
    assert got == want
    here = sum(n for main, n, _ in filled if main)
    assert (here > (1 << 20 if name == "simple" else 0)) if deferred else not here
    # an LL message that does not read as intact LL is read from its wire bytes by the decoder
    assert all(main for main, _, ll in filled if ll or name == "simple")


def test_a_deferred_run_begun_in_held_packets_copies_none_of_them(simple_job, monkeypatch):
    """Batches cut messages. From a capture file (batches that are views of its mapping, which stays
    valid) the packets held for the next batch stay where they lie, and a run whose first messages
    began in them is read from there like the rest of it: no buffer is taken and nothing is copied
    for it until a send is read (once, they were copied into a slab and again into the run's
    buffer); the replay is the same."""
    from mirrorckpt.parser.roce import reassembly

    want = _walk(simple_job, 0, 1024)[0]
    held_runs, copied = [], []
    real_hold, real_run = reassembly.Reassembler._hold, reassembly.Reassembler._run

    def run(self, qp, t, npend, held, data, heads, npks, k0, *a):
        out, k1 = real_run(self, qp, t, npend, held, data, heads, npks, k0, *a)
        if self.runs and (heads[k0] < npend or held is not None and held[heads[k0]]):  # begun in a held packet
            held_runs.extend((r.pending is not None, r.buf is None, r.pend_from) for r in out)
        return out, k1

    def hold(self, tab, src_is_new, data, slab):
        got = real_hold(self, tab, src_is_new, data, slab)
        if len(tab["psn"]):
            copied.append(got[1] is not data and got[1] is not slab)
        return got

    monkeypatch.setattr(reassembly.Reassembler, "_run", run)
    monkeypatch.setattr(reassembly.Reassembler, "_hold", hold)
    assert _walk(simple_job, 1, 1024)[0] == want
    deferred = [r for r in held_runs if r[0]]
    assert deferred and all(no_buf and first == 0 for _, no_buf, first in deferred)
    assert copied and not any(copied)


def test_a_deferred_send_is_never_read_from_pages_already_handed_back(simple_job, monkeypatch):
    """The caller gives a capture's pages back up to the part a list of sends came from, but not
    the pages of packets held from before it that those sends still read (PacketPath.holds_from):
    read again after MADV_DONTNEED they would be mapped anew and stay resident for the rest of the
    replay (peak memory that grew with the capture's length)."""
    from mirrorckpt.capture import pcapfile
    from mirrorckpt.parser.roce import reassembly

    readers, below = [], []
    real_init = pcapfile.CaptureReader.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        readers.append(self)

    def check(src, offsets) -> None:
        for r in readers:
            if r._buf is src and len(offsets):
                below.append(r._released - int(offsets.min()))  # > 0: read from a page handed back

    real_copy, real_gather = reassembly.copy_ranges, reassembly._merge.place_agreeing_gather

    def copy(src, src_off, *a):
        check(src, src_off)
        return real_copy(src, src_off, *a)

    def gather(dst, covered, start, src, src_off, msg_off, length, n, es, first=0, last=-1):
        check(src, src_off[first:last if last >= 0 else len(src_off)])
        return real_gather(dst, covered, start, src, src_off, msg_off, length, n, es, first, last)

    monkeypatch.setattr(pcapfile.CaptureReader, "__init__", init)
    monkeypatch.setattr(pcapfile, "RELEASE_BYTES", 4096)  # pages handed back at every list
    monkeypatch.setattr(reassembly, "copy_ranges", copy)
    monkeypatch.setattr(reassembly._merge, "place_agreeing_gather", gather)
    want = _walk(simple_job, 0, 1024)[0]
    assert _walk(simple_job, 1, 1024)[0] == want
    assert below and max(below) <= 0 and any(r._released for r in readers)


@pytest.mark.parametrize("protocol", ["Simple", "LL"])
def test_a_replay_places_the_sends_it_reads_from_the_capture_and_copies_no_others(protocol, simple_job, ll_job,
                                                                                  monkeypatch):
    """The concatenator reads the final values only: the reduce-scatter half of a ring all-reduce's
    sends stays in the capture (Simple: its wire bytes; LL: its words as the decode read them), and
    every all-reduce is still exact."""
    import json

    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.parser.roce import reassembly
    from mirrorckpt.tools.cmd_replay import run

    job_dir, ll = (simple_job, False) if protocol == "Simple" else (ll_job, True)
    copied = {"lazy": 0, "whole": 0, "deferred": 0, "placed": 0}
    real_range, real_fill = reassembly.MessageRun.fill_range, reassembly.MessageRun.fill
    real_place, real_run = reassembly.MessageRun.place_range, reassembly.Reassembler._run

    def pend(r):
        return getattr(r, "ll_pending" if ll else "pending", None)

    def place_range(self, k, *rest):
        if pend(self) is not None and rest[-1] == ll:
            a, b = self.bounds(k, ll)
            copied["placed"] += b - a
        return real_place(self, k, *rest)

    def run_(self, *a):
        out, k1 = real_run(self, *a)
        copied["deferred"] += sum(int(pend(r)[3].sum()) for r in out if pend(r) is not None)
        return out, k1

    def fill_range(self, k, which=False):
        if which == ll and pend(self) is not None and k >= self.pend_from:
            a, b = self.bounds(k, ll)
            copied["lazy"] += b - a
        real_range(self, k, which)

    def fill(self):
        if pend(self) is not None:
            copied["whole"] += int(pend(self)[3].sum())
        real_fill(self)

    monkeypatch.setattr(reassembly.MessageRun, "fill_range", fill_range)
    monkeypatch.setattr(reassembly.MessageRun, "fill", fill)
    monkeypatch.setattr(reassembly.Reassembler, "_run", run_)
    monkeypatch.setattr(reassembly.MessageRun, "place_range", place_range)
    job = load_job(job_dir / "job.toml")
    js, results, _, _ = run([str(job_dir / m.source) for m in job.mirrors], job, nccl_version=job.ring.nccl_version)
    truth = json.loads((job_dir / "truth.json").read_text())
    want = [h for it in truth["iterations"] for h in it["buckets_sha256"]]
    got = [r.sha256() for r in results if r.spec.kind == "allreduce" and r.spec.iteration is not None]
    assert got == want
    # 2 ranks: half of the ring's sends carry final values, placed from the capture without a copy
    # in between (the careful path, the decoder's first sends, copies its runs whole on the packet
    # path's thread)
    deferred = copied["deferred"] - copied["whole"]
    assert deferred > 1 << 20 and 0.4 * deferred < copied["placed"] < 0.6 * deferred
    assert copied["lazy"] == 0


def test_simple_data_in_whole_ll128_groups_is_told_from_ll128_by_its_first_two_lines():
    import numpy as np
    from mirrorckpt.parser.roce import protocols
    from mirrorckpt.parser.roce.reassembly import _may_be_ll128

    rng = np.random.default_rng(0)
    user = rng.standard_normal(1920 * 4 // 4).astype(np.float32).view(np.uint8)  # 4 groups of user bytes
    ll128 = protocols.encode(protocols.LL128, user, flag=7)
    simple = np.ascontiguousarray(np.tile(user, 2)[:len(ll128)])
    simple[120:128] = np.frombuffer(np.int64(5).tobytes(), np.uint8)  # its first line passes alone
    first, length = np.array([0]), np.array([4096])
    assert _may_be_ll128(ll128, first, length, np.array([len(ll128)]))
    assert not _may_be_ll128(simple, first, length, np.array([len(simple)]))
    assert not _may_be_ll128(simple, first, length, np.array([len(simple) - 64]))  # not whole groups
    assert _may_be_ll128(simple, first, np.array([200]), np.array([len(simple)]))  # line 2 not seen: maybe


def test_read_ahead_gives_back_the_pages_of_batches_once_copied(simple_job, monkeypatch):
    """Deferred copies read their batch after the walk has moved on, so the caller gives the pages
    back once it has copied them, not the walk: a page read again after the walk's release would
    stay mapped for good (a 2 GB replay peaked at 1.3 GB that way, against 0.3 GB)."""
    import mmap
    import os

    from mirrorckpt.capture import pcapfile

    monkeypatch.setattr(pcapfile, "RELEASE_BYTES", mmap.PAGESIZE)
    released = []
    real = pcapfile.CaptureReader._release

    def spy(self, upto):
        real(self, upto)
        released.append((self.name, threading.current_thread() is threading.main_thread(), self._released))

    monkeypatch.setattr(pcapfile.CaptureReader, "_release", spy)
    files = sorted(simple_job.glob("*.pcapng"))
    ms = MirrorStreams([(str(p), open_capture(p, batch_frames=256)) for p in files], ahead=1)
    for _ in ms:
        pass
    assert released and all(main for _, main, _ in released)  # never on the packet path's thread
    for p in files:  # each capture given back up to its last batches
        assert max(r for name, _, r in released if name == str(p)) > os.path.getsize(p) // 2


def test_a_damaged_simple_capture_gives_the_same_verdicts_placed_from_the_capture(tmp_path, monkeypatch):
    """Loss, duplicates, reordering and corruption: held packets, messages begun in an earlier
    batch, the careful path. Replayed from files with the sends placed from the capture, every
    all-reduce's verdict and bytes are those of copying every run at once."""
    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.tools import cmd_replay
    from mirrorckpt.tools.generator.faults import FaultOptions
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, channels=2, protocol="Simple", model="linear:300000", steps=8, seed=3,
                       mirrors="0:egress,1:egress", wire=WireOptions(pmtu=4096), send_truth=False,
                       faults=FaultOptions(loss=0.0005, duplicate=0.001, reorder=0.0025, corrupt=0.0005, seed=5)),
             tmp_path)
    job = load_job(tmp_path / "job.toml")
    files = [str(tmp_path / m.source) for m in job.mirrors]

    def verdicts():
        _, results, _, _ = cmd_replay.run(files, job, nccl_version=job.ring.nccl_version)
        return [(r.index, r.complete, r.sha256(), r.holes) for r in results]

    monkeypatch.setattr(cmd_replay, "READ_AHEAD", 0)  # one thread: every run copied at once
    want = verdicts()
    from mirrorckpt.parser.roce import reassembly

    placed = []
    real = reassembly.MessageRun.place_range
    monkeypatch.setattr(reassembly.MessageRun, "place_range", lambda *a: placed.append(real(*a)) or placed[-1])
    monkeypatch.setattr(cmd_replay, "READ_AHEAD", 1)
    got = verdicts()
    assert got == want
    assert sum(1 for x in placed if x is not None) > 10  # sends placed from the capture
    assert any(c for _, c, _, _ in want) and not all(c for _, c, _, _ in want)  # the faults did damage some
