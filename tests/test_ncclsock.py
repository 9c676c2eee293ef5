"""NCCL's socket transport framing (parser.roce.ncclsock) on traffic written as NCCL writes it
(tools.generator.ncclsock): messages back byte for byte whatever the socket count, release and
batch cuts; lost bytes become holes of the right message; what is not a net socket is said."""

from __future__ import annotations

import numpy as np
import pytest
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.parser.roce.ncclsock import NcclSocketDecoder
from mirrorckpt.tools.generator.ncclsock import SocketConnection

SIZES = [0, 8, 128, 129, 4096, 65536, 65537, 300_000, (1 << 20) + 3, 16]


def payloads(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]


def written(nsocks: int, version, messages, **kw) -> SocketConnection:
    conn = SocketConnection("10.1.0.1", "10.1.0.2", port=40000, first_sport=50000, nsocks=nsocks,
                            nccl_version=version, **kw)
    for m in messages:
        conn.send(m)
    return conn


def decode(frames, version, cuts: int = 1, **kw) -> tuple[NcclSocketDecoder, list]:
    dec = NcclSocketDecoder(version, **kw)
    out = []
    for part in np.array_split(np.arange(len(frames)), cuts):
        if len(part):
            ts, fr = zip(*[frames[k] for k in part])
            out += dec.feed(FrameBatch.from_frames(list(fr), ts_ns=list(ts)))
    return dec, out + dec.flush()


@pytest.mark.parametrize("nsocks", [0, 1, 4])
@pytest.mark.parametrize("version", [(2, 21), (2, 28)])
def test_messages_come_back_byte_for_byte(nsocks, version):
    msgs = payloads()
    dec, got = decode(written(nsocks, version, msgs).frames(), version, cuts=7)
    assert [m.index for m in got] == list(range(len(msgs)))
    assert [m.size for m in got] == SIZES
    assert all(m.data.tobytes() == want and m.holes == [] for m, want in zip(got, msgs))
    assert {str(m.conn) for m in got} == {"10.1.0.1->10.1.0.2:40000"}
    assert dec.notes == []


def test_inline_messages_leave_the_data_sockets_turn_where_it_was():
    """2.27+: a message of <= 128 bytes goes inline and takes no data socket's turn; read as an
    older release (no inline), its bytes would be taken from the data sockets instead."""
    msgs = [bytes(range(100)), bytes(200 * [7]), bytes(64), bytes(200 * [9])]
    conn = written(2, (2, 28), msgs, min_task=64)
    _, got = decode(conn.frames(), (2, 28), min_task=64)
    assert [m.data.tobytes() for m in got] == msgs
    _, old = decode(conn.frames(), (2, 21), min_task=64)
    assert [m.data.tobytes() for m in old] != msgs


def test_a_lost_data_segment_is_a_hole_in_its_message_only():
    msgs = payloads(1)
    conn = written(2, (2, 21), msgs, mss=4096)
    frames = conn.frames()
    # the 300,000-byte message (index 7) is two tasks of 150,000; its second task, on the socket
    # after the first's, begins where that socket's earlier tasks end: drop one segment of it
    drop = next(k for k, (_, f) in enumerate(frames) if f[54:58] == msgs[7][150_000 + 4096 * 3:][:4])
    dec, got = decode(frames[:drop] + frames[drop + 1:], (2, 21))
    assert [m.size for m in got] == SIZES
    bad = [m for m in got if m.holes]
    assert [m.index for m in bad] == [7] and bad[0].holes == [(150_000 + 4096 * 3, 4096)]
    assert all(m.data.tobytes() == want for m, want in zip(got, msgs) if not m.holes)


def test_other_tcp_streams_are_named_not_followed():
    data = written(0, (2, 21), payloads()[:3])
    boot = SocketConnection("10.1.0.1", "10.1.0.2", port=29500, first_sport=51000, socket_type=1)  # bootstrap
    boot.send(b"y" * 20)
    dec, got = decode(data.frames() + boot.frames(), (2, 21))
    assert [m.data.tobytes() for m in got] == payloads()[:3]
    assert dec.notes == ["1 TCP stream(s) not followed: socket type 1 (not a net socket)"]


def test_a_lost_size_stops_the_connection_and_says_so():
    msgs = [b"a" * 10, b"b" * 10, b"c" * 10]
    conn = written(0, (2, 21), msgs, mss=1 << 20)
    frames = conn.frames()
    # frames: SYN, hello, then one segment per message (size and bytes together): lose the second
    dec, got = decode(frames[:3] + frames[4:], (2, 21))
    assert [m.data.tobytes() for m in got] == [b"a" * 10]
    assert dec.notes == ["connection 10.1.0.1->10.1.0.2:40000: the size of message 1 was lost: its framing "
                         "cannot be followed"]


def test_a_stream_seen_without_its_syn_is_named():
    conn = written(0, (2, 21), payloads()[:2])
    dec, got = decode(conn.frames()[1:], (2, 21))
    assert got == [] and dec.notes == ["1 TCP stream(s) not followed: joined after its first byte (no SYN)"]
