"""Hostile and broken peers against a live ControlServer on 127.0.0.1.

Each attack checks three things: the connection is dropped, one WARNING line on the
"mirrorckpt.control" logger names the reason, and the appliance state a handler would change is
untouched. A positive control (a valid frame over the same hand-made connection) shows the
handlers are reachable, so the negative checks can fail.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import ssl
import struct
import threading
import time
import tracemalloc

import common
import pytest
import torch
from mirrorckpt.control import auth, tls, wire
from mirrorckpt.control import messages as m
from mirrorckpt.control.channel import Channel, RemoteError, RequestTimeout
from mirrorckpt.control.endpoint import LOGGER, ControlClient, ControlServer
from mirrorckpt.control.outbox import QueueFull
from mirrorckpt.tools.testbed.harness import free_port

SECRET = b"appliance-secret-0123456789abcdef"


wait_for = functools.partial(common.wait_for, timeout=10.0)


class State:
    """What the appliance would change: every handler appends to it."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def handlers(self) -> dict:
        def apply(msg, peer):
            with self.lock:
                self.events.append((msg.type, dict(msg.body)))
            return m.make(m.ACK)
        return {t: apply for t, s in m.REGISTRY.items()
                if t not in m.HANDSHAKE and s.sender in (m.CLIENT, m.ANY) and t not in (m.PING, m.PONG)}


@pytest.fixture
def state():
    return State()


@pytest.fixture
def server(state):
    srv = ControlServer("127.0.0.1", 0, SECRET, state.handlers(), read_timeout=0.3,
                        handshake_timeout=1.0, idle_timeout=30.0).start()
    yield srv
    srv.stop()


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def rejections(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def expect_rejection(server, caplog, before: int, *words) -> str:
    assert wait_for(lambda: server.rejected > before), "the server did not reject the peer"
    lines = [x for x in rejections(caplog) if x.startswith("rejected")]
    assert len(lines) == before + 1, lines
    for w in words:
        assert w in lines[-1], lines[-1]
    return lines[-1]


class Peer:
    """A hand-driven trainer: does the real handshake, then writes whatever bytes a test wants."""

    def __init__(self, port: int, secret: bytes = SECRET, handshake: bool = True):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.chan = Channel(sock, m.CLIENT, stall_timeout=5)
        if handshake:
            auth.client_handshake(self.chan, secret, "trainer")

    def sealed(self, msg: m.Message) -> bytes:
        return self.chan.seal_bytes(msg)

    def forged(self, header: dict | bytes, payload: bytes = b"") -> bytes:
        """A frame with a valid tag of this session around an arbitrary header and payload."""
        h = header if isinstance(header, bytes) else json.dumps(header).encode()
        tag = self.chan.session.sign(h, [payload], len(payload))
        self.chan.send_seq += 1
        return wire.frame_bytes(h, payload, tag)

    def send(self, data: bytes) -> None:
        self.chan.send_raw(data)

    def closed_by_server(self) -> bool:
        """True once the appliance has closed the connection (replies before that are skipped)."""
        self.chan.source.idle_timeout = 10
        try:
            while True:
                self.chan.recv()
        except wire.ConnectionClosed:
            return True
        except wire.ProtocolError:
            return True  # e.g. EOF in the middle of our read
        finally:
            self.chan.close()

    def ack(self) -> m.Message:
        return self.chan.recv()


def meta(step: int, **kw) -> m.Message:
    return m.make(m.STEP_META, {"rng": torch.arange(16, dtype=torch.uint8)}, step=step, lr=0.1,
                  loss_scale=None, **kw)


def part_header(peer: Peer, tensors: list, body=None) -> dict:
    return {"v": 1, "type": m.GOCKPT_PART, "seq": peer.chan.send_seq,
            "body": body or {"step": 1, "index": 0, "parts": 1}, "tensors": tensors}


# ---------------------------------------------------------------------------- positive control

def test_valid_frames_reach_the_handlers(server, state, log):
    p = Peer(server.port)
    p.send(p.sealed(meta(1, rid=1)))
    assert p.ack().type == m.ACK
    assert state.events == [(m.STEP_META, {"step": 1, "lr": 0.1, "loss_scale": None})]
    assert not rejections(log)


# ---------------------------------------------------------------------------- authentication

def test_wrong_secret(server, state, log):
    with pytest.raises(wire.AuthError):
        Peer(server.port, secret=b"a-guess-at-the-secret-xxxxxxxx")
    expect_rejection(server, log, 0, "AuthError", "wrong secret")
    # the real client keeps failing and never gets through
    cli = ControlClient("127.0.0.1", server.port, b"another-wrong-secret-yyyyyyyy",
                        backoff_initial=0.01, backoff_max=0.05).start()
    try:
        cli.send(meta(1))
        assert wait_for(lambda: cli.connect_failures >= 2)
        assert not cli.connected
    finally:
        cli.close()
    assert state.events == []


def test_frame_before_authentication(server, state, log):
    p = Peer(server.port, handshake=False)
    p.send(m.to_bytes(meta(1)))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "unauthenticated", "expected HELLO before authentication, got STEP_META")
    assert state.events == []


def test_role_not_accepted(server, state, log):
    p = Peer(server.port, handshake=False)
    p.send(m.to_bytes(m.make(m.HELLO, role="appliance", nonce="00" * 32)))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "AuthError", "role 'appliance' is not accepted")


def test_bad_json_before_and_after_authentication(server, state, log):
    p = Peer(server.port, handshake=False)
    p.send(wire.frame_bytes(b'{"v":1,"type":"HELLO",'))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "BadHeader", "not valid JSON")
    p = Peer(server.port)
    p.send(p.forged(b'{"v":1,"type":"STEP_META","seq":2,"body":{'))
    assert p.closed_by_server()
    expect_rejection(server, log, 1, "(trainer)", "BadHeader", "not valid JSON")
    assert state.events == []


# ---------------------------------------------------------------------------- framing

def test_oversized_length_prefix_is_refused_without_allocating(server, state, log):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        p = Peer(server.port, handshake=False)  # before authentication: 4 KiB limit
        p.send(struct.pack(">I", 0xFFFFFFF0) + bytes(64))
        assert p.closed_by_server()
        expect_rejection(server, log, 0, "FrameTooLarge", "4294967280", "limit of 4096")
        p = Peer(server.port)  # after: the session limit (1 GiB)
        p.send(struct.pack(">I", (1 << 30) + 1) + bytes(64))
        assert p.closed_by_server()
        expect_rejection(server, log, 1, "FrameTooLarge", "1073741825")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # nothing near the declared sizes was allocated
    assert state.events == []


def test_truncated_frame(server, state, log):
    p = Peer(server.port)
    data = p.sealed(meta(1))
    p.send(data[:len(data) // 2])
    p.chan.sock.shutdown(socket.SHUT_WR)  # EOF in the middle of the frame
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "TruncatedFrame", "closed mid-frame")
    assert state.events == []


def test_peer_stalling_mid_frame_is_dropped(server, state, log):
    p = Peer(server.port)
    data = p.sealed(meta(1))
    p.send(data[:10])  # and then nothing: read_timeout is 0.3 s
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "PeerTimeout", "stalled mid-frame")
    assert state.events == []


def test_peer_stalling_in_the_handshake_is_dropped(server, state, log):
    p = Peer(server.port, handshake=False)
    p.send(struct.pack(">I", 100))  # a frame that never comes
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "PeerTimeout")


def test_unknown_message_type(server, state, log):
    p = Peer(server.port)
    p.send(p.forged({"v": 1, "type": "FORMAT_DISKS", "seq": p.chan.send_seq, "body": {}, "tensors": []}))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "UnknownMessageType", "FORMAT_DISKS")
    assert state.events == []


def test_message_the_trainer_may_not_send(server, state, log):
    p = Peer(server.port)
    p.send(p.sealed(m.make(m.FALLBACK_REQUEST, reason="x", step=1, parts=2)))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "SchemaError", "may not be sent by the client")
    assert state.events == []


def test_tensor_table_pointing_outside_the_payload(server, state, log):
    p = Peer(server.port)
    table = [{"name": "w", "dtype": "float32", "shape": [4], "offset": 1 << 20, "nbytes": 16}]
    p.send(p.forged(part_header(p, table), bytes(16)))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "TensorTableError", "outside the 16-byte payload")
    assert state.events == []


def test_tensor_table_with_wrong_nbytes(server, state, log):
    p = Peer(server.port)
    table = [{"name": "w", "dtype": "bfloat16", "shape": [4], "offset": 0, "nbytes": 16}]
    p.send(p.forged(part_header(p, table), bytes(16)))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "TensorTableError", "nbytes 16 != 2 x prod(4,)")
    assert state.events == []


# ---------------------------------------------------------------------------- integrity

def test_replayed_frame(server, state, log):
    p = Peer(server.port)
    captured = p.sealed(meta(1, rid=1))
    p.send(captured)
    assert p.ack().type == m.ACK
    assert len(state.events) == 1
    p.send(captured)  # the identical, validly tagged frame again
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "SequenceError", "replayed", "seq 2, expected 3")
    assert len(state.events) == 1


def test_frame_from_another_session(server, state, log):
    a, b = Peer(server.port), Peer(server.port)
    frame_of_a = a.sealed(meta(1))  # a's seq 2 is also b's next seq: only the key differs
    b.send(frame_of_a)
    assert b.closed_by_server()
    expect_rejection(server, log, 0, "BadMac", "another session")
    assert state.events == []
    a.send(frame_of_a)  # where it belongs, it is fine
    assert wait_for(lambda: len(state.events) == 1)


@pytest.mark.parametrize("where", ["payload", "header", "tag"])
def test_tampered_frame(server, state, log, where):
    p = Peer(server.port)
    data = bytearray(p.sealed(m.make(m.GOCKPT_PART, {"w": torch.ones(64)}, step=1, index=0, parts=1)))
    hlen = struct.unpack(">I", data[4:8])[0]
    pos = {"payload": 8 + hlen + 100, "header": 8 + hlen - 3, "tag": len(data) - 1}[where]
    data[pos] ^= 0x01
    p.send(bytes(data))
    assert p.closed_by_server()
    expect_rejection(server, log, 0, "BadMac", "tampered")
    assert state.events == []


def test_frame_reflected_back_is_refused(state, log):
    """A frame the appliance sent cannot be fed back to it (directions are in the tag)."""
    srv = ControlServer("127.0.0.1", 0, SECRET, state.handlers(), read_timeout=0.3).start()
    try:
        p = Peer(srv.port)
        assert wait_for(lambda: srv.peers())
        srv.push(m.make(m.ACK, info={"x": 1}))
        raw = wire.read_frame(p.chan.source, wire.MAX_FRAME, wire.TAG_LEN)
        p.send(wire.frame_bytes(raw.header, raw.payload.tobytes(), raw.tag))
        assert p.closed_by_server()
        expect_rejection(srv, log, 0, "BadMac")
    finally:
        srv.stop()
    assert state.events == []


# ---------------------------------------------------------------------------- the real client

def test_client_round_trip_push_and_handler_errors(state, log):
    pushed = []

    def failing(msg, peer):
        raise ValueError("layout does not match the wire\nsecond line")

    handlers = state.handlers() | {m.REGISTER: failing}
    with ControlServer("127.0.0.1", 0, SECRET, handlers).start() as srv:
        cli = ControlClient("127.0.0.1", srv.port, SECRET,
                            handlers={m.FALLBACK_REQUEST: lambda msg, c: pushed.append(msg) or m.make(m.ACK)})
        with cli:
            assert cli.wait_connected(10)
            assert cli.request(meta(3), timeout=10).type == m.ACK
            assert cli.request(m.make(m.PING), timeout=10).type == m.PONG
            with pytest.raises(RemoteError, match="layout does not match"):
                cli.request(m.make(m.REGISTER, job="j", step=0, layout={"params": [], "buckets": []},
                                   training={}), timeout=10)
            assert wait_for(lambda: srv.peers())
            reply = srv.request(srv.peers()[0], m.make(m.FALLBACK_REQUEST, reason="hole", step=4, parts=3), 10)
            assert reply.type == m.ACK and pushed[0].body == {"reason": "hole", "step": 4, "parts": 3}
            assert cli.connected  # a refused message does not cost the connection
    assert [e[0] for e in state.events] == [m.STEP_META]
    assert srv.rejected == 0
    refused = [x for x in rejections(log) if "refused it" in x]
    assert len(refused) == 1 and "\n" not in refused[0] and "layout does not match" in refused[0]


def test_client_drops_a_hostile_appliance_and_reconnects(log):
    """The trainer side checks frames just as strictly: a tampered push costs the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    seen = []

    def fake_appliance():
        for attempt in range(2):
            sock, _ = listener.accept()
            chan = Channel(sock, m.SERVER, stall_timeout=5)
            auth.server_handshake(chan, SECRET, {"trainer"})
            data = bytearray(chan.seal_bytes(m.make(m.FALLBACK_REQUEST, reason="x", step=attempt, parts=2)))
            if attempt == 0:
                data[20] ^= 0x20  # tampered on the way
            chan.send_raw(bytes(data))
            try:
                chan.source.idle_timeout = 10
                while True:
                    chan.recv()
            except (wire.ConnectionClosed, wire.ProtocolError):
                pass
            chan.close()
            if attempt == 1:
                return

    t = threading.Thread(target=fake_appliance)
    t.start()
    cli = ControlClient("127.0.0.1", listener.getsockname()[1], SECRET, backoff_initial=0.01,
                        handlers={m.FALLBACK_REQUEST: lambda msg, c: seen.append(msg.body["step"])}).start()
    try:
        assert wait_for(lambda: seen)
        assert cli.connections == 2
    finally:
        cli.close()
        t.join(10)
        listener.close()
    assert seen == [1]
    assert any(x.startswith("rejected appliance") and "BadMac" in x for x in rejections(log))


def test_request_times_out_when_no_reply_comes(log):
    with ControlServer("127.0.0.1", 0, SECRET, {m.FINGERPRINT: lambda msg, peer: None}).start() as srv:
        with ControlClient("127.0.0.1", srv.port, SECRET) as cli:
            with pytest.raises(RequestTimeout):
                cli.request(m.make(m.FINGERPRINT, step=1, fingerprints={}), timeout=0.3)
            assert cli.connected


def test_client_reconnects_after_server_restart(log):
    first, second = State(), State()
    srv = ControlServer("127.0.0.1", 0, SECRET, first.handlers()).start()
    port = srv.port
    register = m.make(m.REGISTER, job="j", step=0, training={},
                      layout={"params": [{"name": "w", "shape": [2]}], "buckets": [[0]], "first_buckets": [[0]]})
    cli = ControlClient("127.0.0.1", port, SECRET, backoff_initial=0.02, backoff_max=0.2,
                        on_connect=lambda c: [register]).start()
    try:
        assert cli.request(meta(1), timeout=10).type == m.ACK
        srv.stop()
        assert wait_for(lambda: not cli.connected)
        for s in (2, 3):
            cli.send(meta(s))  # queued while the appliance is away
        srv = ControlServer("127.0.0.1", port, SECRET, second.handlers()).start()
        assert cli.wait_connected(10)
        assert cli.request(meta(4), timeout=10).type == m.ACK
        assert cli.connections == 2
    finally:
        cli.close()
        srv.stop()
    assert [(t, b.get("step")) for t, b in first.events] == [(m.REGISTER, 0), (m.STEP_META, 1)]
    # the new session starts with REGISTER again, then what was queued, in order
    assert [(t, b.get("step")) for t, b in second.events] == [(m.REGISTER, 0), (m.STEP_META, 2),
                                                              (m.STEP_META, 3), (m.STEP_META, 4)]


def test_test_ports_come_from_outside_the_ephemeral_range():
    """The tests' listening ports: a port that a port-0 bind handed out may be taken by any
    outgoing connection of the tests beside before it is bound again."""
    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and not any(lo <= p <= hi for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_client_queue_policy_while_disconnected(log):
    port = free_port()  # nothing listens here
    cli = ControlClient("127.0.0.1", port, SECRET, max_queue=4, block_timeout=0.05,
                        backoff_initial=0.01, backoff_max=0.05).start()
    try:
        for step in range(10):
            cli.send(meta(step))  # never blocks the training loop
        assert cli.drops[m.STEP_META] == 6
        for i in range(4):
            cli.send(m.make(m.GOCKPT_PART, {"x": torch.ones(2)}, step=1, index=i, parts=8))
        with pytest.raises(QueueFull):
            cli.send(m.make(m.GOCKPT_PART, {"x": torch.ones(2)}, step=1, index=4, parts=8))
        assert cli.drops[m.STEP_META] == 10 and not cli.drops[m.GOCKPT_PART]
        assert wait_for(lambda: cli.connect_failures >= 1)
    finally:
        cli.close()


def test_oversized_messages_are_refused_at_the_call(log):
    port = free_port()
    # not started: no network. Above the frame limit a message is streamed; only the message
    # limit refuses it.
    cli = ControlClient("127.0.0.1", port, SECRET, max_frame=1 << 20, max_message=2 << 20)
    with pytest.raises(ValueError, match="message limit"):
        cli.send(m.make(m.GOCKPT_PART, {"w": torch.zeros(1 << 19)}, step=1, index=0, parts=1))
    assert len(cli.outbox) == 0
    assert cli.send(m.make(m.GOCKPT_PART, {"w": torch.zeros(1 << 18)}, step=1, index=0, parts=1))
    # the exact check when a frame is sealed, header included
    a, b = socket.socketpair()
    chan = Channel(a, m.CLIENT, preauth_max_frame=200)
    with pytest.raises(ValueError, match="frame limit"):
        chan.seal(m.make(m.ERROR, reason="x" * 300))
    assert chan.send_seq == 0  # nothing was numbered
    a.close()
    b.close()


def test_client_refuses_an_appliance_with_another_secret(log):
    other = b"some-other-appliance-secret-000"
    with ControlServer("127.0.0.1", 0, other, {}).start() as srv:
        cli = ControlClient("127.0.0.1", srv.port, SECRET, backoff_initial=0.01, backoff_max=0.05).start()
        try:
            assert wait_for(lambda: cli.connect_failures >= 1)
            assert not cli.connected
        finally:
            cli.close()
        assert srv.rejected >= 1
    assert any("connection failed (AuthError" in x for x in rejections(log))


# ---------------------------------------------------------------------------- TLS

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    c = common.make_certs(tmp_path_factory.mktemp("tls"))  # never skipped: openssl is a test dependency
    return c["appliance_cert"], c["appliance_key"], c


def test_tls_under_the_hmac_session(certs, state, log):
    cert, key, c = certs
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(c["ca"]))
    pushed, intact = [], []
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB per part
    handlers = state.handlers() | {
        m.GOCKPT_PART: lambda msg, p: intact.append(torch.equal(msg.tensors["w"], big + msg.body["index"]))}
    with ControlServer("127.0.0.1", 0, SECRET, handlers, ssl_context=server_ctx,
                       handshake_timeout=2.0).start() as srv:
        # a client speaking plain TCP to the TLS port is refused
        p = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        p.sendall(m.to_bytes(m.make(m.HELLO, role="trainer", nonce="00" * 32)))
        assert wait_for(lambda: srv.rejected == 1)
        p.close()
        assert "TLS" in rejections(log)[-1]
        cli = ControlClient("127.0.0.1", srv.port, SECRET, ssl_context=client_ctx,
                            handlers={m.FALLBACK_REQUEST: lambda msg, c: pushed.append(msg.body["step"])})
        with cli:
            assert cli.wait_connected(10)
            stop = threading.Event()

            def push():  # the appliance writes while the trainer writes
                step = 0
                while not stop.is_set() and step < 200:
                    srv.push(m.make(m.FALLBACK_REQUEST, reason="x", step=step, parts=2))
                    step += 1

            assert wait_for(lambda: srv.peers())
            t = threading.Thread(target=push)
            t.start()
            for i in range(8):
                cli.send(m.make(m.GOCKPT_PART, {"w": big + i}, step=1, index=i, parts=8))
            assert cli.request(m.make(m.GOCKPT_DONE, step=1, parts=8), timeout=20).type == m.ACK
            stop.set()
            t.join(10)
            assert wait_for(lambda: len(pushed) >= 1)
    assert intact == [True] * 8
    assert srv.rejected == 1
    assert pushed == sorted(pushed)


def mutual(c):
    return (tls.server_context(c["appliance_cert"], c["appliance_key"], c["ca"]),
            tls.client_context(c["trainer_cert"], c["trainer_key"], c["ca"]))


@pytest.mark.parametrize("who", ["no certificate", "self-signed certificate", "no TLS"])
def test_mutual_tls_refuses_a_client_without_a_ca_signed_cert(certs, state, log, who):
    _, _, c = certs
    server_ctx, good = mutual(c)
    with ControlServer("127.0.0.1", 0, SECRET, state.handlers(), ssl_context=server_ctx,
                       handshake_timeout=2.0).start() as srv:
        raw = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        hello = m.to_bytes(m.make(m.HELLO, role="trainer", nonce="00" * 32))
        if who == "no TLS":
            raw.sendall(hello)
            sock = raw
        else:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_verify_locations(c["ca"])
            if who == "self-signed certificate":
                ctx.load_cert_chain(c["rogue_cert"], c["rogue_key"])
            sock = ctx.wrap_socket(raw, server_hostname="localhost")  # TLS 1.3: the server judges after this
            try:
                sock.sendall(hello)
            except (ssl.SSLError, OSError):
                pass
        assert wait_for(lambda: srv.rejected == 1)
        got = b""
        try:
            got = sock.recv(1 << 16)  # nothing but the end of the connection (or a TLS alert) comes back
        except (ssl.SSLError, OSError):
            pass
        sock.close()
        assert got == b""
        assert "TLS" in rejections(log)[-1] and not srv.peers()
        # a trainer with a CA-signed certificate (and the secret) gets through
        cli = ControlClient("127.0.0.1", srv.port, SECRET, ssl_context=good, server_hostname="localhost")
        with cli:
            assert cli.request(m.make(m.GOCKPT_DONE, step=1, parts=8), timeout=10).type == m.ACK
    assert state.events == [(m.GOCKPT_DONE, {"step": 1, "parts": 8})]  # only the trainer's frame


def idle(host: str, port: int, n: int, source: str | None = None) -> list[socket.socket]:
    out = []
    for i in range(n):
        s = socket.socket()
        s.bind((source or f"127.0.0.{2 + i}", 0))
        s.connect((host, port))
        out.append(s)
    return out


def test_64_idle_connections_do_not_delay_the_trainer(certs, state, log):
    """Idle connections from 64 addresses hold handshake slots, not the trainer's; a flood from one
    address gets its few slots and no more; a handshake is cut off at its deadline."""
    _, _, c = certs
    server_ctx, good = mutual(c)
    with ControlServer("127.0.0.1", 0, SECRET, state.handlers(), ssl_context=server_ctx,
                       handshake_timeout=2.0).start() as srv:
        crowd = idle("127.0.0.1", srv.port, 64)
        flood = idle("127.0.0.1", srv.port, 64, source="127.0.0.99")
        assert wait_for(lambda: len(srv._pending) == 64 + srv.handshake_slots and srv.refused == 60)
        t0 = time.monotonic()
        cli = ControlClient("127.0.0.1", srv.port, SECRET, ssl_context=good, server_hostname="localhost")
        with cli:
            assert cli.request(m.make(m.GOCKPT_DONE, step=1, parts=8), timeout=10).type == m.ACK
            took = time.monotonic() - t0
            assert took < 1.0, f"the trainer waited {took:.2f} s behind 64 idle connections"
            assert wait_for(lambda: not srv._pending, timeout=5) and srv.peers()  # cut off after 2 s
            assert srv.rejected >= 64 + srv.handshake_slots
        for s in crowd + flood:
            s.close()
    assert any("no handshake slot" in x for x in rejections(log))


def test_a_handshake_dripped_byte_by_byte_is_cut_off_at_its_deadline(certs, state, log):
    _, _, c = certs
    server_ctx, _ = mutual(c)
    hello = m.to_bytes(m.make(m.HELLO, role="trainer", nonce="00" * 32))
    for ctx in (server_ctx, None):  # in the TLS handshake, and in the HMAC one
        with ControlServer("127.0.0.1", 0, SECRET, state.handlers(), ssl_context=ctx, read_timeout=1.0,
                           handshake_timeout=1.0).start() as srv:
            (p,) = idle("127.0.0.1", srv.port, 1)
            t0 = time.monotonic()
            closed = None
            for i in range(40):  # a byte every 0.1 s: no single read waits long
                try:
                    p.sendall(hello[i:i + 1] if ctx is None else b"\x16")
                except OSError:
                    closed = time.monotonic() - t0
                    break
                time.sleep(0.1)
            p.close()
            assert wait_for(lambda: not srv._pending and srv.rejected + srv.expired >= 1)
            assert closed is not None and closed < 2.5, closed
    assert state.events == []
