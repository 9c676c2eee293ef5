"""pcap/pcapng readers and writers, checked against tshark and hand-built files."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.capture.pcapfile import open_capture, read_all
from mirrorckpt.capture.source import open_source, paced
from mirrorckpt.capture.writer import PcapngWriter, PcapWriter

SHARED = Path(__file__).resolve().parents[2] / "shared"
CAPTURES = sorted((SHARED / "captures" / "flowcheck").glob("*.pcapng"))
TSHARK = shutil.which("tshark")


# ---- hand-built files (struct only, independent of the writer) -------------------------------

def block(order: str, btype: int, body: bytes) -> bytes:
    body += b"\0" * (-len(body) % 4)
    n = 12 + len(body)
    return struct.pack(order + "II", btype, n) + body + struct.pack(order + "I", n)


def shb(order: str) -> bytes:
    return block(order, 0x0A0D0D0A, struct.pack(order + "IHHq", 0x1A2B3C4D, 1, 0, -1))


def option(order: str, code: int, value: bytes) -> bytes:
    return struct.pack(order + "HH", code, len(value)) + value + b"\0" * (-len(value) % 4)


def idb(order: str, linktype: int = 1, snaplen: int = 0, tsresol: int | None = None,
        tsoffset: int | None = None) -> bytes:
    opts = option(order, 2, b"if-with-a-name")
    if tsresol is not None:
        opts += option(order, 9, bytes([tsresol]))
    if tsoffset is not None:
        opts += option(order, 14, struct.pack(order + "q", tsoffset))
    opts += option(order, 0, b"")
    return block(order, 1, struct.pack(order + "HHI", linktype, 0, snaplen) + opts)


def epb(order: str, iface: int, ticks: int, frame: bytes, wirelen: int | None = None) -> bytes:
    head = struct.pack(order + "IIIII", iface, ticks >> 32, ticks & 0xFFFFFFFF, len(frame),
                       len(frame) if wirelen is None else wirelen)
    return block(order, 6, head + frame + b"\0" * (-len(frame) % 4) + option(order, 1, b"c") +
                 option(order, 0, b""))


def pb(order: str, iface: int, ticks: int, frame: bytes) -> bytes:
    head = struct.pack(order + "HHIIII", iface, 0, ticks >> 32, ticks & 0xFFFFFFFF, len(frame),
                       len(frame))
    return block(order, 2, head + frame)


def spb(order: str, frame: bytes, wirelen: int) -> bytes:
    return block(order, 3, struct.pack(order + "I", wirelen) + frame)


def pcap_bytes(order: str, nanosecond: bool, records, snaplen: int = 65535, linktype: int = 1):
    magic = 0xA1B23C4D if nanosecond else 0xA1B2C3D4
    out = [struct.pack(order + "IHHiIII", magic, 2, 4, 0, 0, snaplen, linktype)]
    for sec, frac, frame, wirelen in records:
        out.append(struct.pack(order + "IIII", sec, frac, len(frame), wirelen) + frame)
    return b"".join(out)


def frames_of(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes()
            for k in rng.integers(14, 1600, n)]


def block_offsets(path: Path) -> list[tuple[int, int, int]]:
    """(offset, type, length) of every block of a little-endian single-section pcapng."""
    b = path.read_bytes()
    out, pos = [], 0
    while pos < len(b):
        t, n = struct.unpack_from("<II", b, pos)
        out.append((pos, t, n))
        pos += n
    return out


def all_frames(batch: FrameBatch) -> list[bytes]:
    return [batch.frame(i) for i in range(len(batch))]


# ---- real captures against tshark ------------------------------------------------------------

def tshark_fields(path: Path, *fields: str) -> list[list[str]]:
    args = [TSHARK, "-r", str(path), "-T", "fields"]
    for f in fields:
        args += ["-e", f]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [line.split("\t") for line in out.splitlines()]


def epoch_to_ns(text: str) -> int:
    sec, _, frac = text.partition(".")
    return int(sec) * 10**9 + int((frac + "000000000")[:9])


def test_real_captures_present():
    assert len(CAPTURES) >= 5, f"expected the flowcheck captures under {SHARED}"


@pytest.mark.skipif(TSHARK is None, reason="tshark not installed (make system-deps)")
@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_capture_matches_tshark(path):
    rows = tshark_fields(path, "frame.len", "frame.cap_len", "frame.time_epoch", "eth.src")
    batch = read_all(path)
    assert len(batch) == len(rows)
    assert batch.wirelen.tolist() == [int(r[0]) for r in rows]
    assert batch.caplen.tolist() == [int(r[1]) for r in rows]
    # These files have if_tsresol 10^-6; tshark prints 9 digits, so ns compare exactly.
    assert batch.ts_ns.tolist() == [epoch_to_ns(r[2]) for r in rows]
    src = [":".join(f"{x:02x}" for x in batch.data[o + 6 : o + 12]) for o in batch.offset]
    assert src == [r[3] for r in rows]
    assert batch.linktypes == {0: 1}


@pytest.mark.parametrize("path", CAPTURES[:2], ids=lambda p: p.name)
def test_batches_concatenate_to_read_all(path):
    whole = read_all(path)
    for k in (1, 7, 100000):
        with open_capture(path, batch_frames=k) as r:
            batches = list(r)
            assert r.stats.frames == len(whole)
            assert r.stats.bytes == int(whole.caplen.sum())
            assert r.stats.truncated == 0
        assert all(len(b) <= k for b in batches)
        assert [b.first_index for b in batches] == np.cumsum([0] + [len(b) for b in batches[:-1]]).tolist()
        got = [f for b in batches for f in all_frames(b)]
        assert got == all_frames(whole)
        assert np.concatenate([b.ts_ns for b in batches]).tolist() == whole.ts_ns.tolist()
        # Each batch's data covers its own frames only.
        assert all(b.offset[0] == 0 and b.data.size == int((b.offset + b.caplen).max()) for b in batches)


@pytest.mark.parametrize("suffix", ["pcap", "pcapng"])
def test_a_walk_for_a_reader_that_prefetches_lists_the_same_frames(tmp_path, monkeypatch, suffix):
    """consumer_prefetches (the RoCE decode prefetches each frame itself) makes the walk ask for the
    records' boundaries only, from the first record on and for frames of 14 to 1600 bytes; the
    frames it lists are the same."""
    from mirrorckpt.capture import _walk

    batch = sample_batch(n=600, seed=3)
    path = tmp_path / f"x.{suffix}"
    with (PcapWriter(path) if suffix == "pcap" else PcapngWriter(path)) as w:
        w.write_batch(batch)
    asked = []
    for name in ("walk_pcap", "walk_pcapng"):
        real = getattr(_walk, name)
        monkeypatch.setattr(_walk, name, lambda *a, real=real: asked.append(a[-1]) or real(*a))
    got = {}
    for prefetches in (False, True):
        with open_capture(path, batch_frames=50) as r:
            r.consumer_prefetches = prefetches
            got[prefetches] = [f for b in r for f in all_frames(b)]
    assert got[True] == got[False] == all_frames(batch)
    assert set(asked) == {_walk.STRIDE_MIN, _walk.BOUNDS_STRIDE_MIN} and _walk.BOUNDS_STRIDE_MIN < 1000


# ---- writer round trips ----------------------------------------------------------------------

def sample_batch(n=300, seed=1, ts0=1_700_000_000_123_456_789) -> FrameBatch:
    frames = frames_of(n, seed)
    rng = np.random.default_rng(seed)
    ts = (ts0 + np.cumsum(rng.integers(0, 5_000_000, n))).tolist()
    wire = [len(f) + int(x) for f, x in zip(frames, rng.integers(0, 3, n) * (rng.random(n) < 0.2))]
    return FrameBatch.from_frames(frames, ts_ns=ts, wirelen=wire)


@pytest.mark.parametrize("nanosecond", [True, False])
def test_pcap_writer_round_trip(tmp_path, nanosecond):
    batch = sample_batch()
    path = tmp_path / "x.pcap"
    with PcapWriter(path, nanosecond=nanosecond, linktype=101) as w:
        w.write_batch(batch)
        w.write(b"\x01" * 60, 1_700_000_001_000_000_999, wirelen=64)
    got = read_all(path)
    assert got.linktypes == {0: 101}
    unit = 1 if nanosecond else 1000
    assert len(got) == len(batch) + 1
    assert all_frames(got)[:-1] == all_frames(batch)
    assert got.ts_ns[:-1].tolist() == (batch.ts_ns // unit * unit).tolist()
    assert got.wirelen[:-1].tolist() == batch.wirelen.tolist()
    assert got.ts_ns[-1] == 1_700_000_001_000_000_999 // unit * unit
    assert (got.caplen[-1], got.wirelen[-1]) == (60, 64)
    with open_capture(path) as r:
        list(r)
        assert r.stats.truncated == int(batch.truncated.sum()) + 1


@pytest.mark.parametrize("writer", [PcapWriter, PcapngWriter])
def test_writers_write_whole_aligned_spans_but_the_last(tmp_path, monkeypatch, writer):
    """Every write but the file's last starts and ends on a WRITE_SPAN boundary (the page cache then
    holds the capture in large folios, which a replay maps one fault each); the bytes read back are
    the frames written, batch and single frames mixed."""
    from mirrorckpt.capture import writer as wmod

    monkeypatch.setattr(wmod, "WRITE_SPAN", 4096)
    monkeypatch.setattr(wmod, "WRITE_HOLD", 3 * 4096 + 100)
    writes = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            writes.append((self.f.tell(), len(b)))
            return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

    monkeypatch.setattr(wmod, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    path = tmp_path / "x.cap"
    batches = [sample_batch(50 + 40 * i, i) for i in range(6)]
    with writer(path) as w:
        for i, b in enumerate(batches):
            w.write_batch(b)
            w.write(bytes([i]) * 60, 1_700_000_000_000_000_000 + i)
    assert len(writes) > 3 and all(pos % 4096 == 0 and n % 4096 == 0 for pos, n in writes[:-1]), writes
    assert sum(n for _, n in writes) == path.stat().st_size
    want = []
    for i, b in enumerate(batches):
        want += all_frames(b) + [bytes([i]) * 60]
    assert all_frames(read_all(path)) == want


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("nanosecond", [True, False])
def test_pcap_both_byte_orders(tmp_path, order, nanosecond):
    frames = frames_of(20, 3)
    recs = [(1_700_000_000 + i, 999_999_999 - i if nanosecond else 999_999 - i, f, len(f) + i % 2)
            for i, f in enumerate(frames)]
    path = tmp_path / "x.pcap"
    path.write_bytes(pcap_bytes(order, nanosecond, recs, linktype=113))
    got = read_all(path)
    scale = 1 if nanosecond else 1000
    assert all_frames(got) == frames
    assert got.ts_ns.tolist() == [s * 10**9 + f * scale for s, f, _, _ in recs]
    assert got.wirelen.tolist() == [w for *_, w in recs]
    assert got.linktypes == {0: 113}
    assert got.iface.tolist() == [0] * 20


def test_pcapng_writer_two_interfaces(tmp_path):
    batch = sample_batch(200, 5)
    batch.iface = (np.arange(200) % 3 == 0).astype(np.int32)
    path = tmp_path / "x.pcapng"
    with PcapngWriter(path, interfaces=[("mirror0", 1, 0), ("mirror1", 1, 100)]) as w:
        w.write_batch(batch)
        w.write(b"\x02" * 150, 5, iface=1)
    got = read_all(path)
    assert len(got) == 201
    assert got.iface.tolist() == batch.iface.tolist() + [1]
    assert got.ts_ns.tolist() == batch.ts_ns.tolist() + [5]
    assert got.linktypes == {0: 1, 1: 1}
    want_cap = np.where(batch.iface == 1, np.minimum(batch.caplen, 100), batch.caplen)
    assert got.caplen.tolist() == want_cap.tolist() + [100]
    assert got.wirelen.tolist() == batch.wirelen.tolist() + [150]
    for i in range(200):
        assert got.frame(i) == batch.frame(i)[: want_cap[i]]


def test_pcapng_writer_microseconds(tmp_path):
    batch = sample_batch(50, 6)
    path = tmp_path / "x.pcapng"
    with PcapngWriter(path, tsresol_ns=False) as w:
        w.write_batch(batch)
    got = read_all(path)
    assert got.ts_ns.tolist() == (batch.ts_ns // 1000 * 1000).tolist()
    assert all_frames(got) == all_frames(batch)


@pytest.mark.skipif(TSHARK is None, reason="tshark not installed (make system-deps)")
def test_writer_output_matches_tshark(tmp_path):
    batch = sample_batch(100, 7)
    batch.iface = (np.arange(100) % 2).astype(np.int32)
    path = tmp_path / "x.pcapng"
    with PcapngWriter(path, interfaces=[("a", 1, 0), ("b", 1, 0)]) as w:
        w.write_batch(batch)
    rows = tshark_fields(path, "frame.len", "frame.cap_len", "frame.time_epoch", "frame.interface_id")
    assert [int(r[0]) for r in rows] == batch.wirelen.tolist()
    assert [int(r[1]) for r in rows] == batch.caplen.tolist()
    assert [epoch_to_ns(r[2]) for r in rows] == batch.ts_ns.tolist()
    assert [int(r[3]) for r in rows] == batch.iface.tolist()
    pcap = tmp_path / "x.pcap"
    batch.iface[:] = 0
    with PcapWriter(pcap) as w:
        w.write_batch(batch)
    rows = tshark_fields(pcap, "frame.len", "frame.time_epoch")
    assert [(int(a), epoch_to_ns(b)) for a, b in rows] == list(zip(batch.wirelen.tolist(), batch.ts_ns.tolist()))


def test_writer_rejects_bad_frames(tmp_path):
    with PcapWriter(tmp_path / "a.pcap") as w:
        with pytest.raises(ValueError, match="one interface"):
            w.write(b"x" * 20, 0, iface=1)
        with pytest.raises(ValueError, match="wirelen 10 is below"):
            w.write(b"x" * 20, 0, wirelen=10)
        with pytest.raises(ValueError, match="32-bit seconds"):
            w.write(b"x" * 20, 2**32 * 10**9)
    with PcapngWriter(tmp_path / "a.pcapng") as w:
        with pytest.raises(ValueError, match="interface 2 not declared"):
            w.write(b"x" * 20, 0, iface=2)
        bad = FrameBatch.from_frames([b"x" * 20], ts_ns=[-1])
        with pytest.raises(ValueError, match="batch frame 0"):
            w.write_batch(bad)


# ---- hand-built pcapng: resolutions, block kinds, sections -----------------------------------

def expect_ns(ticks: int, base: int, exp: int, offset_s: int = 0) -> int:
    return ticks * 10**9 // base**exp + offset_s * 10**9


@pytest.mark.parametrize("order", ["<", ">"])
def test_pcapng_resolutions_blocks_and_sections(tmp_path, order):
    other = ">" if order == "<" else "<"
    f = frames_of(12, 9)
    t_us, t_ns, t_bin = 1_700_000_000_123_456, 1_700_000_000_123_456_789, (1_700_000_000 << 20) + 777
    parts = [
        shb(order),
        idb(order, 1, 0, 6),                        # iface 0: 10^-6
        block(order, 4, b"\0" * 8),                 # name resolution: skipped
        idb(order, 147, 64, 9, tsoffset=-3),        # iface 1: 10^-9, offset -3 s, snaplen 64
        epb(order, 0, t_us, f[0]),
        epb(order, 1, t_ns, f[1], wirelen=len(f[1]) + 4),
        spb(order, f[2][:64], len(f[2])),           # interface 0's snaplen 0: body bounds it
        pb(order, 1, t_ns + 1, f[3]),
        block(order, 5, b"\0" * 16),                # interface statistics: skipped
        block(order, 0x00000BAD, b"custom!!"),      # custom: skipped
        shb(other),                                 # new section, other byte order
        idb(other, 1, 100, 0x80 | 20),              # iface 2 (local 0): 2^-20
        epb(other, 0, t_bin, f[4]),
        spb(other, f[5], len(f[5])),                # SPB: cut to interface 0's snaplen 100
    ]
    path = tmp_path / "x.pcapng"
    path.write_bytes(b"".join(parts))
    with open_capture(path, batch_frames=2) as r:
        batches = list(r)
        assert r.stats.skipped_blocks == 3
        assert r.stats.frames == 6
    got = read_all(path)
    assert got.linktypes == {0: 1, 1: 147, 2: 1}
    assert got.iface.tolist() == [0, 1, 0, 1, 2, 2]
    assert all_frames(got) == [f[0], f[1], f[2][:64], f[3], f[4], f[5][:100]]
    assert got.wirelen.tolist() == [len(f[0]), len(f[1]) + 4, len(f[2]), len(f[3]), len(f[4]), len(f[5])]
    assert got.ts_ns.tolist() == [
        expect_ns(t_us, 10, 6), expect_ns(t_ns, 10, 9, -3), 0,
        expect_ns(t_ns + 1, 10, 9, -3), expect_ns(t_bin, 2, 20), 0]
    assert [b.linktypes for b in batches][-1] == got.linktypes
    assert got.truncated.tolist() == [False, True, True, False, False, len(f[5]) > 100]


@pytest.mark.parametrize("tsresol,base,exp", [(6, 10, 6), (9, 10, 9), (0x80 | 10, 2, 10),
                                              (0x80 | 30, 2, 30), (0x80 | 40, 2, 40), (12, 10, 12)])
def test_pcapng_tsresol(tmp_path, tsresol, base, exp):
    rng = np.random.default_rng(exp)
    ticks = [int(x) for x in rng.integers(0, 2**62, 50, dtype=np.int64)]
    path = tmp_path / "x.pcapng"
    path.write_bytes(shb("<") + idb("<", 1, 0, tsresol) + b"".join(epb("<", 0, t, b"abcd" * 5) for t in ticks))
    got = read_all(path)
    assert got.ts_ns.view(np.uint64).tolist() == [expect_ns(t, base, exp) % 2**64 for t in ticks]


def test_concatenated_writer_files_are_sections(tmp_path):
    a, b = sample_batch(30, 1), sample_batch(40, 2)
    pa, pb_, both = tmp_path / "a.pcapng", tmp_path / "b.pcapng", tmp_path / "ab.pcapng"
    with PcapngWriter(pa, interfaces=[("x", 1, 0)]) as w:
        w.write_batch(a)
    with PcapngWriter(pb_, interfaces=[("y", 105, 0), ("z", 1, 0)], tsresol_ns=False) as w:
        b.iface = np.ones(40, np.int32)
        w.write_batch(b)
    both.write_bytes(pa.read_bytes() + pb_.read_bytes())
    got = read_all(both)
    assert got.linktypes == {0: 1, 1: 105, 2: 1}
    assert got.iface.tolist() == [0] * 30 + [2] * 40
    assert all_frames(got) == all_frames(a) + all_frames(b)
    assert got.ts_ns.tolist() == a.ts_ns.tolist() + (b.ts_ns // 1000 * 1000).tolist()


# ---- damaged and non-capture files -----------------------------------------------------------

def read_until_error(path, batch_frames=65536):
    frames = []
    with open_capture(path, batch_frames) as r:
        with pytest.raises(CaptureError) as e:
            for batch in r:
                frames += all_frames(batch)
    return frames, str(e.value)


@pytest.mark.parametrize("cut", [10, 3, 7])
def test_truncated_pcapng_yields_earlier_frames(tmp_path, cut):
    src = CAPTURES[-1]
    blocks = block_offsets(src)
    whole = all_frames(read_all(src))
    k = 100  # cut inside the k-th block (index into all blocks; 2 are SHB + IDB)
    off = blocks[k][0]
    path = tmp_path / "cut.pcapng"
    path.write_bytes(src.read_bytes()[: off + cut])
    for bf in (65536, 9):
        frames, msg = read_until_error(path, bf)
        assert frames == whole[: k - 2]
        assert msg.startswith(f"{path}: block at byte {off}")
        assert ("cut short" if cut < 8 else "bytes are left in the file") in msg


def test_truncated_pcap_yields_earlier_frames(tmp_path):
    frames = frames_of(10, 4)
    data = pcap_bytes("<", True, [(1, 2, f, len(f)) for f in frames])
    record7 = 24 + sum(16 + len(f) for f in frames[:7])
    for cut, what in ((record7 + 5, "cut short"), (record7 + 20, "only")):
        path = tmp_path / "cut.pcap"
        path.write_bytes(data[:cut])
        got, msg = read_until_error(path)
        assert got == frames[:7]
        assert msg.startswith(f"{path}: record at byte {record7}") and what in msg


def mutate_block(src: Path, dst: Path, k: int, length: int | None = None,
                 trailer: int | None = None, field: tuple[int, int] | None = None) -> int:
    b = bytearray(src.read_bytes())
    off, _, n = block_offsets(src)[k]
    if length is not None:
        struct.pack_into("<I", b, off + 4, length)
    if trailer is not None:
        struct.pack_into("<I", b, off + n - 4, trailer)
    if field is not None:
        struct.pack_into("<I", b, off + field[0], field[1])
    dst.write_bytes(bytes(b))
    return off


@pytest.mark.parametrize("kw,expect", [
    (dict(length=12), "(enhanced packet block) has length 12 (minimum 32)"),
    (dict(length=102), "not a multiple of 4"),
    (dict(length=0x7FFFFFFC), "bytes are left in the file"),
    (dict(trailer=8), "trailing length 8"),
    (dict(field=(8, 5)), "refers to interface 5, but its section has 1"),
    (dict(field=(20, 300000)), "captured length 300000 (more than 262144)"),
    (dict(field=(20, 4000)), "captured length 4000, more than its"),
])
def test_damaged_block_named(tmp_path, kw, expect):
    src = CAPTURES[0]
    whole = all_frames(read_all(src))
    path = tmp_path / "bad.pcapng"
    off = mutate_block(src, path, 50, **kw)
    frames, msg = read_until_error(path)
    assert frames == whole[:48]
    assert msg.startswith(f"{path}: block at byte {off}")
    assert expect in msg


def test_damaged_interface_option(tmp_path):
    path = tmp_path / "bad.pcapng"
    path.write_bytes(shb("<") + idb("<", 1, 0, tsoffset=1) + epb("<", 0, 1, b"x" * 30))
    data = bytearray(path.read_bytes())
    # The if_tsoffset option is 4 + 8 bytes before the end-of-options (4) and trailer (4).
    idb_end = 28 + struct.unpack_from("<I", data, 32)[0]
    struct.pack_into("<H", data, idb_end - 4 - 4 - 12 + 2, 400)
    path.write_bytes(bytes(data))
    frames, msg = read_until_error(path)
    assert frames == []
    assert msg.startswith(f"{path}: interface description block at byte 28: option 14 at byte")
    assert "past the block end" in msg


@pytest.mark.parametrize("content,expect", [
    (b"", "not a pcap or pcapng file (the file is empty)"),
    (b"hello, world\n" * 10, "not a pcap or pcapng file (first bytes 68 65 6c 6c"),
    (b"\xd4\xc3\xb2\xa1\x02\x00", "pcap file header is cut short (6 of 24 bytes)"),
    (b"\x0a\x0d\x0d\x0a\x1c\x00\x00\x00\x11\x22\x33\x44", "has byte-order magic 11223344"),
])
def test_not_a_capture(tmp_path, content, expect):
    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    with pytest.raises(CaptureError) as e:
        with open_capture(path) as r:
            list(r)
    assert str(e.value).startswith(str(path)) and expect in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CaptureError, match="cannot open"):
        open_capture(tmp_path / "nope.pcap")


def test_reader_stops_after_error(tmp_path):
    path = tmp_path / "bad.pcapng"
    mutate_block(CAPTURES[0], path, 3, length=12)
    r = open_capture(path)
    assert len(next(r)) == 1
    with pytest.raises(CaptureError):
        next(r)
    with pytest.raises(StopIteration):
        next(r)
    r.close()


# ---- sources and pacing ----------------------------------------------------------------------

def test_open_source_specs(tmp_path):
    path = CAPTURES[0]
    n = len(read_all(path))
    for spec in (str(path), f"file:{path}", path):
        with open_source(spec, batch_frames=100) as src:
            assert sum(len(b) for b in src) == n
    with pytest.raises(CaptureError, match="unknown capture source kind 'bogus'"):
        open_source("bogus:eth0")


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def clock(self):
        return self.now

    def sleep(self, s):
        assert s > 0
        self.slept.append(s)
        self.now += s


def test_paced_recorded_and_rate():
    batch = read_all(CAPTURES[1])
    t0 = int(batch.ts_ns[0])
    fake = FakeClock()
    pieces = list(paced(iter([batch]), "recorded", clock=fake.clock, sleep=fake.sleep))
    # Each piece is released when its first frame is due; the last one at its recorded time.
    assert fake.now - 100.0 == pytest.approx((int(pieces[-1].ts_ns[0]) - t0) / 1e9, abs=1e-6)
    assert len(pieces) > 10
    assert np.concatenate([p.ts_ns for p in pieces]).tolist() == batch.ts_ns.tolist()
    assert [p.first_index for p in pieces] == np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
    assert all((int(p.ts_ns[-1]) - t0) // 10**6 == (int(p.ts_ns[0]) - t0) // 10**6 for p in pieces)

    fake = FakeClock()
    frames = all_frames(batch)
    halves = [FrameBatch.from_frames(frames[:700]), FrameBatch.from_frames(frames[700:])]
    halves[1].first_index = 700
    pieces = list(paced(halves, 0.01, clock=fake.clock, sleep=fake.sleep))
    assert sum(len(p) for p in pieces) == len(batch) and len(pieces) > 100
    # The last piece is due when every frame before it has left at 0.01 Gbit/s.
    bits_before = int(batch.wirelen[: pieces[-1].first_index].sum()) * 8
    assert fake.now - 100.0 == pytest.approx(bits_before / 0.01e9, abs=1e-6)
    assert list(paced(halves, None)) == halves
    with pytest.raises(ValueError, match="pace mode"):
        list(paced(halves, "fast"))


@pytest.mark.parametrize("writer", [PcapWriter, PcapngWriter])
def test_batches_are_bounded_in_bytes(tmp_path, monkeypatch, writer):
    """Jumbo frames: a batch ends after BATCH_BYTES of file (the walk sized to match), the pages
    before it are handed back, and the frames are the same as one read of the whole file."""
    import mirrorckpt.capture.pcapfile as pf

    monkeypatch.setattr(pf, "BATCH_BYTES", 200_000)
    monkeypatch.setattr(pf, "RELEASE_BYTES", 4096)
    path = tmp_path / "jumbo.cap"
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, int(n), np.uint8).tobytes() for n in rng.integers(60, 9000, 400)]
    with writer(path) as w:
        for i, f in enumerate(frames):
            w.write(f, 1_000 + i)
    r = open_capture(path)
    got, spans = [], []
    for b in r:
        spans.append(int(b.offset[-1]) - int(b.offset[0]))
        got += [b.data[o:o + c].tobytes() for o, c in zip(b.offset.tolist(), b.caplen.tolist())]
    assert got == frames
    assert len(spans) >= 8 and max(spans) <= 200_000
    assert r._released > 0
    whole = read_all(path)
    assert [whole.data[o:o + c].tobytes() for o, c in zip(whole.offset.tolist(), whole.caplen.tolist())] == frames


def test_a_batch_s_pages_are_handed_back_before_the_next_batch_is_walked(tmp_path, monkeypatch):
    """A batch is done with once the next is asked for: its pages go before the walk maps the
    next batch's, so a capture holds about one batch resident, not two (and a job's captures
    do not all peak together)."""
    import mmap

    import mirrorckpt.capture.pcapfile as pf

    monkeypatch.setattr(pf, "BATCH_BYTES", 200_000)
    monkeypatch.setattr(pf, "RELEASE_BYTES", 4096)
    path = tmp_path / "big.pcapng"
    frames = [bytes([i % 251]) * 4000 for i in range(400)]
    with PcapngWriter(path) as w:
        for i, f in enumerate(frames):
            w.write(f, 1_000 + i)
    r = open_capture(path, batch_frames=40)  # a walk per batch

    class Walk:  # records what was handed back when each walk starts
        def __init__(self, walk):
            self.walk, self.at_fill = walk, []

        def fill(self, *cols):
            self.at_fill.append(r._released)
            return self.walk.fill(*cols)

        def __getattr__(self, k):
            return getattr(self.walk, k)

    r._walk = Walk(r._walk)
    ends, got = [], []
    for b in r:
        start = b.data.ctypes.data - r._buf.ctypes.data  # the batch's place in the file
        ends.append(start + int(b.offset[-1]) + int(b.caplen[-1]))
        got += [b.data[o:o + c].tobytes() for o, c in zip(b.offset.tolist(), b.caplen.tolist())]
    assert got == frames
    walks = r._walk.at_fill
    assert len(walks) >= 4
    # every walk after the first began with the pages of the batch before it handed back
    handed = [e - e % mmap.PAGESIZE for e in ends]
    assert all(w >= h for w, h in zip(walks[1:], handed)), (walks, handed)


def test_release_before_keeps_the_pages_of_bytes_still_to_be_read(tmp_path, monkeypatch):
    """``release_before(batch, keep_from)`` gives back the pages before ``batch`` but none from
    ``keep_from`` on (an earlier batch's bytes a reader of the sends still needs); a later call
    without it gives those back too."""
    import mmap

    import mirrorckpt.capture.pcapfile as pf

    monkeypatch.setattr(pf, "BATCH_BYTES", 100_000)
    monkeypatch.setattr(pf, "RELEASE_BYTES", 4096)
    path = tmp_path / "big.pcapng"
    with PcapngWriter(path) as w:
        for i in range(200):
            w.write(bytes([i % 251]) * 4000, 1_000 + i)
    r = open_capture(path, batch_frames=25)
    r.consumer_releases = True
    batches = [next(r) for _ in range(4)]
    start = [b.data.ctypes.data + int(b.offset[0]) - r._buf.ctypes.data for b in batches]
    keep = r._buf.ctypes.data + start[1] + 5000  # a byte inside the second batch
    r.release_before(batches[3], keep)
    assert r._released == (start[1] + 5000) // mmap.PAGESIZE * mmap.PAGESIZE
    r.release_before(batches[3])
    assert r._released == start[3] // mmap.PAGESIZE * mmap.PAGESIZE
    r.release_before(batches[2], keep)  # nothing handed back is taken back
    assert r._released == start[3] // mmap.PAGESIZE * mmap.PAGESIZE


def test_reader_asks_for_huge_pages_and_a_refusal_is_harmless():
    """A capture read from disk is cached in 2 MB folios where the kernel can (pcapfile._huge_pages):
    later walks of it map a folio per fault. A kernel or file system that refuses changes nothing."""
    import mmap

    from mirrorckpt.capture import pcapfile

    class Mapping:
        def __init__(self, refuse):
            self.refuse, self.advice = refuse, []

        def madvise(self, advice, *a):
            self.advice.append(advice)
            if self.refuse:
                raise OSError(22, "Invalid argument")

    for refuse in (False, True):
        m = Mapping(refuse)
        pcapfile._huge_pages(m)
        assert m.advice == ([mmap.MADV_HUGEPAGE] if hasattr(mmap, "MADV_HUGEPAGE") else [])
