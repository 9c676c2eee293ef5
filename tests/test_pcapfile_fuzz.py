"""Fuzzing the capture readers with mutated copies of the real captures.

Whatever the damage, reading raises nothing but CaptureError, every yielded frame lies inside
its batch's buffer, and the walk only ever moves forward (each walk call starts past the
previous one), so every read ends.
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mirrorckpt.capture import _walk
from mirrorckpt.capture import formats as fmt
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture, read_all
from mirrorckpt.capture.writer import PcapngWriter, PcapWriter

SHARED = Path(__file__).resolve().parents[2] / "shared"
CAPTURES = sorted((SHARED / "captures" / "flowcheck").glob("*.pcapng"), key=lambda p: p.stat().st_size)
N_SEEDS = 7
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def byte_order(data: bytes) -> str:
    """struct prefix of an undamaged pcap or single-byte-order pcapng file."""
    if data[:4] == b"\x0a\x0d\x0d\x0a":
        return "<" if data[8:12] == b"\x4d\x3c\x2b\x1a" else ">"
    return "<" if data[:4] in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"


def structure(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every pcap record or pcapng block of an undamaged single-byte-order
    file."""
    order = byte_order(data)
    if data[:4] == b"\x0a\x0d\x0d\x0a":
        out, pos = [], 0
        while pos < len(data):
            n = struct.unpack_from(order + "I", data, pos + 4)[0]
            out.append((pos, n))
            pos += n
        return out
    out, pos = [], 24
    while pos < len(data):
        n = 16 + struct.unpack_from(order + "I", data, pos + 8)[0]
        out.append((pos, n))
        pos += n
    return out


def big_endian_pcapng(frames: list[bytes], ts_us: list[int]) -> bytes:
    def block(btype: int, body: bytes) -> bytes:
        body += b"\0" * (-len(body) % 4)
        return struct.pack(">II", btype, 12 + len(body)) + body + struct.pack(">I", 12 + len(body))
    out = [block(fmt.BT_SHB, struct.pack(">IHHq", fmt.BYTE_ORDER_MAGIC, 1, 0, -1)),
           block(fmt.BT_IDB, struct.pack(">HHI", 1, 0, 0))]
    for f, t in zip(frames, ts_us):
        out.append(block(fmt.BT_EPB, struct.pack(">IIIII", 0, t >> 32, t & 0xFFFFFFFF, len(f), len(f)) + f))
    return b"".join(out)


def big_endian_pcap(frames: list[bytes], ts_ns: list[int]) -> bytes:
    out = [struct.pack(">IHHiIII", fmt.PCAP_MAGIC_NS, 2, 4, 0, 0, 65535, 1)]
    for f, t in zip(frames, ts_ns):
        out.append(struct.pack(">IIII", t // 10**9, t % 10**9, len(f), len(f)) + f)
    return b"".join(out)


class Seed(tuple):
    """(content, path) with a short repr for hypothesis reports."""

    def __repr__(self) -> str:
        return f"Seed({self[1].name}, {len(self[0])} bytes)"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[Seed]:
    """(content, file) of the two smallest real captures, plus pcap (ns and µs) and a
    two-section, two-interface pcapng derived from them with the writers, and big-endian
    pcapng and pcap built here."""
    assert CAPTURES, f"no captures under {SHARED}"
    d = tmp_path_factory.mktemp("seeds")
    small = read_all(CAPTURES[0])
    out = [CAPTURES[0].read_bytes(), CAPTURES[1].read_bytes()]
    for ns in (True, False):
        with PcapWriter(d / "x.pcap", nanosecond=ns) as w:
            w.write_batch(small)
        out.append((d / "x.pcap").read_bytes())
    small.iface = (np.arange(len(small)) % 2).astype(np.int32)
    with PcapngWriter(d / "a.pcapng", interfaces=[("a", 1, 0), ("b", 1, 128)]) as w:
        w.write_batch(small)
    out.append((d / "a.pcapng").read_bytes() * 2)
    frames = [small.frame(i) for i in range(len(small))]
    out.append(big_endian_pcapng(frames, (small.ts_ns // 1000).tolist()))
    out.append(big_endian_pcap(frames, small.ts_ns.tolist()))
    assert len(out) == N_SEEDS
    for i, content in enumerate(out):
        (d / f"seed{i}").write_bytes(content)
    for i in (5, 6):  # the hand-built big-endian seeds read back as the frames they hold
        got = read_all(d / f"seed{i}")
        assert [got.frame(k) for k in range(len(got))] == frames
        assert got.ts_ns.tolist() == (small.ts_ns if i == 6 else small.ts_ns // 1000 * 1000).tolist()
    return [Seed((content, d / f"seed{i}")) for i, content in enumerate(out)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "mutated"


@contextlib.contextmanager
def walk_recorder():
    """Wraps the compiled walks to record where each call starts and check it moved on."""
    starts: list[int] = []
    real = _walk.walk_pcap, _walk.walk_pcapng

    def recorded(fn):
        def call(buf, pos, *args):
            assert not starts or pos > starts[-1], f"walk restarted at {pos} after {starts[-1]}"
            starts.append(pos)
            result = fn(buf, pos, *args)
            end_pos, status = result[1], result[2]
            assert end_pos >= pos
            if status == _walk.Status.FULL:
                assert end_pos > pos
            return result
        return call

    _walk.walk_pcap, _walk.walk_pcapng = recorded(real[0]), recorded(real[1])
    try:
        yield starts
    finally:
        _walk.walk_pcap, _walk.walk_pcapng = real


def read_checked(path: Path, batch_frames: int) -> tuple[int, CaptureError | None]:
    """Reads the whole file; returns (frames, error) after checking every batch."""
    frames, error = 0, None
    size = path.stat().st_size
    with walk_recorder() as starts:
        try:
            with open_capture(path, batch_frames) as reader:
                for batch in reader:
                    n = len(batch)
                    assert 1 <= n <= batch_frames
                    assert batch.first_index == frames
                    assert np.all(batch.offset >= 0) and np.all(batch.caplen >= 0)
                    assert np.all(batch.caplen <= fmt.MAX_CAPLEN)
                    assert np.all(batch.offset + batch.caplen <= batch.data.size)
                    assert set(np.unique(batch.iface).tolist()) <= set(batch.linktypes)
                    frames += n
                    assert reader.stats.frames == frames
        except CaptureError as e:
            error = e
            assert str(e).startswith(str(path))
        assert len(starts) <= size // 8 + 2
    return frames, error


# Mutations: positions are fractions of the current length so they shrink well.
flip = st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255))
cut = st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True), st.just(0))
insert = st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=40))
delete = st.tuples(st.just("delete"), st.floats(0, 1, exclude_max=True), st.integers(1, 64))
LENGTHS = st.one_of(st.sampled_from([0, 1, 4, 8, 12, 13, 16, 20, 28, 32, 0x7FFFFFFF, 0xFFFFFFFF,
                                     fmt.MAX_CAPLEN, fmt.MAX_CAPLEN + 1]),
                    st.integers(0, 2**32 - 1))
length_field = st.tuples(st.just("length"), st.floats(0, 1, exclude_max=True),
                         st.tuples(st.sampled_from([4, 8, 12, 20, -4]), LENGTHS))
mutation = st.one_of(flip, cut, insert, delete, length_field)


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    units = structure(data)
    order = byte_order(data)
    for kind, where, arg in ops:
        if not b:
            break
        pos = int(where * len(b))
        if kind == "flip":
            b[pos] ^= arg
        elif kind == "cut":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "delete":
            del b[pos : pos + arg]
        else:
            # A length-ish field of one record/block: +4 block length / pcap incl_len at +8,
            # EPB caplen at +20, iface at +8, trailing length at -4.
            off, n = units[int(where * len(units))]
            field, value = arg
            at = off + (n + field if field < 0 else field)
            if 0 <= at <= len(b) - 4:
                struct.pack_into(order + "I", b, at, value)
    return bytes(b)


@FUZZ
@given(seed=st.integers(0, N_SEEDS - 1), ops=st.lists(mutation, min_size=1, max_size=4),
       batch_frames=st.sampled_from([1, 5, 64, 65536]))
def test_mutated_captures_only_raise_capture_error(seeds, work, seed, ops, batch_frames):
    work.write_bytes(mutate(seeds[seed][0], ops))
    read_checked(work, batch_frames)


@FUZZ
@given(seed=st.integers(0, N_SEEDS - 1), where=st.floats(0, 1), batch_frames=st.sampled_from([1, 7, 65536]))
def test_truncation_yields_exactly_the_whole_frames_before_the_cut(seeds, work, seed, where,
                                                                  batch_frames):
    data = seeds[seed][0]
    units = structure(data)
    pcapng = data[:4] == b"\x0a\x0d\x0d\x0a"
    first = 0 if pcapng else 24  # where the first block/record starts
    lo = 4 if pcapng else 24  # shorter files are not recognised as captures at all
    cut = lo + int(where * (len(data) - lo))
    work.write_bytes(data[:cut])
    whole = [(o, n) for o, n in units if o + n <= cut]
    packets = len(whole) if not pcapng else sum(
        1 for o, _ in whole if data[o : o + 4] not in (b"\x0a\x0d\x0d\x0a", b"\x01\0\0\0", b"\0\0\0\x01"))
    frames, error = read_checked(work, batch_frames)
    assert frames == packets
    on_boundary = cut in {first} | {o + n for o, n in units}
    assert (error is None) == (on_boundary and cut > 0), error
    if error is not None:
        at = whole[-1][0] + whole[-1][1] if whole else first
        assert f"at byte {at}" in str(error), error


@FUZZ
@given(seed=st.integers(0, N_SEEDS - 1), data=st.data())
def test_flipped_payload_bytes_change_no_structure(seeds, work, seed, data):
    original, path = seeds[seed]
    ref = read_all(path)  # the seed file is never rewritten, so its mapping stays valid
    b = bytearray(original)
    i = data.draw(st.integers(0, len(ref) - 1))
    o, n = int(ref.offset[i]), int(ref.caplen[i])
    for k in data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8, unique=True)):
        b[o + k] ^= 0xFF
    work.write_bytes(bytes(b))
    got = read_all(work)
    assert got.caplen.tolist() == ref.caplen.tolist()
    assert got.wirelen.tolist() == ref.wirelen.tolist()
    assert got.ts_ns.tolist() == ref.ts_ns.tolist()
    assert got.frame(i) != ref.frame(i)
    del got  # drop the mapping before the next example rewrites the file
