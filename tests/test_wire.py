"""Control-plane framing, message registry, session tags and the trainer's send queue."""

from __future__ import annotations

import json
import math
import socket
import struct
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec
from mirrorckpt.control import auth, wire
from mirrorckpt.control import messages as m
from mirrorckpt.control.channel import Channel
from mirrorckpt.control.outbox import Outbox, QueueFull
from mirrorckpt.updater.fingerprint import fingerprint

SECRET = b"test-secret-0123456789abcdef"


def some_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(4, 3, generator=g),
        "bf16": torch.randn(5, 2, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(),
        "f64": torch.randn(2, 2, 2, generator=g).double(),
        "i64": torch.arange(-3, 6, dtype=torch.int64),
        "i32": torch.arange(10, dtype=torch.int32).reshape(2, 5),
        "i16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "i8": torch.tensor([-128, 1, 127], dtype=torch.int8),
        "u8": torch.arange(255, dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(3, 4, generator=g).t(),  # non-contiguous input
        "numpy": np.arange(6, dtype=np.float32).reshape(2, 3),
        "numpy_be": np.arange(4, dtype=">i4"),
    }


def layout() -> JobLayout:
    # first_buckets given explicitly: JobLayout.__post_init__ currently refuses None (reported)
    return JobLayout([ParamSpec("w", (4, 3)), ParamSpec("b", (3,))], [BucketSpec((1, 0))],
                     first_buckets=[BucketSpec((0,)), BucketSpec((1,))], grad_dtype="bfloat16")


def every_message() -> list[m.Message]:
    t = some_tensors()
    lay = layout().to_dict()
    return [
        m.make(m.HELLO, role="trainer", nonce="ab" * 32),
        m.make(m.AUTH, proof="0f" * 32),
        m.make(m.REGISTER, t, job="job-1", step=0, layout=lay, ring=RingSpec(nranks=4).to_dict(),
               training={"optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.999]}},
               state_meta={"param_groups": "[]", "lr_scheduler": None}),
        m.make(m.STEP_META, {"rng/cpu": torch.get_rng_state(), "rng/cuda0": torch.zeros(16, dtype=torch.uint8)},
               step=5, lr=0.01, loss_scale=65536.0, data_position={"epoch": 1, "sample": 640},
               lr_scheduler='{"best": 2.5}'),
        m.fingerprints(5, {"w": t["f32"], "b": t["bf16"]}),
        m.make(m.FALLBACK_REQUEST, reason="bucket 2 incomplete at iteration 6", step=7, parts=3),
        m.make(m.GOCKPT_PART, t, step=8, index=1, parts=3, slices={"w": [0, 6]}),
        m.make(m.GOCKPT_DONE, step=10, parts=3, fingerprints={"w": 2**64 - 1}),
        m.make(m.RESTORE_REQUEST, step=None),
        m.make(m.RESTORE_STATE, t, step=10, layout=lay, meta={"lr": 0.001}),
        m.make(m.ACK, info={"step": 3}, re=7),
        m.make(m.ERROR, reason="no such step", code="missing", re=9),
        m.make(m.PING, rid=4),
        m.make(m.PONG, re=4),
    ]


def assert_same(sent: m.Message, got: m.Message) -> None:
    assert (got.type, got.body, got.rid, got.re) == (sent.type, sent.body, sent.rid, sent.re)
    assert list(got.tensors) == list(sent.tensors)
    for name, want in sent.tensors.items():
        have = got.tensors[name]
        assert isinstance(have, torch.Tensor)
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(have.numpy(), want)
            assert have.numpy().dtype == want.dtype.newbyteorder("=")
        else:
            assert have.dtype == want.dtype and have.shape == want.shape
            assert torch.equal(have, want)


def test_registry_is_covered():
    assert {msg.type for msg in every_message()} == set(m.REGISTRY)


@pytest.mark.parametrize("msg", every_message(), ids=lambda x: x.type)
def test_round_trip_in_memory(msg):
    got = m.parse(m.to_bytes(msg, seq=11))
    assert got.seq == 11
    assert_same(msg, got)


def test_decoded_tensors_are_views_of_the_payload():
    msg = m.make(m.GOCKPT_PART, {"a": torch.ones(3), "b": torch.arange(8).bfloat16()}, step=1, index=0, parts=1)
    raw = wire.decode_frame(m.to_bytes(msg))
    got = m.from_frame(raw)
    base = raw.payload.ctypes.data
    assert raw.payload.ctypes.data % wire.ALIGN == 0
    for t in got.tensors.values():
        assert base <= t.data_ptr() < base + raw.payload.size
        assert t.data_ptr() % t.element_size() == 0
    raw.payload[:] = 0  # writes through: no copy was made
    assert got.tensors["a"].sum() == 0
    assert got.array("b").dtype == np.uint16  # bf16 as raw bits, like config.layout.numpy_dtype


def test_fingerprint_values_survive_as_u64():
    t = torch.randn(100)
    got = m.parse(m.to_bytes(m.fingerprints(3, {"t": t})))
    assert got.body["fingerprints"]["t"] == fingerprint(t)


# ---------------------------------------------------------------------------- strict validation

def frame(header, payload: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return wire.frame_bytes(h, payload)


def hdr(**kw) -> dict:
    h = {"v": 1, "type": "PING", "seq": 0, "body": {}, "tensors": []}
    h.update(kw)
    return {k: v for k, v in h.items() if v is not ...}


def entry(name="x", dtype="float32", shape=(2,), offset=0, nbytes=8) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes}


BAD = [
    ("version", frame(hdr(v=2)), wire.UnsupportedVersion, "version 2"),
    ("no-version", frame(hdr(v=...)), wire.BadHeader, "version"),
    ("unknown-type", frame(hdr(type="SELF_DESTRUCT")), wire.UnknownMessageType, "SELF_DESTRUCT"),
    ("bad-json", frame(b'{"v":1,"type":'), wire.BadHeader, "not valid JSON"),
    ("not-utf8", frame(b'{"v":1,"type":"\xff"}'), wire.BadHeader, "not valid JSON"),
    ("nan", frame(b'{"v":1,"type":"PING","seq":NaN,"body":{},"tensors":[]}'), wire.BadHeader, "JSON"),
    ("dup-key", frame(b'{"v":1,"v":1,"type":"PING","seq":0,"body":{},"tensors":[]}'), wire.BadHeader, "duplicate"),
    ("array", frame(b"[1,2]"), wire.BadHeader, "object"),
    ("seq-str", frame(hdr(seq="0")), wire.BadHeader, "seq"),
    ("seq-bool", frame(hdr(seq=True)), wire.BadHeader, "seq"),
    ("seq-neg", frame(hdr(seq=-1)), wire.BadHeader, "seq"),
    ("type-int", frame(hdr(type=3)), wire.BadHeader, "type"),
    ("body-list", frame(hdr(body=[])), wire.BadHeader, "body"),
    ("extra-key", frame(hdr(extra=1)), wire.BadHeader, "unknown field"),
    ("rid-zero", frame(hdr(rid=0)), wire.BadHeader, "rid"),
    ("body-field", frame(hdr(type="FALLBACK_REQUEST", body={"reason": "x", "step": "7", "parts": 2})),
     wire.SchemaError, "'step'"),
    ("body-missing", frame(hdr(type="ERROR")), wire.SchemaError, "missing field 'reason'"),
    ("body-extra", frame(hdr(body={"x": 1})), wire.SchemaError, "unknown field"),
    ("part-index", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 3, "parts": 3})),
     wire.SchemaError, "index"),
    ("bad-layout", frame(hdr(type="REGISTER", body={"job": "j", "step": 0, "layout": {"params": 5},
                                                     "training": {}})), wire.SchemaError, "layout"),
    ("u64", frame(hdr(type="FINGERPRINT", body={"step": 1, "fingerprints": {"w": 2**64}})),
     wire.SchemaError, "64-bit"),
    ("tensors-in-ping", frame(hdr(tensors=[entry()]), bytes(8)), wire.SchemaError, "no tensors"),
    ("rng-not-bytes", frame(hdr(type="STEP_META", body={"step": 1, "lr": 0.1, "loss_scale": None},
                                tensors=[entry()]), bytes(8)), wire.SchemaError, "uint8"),
    ("outside", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                          tensors=[entry(offset=8)]), bytes(8)), wire.TensorTableError, "outside"),
    ("nbytes", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                         tensors=[entry(nbytes=12)]), bytes(12)), wire.TensorTableError, "nbytes"),
    ("overlap", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                          tensors=[entry(), entry("y", offset=4)]), bytes(12)), wire.TensorTableError, "overlaps"),
    ("dup-name", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                           tensors=[entry(), entry(offset=8)]), bytes(16)), wire.TensorTableError, "twice"),
    ("misaligned", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                             tensors=[entry(offset=2)]), bytes(10)), wire.TensorTableError, "aligned"),
    ("dtype", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                        tensors=[entry(dtype="bool", nbytes=2)]), bytes(2)), wire.TensorTableError, "dtype"),
    ("shape", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                        tensors=[entry(shape=(-2,), nbytes=-8)]), bytes(0)), wire.TensorTableError, "shape"),
    ("entry-keys", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                             tensors=[{"name": "x"}])), wire.TensorTableError, "fields"),
    ("gap", frame(hdr(type="GOCKPT_PART", body={"step": 1, "index": 0, "parts": 1},
                      tensors=[entry(offset=64)]), bytes(72)), wire.TensorTableError, "unexplained"),
    ("trailing-payload", frame(hdr(), bytes(3)), wire.TrailingBytes, "after the last tensor"),
    ("trailing-frame", frame(hdr()) + b"x", wire.TrailingBytes, "after the end of the frame"),
    ("truncated", frame(hdr())[:-1], wire.TruncatedFrame, "ends after"),
    ("truncated-prefix", b"\x00\x00", wire.TruncatedFrame, "ends after"),
    ("empty", b"", wire.TruncatedFrame, "no data"),
    ("oversize", struct.pack(">I", 2**31) + b"garbage", wire.FrameTooLarge, "length prefix 2147483648"),
    ("hlen-too-big", struct.pack(">II", 8, 9) + bytes(4), wire.MalformedFrame, "header length"),
    ("hlen-zero", struct.pack(">II", 4, 0), wire.MalformedFrame, "header length"),
    ("tiny", struct.pack(">I", 2) + bytes(2), wire.MalformedFrame, "too small"),
]


@pytest.mark.parametrize("data,err,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_frames_are_rejected_with_a_reason(data, err, text):
    with pytest.raises(err) as info:
        m.parse(data)
    assert text in info.value.reason
    assert isinstance(info.value, wire.ProtocolError)


def test_sender_side_is_enforced():
    data = m.to_bytes(m.make(m.FALLBACK_REQUEST, reason="x", step=1, parts=2))
    assert m.parse(data, sender=m.SERVER).type == m.FALLBACK_REQUEST
    with pytest.raises(wire.SchemaError, match="may not be sent by the client"):
        m.parse(data, sender=m.CLIENT)


def test_make_rejects_bad_messages_at_the_call():
    with pytest.raises(wire.SchemaError):
        m.make(m.STEP_META, step=-1, lr=0.1, loss_scale=None)
    with pytest.raises(wire.SchemaError):
        m.make(m.STEP_META, step=1, lr=float("nan"), loss_scale=None)
    with pytest.raises(wire.UnknownMessageType):
        m.make("NOPE")
    with pytest.raises(ValueError, match="bfloat16"):
        m.make(m.GOCKPT_PART, {"x": np.zeros(2, np.uint16)}, step=1, index=0, parts=1)


class RecordingSource(wire.BytesSource):
    def __init__(self, data):
        super().__init__(data)
        self.asked = []

    def read_into(self, view, started):
        self.asked.append(len(view))
        super().read_into(view, started)


def test_oversize_prefix_is_refused_before_reading_or_allocating():
    src = RecordingSource(struct.pack(">I", 0xFFFFFFF0) + bytes(100))
    with pytest.raises(wire.FrameTooLarge):
        wire.read_frame(src, max_frame=wire.MAX_FRAME, tag_len=0)
    assert src.asked == [4]  # only the prefix itself was read
    # the pre-authentication limit is much smaller than the session one
    src = RecordingSource(frame(hdr(type="ERROR", body={"reason": "x" * 5000})))
    with pytest.raises(wire.FrameTooLarge, match="limit of 4096"):
        wire.read_frame(src, max_frame=wire.PREAUTH_MAX_FRAME, tag_len=0)
    assert src.asked == [4]


# ---------------------------------------------------------------------------- fuzzing

def _only_protocol_errors(data: bytes) -> None:
    try:
        m.parse(data, max_frame=1 << 20)
    except wire.ProtocolError:
        pass


SEEDS = [m.to_bytes(msg) for msg in every_message()]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    _only_protocol_errors(data)
    _only_protocol_errors(struct.pack(">I", len(data)) + data)
    _only_protocol_errors(struct.pack(">II", len(data) + 4, len(data)) + data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                        min_size=1, max_size=6),
       st.integers(0, 1 << 16), st.sampled_from(["flip", "cut", "insert"]))
def test_fuzz_mutated_frames(seed, flips, cut, how):
    data = bytearray(seed)
    for pos, val in flips:
        data[pos % len(data)] = val
    if how == "cut":
        data = data[:cut % len(data)]
    elif how == "insert":
        data[cut % len(data):cut % len(data)] = b"\x00\x01"
    _only_protocol_errors(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20),
       st.sampled_from(sorted(m.REGISTRY)))
def test_fuzz_header_values(body, mtype):
    """Structurally valid frames whose header values are arbitrary JSON."""
    for h in (hdr(type=mtype, body=body), hdr(type=mtype, tensors=body), hdr(type=mtype, seq=body),
              hdr(type=mtype, body={"step": body, "parts": body, "index": body, "reason": body})):
        try:
            _only_protocol_errors(frame(json.dumps(h).encode()))
        except (ValueError, OverflowError):  # json.dumps of a huge float: not a frame at all
            pass


# ---------------------------------------------------------------------------- sessions

def channel_pair(secret_c=SECRET, secret_s=SECRET):
    a, b = socket.socketpair()
    cli, srv = Channel(a, m.CLIENT, stall_timeout=5), Channel(b, m.SERVER, stall_timeout=5)
    err = []

    def serve():
        try:
            auth.server_handshake(srv, secret_s, {"trainer"})
        except Exception as e:  # noqa: BLE001
            err.append(e)
            srv.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        auth.client_handshake(cli, secret_c, "trainer")
    finally:
        t.join(10)
    return cli, srv, err


def test_authenticated_round_trip_of_every_message():
    cli, srv, err = channel_pair()
    assert not err and cli.authenticated and srv.authenticated and srv.peer_role == "trainer"
    try:
        for msg in every_message():
            sender, receiver = (srv, cli) if m.REGISTRY[msg.type].sender == m.SERVER else (cli, srv)
            if msg.type in (m.HELLO,):
                continue  # handshake only
            t = threading.Thread(target=sender.send, args=(msg,))
            t.start()
            got = receiver.recv()
            t.join(10)
            assert_same(msg, got)
            assert got.seq == msg.seq
    finally:
        cli.close()
        srv.close()


def test_wrong_secret_fails_the_handshake_on_both_sides():
    with pytest.raises(wire.AuthError, match="refused our proof"):
        channel_pair(secret_c=b"not-the-right-secret-at-all")


def test_session_tags_bind_key_direction_and_content():
    key = bytes(32)
    c, s = auth.Session(key, m.CLIENT), auth.Session(key, m.SERVER)
    header, pieces, n = m.encode(m.make(m.GOCKPT_PART, {"x": torch.ones(4)}, step=1, index=0, parts=1), 5)
    payload = b"".join(bytes(p) for p in pieces)
    raw = wire.decode_frame(wire.frame_bytes(header, payload, c.sign(header, pieces, n)), tag_len=wire.TAG_LEN)
    s.verify(raw)  # the appliance accepts the trainer's frame
    with pytest.raises(wire.BadMac):
        c.verify(raw)  # but a frame reflected back to the trainer is refused
    with pytest.raises(wire.BadMac):
        auth.Session(bytes([1]) * 32, m.SERVER).verify(raw)  # another session's key
    raw.payload[3] ^= 1
    with pytest.raises(wire.BadMac):
        s.verify(raw)


def test_proofs_depend_on_secret_side_and_nonces():
    t = auth.transcript("trainer", bytes(32), "appliance", bytes([1]) * 32)
    p = auth.proof(SECRET, m.CLIENT, t)
    assert p != auth.proof(SECRET, m.SERVER, t)
    assert p != auth.proof(SECRET + b"x", m.CLIENT, t)
    assert p != auth.proof(SECRET, m.CLIENT, auth.transcript("trainer", bytes(32), "appliance", bytes(32)))
    with pytest.raises(ValueError):
        auth.normalize_secret("short")


# ---------------------------------------------------------------------------- the send queue

def meta(step):
    return m.make(m.STEP_META, step=step, lr=0.1, loss_scale=None)


def part(i):
    return m.make(m.GOCKPT_PART, {"x": torch.ones(2)}, step=1, index=i, parts=8)


def test_outbox_drops_oldest_step_meta_and_counts():
    box = Outbox(maxsize=3, block_timeout=0.05)
    for s in range(5):
        assert box.put(meta(s))
    assert box.drops[m.STEP_META] == 2
    assert [box.get(0).body["step"] for _ in range(3)] == [2, 3, 4]


def test_outbox_never_drops_gockpt_parts():
    box = Outbox(maxsize=2, block_timeout=0.05)
    box.put(meta(0))
    box.put(part(0))
    box.put(part(1))  # evicts the STEP_META rather than waiting
    assert box.drops[m.STEP_META] == 1
    with pytest.raises(QueueFull):
        box.put(part(2))  # nothing droppable left: block, then an error, never a silent drop
    assert box.put(meta(1)) is False  # a STEP_META meeting a queue of parts is the one dropped
    assert box.drops[m.STEP_META] == 2
    assert [box.get(0).body["index"] for _ in range(2)] == [0, 1]


def test_outbox_blocked_put_resumes_when_the_writer_takes():
    box = Outbox(maxsize=1, block_timeout=10)
    box.put(part(0))
    taken = []
    t = threading.Thread(target=lambda: taken.append(box.get(10)))
    t.start()
    box.put(part(1))  # returns once the other thread made room
    t.join(10)
    assert taken[0].body["index"] == 0 and len(box) == 1


# ---------------------------------------------------------------------------- streaming

KB64 = 64 << 10


def streaming_pair(**kw):
    a, b = socket.socketpair()
    cli, srv = Channel(a, m.CLIENT, stall_timeout=5, **kw), Channel(b, m.SERVER, stall_timeout=5, **kw)
    t = threading.Thread(target=auth.server_handshake, args=(srv, SECRET, {"trainer"}))
    t.start()
    auth.client_handshake(cli, SECRET, "trainer")
    t.join(10)
    return cli, srv


def big_state(nbytes: int) -> dict:
    """Tensors of odd sizes and several dtypes totalling about ``nbytes``."""
    g = torch.Generator().manual_seed(3)
    out, i = {}, 0
    while sum(v.numel() * v.element_size() for v in out.values()) < nbytes:
        n = 10_007 * (i % 7 + 1) + i
        out[f"t{i}"] = torch.randn(n, generator=g) if i % 3 else torch.randn(n, generator=g).bfloat16()
        i += 1
    return out


def split_frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        out.append(data[pos:pos + 4 + n])
        pos += 4 + n
    return out


def test_a_state_larger_than_the_frame_limit_streams_in_bounded_frames():
    """A 6 MB state through channels whose frame limit is 1 MiB, in 64 KiB frames: every frame
    is bounded, the message arrives bit-exact, its tensors are views of one preallocated payload,
    and small messages sent meanwhile from another thread arrive intact."""
    cli, srv = streaming_pair(max_frame=1 << 20, stream_frame=KB64)
    try:
        state = big_state(6 << 20)
        msg = m.make(m.GOCKPT_PART, state, step=4, index=0, parts=1, slices={"params": ["x"]})
        _, _, n = m.encode_payload(msg)
        assert n > cli.max_frame
        pings = [m.make(m.PING, rid=i + 1) for i in range(20)]
        big = threading.Thread(target=cli.send, args=(msg,))
        small = threading.Thread(target=lambda: [cli.send(p) for p in pings])
        big.start()
        small.start()
        got = [srv.recv() for _ in range(21)]
        big.join(10)
        small.join(10)
        assert [g.rid for g in got if g.type == m.PING] == list(range(1, 21))
        (part,) = [g for g in got if g.type == m.GOCKPT_PART]
        assert_same(msg, part)
        assert srv.frames_received == 2 + 1 + math.ceil(n / KB64) + 20  # handshake, head, MORE, pings
        ptrs = sorted(t.data_ptr() for t in part.tensors.values())
        assert ptrs[-1] - ptrs[0] < n  # one buffer, filled in place
    finally:
        cli.close()
        srv.close()


def test_streaming_memory_is_the_state_plus_a_window():
    """Sender and receiver together allocate (numpy and Python) about the payload once: the
    receiver's buffer. No copy of the state, no per-frame buffer."""
    import tracemalloc

    cli, srv = streaming_pair(stream_frame=KB64)
    try:
        msg = m.make(m.GOCKPT_PART, big_state(8 << 20), step=4, index=0, parts=1)
        _, _, n = m.encode_payload(msg)
        tracemalloc.start()
        t = threading.Thread(target=cli.send, args=(msg,))
        t.start()
        got = srv.recv()
        t.join(10)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert_same(msg, got)
        assert n <= peak < n + (1 << 20), (n, peak)
    finally:
        cli.close()
        srv.close()


def stream_frames(nbytes=300_000, **kw) -> tuple[Channel, Channel, list[bytes]]:
    cli, srv = streaming_pair(stream_frame=KB64, **kw)
    msg = m.make(m.GOCKPT_PART, {"x": torch.randn(nbytes // 4)}, step=1, index=0, parts=1)
    return cli, srv, split_frames(cli.seal_bytes(msg))


def _flip_more(frames):
    f = bytearray(frames[2])
    f[-100] ^= 1
    frames[2] = bytes(f)


@pytest.mark.parametrize("edit, err, text", [
    (_flip_more, wire.BadMac, "does not verify"),
    (lambda f: f.pop(2), wire.MalformedFrame, "expects offset"),
    (lambda f: f.pop(0), wire.MalformedFrame, "without a stream"),
    (lambda f: f.insert(2, f[1]), wire.MalformedFrame, "expects offset"),
    (lambda f: f.insert(1, f[0]), wire.SequenceError, "replayed"),
])
def test_broken_streams_are_refused_and_never_delivered(edit, err, text):
    cli, srv, frames = stream_frames()
    try:
        assert len(frames) == 1 + math.ceil(300_000 / KB64)
        edit(frames)

        def write():
            try:
                for f in frames:
                    cli.send_raw(f)
                cli.send(m.make(m.PING))
            except (wire.ProtocolError, wire.ConnectionClosed):
                pass  # the receiver hung up
        t = threading.Thread(target=write)
        t.start()
        with pytest.raises(err, match=text):
            srv.recv()
    finally:
        srv.close()
        t.join(10)
        cli.close()


def test_a_stream_above_the_message_limit_is_refused_before_allocating():
    cli, srv, frames = stream_frames()
    srv.max_message = 200_000
    try:
        cli.send_raw(frames[0])
        with pytest.raises(wire.FrameTooLarge, match="exceeds the limit of 200000"):
            srv.recv()
        assert srv.stream_progress() is None
    finally:
        cli.close()
        srv.close()
